"""Distributed runners run for real on 127.0.0.1 (docs/runners.md): Beam's portable job service
with an external SDK worker pool (what a Flink cluster's job server looks like to a job), a
``dask.distributed`` cluster of two worker processes, and the direct runner's multi-process
mode. Each commits exactly what the in-process direct runner commits: the same rows, the same
quarantine, predictions and ``_input_hash`` bit for bit. And the commit does not depend on the
process that launched the job: killed mid-job, the job still commits, and its retry is a no-op.
The last progress line of each run, from the runner's Beam metrics, says what ``_metrics.json``
says; a runner that reports them only at the end says so first (docs/runners.md "Progress and
metrics").

Every run is a real ``batchinfer`` process, tracked to MLflow for real: forked from the
session's fork server (forkserver.py; the runners' own worker processes, job service and Dask
cluster start as they would), except the launcher that a test interrupts, a plain ``python -m
batchinfer`` (Ctrl-C reaches the entry point); the launchers killed by SIGKILL are forked too,
which SIGKILL ends like any process. The wall times are
printed (``-s``) for the closing note, never asserted.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import forkserver
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factories import DS, check_partition, numeric_project, run_cli
from servers import start_cli

pytestmark = [pytest.mark.slow, pytest.mark.server]

SHARDS, ROWS, BATCH = 4, 3000, 1000
BAD = {1: [7, 2999], 3: [0]}   # shard → rows given an out-of-range f0 (quarantined)
KEY = [("_source_shard", "ascending"), ("_source_row", "ascending")]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """4 shards × 3,000 rows (3 bad), 1,000-row batches, a stamped MLP."""
    folder = tmp_path_factory.mktemp("runners")
    numeric_project(folder, shards=SHARDS, rows=ROWS, batch={"rows": BATCH})
    for shard, rows in BAD.items():
        path = shard_paths(folder)[shard]
        table = pq.read_table(path)
        f0 = table.column("f0").to_numpy().copy()
        f0[rows] = 50.0
        pq.write_table(table.set_column(table.column_names.index("f0"), "f0", pa.array(f0)), path)
    return folder


def shard_paths(folder: Path) -> list[Path]:
    return sorted((folder / "data" / f"dt={DS}").glob("*.parquet"))


def run(folder: Path, label: str, runner: str = "direct", **options) -> tuple[Path, float, str]:
    """``batchinfer run`` into ``out_<label>`` on ``runner``; (output, wall seconds, stdout)."""
    sets = ["--set", f"output.path=out_{label}", "--set", f"runner.name={runner}"]
    for key, value in options.items():
        sets += ["--set", f"runner.options.{key}={value}"]
    t0 = time.perf_counter()
    result = run_cli("run", "job.yaml", "--ds", DS, *sets, cwd=folder, track=True, timeout=600)
    wall = time.perf_counter() - t0
    assert result.returncode == 0, result.stdout + result.stderr
    print(f"\n[{label}] {runner} runner: {wall:.1f} s wall (process start to exit)")
    return folder / f"out_{label}", wall, result.stdout


@pytest.fixture(scope="module")
def direct(project) -> Path:
    out, _, stdout = run(project, "direct")
    assert_progress_agrees(out, stdout, live=True)
    return out


def assert_progress_agrees(out: Path, stdout: str, *, live: bool) -> None:
    """The run's last progress line (its Beam metrics) holds the shards, rows and quarantined rows
    of its ``_metrics.json`` (the shard records); without ``live`` the first line says progress
    is not available live on this runner, and no line shows figures before the last."""
    from batchinfer.app.run_progress import NOT_LIVE

    lines = [line for line in stdout.splitlines() if line.startswith("progress: ")]
    assert lines, stdout
    assert (lines[0] == f"progress: {NOT_LIVE}") is (not live), lines
    if not live:
        assert len(lines) == 2, lines
    last = re.fullmatch(r"progress: shards (\d+)/(\d+), rows ([\d,]+)/([\d,]+), .*, "
                        r"([\d,]+) quarantined", lines[-1])
    assert last, lines
    metrics = json.loads((out / "_metrics.json").read_text())["metrics"]
    shards_done, shards, rows_done, rows_total, quarantined = (int(g.replace(",", ""))
                                                               for g in last.groups())
    assert shards_done == shards == metrics["shards"] == SHARDS
    assert rows_done == rows_total == metrics["rows_in"] == SHARDS * ROWS
    assert quarantined == metrics["rows_quarantined"] == sum(len(r) for r in BAD.values())


def assert_same_partition(out: Path, reference: Path, folder: Path, runner: str) -> None:
    """``out`` is a complete partition (contract §4–§5) holding what ``reference`` holds: the same
    rows and quarantine, predictions and ``_input_hash`` bit-identical; only the execution
    differs (attempt, ``_inference_id``, ``_compute_ms``, runner, times)."""
    preds, quar, manifest = check_partition(out, shard_paths(folder))
    ref_preds, ref_quar, ref_manifest = check_partition(reference, shard_paths(folder))
    assert manifest["runner"] == runner
    assert manifest["totals"] == ref_manifest["totals"]
    assert manifest["totals"]["rows_quarantined"] == sum(len(r) for r in BAD.values())
    assert manifest["triple"] == ref_manifest["triple"]
    shard_facts = ("path", "sha256", "rows_in", "rows_scored", "rows_quarantined", "status")
    assert ([{k: s[k] for k in shard_facts} for s in manifest["shards"]]
            == [{k: s[k] for k in shard_facts} for s in ref_manifest["shards"]])
    preds, ref_preds = preds.sort_by(KEY), ref_preds.sort_by(KEY)
    assert preds.num_rows == ref_preds.num_rows == SHARDS * ROWS - 3
    for column in ("id", "y", "_source_shard", "_source_row", "_input_hash"):
        # Arrow's equality on float32 is bit-for-bit here (no NaN: non-finite outputs are quarantined).
        assert preds[column].combine_chunks().equals(ref_preds[column].combine_chunks()), column
    quar_columns = ["_source_shard", "_source_row", "_reason", "_values"]
    assert quar.select(quar_columns).sort_by(KEY).equals(ref_quar.select(quar_columns).sort_by(KEY))
    diff = run_cli("diff", str(reference), str(out), cwd=folder)
    assert diff.returncode == 0 and diff.stdout.strip().splitlines()[-1] == "verdict: identical", diff.stdout


def test_portable_job_service_commits_what_the_direct_runner_commits(project, direct, beam_job_service):
    out, _, stdout = run(project, "portable", "portable", **beam_job_service.options)
    assert_same_partition(out, direct, project, "portable")
    assert_progress_agrees(out, stdout, live=False)


def test_dask_cluster_of_two_worker_processes_commits_what_the_direct_runner_commits(
        project, direct, dask_cluster):
    before = dask_cluster.executed()
    out, _, stdout = run(project, "dask", "dask", dask_client_address=dask_cluster.address)
    assert_same_partition(out, direct, project, "dask")
    assert_progress_agrees(out, stdout, live=True)
    after = dask_cluster.executed()
    assert len(after) == 2
    ran = {worker: after[worker] - before.get(worker, 0) for worker in after}
    assert all(count > 0 for count in ran.values()), f"tasks run per worker process: {ran}"


def test_direct_runner_multi_processing_commits_what_one_process_commits(project, direct):
    out, _, stdout = run(project, "multiprocess", direct_num_workers=2,
                         direct_running_mode="multi_processing")
    assert_same_partition(out, direct, project, "direct")
    assert_progress_agrees(out, stdout, live=False)


def test_one_model_copy_served_to_all_worker_processes_commits_the_same(project, direct):
    """``model.options.share_across_processes``: Beam serves one copy from a process of its own
    and the workers call it through a proxy (before the loaded model answered with plain data,
    the first call failed: ``TypeError: cannot pickle … NodeArg``)."""
    sets = ["--set", "output.path=out_shared", "--set", "model.options.share_across_processes=true",
            "--set", "runner.options.direct_num_workers=2",
            "--set", "runner.options.direct_running_mode=multi_processing"]
    result = run_cli("run", "job.yaml", "--ds", DS, *sets, cwd=project, track=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert_same_partition(project / "out_shared", direct, project, "direct")


GATE_SOURCE = '''\
import os
import time
from pathlib import Path

import numpy as np

GATE = Path({gate!r})


def transform(batch):
    # Runs in the worker pool's SDK worker: says it is there, then waits for the test.
    Path(GATE, f"ready-{{os.getpid()}}").touch()
    while not Path(GATE, "go").exists():
        time.sleep(0.01)
    return np.stack([batch.column(n).to_numpy() for n in ("f0", "f1", "f2", "f3")],
                    axis=1).astype(np.float32)
'''


def test_launcher_killed_mid_job_the_job_still_commits_and_the_retry_is_a_noop(
        tmp_path, beam_job_service):
    """The commit is the pipeline's last step (docs/runners.md): an Airflow worker that launched
    the job and died takes nothing with it. The launcher is killed (SIGKILL) while the job runs on
    the job service; the job commits on its own; the retried launch finds the partition
    committed by that attempt and exits 0 without scoring anything."""
    assert_commits_without_its_launcher(tmp_path, "portable", beam_job_service.options)


def test_dask_launcher_killed_mid_job_the_workers_still_commit_and_the_retry_is_a_noop(
        tmp_path, dask_cluster):
    """The same on a Dask cluster. dask.distributed releases a client's tasks when the client
    disconnects, so before the fix the scheduler dropped the job with its launcher and nothing
    was committed; the runner now marks the job's final tasks fire-and-forget."""
    assert_commits_without_its_launcher(
        tmp_path, "dask", {"dask_client_address": dask_cluster.address},
        # Before opening the gate, let the scheduler see the launcher gone: without the fix it
        # then releases the job before any gated task can finish.
        launcher_gone=lambda: dask_cluster.wait_for_no_clients(60))


def test_dask_launcher_interrupted_cancels_the_job_and_nothing_is_committed(tmp_path, dask_cluster):
    """Ctrl-C still commits nothing (contract §6): the fire-and-forget tasks are cancelled before
    the launcher removes its attempt, so once the cluster is idle there is no manifest, and the
    next run commits the partition with nothing of the interrupted attempt in it."""
    options = {"dask_client_address": dask_cluster.address}
    launcher, gate, sets = launch_gated(tmp_path, "dask", options, fresh=True)  # a signal: the subject
    try:
        launcher.send_signal(signal.SIGINT)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        (gate / "go").touch()
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, stderr
    dask_cluster.wait_until_idle(120)  # the tasks already running have finished
    out = tmp_path / "out" / f"dt={DS}"
    assert not (out / "_manifest.json").exists()
    rerun = run_cli("run", "job.yaml", "--ds", DS, *sets, cwd=tmp_path, track=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    _, _, manifest = check_partition(out, shard_paths(tmp_path))   # no file of the first attempt
    assert manifest["totals"]["rows_scored"] == 1000


def launch_gated(folder: Path, runner: str, options: dict, fresh: bool = False
                 ) -> tuple[subprocess.Popen | forkserver.Run, Path, list[str]]:
    """Start ``run`` on ``runner`` in ``folder`` (2 shards × 500 rows) with a preprocessing that
    waits at a gate; return (the launcher, the gate, its ``--set`` arguments) once a worker is
    scoring, inside the gate (touch ``gate/go`` to open it). The launcher is a child of the fork
    server (SIGKILL ends it as it ends any process), or with ``fresh`` a plain ``python -m
    batchinfer`` (for Ctrl-C, whose handling is the entry point's)."""
    gate = folder / "gate"
    gate.mkdir()
    (folder / "gated.py").write_text(GATE_SOURCE.format(gate=str(gate)))
    numeric_project(folder, shards=2, rows=500, preprocess="gated:transform")
    sets = ["--set", f"runner.name={runner}"]
    for key, value in options.items():
        sets += ["--set", f"runner.options.{key}={value}"]
    launcher = start_cli("run", "job.yaml", "--ds", DS, *sets, cwd=folder, fresh=fresh)
    try:
        deadline = time.monotonic() + 300
        while not any(gate.glob("ready-*")):
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the job never reached preprocessing"
            time.sleep(0.05)
    except BaseException:
        launcher.kill()
        (gate / "go").touch()
        raise
    return launcher, gate, sets


def assert_commits_without_its_launcher(folder: Path, runner: str, options: dict,
                                        launcher_gone=lambda: None) -> None:
    """SIGKILL the launcher of a gated job once a worker is scoring, open the gate, and check
    that the job commits a whole partition on its own and that the retried launch is a no-op
    (exit 0)."""
    launcher, gate, sets = launch_gated(folder, runner, options)
    out = folder / "out" / f"dt={DS}"
    try:
        launcher.kill()  # the launcher dies mid-job, as an Airflow worker can
        launcher.wait()
        assert not (out / "_manifest.json").exists()
        launcher_gone()
    finally:
        (gate / "go").touch()
    # The commit step's record of what it did is the job's last write (after manifest and cleanup).
    deadline = time.monotonic() + 300
    while not list(out.glob("_tmp/*/outcome.json")):
        assert time.monotonic() < deadline, "the job did not commit without its launcher"
        time.sleep(0.1)
    committed = json.loads((out / "_manifest.json").read_text())
    retry = run_cli("run", "job.yaml", "--ds", DS, *sets, cwd=folder, track=True, timeout=600)
    assert retry.returncode == 0, retry.stderr
    assert f"already committed with this triple (attempt {committed['attempt']})" in retry.stdout
    _, _, manifest = check_partition(out, shard_paths(folder))   # the retry tidied the scratch
    assert manifest == committed
    assert manifest["runner"] == runner
    assert manifest["totals"]["rows_scored"] == 1000
