"""Crash safety (contract §4, §5.2–5.3): a run SIGKILLed at any fault point, then rerun, commits
exactly what an uninterrupted run commits; nothing outside the manifest survives.

Every run is a real ``batchinfer`` process (``cli.main`` in its own process, with
``BATCHINFER_FAULT`` in its environment). To keep the file fast on a 2-core machine the
processes are forked from a small fork server that has already imported Beam, ONNX Runtime,
pandera and MLflow (about 5 s of imports per plain ``python -m batchinfer``), so each run costs
only its own work; the forked child is killed by SIGKILL exactly like a ``python -m`` process.
``test_fault_env_var_kills_cli_process`` checks the same hook on a plain ``python -m``
process. Killed runs track to MLflow for real; reruns and set-up runs replace tracking by a
stub (its helper process costs about 2 s of CPU a run, and tracking is not under test here).

Faults injected (``BATCHINFER_FAULT``): read, mid_write, write:2, shard_done, before_commit,
during_commit, after_commit; during_commit and after_commit again on an ``--overwrite`` run;
and an external ``kill -9`` at a moment chosen by polling (8 shards x 50k rows). Every rerun
resumes (contract §5.3 "Resume"): it scores exactly the shards the killed run had not finished
(counted from the manifest's ``scored_by`` and ``_metrics.json``) and adopts the others; one
killed run's input shard is rewritten before its rerun, which scores it again.

Rerun them with ``.venv/bin/pytest tests/faults/test_crash.py -q``.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factories import (
    DS,
    assert_same_result,
    check_partition,
    finished_shards,
    make_mlp_onnx,
    make_shards,
    partition_files,
    write_job,
    write_schema,
)

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def server():
    """The session's fork server (see forkserver.py)."""
    return forkserver.shared()


# -- checks shared by the crash tests ----------------------------------------------------------

# -- the project ---------------------------------------------------------------------------------

SHARDS, ROWS, BATCH = 4, 2000, 500
BAD_ROWS = {1: [5, 600, 1999], 3: [0]}   # out of range: quarantined, so quarantine files exist too


@pytest.fixture(scope="module")
def project(tmp_path_factory, server):
    folder = tmp_path_factory.mktemp("crash")
    write_schema(folder / "schemas")
    shards = make_shards(folder / "data" / f"dt={DS}", shards=SHARDS, rows=ROWS, seed=7)
    for s, rows in BAD_ROWS.items():
        table = pq.read_table(shards[s])
        f0 = table["f0"].to_numpy().copy()
        f0[rows] = 50.0
        pq.write_table(table.set_column(1, "f0", pa.array(f0, pa.float32())), shards[s])
    make_mlp_onnx(folder / "models" / "model.onnx")
    make_mlp_onnx(folder / "models" / "model_old.onnx")   # same bytes, declared as another version
    for job, model in (("job_old.yaml", "models/model_old.onnx"), ("job.yaml", "models/model.onnx")):
        write_job(folder, model=model, batch={"rows": BATCH},
                  quarantine={"max_bad_fraction": 0.01, "max_bad_shards": 0},
                  tracking={"uri": "sqlite:///mlflow.db", "experiment": "crash"}).rename(folder / job)
    stamps = [server.start("stamp", model, "--job", job, "--model-version", version, cwd=folder)
              for job, model, version in (("job_old.yaml", "models/model_old.onnx", "model:0"),
                                          ("job.yaml", "models/model.onnx", "model:1"))]
    for r in stamps:
        assert r.wait().returncode == 0, r.stderr
    # The reference: an uninterrupted run (it also creates the sqlite store before the
    # parallel runs below use it: a new store cannot take concurrent first use: measured).
    ref = server.run("run", "job.yaml", "--ds", DS, "--set", "output.path=ref", cwd=folder)
    assert ref.returncode == 0, ref.stderr
    check_partition(folder / "ref", shards)
    return folder, shards


def run_args(out: str) -> tuple[str, ...]:
    return ("run", "job.yaml", "--ds", DS, "--set", f"output.path={out}")


FAULTS = ["read", "mid_write", "write:2", "shard_done", "before_commit", "during_commit",
          "after_commit"]


OVERWRITE_FAULTS = ["during_commit", "after_commit"]


def _snapshot(run: forkserver.Run, out: Path) -> dict:
    return {
        "finished": finished_shards(out),
        "rc": run.returncode, "stderr": run.stderr,
        "manifest": (out / "_manifest.json").read_bytes() if (out / "_manifest.json").exists() else None,
        "files": partition_files(out),
        "tmp": sorted(str(p.relative_to(out)) for p in (out / "_tmp").rglob("*") if p.is_file())
        if (out / "_tmp").exists() else [],
        "metrics": (out / "_metrics.json").exists(),
    }


@pytest.fixture(scope="module")
def crashed(project, server):
    """Waves of runs at once, each on its own output (the reference ran first, alone). The
    killed runs track to MLflow for real (a kill with a live tracking helper); runs that only
    set up or finish the scenario use the tracking stub.

    A. every fault; the partitions that ``--overwrite`` will replace are committed under the
       old triple; a plain ``python -m batchinfer`` process with a fault beside them; a run on a
       copy of the input killed before its commit (all its shards finished), one of whose
       shards is then rewritten;
    B. every rerun; the ``--overwrite`` runs, killed at a commit fault;
    C. their reruns.
    """
    folder, shards = project
    copy = folder / "data_copy" / f"dt={DS}"
    copy.mkdir(parents=True, exist_ok=True)
    for shard in shards:
        (copy / shard.name).write_bytes(shard.read_bytes())
    copied = ("--set", f"input.path=data_copy/dt={DS}/*.parquet")
    rewritten = server.start(*run_args("out_rewritten"), *copied, cwd=folder, track=False,
                             fault="before_commit")
    cli = subprocess.Popen([sys.executable, "-m", "batchinfer", *run_args("out_cli")], cwd=folder,
                           env={**os.environ, "BATCHINFER_FAULT": "during_commit"},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = {f: server.start(*run_args(_out(f)), cwd=folder, fault=f) for f in FAULTS}
    old = {f: server.start("run", "job_old.yaml", "--ds", DS, "--set", f"output.path={_ow(f)}",
                           cwd=folder, track=False) for f in OVERWRITE_FAULTS}
    killed = {f: _snapshot(run.wait(), folder / _out(f)) for f, run in runs.items()}
    killed["rewritten"] = _snapshot(rewritten.wait(), folder / "out_rewritten")
    table = pq.read_table(copy / shards[2].name)   # rewritten upstream: one value changed
    f0 = table["f0"].to_numpy().copy()
    f0[0] += 1.0
    pq.write_table(table.set_column(1, "f0", pa.array(f0, pa.float32())), copy / shards[2].name)
    old_manifest = {}
    for f, run in old.items():
        assert run.wait().returncode == 0, run.stderr
        old_manifest[f] = (folder / _ow(f) / "_manifest.json").read_bytes()

    plan = server.run("plan", "job.yaml", "--ds", DS, "--set", f"output.path={_out('shard_done')}",
                      cwd=folder, track=False)
    reruns = {f: server.start(*run_args(_out(f)), cwd=folder, track=False) for f in FAULTS}
    reruns["rewritten"] = server.start(*run_args("out_rewritten"), *copied, cwd=folder, track=False)
    ow = {f: server.start(*run_args(_ow(f)), "--overwrite", cwd=folder, fault=f)
          for f in OVERWRITE_FAULTS}
    ow_killed = {f: _snapshot(run.wait(), folder / _ow(f)) for f, run in ow.items()}
    for run in reruns.values():
        run.wait()

    ow_reruns = {"during_commit": server.start(*run_args(_ow("during_commit")), "--overwrite",
                                               cwd=folder, track=False),
                 "after_commit": server.start(*run_args(_ow("after_commit")), cwd=folder, track=False)}
    for run in ow_reruns.values():
        run.wait()
    inspect = server.run("inspect", _out("shard_done"), cwd=folder, track=False)
    _, err = cli.communicate(timeout=300)
    return {"killed": killed, "reruns": reruns, "cli": (cli.returncode, err), "plan": plan,
            "inspect": inspect,
            "old_manifest": old_manifest, "ow_killed": ow_killed, "ow_reruns": ow_reruns}


def _ow(fault: str) -> str:
    return "ow_" + fault


def _out(fault: str) -> str:
    return "out_" + fault.replace(":", "_")


@pytest.mark.parametrize("fault", [f for f in FAULTS if f != "after_commit"])
def test_kill_at_fault_point_then_rerun_commits_reference(fault, project, crashed):
    folder, shards = project
    killed, reruns = crashed["killed"], crashed["reruns"]
    k = killed[fault]
    assert k["rc"] == -signal.SIGKILL, f"{fault}: run was not killed (rc {k['rc']}): {k['stderr'][-500:]}"
    assert k["manifest"] is None, f"{fault}: the killed run committed"
    point = fault.split(":")[0]
    if point in ("mid_write", "write", "shard_done", "before_commit", "during_commit"):
        assert k["files"], f"{fault}: the killed run should have left data files behind"
    if point == "mid_write":  # the half-written file is really there and really broken
        broken = []
        for rel in k["files"]:
            try:
                pq.read_metadata(folder / _out(fault) / rel)
            except Exception:
                broken.append(rel)
        assert broken, "mid_write left no truncated file"
    if point in ("shard_done", "before_commit"):
        assert any(t.endswith(".json") and "/shards/" in t for t in k["tmp"])
    if point == "during_commit":
        assert any(t.endswith("_manifest.json") for t in k["tmp"]), k["tmp"]
    if point in ("shard_done", "before_commit", "during_commit"):
        assert k["finished"], f"{fault}: the killed run finished no shard (resume proves nothing)"
    rerun = reruns[fault]
    assert rerun.returncode == 0, rerun.stderr
    assert "committed" in rerun.stdout
    manifest = assert_same_result(folder / _out(fault), folder / "ref", shards)
    assert manifest["totals"]["rows_quarantined"] == sum(len(v) for v in BAD_ROWS.values())
    assert_resumed(folder / _out(fault), manifest, k["finished"])


def assert_resumed(out: Path, manifest: dict, finished: dict[str, str]) -> None:
    """The rerun scored exactly the shards the killed run had not finished, and adopted the
    others where the killed attempt wrote them (``finished``: shard → attempt)."""
    scored_by = {s["path"]: s["scored_by"] for s in manifest["shards"]}
    assert {p: a for p, a in scored_by.items() if a != manifest["attempt"]} == finished
    metrics = json.loads((out / "_metrics.json").read_text())["metrics"]
    assert metrics["shards_reused"] == len(finished)
    assert metrics["rows_reused"] == len(finished) * ROWS


def test_plan_inspect_and_report_say_what_a_resume_reuses(project, crashed):
    folder, _ = project
    finished = len(crashed["killed"]["shard_done"]["finished"])
    plan, inspect = crashed["plan"], crashed["inspect"]
    assert plan.returncode == 0, plan.stderr
    assert (f"a run would      reusing {finished} of {SHARDS} shards ({finished * ROWS:,} rows)"
            in plan.stdout), plan.stdout
    assert f"; scoring {SHARDS - finished}" in plan.stdout
    assert inspect.returncode == 0, inspect.stderr
    assert f"reused: {finished} of {SHARDS} shards ({finished * ROWS} rows)" in inspect.stdout
    report = (folder / _out("shard_done") / "report.html").read_text()
    assert "scored by" in report and f"reused: {finished} of {SHARDS} shards" in report


def test_shard_rewritten_after_the_crash_is_scored_again(project, crashed):
    folder, _ = project
    k, rerun = crashed["killed"]["rewritten"], crashed["reruns"]["rewritten"]
    assert k["rc"] == -signal.SIGKILL, k["stderr"]
    assert len(k["finished"]) == SHARDS, "killed before its commit, every shard finished"
    assert rerun.returncode == 0, rerun.stderr
    out = folder / "out_rewritten"
    copy = sorted((folder / "data_copy" / f"dt={DS}").glob("*.parquet"))
    _, _, manifest = check_partition(out, copy)
    changed = str(copy[2])
    by_path = {s["path"]: s for s in manifest["shards"]}
    assert by_path[changed]["scored_by"] == manifest["attempt"], "a rewritten shard was adopted"
    assert by_path[changed]["sha256"] == hashlib.sha256(copy[2].read_bytes()).hexdigest()
    assert {p for p, s in by_path.items() if s["scored_by"] != manifest["attempt"]} == (
        set(k["finished"]) - {changed})


def test_kill_after_commit_keeps_commit_and_rerun_is_noop(project, crashed):
    folder, shards = project
    killed, reruns = crashed["killed"], crashed["reruns"]
    k = killed["after_commit"]
    assert k["rc"] == -signal.SIGKILL, k["stderr"]
    assert k["manifest"] is not None, "the manifest was created before after_commit"
    assert k["tmp"], "after_commit leaves scratch (the test would prove nothing otherwise)"
    # Observed, not required by the contract: the killed run never wrote _metrics.json and the no-op
    # rerun does not either (the manifest keeps the totals; the MLflow run stays RUNNING).
    out = folder / _out("after_commit")
    rerun = reruns["after_commit"]
    assert rerun.returncode == 0, rerun.stderr
    assert "already committed with this triple" in rerun.stdout
    assert (out / "_manifest.json").read_bytes() == k["manifest"], "the no-op rerun changed the commit"
    assert_same_result(out, folder / "ref", shards)   # includes: debris and _tmp removed


def test_fault_env_var_kills_cli_process(project, crashed):
    """The hook on a plain ``python -m batchinfer`` process (no fork server)."""
    folder, shards = project
    returncode, stderr = crashed["cli"]
    assert returncode == -signal.SIGKILL, stderr
    assert not (folder / "out_cli" / "_manifest.json").exists()
    assert list((folder / "out_cli" / "_tmp").rglob("_manifest.json"))


# -- an external kill -9 at a random moment, on more data ----------------------------------------

@pytest.fixture(scope="module")
def big_project(tmp_path_factory, server, project):
    folder = tmp_path_factory.mktemp("crash_big")
    store = f"sqlite:///{project[0] / 'mlflow.db'}"   # an existing store: no first-use race
    write_schema(folder / "schemas")
    shards = make_shards(folder / "data" / f"dt={DS}", shards=8, rows=50_000, seed=3)
    make_mlp_onnx(folder / "models" / "model.onnx")
    write_job(folder, batch={"rows": 8192}, tracking={"uri": store, "experiment": "big"})
    r = server.run("stamp", "models/model.onnx", "--job", "job.yaml", "--model-version", "model:1",
                   cwd=folder)
    assert r.returncode == 0, r.stderr
    return folder, shards


def test_external_kill_9_while_working_then_rerun(big_project, server):
    folder, shards = big_project
    ref = server.start(*run_args("ref"), cwd=folder, track=False)
    victim = server.start(*run_args("out"), cwd=folder)
    out = folder / "out"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if len(partition_files(out)) >= 3:   # working: some batches written, most not
            break
        time.sleep(0.01)
    else:
        pytest.fail("the run wrote nothing within 120 s")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (out / "_manifest.json").exists(), "killed too late: it had already committed"
    written = len(partition_files(out))
    assert 0 < written < 8 * 7, "killed while working, with batches left to write"
    finished = finished_shards(out)
    ref.wait()
    assert ref.returncode == 0, ref.stderr
    rerun = server.run(*run_args("out"), cwd=folder, track=False)
    assert rerun.returncode == 0, rerun.stderr
    manifest = assert_same_result(out, folder / "ref", shards)
    assert manifest["totals"]["rows_scored"] == 8 * 50_000
    reused = {s["path"] for s in manifest["shards"] if s["scored_by"] != manifest["attempt"]}
    assert reused == set(finished)


def test_overwrite_killed_during_commit_keeps_old_partition_then_rerun_replaces_it(project, crashed):
    folder, shards = project
    out = folder / _ow("during_commit")
    k = crashed["ow_killed"]["during_commit"]
    assert k["rc"] == -signal.SIGKILL, k["stderr"]
    # the old commit is untouched and still whole
    assert k["manifest"] == crashed["old_manifest"]["during_commit"]
    old = json.loads(k["manifest"])
    assert old["triple"]["model_version"] == "model:0"
    rerun = crashed["ow_reruns"]["during_commit"]
    assert rerun.returncode == 0, rerun.stderr
    manifest = assert_same_result(out, folder / "ref", shards)   # no file of the old triple left
    assert manifest["triple"]["model_version"] == "model:1"
    assert not (out / "predictions" / old["attempt"]).exists()


def test_overwrite_killed_after_commit_never_mixes_triples(project, crashed):
    folder, shards = project
    out = folder / _ow("after_commit")
    k = crashed["ow_killed"]["after_commit"]
    assert k["rc"] == -signal.SIGKILL, k["stderr"]
    new = json.loads(k["manifest"])
    old = json.loads(crashed["old_manifest"]["after_commit"])
    assert new["triple"]["model_version"] == "model:1" and new["attempt"] != old["attempt"]
    # right after the kill: the old attempt's files are still on disk, but not in the partition
    assert any(f.split("/")[1] == old["attempt"] for f in k["files"])
    listed = {f["path"] for s in new["shards"] for f in s["files"]}
    assert all(f.split("/")[1] == new["attempt"] for f in listed)
    rerun = crashed["ow_reruns"]["after_commit"]      # no --overwrite: same triple, a no-op
    assert rerun.returncode == 0, rerun.stderr
    assert "already committed with this triple" in rerun.stdout
    assert (out / "_manifest.json").read_bytes() == k["manifest"]
    assert_same_result(out, folder / "ref", shards)
    assert not (out / "predictions" / old["attempt"]).exists()
