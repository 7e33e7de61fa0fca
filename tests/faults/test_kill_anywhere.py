"""Crash anywhere, resume everything (contract §5.3 "Resume", issue 34): a run SIGKILLed from
this process at about 25 %, 50 % and 90 % of a clean run's scoring — moments taken from the
clock (tests/killing.py), not fault points — and rerun. The rerun reuses at least every shard
whose rows were all on disk at the kill (counted from the files, as a user could), commits what
the clean run committed, and says what it reused: the run's line, ``shards_reused`` and
``rows_reused``. On the direct runner in one process and with two worker processes (the kill
takes the whole process tree, as a lost machine does). The Dask cluster's cases are in
tests/with_servers/test_kill_anywhere_dask.py.

Before issue 34 a shard's result came after a GroupByKey, so no kill before the end of scoring
left anything to reuse: every one of these tests failed (0 reused).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import forkserver
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factories import DS, assert_same_result, kept_for_resume, make_mlp_onnx, make_shards, write_job, write_schema
from killing import Scoring, complete_on_disk, data_files, kill_at, scoring_of

pytestmark = pytest.mark.slow

SHARDS, ROWS, BATCH = 16, 100_000, 25_000   # about 0.7 s of scoring: the kill's moment well inside it
BAD = {2: [5, 99_999], 7: [0]}     # quarantined rows, so quarantine files are counted too
MOMENTS = (0.25, 0.5, 0.9)
AIMS = 3   # tries at a moment before a run that keeps finishing first fails the test
MULTI = ("--set", "runner.options.direct_num_workers=2",
         "--set", "runner.options.direct_running_mode=multi_processing")


@pytest.fixture(scope="module")
def server():
    return forkserver.shared()


@pytest.fixture(scope="module")
def project(tmp_path_factory, server) -> tuple[Path, list[Path]]:
    folder = tmp_path_factory.mktemp("kill_anywhere")
    write_schema(folder / "schemas")
    shards = make_shards(folder / "data" / f"dt={DS}", shards=SHARDS, rows=ROWS, seed=11)
    for s, rows in BAD.items():
        table = pq.read_table(shards[s])
        f0 = table["f0"].to_numpy().copy()
        f0[rows] = 50.0
        pq.write_table(table.set_column(1, "f0", pa.array(f0, pa.float32())), shards[s])
    make_mlp_onnx(folder / "models" / "model.onnx")
    write_job(folder, batch={"rows": BATCH}, quarantine={"max_bad_fraction": 0.01},
              tracking={"uri": "sqlite:///mlflow.db", "experiment": "kill"})
    stamp = server.run("stamp", "models/model.onnx", "--job", "job.yaml", "--model-version",
                       "model:1", cwd=folder)
    assert stamp.returncode == 0, stamp.stderr
    return folder, shards


def args(out: str, *more: str) -> tuple[str, ...]:
    return ("run", "job.yaml", "--ds", DS, "--set", f"output.path={out}", *more)


def clean(server, folder: Path, out: str, *more: str) -> Scoring:
    started = time.time()
    ref = server.run(*args(out, *more), cwd=folder, track=False)
    assert ref.returncode == 0, ref.stderr
    scoring = scoring_of(folder / out, started)
    print(f"\nclean run into {out}: scoring from {scoring.first:.2f} s to {scoring.last:.2f} s")
    return scoring


@pytest.fixture(scope="module")
def reference(server, project) -> Scoring:
    """The clean run's scoring, from a second clean run (the first pays for first use: its
    scoring is longer than any later run's)."""
    clean(server, project[0], "warm")
    return clean(server, project[0], "ref")


def killed_then_rerun(server, project, scoring: Scoring, fraction: float, out: str,
                      *more: str, from_first_file: bool = False) -> dict:
    """Kill a run into ``out`` at ``fraction`` of ``scoring`` (counted from its start, or with
    ``from_first_file`` from its own first data file: its start-up varies more than its
    scoring), count what is on disk, rerun. A run that commits before its kill is aimed at
    again by its own scoring (at most ``AIMS`` tries): the machine's speed drifts between the
    clean run and the victim."""
    folder, shards = project
    for _ in range(AIMS):
        after, since = scoring.at(fraction), None
        if from_first_file:
            after, since = fraction * (scoring.last - scoring.first), lambda: bool(data_files(folder / out))
        started = time.time()
        victim, at = kill_at(lambda: server.start(*args(out, *more), cwd=folder, track=False),
                             lambda run: run.pid, after, since=since)
        victim.wait()
        if victim.returncode != 0:
            break
        # It committed before the kill: this machine ran faster than during the clean run. Aim
        # again, by the victim's own scoring span, at a fresh output.
        scoring = scoring_of(folder / out, started)
        print(f"\nrun into {out} ended before the kill at {at:.2f} s; aiming again by its "
              f"scoring, {scoring.first:.2f} s to {scoring.last:.2f} s")
        shutil.rmtree(folder / out)
    assert victim.returncode == -signal.SIGKILL, victim.stderr
    assert not (folder / out / "_manifest.json").exists(), f"killed at {at:.2f} s: after the commit"
    on_disk = complete_on_disk(folder / out, shards)
    rerun = server.run(*args(out, *more), cwd=folder)   # tracked: _metrics.json says what it reused
    assert rerun.returncode == 0, rerun.stderr
    manifest = assert_same_result(folder / out, folder / "ref", shards)
    reused = {s["path"] for s in manifest["shards"] if s["scored_by"] != manifest["attempt"]}
    metrics = json.loads((folder / out / "_metrics.json").read_text())["metrics"]
    return {"at": at, "on_disk": on_disk, "reused": reused, "stdout": rerun.stdout,
            "metrics": metrics, "manifest": manifest}


def assert_resumed(result: dict, fraction: float) -> None:
    on_disk, reused, manifest = result["on_disk"], result["reused"], result["manifest"]
    print(f"\nkilled at {fraction:.0%} ({result['at']:.2f} s): {len(on_disk)} shards whole on "
          f"disk, {len(reused)} reused")
    assert on_disk <= reused, f"shards whole on disk but scored again: {sorted(on_disk - reused)}"
    rows = sum(s["rows_in"] for s in manifest["shards"] if s["path"] in reused)
    assert result["metrics"]["shards_reused"] == len(reused)
    assert result["metrics"]["rows_reused"] == rows
    if reused:
        line = re.search(r"reusing (\d+) of (\d+) shards \(([\d,]+) rows\)", result["stdout"])
        assert line, result["stdout"]
        assert (int(line[1]), int(line[2]), int(line[3].replace(",", ""))) == (
            len(reused), SHARDS, rows)
    else:
        assert "reusing" not in result["stdout"]


@pytest.mark.parametrize("fraction", MOMENTS)
def test_killed_at_a_moment_of_scoring_the_rerun_reuses_every_shard_on_disk(
        server, project, reference, fraction):
    result = killed_then_rerun(server, project, reference, fraction, f"out_{int(fraction * 100)}",
                               from_first_file=True)
    assert_resumed(result, fraction)
    if fraction == 0.9:   # by then most shards are whole: the test would prove little otherwise
        assert len(result["on_disk"]) >= SHARDS // 2, result


def test_killed_with_its_worker_processes_the_rerun_reuses_every_shard_on_disk(server, project,
                                                                                reference):
    """The direct runner's multi-processing mode: the kill takes the launcher and its two worker
    processes, half-way through the scoring of a clean run in the same mode (counted from the
    first data file: the workers' start-up varies by seconds)."""
    scoring = clean(server, project[0], "ref_multi", *MULTI)
    result = killed_then_rerun(server, project, scoring, 0.5, "out_multi", *MULTI,
                               from_first_file=True)
    assert_resumed(result, 0.5)


# -- a run that fails, or is stopped, keeps what it finished ----------------------------------------

SLOW_PREP_SOURCE = '''\
import os
import time

import numpy as np


def transform(batch):
    if os.path.exists(os.environ.get("SLOW_WHILE", "")):
        time.sleep(0.15)   # slow enough for the test to break the store under the run
    return np.stack([batch.column(f"f{i}").to_numpy(zero_copy_only=False) for i in range(4)],
                    axis=1).astype(np.float32)
'''


def test_a_run_that_fails_keeps_its_finished_shards_and_the_rerun_reuses_them(server, project,
                                                                                tmp_path):
    """A transient failure of the output store (exit 5) part-way: once a few shards are finished,
    the first file of every shard not yet begun cannot be written (a folder stands where it
    goes). The failed run keeps what it finished; the rerun, the store mended, reuses it."""
    folder, shards = project
    (folder / "slow_prep.py").write_text(SLOW_PREP_SOURCE)
    make_mlp_onnx(folder / "models" / "slow.onnx")   # stamped for this job's preprocessing
    write_job(folder, batch={"rows": BATCH}, quarantine={"max_bad_fraction": 0.01},
              preprocess="slow_prep:transform", model="models/slow.onnx",
              tracking={"uri": "sqlite:///mlflow.db", "experiment": "kill"}).rename(folder / "slow.yaml")
    stamp = server.run("stamp", "models/slow.onnx", "--job", "slow.yaml", "--model-version",
                       "model:1", cwd=folder)
    assert stamp.returncode == 0, stamp.stderr
    slow = tmp_path / "slow"
    env = {**os.environ, "SLOW_WHILE": str(slow)}
    ref = server.run("run", "slow.yaml", "--ds", DS, "--set", "output.path=ref_slow", cwd=folder,
                     env=env, track=False)
    assert ref.returncode == 0, ref.stderr
    slow.touch()
    run = ("run", "slow.yaml", "--ds", DS, "--set", "output.path=out_failed")
    out = folder / "out_failed"
    victim = server.start(*run, cwd=folder, env=env, track=False)
    deadline = time.monotonic() + 120
    while len(list(out.glob("_tmp/*/shards/*.json"))) < 3:
        assert victim.poll() is None, victim.stderr
        assert time.monotonic() < deadline, "no 3 shards finished within 120 s"
        time.sleep(0.02)
    [attempt] = [p.name for p in (out / "predictions").iterdir()]
    blocked = []
    for i in range(SHARDS):
        first = out / "predictions" / attempt / f"part-{i:05d}-00000.parquet"
        if not first.exists():
            first.mkdir()
            blocked.append(first)
    victim.wait()
    assert victim.returncode == 5, victim.stderr
    assert "cannot write" in victim.stderr.strip().splitlines()[-1]
    kept = kept_for_resume(out, all_finished=False)
    assert 3 <= len(kept) < SHARDS, kept
    for path in blocked:          # the store mended
        path.rmdir()
    slow.unlink()
    rerun = server.run(*run, cwd=folder, env=env)
    assert rerun.returncode == 0, rerun.stderr
    manifest = assert_same_result(out, folder / "ref_slow", shards)
    reused = {s["path"] for s in manifest["shards"] if s["scored_by"] != manifest["attempt"]}
    assert reused == kept
    assert f"reusing {len(kept)} of {SHARDS} shards" in rerun.stdout
