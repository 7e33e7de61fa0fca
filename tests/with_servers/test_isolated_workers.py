"""Workers that really are elsewhere (docs/runners.md "Tested with workers elsewhere"): a Dask
scheduler and two worker processes, and separately Beam's job service and its external worker
pool, each in a mount namespace of its own (``unshare -m``, servers.MountNamespace) where the
launcher's temp folders (``/tmp``, pytest's, ``tempfile.gettempdir()``) and ``~/.cache`` are
empty tmpfs: the job's folder, its schema, its preprocessing module and the launcher's files are
not there. Only the interpreter, the repository and ``/dev/shm`` (where the tests' gate is) are
shared, and the network (moto on 127.0.0.1).

The object store (moto) holds the data, the model and its declaration, the drift baseline and
the outputs; the workers reach it with the standard ``AWS_*`` variables of their own
environment, where their code and model caches point into their tmpfs too. The output path
holds a ``${BI_TOKEN}`` secret, which the workers fill in from their environment.

Each partition equals the launcher's direct run bit for bit, including on Dask with a worker
process killed (SIGKILL) while it scores a shard: the scheduler gives the shard to a worker
again and the one run commits. Each namespace fetches the model from the store once. Two more
runs, whose workers' store refuses every prediction file, fail (exit 5) naming the output with
``${BI_TOKEN}``; no log of the clusters' processes holds the secret's value.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factories import (
    DS,
    REPO,
    make_mlp_onnx,
    make_shards,
    mlp_reference,
    one_line_error,
    read_partition,
    run_cli,
    write_job,
    write_schema,
)
from servers import BeamJobService, DaskCluster, FaultProxy, MountNamespace, env_for, processes_of, start_cli

pytestmark = [pytest.mark.slow, pytest.mark.server]

SHARDS, ROWS, BATCH = 4, 2000, 1000
BAD = {1: [7, 1999], 3: [0]}   # shard → rows given an out-of-range f0 (quarantined)
KEY = [("_source_shard", "ascending"), ("_source_row", "ascending")]
TOKEN = f"tok3n{uuid.uuid4().hex[:12]}"
WORKER_TMP = "/tmp/batchinfer-worker"   # inside each namespace's own /tmp

GATE_SOURCE = '''\
import os
import time
from pathlib import Path

import numpy as np

GATE = Path({gate!r})


def transform(batch):
    # Armed, a worker says it is here (its pid) and waits for the test; otherwise it goes on.
    if (GATE / "armed").exists():
        Path(GATE, f"ready-{{os.getpid()}}").touch()
        while not (GATE / "go").exists():
            time.sleep(0.01)
    return np.stack([batch.column(n).to_numpy() for n in ("f0", "f1", "f2", "f3")],
                    axis=1).astype(np.float32)
'''


# -- where things are ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shared() -> Iterator[Path]:
    """A folder the launcher and the workers both see: the tests' gate."""
    if not Path("/dev/shm").is_dir():
        cannot("no /dev/shm to share a gate with the workers")
    folder = Path("/dev/shm") / f"batchinfer-iso-{uuid.uuid4().hex[:8]}"
    (folder / "gate").mkdir(parents=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def namespace(tmp_path_factory, shared) -> MountNamespace:
    reason = MountNamespace.unavailable()
    if reason:
        cannot(reason)
    import batchinfer

    # What the workers need of the launcher's disk (the interpreter, the repository and its
    # virtual environment) stays, even in a checkout under /tmp.
    ns = MountNamespace([Path("/tmp"), Path(tempfile.gettempdir()),
                         tmp_path_factory.getbasetemp(), Path.home() / ".cache"],
                        keep=[REPO, Path(sys.prefix), Path(batchinfer.__file__).parent])

    for needed in (sys.executable, REPO, Path(batchinfer.__file__), shared):
        if ns.covers(needed):
            cannot(f"{needed} is in a folder the workers must not see ({ns.hide})")
    return ns


def cannot(reason: str) -> None:
    """Skip the module, saying why; fail it where it must run (``BATCHINFER_REQUIRE_NAMESPACES``,
    set by .ci/run)."""
    if os.environ.get("BATCHINFER_REQUIRE_NAMESPACES"):
        pytest.fail(f"workers elsewhere are required here (BATCHINFER_REQUIRE_NAMESPACES): {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def marker(tmp_path_factory) -> Iterator[Path]:
    """A file only the launcher has, in its temp folder."""
    path = Path(tempfile.gettempdir()) / f"launcher-marker-{uuid.uuid4().hex[:8]}"
    path.write_text("the launcher's")
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def store(s3_server):
    """(s3fs, bucket, the launcher's environment: AWS_* and the secret)."""
    return s3_server.s3fs(), s3_server.make_bucket(), {**s3_server.env, "BI_TOKEN": TOKEN}


@pytest.fixture(scope="module")
def project(tmp_path_factory, store, shared) -> Path:
    """The job's folder (the launcher's only): a schema, the gated preprocessing and job.yaml.
    In the store: 4 shards × 2,000 rows (3 bad), the MLP with the sidecar ``stamp`` writes
    beside it, and a baseline of these data."""
    fs, bucket, env = store
    folder = tmp_path_factory.mktemp("launcher-only")
    write_schema(folder / "schemas")
    (folder / "gated.py").write_text(GATE_SOURCE.format(gate=str(shared / "gate")))
    staging = tmp_path_factory.mktemp("staging")
    features = []
    for shard, path in enumerate(make_shards(staging, shards=SHARDS, rows=ROWS)):
        table = pq.read_table(path)
        features.append(np.stack([table.column(f"f{i}").to_numpy() for i in range(4)], axis=1))
        f0 = table.column("f0").to_numpy().copy()
        f0[BAD.get(shard, [])] = 50.0
        table = table.set_column(table.column_names.index("f0"), "f0", pa.array(f0))
        pq.write_table(table, path)
        fs.pipe_file(f"{bucket}/data/dt={DS}/{path.name}", path.read_bytes())
    model_uri = f"s3://{bucket}/models/model.onnx"
    fs.pipe_file(model_uri, make_mlp_onnx(staging / "model.onnx").read_bytes())
    fs.pipe_file(f"{bucket}/baseline.json", json.dumps(baseline(np.concatenate(features))).encode())
    write_job(folder, model=model_uri, preprocess="gated:transform", batch={"rows": BATCH},
              input={"path": f"s3://{bucket}/data/dt={{ds}}/*.parquet"},
              output={"path": f"s3://{bucket}/out-${{BI_TOKEN}}/direct/dt={{ds}}",
                      "id_columns": ["id"]},
              monitor={"baseline": f"s3://{bucket}/baseline.json"})
    result = run_cli("stamp", model_uri, "--job", "job.yaml", "--model-version", "model:1",
                     cwd=folder, env=env)
    assert result.returncode == 0, result.stderr
    shutil.rmtree(staging)
    return folder


def baseline(x: np.ndarray) -> dict:
    """A baseline profile of these features and of the model's scores (no drift)."""
    from batchinfer.commands.profile import PROFILE_VERSION
    from batchinfer.rows.column_profiles import baseline_column

    columns = {f"f{i}": baseline_column("feature", x[:, i].astype(np.float64)).to_dict()
               for i in range(4)}
    columns["y"] = baseline_column("prediction", mlp_reference(x)).to_dict()
    return {"profile_version": PROFILE_VERSION, "job": "testjob", "ds": DS, "output": "elsewhere",
            "attempt": "a", "triple": {}, "rows": len(x), "columns": columns}


@pytest.fixture(scope="module")
def workers_proxy(s3_server) -> Iterator[FaultProxy]:
    """The store as the clusters' processes reach it: through a proxy of their own (no faults
    but where a test adds them; the launcher talks to the store directly)."""
    with FaultProxy(s3_server.endpoint) as proxy:
        yield proxy


def worker_env(store, proxy: FaultProxy) -> dict:
    """What a cluster's processes have: the store's AWS_* variables (through the proxy), the
    secret, and their code and model caches in their own tmpfs."""
    return {**env_for(proxy.url), "BI_TOKEN": TOKEN, "BATCHINFER_CODE_CACHE": f"{WORKER_TMP}/code",
            "BATCHINFER_MODEL_CACHE": f"{WORKER_TMP}/models"}


@pytest.fixture(scope="module")
def dask_elsewhere(tmp_path_factory, namespace, store, workers_proxy) -> Iterator[DaskCluster]:
    with DaskCluster(tmp_path_factory.mktemp("dask-elsewhere"), namespace=namespace,
                     env=worker_env(store, workers_proxy)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def beam_elsewhere(tmp_path_factory, namespace, store, workers_proxy) -> Iterator[BeamJobService]:
    with BeamJobService(tmp_path_factory.mktemp("beam-elsewhere"), namespace=namespace,
                        env=worker_env(store, workers_proxy)) as service:
        yield service


# -- runs and what they commit -------------------------------------------------------------------

def out_url(bucket: str, label: str, *, secret: bool = True) -> str:
    """Where the run ``label`` commits: its URL (the secret's value in it), or as the job says
    it (``${BI_TOKEN}``)."""
    return f"s3://{bucket}/out-{TOKEN if secret else '${BI_TOKEN}'}/{label}/dt={DS}"


def run_args(bucket: str, label: str, runner: str, options: dict[str, str]) -> list[str]:
    sets = ["--set", f"output.path={out_url(bucket, label, secret=False)}",
            "--set", f"runner.name={runner}"]
    for key, value in options.items():
        sets += ["--set", f"runner.options.{key}={value}"]
    return ["run", "job.yaml", "--ds", DS, *sets]


def run(project: Path, store, label: str, runner: str, options: dict[str, str]) -> str:
    """``batchinfer run`` on ``runner`` into the store; the committed partition's URL."""
    _, bucket, env = store
    t0 = time.perf_counter()
    result = run_cli(*run_args(bucket, label, runner, options), cwd=project, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    print(f"\n[{label}] {runner}: {time.perf_counter() - t0:.1f} s wall")
    return out_url(bucket, label)


@pytest.fixture(scope="module")
def direct(project, store) -> str:
    """The launcher's own direct run of the job (the reference)."""
    return run(project, store, "direct", "direct", {})


def dask_options(cluster: DaskCluster) -> dict[str, str]:
    return {"dask_client_address": cluster.address}


def assert_same_partition(out: str, reference: str, project: Path, store, runner: str) -> None:
    """``out`` is a complete partition in the store holding what ``reference`` holds: every file
    the manifest lists with its sha256 and rows, nothing else, no scratch; the same rows and
    quarantine, predictions and ``_input_hash`` bit-identical (only the execution differs)."""
    fs = store[0]
    fs.invalidate_cache()
    preds, quar, manifest = read_partition(out, fs=fs)
    ref_preds, ref_quar, ref_manifest = read_partition(reference, fs=fs)
    listed = set()
    for shard in manifest["shards"]:
        for f in shard["files"]:
            data = fs.cat_file(f"{out}/{f['path']}")
            assert hashlib.sha256(data).hexdigest() == f["sha256"], f["path"]
            assert pq.read_metadata(pa.BufferReader(data)).num_rows == f["rows"]
            assert f["path"].split("/")[1] == manifest["attempt"]
            listed.add(f["path"])
    present = {key[len(out.removeprefix("s3://")) + 1:] for key in fs.find(out)}
    assert {k for k in present if k.startswith(("predictions/", "quarantine/"))} == listed
    assert not any(k.startswith("_tmp/") for k in present), "scratch left behind"
    assert manifest["runner"] == runner
    assert manifest["totals"] == ref_manifest["totals"]
    assert manifest["totals"]["rows_in"] == SHARDS * ROWS
    assert manifest["totals"]["rows_quarantined"] == sum(len(r) for r in BAD.values())
    assert manifest["triple"] == ref_manifest["triple"]
    facts = ("path", "sha256", "rows_in", "rows_scored", "rows_quarantined", "status")
    assert ([{k: s[k] for k in facts} for s in manifest["shards"]]
            == [{k: s[k] for k in facts} for s in ref_manifest["shards"]])
    preds, ref_preds = preds.sort_by(KEY), ref_preds.sort_by(KEY)
    assert preds.num_rows == SHARDS * ROWS - 3
    keys = list(zip(preds["_source_shard"].to_pylist(), preds["_source_row"].to_pylist()))
    assert len(set(keys)) == len(keys), "a row is in the partition twice"
    for column in ("id", "y", "_source_shard", "_source_row", "_input_hash"):
        assert preds[column].combine_chunks().equals(ref_preds[column].combine_chunks()), column
    columns = ["_source_shard", "_source_row", "_reason", "_values"]
    assert quar.select(columns).sort_by(KEY).equals(ref_quar.select(columns).sort_by(KEY))
    diff = run_cli("diff", reference, out, cwd=project, env=store[2])
    assert diff.returncode == 0, diff.stdout + diff.stderr
    assert diff.stdout.strip().splitlines()[-1] == "verdict: identical", diff.stdout


def assert_elsewhere(roots: list[int], project: Path, marker: Path, shared: Path) -> list[int]:
    """Every process under ``roots`` is in another mount namespace than this one, where the job's
    folder and the launcher's marker are not (seen through ``/proc/PID/root``, the process's own
    view) and the shared folder is; returns them."""
    ours = os.readlink("/proc/self/ns/mnt")
    seen = []
    for pid in (pid for root in roots for pid in processes_of(root)):
        view = Path(f"/proc/{pid}/root")
        try:
            facts = (os.readlink(f"/proc/{pid}/ns/mnt"),
                     (view / project.relative_to("/") / "job.yaml").exists(),
                     (view / marker.relative_to("/")).exists(),
                     (view / shared.relative_to("/") / "gate").is_dir())
        except FileNotFoundError:
            continue
        if not Path(f"/proc/{pid}").exists():
            continue   # it ended while we looked (an SDK worker of a job that finished)
        assert facts[0] != ours and facts[1:] == (False, False, True), (pid, facts)
        seen.append(pid)
    assert seen
    return seen


def cached_models(pid: int) -> list[str]:
    """The model cache entries (digests) in the namespace of process ``pid``."""
    root = Path(f"/proc/{pid}/root{WORKER_TMP}/models")
    return sorted(p.name for p in root.iterdir() if len(p.name) == 64) if root.is_dir() else []


def model_gets(proxy: FaultProxy) -> int:
    """GETs of the model file (not its sidecar) that the workers' proxy passed on."""
    return sum(1 for _, target, status in proxy.requests("GET")
               if target.split("?")[0].endswith("/models/model.onnx") and status == 200)


def worker_views(cluster: DaskCluster, project: Path, marker: Path) -> dict[str, dict]:
    """What each Dask worker process sees, from inside (``Client.run``)."""
    from distributed import Client

    def inside(job_folder: str, marker: str, token: str) -> dict:
        # Nested, so that cloudpickle sends it by value (the workers cannot import this module).
        import os
        import sys

        return {"job folder": os.path.exists(job_folder), "marker": os.path.exists(marker),
                "launcher temp": os.path.exists(os.path.dirname(job_folder)),
                "python": os.path.exists(sys.executable),
                "token": os.environ.get("BI_TOKEN") == token, "pid": os.getpid()}

    with Client(cluster.address, timeout=30) as client:
        return client.run(inside, str(project), str(marker), TOKEN)


# -- the tests -----------------------------------------------------------------------------------

def test_the_cluster_processes_see_nothing_of_the_launchers_disk(
        dask_elsewhere, beam_elsewhere, project, marker, shared):
    """The namespaces hold: neither the job's folder nor a file of the launcher's temp folder
    is there, for the scheduler, the worker processes, the job service and the worker pool; a
    Dask worker says so from inside, and it has the secret's variable (a leak would be its)."""
    roots = [p.pid for p in (dask_elsewhere.proc, dask_elsewhere.nanny, beam_elsewhere.proc,
                             beam_elsewhere.pool) if p is not None]
    assert len(assert_elsewhere(roots, project, marker, shared)) >= 6
    views = worker_views(dask_elsewhere, project, marker)
    assert len(views) == 2
    for view in views.values():
        assert view == {"job folder": False, "marker": False, "launcher temp": False,
                        "python": True, "token": True, "pid": view["pid"]}, view


def test_dask_workers_elsewhere_commit_what_the_launcher_commits_even_with_one_killed_mid_shard(
        project, store, direct, dask_elsewhere, workers_proxy, shared, marker):
    """A worker process is killed (SIGKILL) inside the preprocessing of a shard; the nanny
    starts another, the scheduler runs the lost tasks again, and the one run commits the
    partition the launcher's direct run commits. The workers' machine fetched the model from
    the store once, into its own cache."""
    _, bucket, env = store
    gate = shared / "gate"
    pids = {view["pid"] for view in worker_views(dask_elsewhere, project, marker).values()}
    workers_proxy.reset()
    (gate / "armed").touch()
    launcher = start_cli(*run_args(bucket, "dask", "dask", dask_options(dask_elsewhere)),
                         cwd=project, env=env)
    try:
        deadline = time.monotonic() + 300
        while not (ready := sorted(gate.glob("ready-*"))):
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "no worker reached the preprocessing"
            time.sleep(0.05)
        killed = int(ready[0].name.removeprefix("ready-"))
        assert killed in pids, (killed, pids)
        os.kill(killed, signal.SIGKILL)
    finally:
        (gate / "go").touch()
    try:
        stdout, stderr = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for name in ("armed", "go"):
            (gate / name).unlink(missing_ok=True)
    assert launcher.returncode == 0, stdout + stderr
    dask_elsewhere.wait_for_workers(60)
    now = {view["pid"] for view in worker_views(dask_elsewhere, project, marker).values()}
    assert killed not in now and len(now) == 2, (killed, now)
    assert_same_partition(out_url(bucket, "dask"), direct, project, store, "dask")
    print(f"\nkilled worker process {killed}; workers now {sorted(now)}")
    assert_elsewhere([dask_elsewhere.proc.pid, dask_elsewhere.nanny.pid], project, marker, shared)
    digest = json.loads(store[0].cat_file(f"{bucket}/models/model.onnx.batchinfer.json"))["model_digest"]
    assert cached_models(dask_elsewhere.nanny.pid) == [digest]
    assert model_gets(workers_proxy) == 1


def test_beam_job_service_and_worker_pool_elsewhere_commit_what_the_launcher_commits(
        project, store, direct, beam_elsewhere, workers_proxy, shared, marker):
    workers_proxy.reset()
    out = run(project, store, "portable", "portable", beam_elsewhere.options)
    assert_same_partition(out, direct, project, store, "portable")
    assert_elsewhere([beam_elsewhere.proc.pid, beam_elsewhere.pool.pid], project, marker, shared)
    assert len(cached_models(beam_elsewhere.pool.pid)) == 1
    assert model_gets(workers_proxy) == 1


@pytest.mark.parametrize("runner", ["dask", "portable"])
def test_a_worker_that_cannot_write_fails_the_job_without_showing_the_secret(
        project, store, dask_elsewhere, beam_elsewhere, workers_proxy, runner):
    """Every write of a prediction file by a worker is refused (HTTP 403 from its store): the
    job fails (exit 5) and nothing is committed; the launcher's line, and what the cluster logs
    of the worker's failure, show the output's path with ``${BI_TOKEN}``, not its value."""
    fs, bucket, env = store
    options = dask_options(dask_elsewhere) if runner == "dask" else beam_elsewhere.options
    workers_proxy.add(method="PUT", contains="/predictions/", status=403, times=None)
    try:
        result = run_cli(*run_args(bucket, f"faulted-{runner}", runner, options), cwd=project,
                         env=env, timeout=600)
    finally:
        workers_proxy.reset()
    assert result.returncode == 5, result.stdout + result.stderr
    assert TOKEN not in result.stdout + result.stderr
    # One line (contract §2): on the job service, not after the traceback that Beam's portable
    # runner relays from it through the root logger.
    assert f"/out-${{BI_TOKEN}}/faulted-{runner}/" in one_line_error(result)
    fs.invalidate_cache()
    assert not fs.exists(f"{out_url(bucket, f'faulted-{runner}')}/_manifest.json")


def test_no_log_of_the_cluster_holds_the_secret(dask_elsewhere, beam_elsewhere):
    """After the runs (a worker killed, writes refused): the scheduler's, the workers', the job
    service's and the worker pool's logs name the job's outputs only as ``${BI_TOKEN}``."""
    logs = dask_elsewhere.logs + beam_elsewhere.logs
    found = [str(log) for log in logs if TOKEN.encode() in log.read_bytes()]
    assert found == [], found
    # They do name the outputs: the failed writes, as the workers' errors show them.
    for cluster in (dask_elsewhere, beam_elsewhere):
        assert any(b"/out-${BI_TOKEN}/faulted-" in log.read_bytes() for log in cluster.logs)
