"""Two runs of one partition at once (contract §4 "Two runs at once", §5.2): exactly one commits,
the other exits 0 saying "already committed by attempt …" and removes its own files; the
output is never mixed. With a shared, existing sqlite MLflow store, and on a new one (measured:
sqlite's first use is not safe for two processes at once).

Rerun with ``.venv/bin/pytest tests/faults/test_concurrency.py -q``.
"""
from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pytest

from factories import (
    BARRIER_SOURCE,
    DS,
    NoTracking,
    make_mlp_onnx,
    make_shards,
    partition_files,
    read_partition,
    release_at_barrier,
    write_job,
    write_schema,
)
from servers import start_cli

if TYPE_CHECKING:
    import forkserver

pytestmark = pytest.mark.slow

OTHER_DS = "2026-01-14"
SHARDS, ROWS = 3, 4_000
# The interleaving is forced, not hoped for: with BARRIER set, each process's preprocessing
# (which runs only after the run's manifest check) says it is there, then waits until the test
# lets all of them go. Every racer is then past its manifest check when any of them commits.
BARRIER_PREP = "barrier_prep"


def make_project(folder: Path) -> tuple[Path, list[Path]]:
    write_schema(folder / "schemas")
    shards = make_shards(folder / "data" / f"dt={DS}", shards=SHARDS, rows=ROWS, seed=11)
    make_shards(folder / "data" / f"dt={OTHER_DS}", shards=1, rows=100, seed=12)
    make_mlp_onnx(folder / "models" / "model.onnx")
    (folder / f"{BARRIER_PREP}.py").write_text(BARRIER_SOURCE)
    (folder / "barrier").mkdir()
    write_job(folder, batch={"rows": 1000}, preprocess=f"{BARRIER_PREP}:transform")
    return folder, shards


def start(folder: Path, *args: str) -> "forkserver.Run":
    """``batchinfer run job.yaml ARGS`` in ``folder``, tracked for real, held at the barrier."""
    return start_cli("run", "job.yaml", *args, cwd=folder, env={"BARRIER": str(folder / "barrier")})


def release(procs: list["forkserver.Run"], folder: Path) -> None:
    """Wait until every process of ``folder`` is at the barrier, then let them all go."""
    release_at_barrier(procs, folder / "barrier")


def finish(proc: "forkserver.Run") -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def attempt_of(stdout: str) -> str:
    match = re.search(r"\(attempt (\S+?),", stdout)
    assert match, stdout
    return match.group(1)


def canonical_predictions(out: Path, project: Path) -> pa.Table:
    """Sorted, execution columns dropped, _source_shard relative to the project folder (the
    two projects hold the same data)."""
    preds, _, _ = read_partition(out)
    preds = preds.drop_columns(["_inference_id", "_compute_ms"])
    shard = [str(Path(p).relative_to(project)) for p in preds["_source_shard"].to_pylist()]
    preds = preds.set_column(preds.column_names.index("_source_shard"), "_source_shard", pa.array(shard))
    cols = {n: (c.combine_chunks().cast(c.type.value_type) if pa.types.is_dictionary(c.type) else c)
            for n, c in zip(preds.column_names, preds.columns)}
    return pa.table(cols).sort_by([("_source_shard", "ascending"), ("_source_row", "ascending")])


def check_race(out: Path, ref: Path, shards: list[Path], results: list[tuple[int, str, str]]) -> dict:
    """Both exit 0, one commit, the loser says so and leaves nothing; output = reference."""
    for rc, _stdout, stderr in results:
        assert rc == 0, stderr
    manifest = json.loads((out / "_manifest.json").read_text())
    attempts = [attempt_of(stdout) for _, stdout, _ in results]
    assert len(set(attempts)) == 2
    assert manifest["attempt"] in attempts
    winner = attempts.index(manifest["attempt"])
    loser_out = results[1 - winner][1]
    assert f"already committed by attempt {manifest['attempt']}" in loser_out, loser_out
    assert "committed" in results[winner][1] and "already committed" not in results[winner][1]
    # nothing of the loser survives; nothing unlisted; no scratch
    listed = {f["path"] for s in manifest["shards"] for f in s["files"]}
    assert partition_files(out) == listed
    assert {p.name for p in (out / "predictions").iterdir()} == {manifest["attempt"]}
    assert not (out / "quarantine").exists() or not any((out / "quarantine").iterdir())
    assert no_scratch_files(out)
    # never mixed: equal, bit for bit, to an uninterrupted single run
    got, want = canonical_predictions(out, shards[0].parents[2]), canonical_predictions(ref, ref.parent)
    assert got.num_rows == SHARDS * ROWS
    assert got.equals(want)
    assert np.array_equal(got["y"].to_numpy().view(np.uint32), want["y"].to_numpy().view(np.uint32))
    keys = set(zip(read_partition(out)[0]["_source_shard"].to_pylist(),
                   read_partition(out)[0]["_source_row"].to_pylist()))
    assert keys == {(str(p), i) for p in shards for i in range(ROWS)}
    return {"manifest": manifest, "winner": winner, "attempts": attempts}




def no_tracking(monkeypatch) -> None:
    import batchinfer.io.tracking

    monkeypatch.setattr(batchinfer.io.tracking, "TrackingRun", NoTracking)


def no_scratch_files(out: Path) -> bool:
    """No _tmp/ at all: a loser that finishes after the winner's cleanup removes its own
    _tmp/<attempt> and then the emptied _tmp/ folder."""
    return not (out / "_tmp").exists()


def store_state(db: Path) -> tuple[str | None, list[str]]:
    """(alembic version, leftover _alembic_tmp_* tables) of an MLflow sqlite store."""
    with sqlite3.connect(db) as con:
        tables = [r[0] for r in con.execute("select name from sqlite_master where type='table'")]
        version = (con.execute("select version_num from alembic_version").fetchone() or [None])[0] \
            if "alembic_version" in tables else None
    return version, sorted(t for t in tables if t.startswith("_alembic_tmp"))


def mlflow_runs(db: Path) -> dict[str, tuple[str, str]]:
    """run id → (name, status), read straight from the sqlite store."""
    with sqlite3.connect(db) as con:
        return {r[0]: (r[1], r[2]) for r in con.execute("select run_uuid, name, status from runs")}


@pytest.fixture(scope="module")
def races(tmp_path_factory):
    """Both races and the reference run at once, after the shared store was created."""
    shared, shards = make_project(tmp_path_factory.mktemp("race_shared"))
    fresh, fresh_shards = make_project(tmp_path_factory.mktemp("race_fresh"))
    from batchinfer.commands.run import run_job
    from batchinfer.commands.stamp import stamp
    from batchinfer.spec import load_job

    for folder in (shared, fresh):
        stamp(load_job(folder / "job.yaml", require_ds=False), None, "model:1")
    # create the shared store once: one job on another partition (in-process, real tracking)
    outcome = run_job(load_job(shared / "job.yaml", ds=OTHER_DS))
    assert outcome.status == "committed" and outcome.manifest.mlflow_run_id, outcome.tracking
    assert (shared / "mlflow.db").exists() and not (fresh / "mlflow.db").exists()
    procs = [start(shared, "--ds", DS), start(shared, "--ds", DS),
             start(fresh, "--ds", DS), start(fresh, "--ds", DS),
             start(shared, "--ds", DS, "--set", "output.path=ref")]
    try:
        release(procs[0:2] + procs[4:5], shared)
        release(procs[2:4], fresh)
        results = [finish(p) for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return {"shared": (shared, shards, results[0:2]), "fresh": (fresh, fresh_shards, results[2:4]),
            "ref": (shared / "ref", results[4])}


def test_two_runs_at_once_shared_mlflow_store(races):
    folder, shards, results = races["shared"]
    ref, ref_result = races["ref"]
    assert ref_result[0] == 0, ref_result[2]
    race = check_race(folder / "out" / f"dt={DS}", ref, shards, results)
    manifest = race["manifest"]
    # tracking: the winner's MLflow run is finished and named in the manifest; the loser's run
    # is marked KILLED; both in the shared store.
    runs = mlflow_runs(folder / "mlflow.db")
    assert manifest["mlflow_run_id"] in runs
    assert runs[manifest["mlflow_run_id"]][1] == "FINISHED"
    winner_stdout = results[race["winner"]][1]
    assert f"MLflow run {manifest['mlflow_run_id']}" in winner_stdout
    statuses = sorted(status for _, status in runs.values())
    assert statuses.count("FINISHED") == 3      # the store-creating run, the winner, the reference
    assert statuses.count("KILLED") == 1        # the loser


def test_two_runs_at_once_new_mlflow_store(races, capsys):
    """A store neither run has seen: the partition still commits exactly once. What tracking
    did is printed (see the report); the store's first use is locked, so the winner tracks."""
    folder, shards, results = races["fresh"]
    ref, _ = races["ref"]
    out = folder / "out" / f"dt={DS}"
    race = check_race(out, ref, shards, results)
    winner_stdout = results[race["winner"]][1]
    metrics = json.loads((out / "_metrics.json").read_text())
    tracking_lines = [line for _, stdout, _ in results for line in stdout.splitlines()
                      if line.startswith("tracking:")]
    runs = mlflow_runs(folder / "mlflow.db") if (folder / "mlflow.db").exists() else {}
    shared_version = store_state(races["shared"][0] / "mlflow.db")[0]
    version, leftovers = store_state(folder / "mlflow.db")
    state = ("intact" if version == shared_version and not leftovers else
             f"HALF-MIGRATED (alembic {version}, head {shared_version}, leftover tables {leftovers})")
    with capsys.disabled():
        print(f"\n[new sqlite store, two runs at once] winner tracking line: "
              f"{[line for line in winner_stdout.splitlines() if line.startswith('tracking:')]}; "
              f"_metrics.json uploaded={metrics['uploaded']} error={metrics['error']}; "
              f"runs in store: {sorted(runs.values())}; store afterwards: {state}")
    assert len(tracking_lines) == 1   # only the winner reports tracking
    # The first use of a sqlite store is serialised by a lock file (tracking.py), so the
    # race measured on a new store no longer loses tracking or half-migrates the store.
    assert metrics["uploaded"], metrics["error"]
    assert state == "intact"
    assert runs[metrics["mlflow_run_id"]][1] == "FINISHED"
    assert metrics["mlflow_run_id"] == race["manifest"]["mlflow_run_id"]


def test_loser_whose_files_the_winner_cleaned_still_exits_as_lost_race(tmp_path, monkeypatch):
    """Deterministic version of the worst interleaving: run B has written its files and every
    shard's result, then run A commits and its cleanup deletes every uncommitted attempt (B's
    included) before B's commit step reads them. B must still end as the loser of the race
    (contract §4: exit 0, "already committed by attempt …", its files removed), not as a runtime
    failure with its debris left behind."""
    import batchinfer.commands.run as job_mod
    import batchinfer.pipeline.commit_step as commit_mod
    from batchinfer.spec import load_job

    no_tracking(monkeypatch)
    folder, _shards = tmp_path, make_shards(tmp_path / "data" / f"dt={DS}", shards=2, rows=200)
    write_schema(folder / "schemas")
    make_mlp_onnx(folder / "models" / "model.onnx")
    write_job(folder)
    from batchinfer.commands.stamp import stamp
    stamp(load_job(folder / "job.yaml", require_ds=False), None, "model:1")

    real = commit_mod.CommitPartition.process
    state = {"inside": False, "winner": None}

    def racing(self, element):
        if not state["inside"]:       # B's shards are done; now A runs start to finish
            state["inside"] = True
            state["winner"] = job_mod.run_job(load_job(folder / "job.yaml", ds=DS))
        yield from real(self, element)  # B's commit step, after A's cleanup

    monkeypatch.setattr(commit_mod.CommitPartition, "process", racing)
    outcome = job_mod.run_job(load_job(folder / "job.yaml", ds=DS))
    assert state["winner"].status == "committed"
    winner = state["winner"].manifest.attempt
    assert outcome.status == "lost_race", outcome.message
    assert f"already committed by attempt {winner}" in outcome.message
    out = folder / "out" / f"dt={DS}"
    assert no_scratch_files(out)
    manifest = json.loads((out / "_manifest.json").read_text())
    # A found B's shards finished (same key, same bytes) and adopted them (contract §5.3
    # "Resume"): B, losing, removed none of the files A's manifest lists.
    scored_by = {s["scored_by"] for s in manifest["shards"]}
    assert len(scored_by) == 1 and winner not in scored_by
    assert {p.name for p in (out / "predictions").iterdir()} == {s["scored_by"] for s in manifest["shards"]}
    assert partition_files(out) == {f["path"] for s in manifest["shards"] for f in s["files"]}


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_winner_cleans_up_while_loser_is_still_writing(tmp_path, monkeypatch, overwrite):
    """Run B has written one data file when run A runs start to finish, commits, and its cleanup
    deletes B's files; B then writes the rest and tries to commit. B must lose the race and
    remove its files; in no case may a manifest list a file that does not exist. With
    ``overwrite`` both runs replace a partition committed under another triple."""
    import threading

    import batchinfer.commands.run as job_mod
    import batchinfer.faults as faults
    from batchinfer.commands.stamp import stamp
    from batchinfer.spec import load_job

    no_tracking(monkeypatch)
    folder = tmp_path
    make_shards(folder / "data" / f"dt={DS}", shards=2, rows=400)
    write_schema(folder / "schemas")
    make_mlp_onnx(folder / "models" / "model.onnx")
    write_job(folder, batch={"rows": 100})
    stamp(load_job(folder / "job.yaml", require_ds=False), None, "model:1")
    out = folder / "out" / f"dt={DS}"
    if overwrite:  # a partition committed under another triple (as if by an older model)
        job_mod.run_job(load_job(folder / "job.yaml", ds=DS))
        manifest = json.loads((out / "_manifest.json").read_text())
        manifest["triple"]["model_version"] = "model:0"
        (out / "_manifest.json").write_text(json.dumps(manifest))

    real_point = faults.point
    state: dict = {"inside": False}

    def winner():
        state["first"] = job_mod.run_job(load_job(folder / "job.yaml", ds=DS), overwrite=overwrite)

    def point(name):
        if name == "write" and not state["inside"]:
            state["inside"] = True
            thread = threading.Thread(target=winner)
            thread.start()
            thread.join()
        real_point(name)

    monkeypatch.setattr(faults, "point", point)
    second = job_mod.run_job(load_job(folder / "job.yaml", ds=DS), overwrite=overwrite)
    assert state["first"].status == "committed", state["first"].message
    first_attempt = state["first"].manifest.attempt
    final = json.loads((out / "_manifest.json").read_text())
    missing = [f["path"] for s in final["shards"] for f in s["files"] if not (out / f["path"]).exists()]
    assert not missing, (f"B ended {second.status}; the manifest of attempt {final['attempt']} "
                         f"lists {len(missing)} deleted files, e.g. {missing[0]}")
    assert second.status == "lost_race", second.message
    assert f"already committed by attempt {first_attempt}" in second.message
    assert final["attempt"] == first_attempt
    assert {p.name for p in (out / "predictions").iterdir()} == {first_attempt}
    assert partition_files(out) == {f["path"] for s in final["shards"] for f in s["files"]}
    assert no_scratch_files(out)
    preds, _, _ = read_partition(out)
    assert preds.num_rows == 800


def test_two_runs_at_once_with_other_challengers_the_loser_exits_3(tmp_path):
    """Two runs of one partition at once, each with a challenger of its own: one commits; the
    other's challenger was never scored, so it must not end "already committed" (exit 0) as if
    the partition held what it was asked for: exit 3, naming the winner and its challenger."""
    from batchinfer.commands.stamp import stamp
    from batchinfer.spec import load_job

    folder, _shards = make_project(tmp_path)
    job = load_job(folder / "job.yaml", require_ds=False)
    stamp(job, None, "model:1")
    for name, seed in (("left", 5), ("right", 6)):
        make_mlp_onnx(folder / "models" / f"{name}.onnx", seed=seed)
        stamp(job, str(folder / "models" / f"{name}.onnx"), f"{name}:1")
    names = ("left", "right")
    procs = [start(folder, "--ds", DS, "--set", f"model.challengers=[{{uri: models/{name}.onnx}}]")
             for name in names]
    try:
        release(procs, folder)
        results = [finish(p) for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert sorted(rc for rc, _, _ in results) == [0, 3], results
    winner = next(i for i, (rc, _, _) in enumerate(results) if rc == 0)
    loser = 1 - winner
    out = folder / "out" / f"dt={DS}"
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["attempt"] == attempt_of(results[winner][1])
    assert [c["name"] for c in manifest["challengers"]] == [names[winner]]
    lines = results[loser][2].strip().splitlines()
    assert lines == [f"batchinfer run: {out} was committed meanwhile by attempt {manifest['attempt']} "
                     f"without challenger {names[loser]}; this run's files were removed: rerun it "
                     f"with --overwrite to score the partition with this run's challengers"], results[loser][2]
    # nothing of the loser's left: only the winner's files, the winner's challenger
    assert partition_files(out) == {f["path"] for s in manifest["shards"] for f in s["files"]}
    assert {p.name for p in (out / "challengers").iterdir()} == {names[winner]}
    assert {p.name for p in (out / "challengers" / names[winner]).iterdir()} == {manifest["attempt"]}
    assert no_scratch_files(out)
