"""Ctrl-C during a run (docs/contract.md §6): exit 130, nothing committed, the MLflow run marked
KILLED rather than left RUNNING, the shards it finished kept, and a rerun that reuses them commits
the partition as if nothing happened."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from factories import DS, kept_for_resume, numeric_project, read_partition, run_cli

pytestmark = pytest.mark.slow

SLOW_PREP = "slow_prep"
SLOW_PREP_SOURCE = '''\
import os
import time

import numpy as np

COLUMNS = ("f0", "f1", "f2", "f3")


def transform(batch):
    if os.path.exists(os.environ.get("SLOW_WHILE", "")):
        time.sleep(0.4)  # keeps the job scoring long enough to be interrupted
    return np.stack([batch.column(n).to_numpy(zero_copy_only=False) for n in COLUMNS],
                    axis=1).astype(np.float32)
'''


def run_statuses(db: Path) -> list[str]:
    with sqlite3.connect(db) as conn:
        return [row[0] for row in conn.execute("select status from runs order by start_time")]


def test_ctrl_c_commits_nothing_and_marks_the_run_killed(tmp_path):
    (tmp_path / f"{SLOW_PREP}.py").write_text(SLOW_PREP_SOURCE)
    numeric_project(tmp_path, shards=3, rows=1000, preprocess=f"{SLOW_PREP}:transform",
                    batch={"rows": 200})  # 15 batches × 0.4 s
    slow = tmp_path / "slow"   # the first run is slow while this file exists; the rerun is not
    slow.touch()
    child = subprocess.Popen([sys.executable, "-m", "batchinfer", "run", "job.yaml", "--ds", DS],
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "SLOW_WHILE": str(slow)})
    try:
        first = child.stdout.readline()
        assert first.startswith("scoring 3 shards"), first
        # Interrupt once some batches are written (not after a guessed delay): the attempt then
        # has files that the interrupted run must remove.
        predictions = tmp_path / "out" / f"dt={DS}" / "predictions"
        deadline = time.monotonic() + 120
        while not list(predictions.glob("*/*.parquet")):
            assert time.monotonic() < deadline, "no prediction file within 120 s"
            assert child.poll() is None, child.communicate()
            time.sleep(0.02)
        child.send_signal(signal.SIGINT)
        stdout, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == (
        "batchinfer run: interrupted; nothing was committed by this run")
    output = tmp_path / "out" / f"dt={DS}"
    assert not (output / "_manifest.json").exists()
    assert run_statuses(tmp_path / "mlflow.db") == ["KILLED"]
    kept = kept_for_resume(output, all_finished=False)   # for the rerun (issue 34)

    slow.unlink()
    rerun = run_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path, track=True)
    assert rerun.returncode == 0, rerun.stderr
    predictions, quarantine, manifest = read_partition(output)
    assert manifest["totals"]["rows_in"] == 3000
    assert predictions.num_rows + quarantine.num_rows == 3000
    listed = {f["path"] for s in manifest["shards"] for f in s["files"]}
    on_disk = {str(p.relative_to(output)) for p in output.rglob("*.parquet")}
    assert on_disk == listed  # the interrupted attempt left nothing behind but what was adopted
    reused = {s["path"] for s in manifest["shards"] if s["scored_by"] != manifest["attempt"]}
    assert reused == kept
    assert run_statuses(tmp_path / "mlflow.db") == ["KILLED", "FINISHED"]
