"""``run --update`` under faults (contract §5.3 "Update"): an update SIGKILLed at a fault point,
then run again with ``--update``, commits exactly what a clean run of the shards as listed now
commits (rows, ``_input_hash``, predictions, quarantine, totals; attempt ids aside), and the
rerun scores only what neither the committed partition nor the killed update had finished; two
updates at once: exactly one replaces the manifest, the other exits 0 ("already committed by
attempt …") with its own files gone and nothing of the winner's lost.

A partition of four shards is committed once per case; then shards 4 and 5 arrive
late, shard 1 is rewritten and shard 3 is no longer listed: every update keeps shards 0 and 2
and scores three. Runs are forked from the session's fork server (``forkserver.py``), the killed
ones with ``BATCHINFER_FAULT``, all at once.

Rerun with ``.venv/bin/pytest tests/faults/test_update_faults.py -q``.
"""
from __future__ import annotations

import json
import signal

import forkserver
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factories import (
    BARRIER_SOURCE,
    DS,
    assert_same_result,
    finished_shards,
    make_mlp_onnx,
    make_shards,
    partition_files,
    release_at_barrier,
    write_job,
    write_schema,
)

pytestmark = pytest.mark.slow

SHARDS, ROWS, BATCH = 4, 1500, 500
FAULTS = ["read", "shard_done", "before_commit", "during_commit", "after_commit"]
# The race: both updates held at a barrier in the preprocessing (factories.BARRIER_SOURCE), so
# both are past their decision when either commits.


def run_args(out: str, *more: str) -> tuple[str, ...]:
    return ("run", "job.yaml", "--ds", DS, "--set", f"output.path={out}", *more)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    server = forkserver.shared()
    folder = tmp_path_factory.mktemp("update_faults")
    write_schema(folder / "schemas")
    data = folder / "data" / f"dt={DS}"
    make_shards(data, shards=SHARDS, rows=ROWS, seed=5)
    table = pq.read_table(data / "part-00002.parquet")   # quarantined rows in a kept shard
    f0 = table["f0"].to_numpy().copy()
    f0[[1, 900]] = 50.0
    pq.write_table(table.set_column(1, "f0", pa.array(f0, pa.float32())), data / "part-00002.parquet")
    make_mlp_onnx(folder / "models" / "model.onnx")
    (folder / "barrier_prep.py").write_text(BARRIER_SOURCE)
    (folder / "barrier").mkdir()
    write_job(folder, batch={"rows": BATCH}, preprocess="barrier_prep:transform",
              tracking={"uri": "sqlite:///mlflow.db", "experiment": "update"})
    stamped = server.run("stamp", "models/model.onnx", "--job", "job.yaml", "--model-version", "model:1",
                         cwd=folder)
    assert stamped.returncode == 0, stamped.stderr
    # One commit per case, each under the spec its update runs with (output.path is a --set).
    firsts = {case: server.start(*run_args(f"out_{case}"), cwd=folder, track=False)
              for case in [*FAULTS, "race"]}
    committed = {}
    for case, run in firsts.items():
        assert run.wait().returncode == 0, run.stderr
        committed[case] = json.loads((folder / f"out_{case}" / "_manifest.json").read_text())
    # The input changes after the commit.
    for late in (4, 5):
        make_shards(folder / "late", shards=1, rows=ROWS, seed=20 + late)
        (folder / "late" / "part-00000.parquet").rename(data / f"part-{late:05d}.parquet")
    table = pq.read_table(data / "part-00001.parquet")
    f1 = table["f1"].to_numpy().copy()
    f1[0] += 1.0
    pq.write_table(table.set_column(2, "f1", pa.array(f1, pa.float32())), data / "part-00001.parquet")
    (data / "part-00003.parquet").unlink()
    ref = server.run(*run_args("ref"), cwd=folder, track=False)
    assert ref.returncode == 0, ref.stderr
    return folder, sorted(data.resolve().glob("*.parquet")), committed


@pytest.fixture(scope="module")
def crashed(project):
    server = forkserver.shared()
    folder, _, _ = project
    runs = {f: server.start(*run_args(f"out_{f}", "--update"), cwd=folder, track=False, fault=f)
            for f in FAULTS}
    killed = {}
    for fault, run in runs.items():
        run.wait()
        out = folder / f"out_{fault}"
        manifest = out / "_manifest.json"
        killed[fault] = {"rc": run.returncode, "stderr": run.stderr, "finished": finished_shards(out),
                         "manifest": json.loads(manifest.read_text()), "files": partition_files(out)}
    reruns = {f: server.start(*run_args(f"out_{f}", "--update"), cwd=folder, track=False) for f in FAULTS}
    return {"killed": killed, "reruns": {f: r.wait() for f, r in reruns.items()}}


@pytest.mark.parametrize("fault", FAULTS)
def test_update_killed_at_a_fault_point_then_updated_again_commits_a_clean_runs_partition(fault, project, crashed):
    folder, shards, committed = project
    committed = committed[fault]
    killed, rerun = crashed["killed"][fault], crashed["reruns"][fault]
    assert killed["rc"] == -signal.SIGKILL, f"{fault}: not killed: {killed['stderr'][-500:]}"
    assert rerun.returncode == 0, rerun.stderr
    out = folder / f"out_{fault}"
    manifest = assert_same_result(out, folder / "ref", shards)
    kept = {str(shards[0]), str(shards[2])}
    scored_by = {s["path"]: s["scored_by"] for s in manifest["shards"]}
    assert {p for p, a in scored_by.items() if a == committed["attempt"]} == kept
    if fault == "after_commit":
        # The killed update had replaced the manifest: the rerun is a no-op that cleans up.
        assert killed["manifest"]["attempt"] != committed["attempt"]
        assert "(--update: no shard new, rewritten or removed); nothing to do" in rerun.stdout
        assert json.loads((out / "_manifest.json").read_text()) == killed["manifest"]
        assert any(f.split("/")[1] == committed["attempt"] and f not in {
            g["path"] for s in manifest["shards"] for g in s["files"]} for f in killed["files"]), (
            "after_commit should leave the replaced files (the test would prove nothing)")
        return
    assert killed["manifest"] == committed, f"{fault}: the killed update changed the commit"
    # The rerun scored what neither the commit nor the killed update had finished, and adopted
    # what the killed update finished of the shards it scores.
    adopted = dict(killed["finished"])
    if fault in ("shard_done", "before_commit", "during_commit"):
        assert adopted, f"{fault}: the killed update finished no shard (resume proves nothing)"
    assert {p: a for p, a in scored_by.items() if p not in kept and a != manifest["attempt"]} == adopted
    metrics = json.loads((out / "_metrics.json").read_text())["metrics"]
    assert metrics["shards_reused"] == len(kept) + len(adopted)
    assert metrics["rows_reused"] == (len(kept) + len(adopted)) * ROWS
    assert f"scoring {len(shards) - len(kept) - len(adopted)} shards into" in rerun.stdout


def test_two_updates_at_once_one_commits_the_other_exits_0_and_nothing_is_lost(project):
    folder, shards, committed = project
    committed = committed["race"]
    server = forkserver.shared()
    barrier = folder / "barrier"
    env = {"BARRIER": str(barrier)}
    racers = [server.start(*run_args("out_race", "--update"), cwd=folder, track=False, env=env)
              for _ in range(2)]
    release_at_barrier(racers, barrier)
    results = [r.wait() for r in racers]
    for r in results:
        assert r.returncode == 0, r.stderr
    out = folder / "out_race"
    manifest = assert_same_result(out, folder / "ref", shards)  # nothing lost, nothing unlisted
    winners = [r for r in results if f"committed {out} (attempt {manifest['attempt']})" in r.stdout]
    losers = [r for r in results if f"already committed by attempt {manifest['attempt']}" in r.stdout]
    assert (len(winners), len(losers)) == (1, 1), [r.stdout for r in results]
    kept = {p for p, s in ((s["path"], s) for s in manifest["shards"]) if s["scored_by"] == committed["attempt"]}
    assert kept == {str(shards[0]), str(shards[2])}
    assert {p.name for p in (out / "predictions").iterdir()} == {committed["attempt"], manifest["attempt"]}
