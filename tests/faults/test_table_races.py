"""Two real runs of one new partition at once, the second slower, for every output format
(contract §4 "Two runs at once", "Tables: Exactly once").

Both runs pass their decision (nothing committed yet) and meet at a barrier in the
preprocessing; then the first commits, cleans its scratch and exits while the second is still
scoring (held in its preprocessing until the first has exited). The second arrives at its
commit to find a partition committed whole — tables at generation 1, the manifest naming it, no
scratch left to finish anything from. It must lose: exit 0 ("already committed") when both have
one triple, exit 3 when they do not, and in both cases its files go. It must never take the
winner's commit for an orphan and replace it as the next generation (found from outside on
Delta: both exited 0 and the later model's rows were served).

Rerun with ``.venv/bin/pytest tests/faults/test_table_races.py -q``.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from factories import DS, make_mlp_onnx, numeric_project, one_line_error, release_at_barrier, run_cli
from servers import finish_all, start_cli

pytestmark = pytest.mark.slow

SHARDS, ROWS, BATCH = 2, 400, 200
# The barrier of factories.BARRIER_SOURCE; then a run given LATER waits until that file exists:
# the test makes it once the other run has exited (committed, cleaned up, tracked), so the later
# run is still scoring when the other one is done — no sleep, no timing to guess.
PREP = '''\
import os
import time
from pathlib import Path

import numpy as np


def transform(batch):
    folder = os.environ.get("BARRIER")
    if folder:
        Path(folder, f"ready-{os.getpid()}").touch()
        while not Path(folder, "go").exists():
            time.sleep(0.01)
    later = os.environ.get("LATER")
    while later and not Path(later).exists():
        time.sleep(0.01)
    return np.stack([batch.column(f"f{i}").to_numpy(zero_copy_only=False) for i in range(4)],
                    axis=1).astype(np.float32)
'''
OUTPUTS = {
    "files": {"path": "out/dt={ds}", "id_columns": ["id"]},
    "delta": {"path": "tables", "format": "delta", "id_columns": ["id"]},
    "iceberg": {"path": "tables", "format": "iceberg", "id_columns": ["id"]},
}


def records(root: Path, fmt: str) -> Path:
    return root / "out" / f"dt={DS}" if fmt == "files" else root / "tables" / "_batchinfer" / f"dt={DS}"


def attempts_on_disk(root: Path, fmt: str) -> set[str]:
    """Every attempt folder that holds a data file of the partition, whatever its kind."""
    if fmt == "files":
        base = root / "out" / f"dt={DS}"
        folders = [base / "predictions", base / "quarantine"]
    else:
        folders = [root / "tables" / f"dt={DS}", root / "tables" / "_quarantine" / f"dt={DS}"]
    return {f.parent.name for folder in folders if folder.exists() for f in folder.rglob("*.parquet")}


def table_rows(root: Path, fmt: str):
    """The partition's rows as the table's own library reads them now."""
    if fmt == "delta":
        import pyarrow.compute as pc
        from deltalake import DeltaTable

        dataset = DeltaTable(str(root / "tables")).to_pyarrow_dataset()
        return dataset.to_table(filter=pc.field("dt") == DS)
    from pyiceberg.catalog import load_catalog
    from pyiceberg.expressions import EqualTo

    catalog = load_catalog("batchinfer", type="sql", uri=f"sqlite:///{root}/tables/_catalog.db")
    return catalog.load_table("batchinfer.testjob").scan(row_filter=EqualTo("dt", DS)).to_arrow()


def generations(root: Path, fmt: str) -> list[str]:
    """The generations committed to the predictions table for the partition, oldest first."""
    if fmt == "delta":
        from deltalake import DeltaTable

        history = DeltaTable(str(root / "tables")).history()
        return [str(h["batchinfer.generation"]) for h in reversed(history)
                if h.get("batchinfer.partition") == f"dt={DS}"]
    from pyiceberg.catalog import load_catalog

    catalog = load_catalog("batchinfer", type="sql", uri=f"sqlite:///{root}/tables/_catalog.db")
    return [s.summary.additional_properties["batchinfer.generation"]
            for s in catalog.load_table("batchinfer.testjob").snapshots()
            if s.summary.additional_properties.get("batchinfer.partition") == f"dt={DS}"]


@pytest.mark.parametrize("fmt", sorted(OUTPUTS))
@pytest.mark.parametrize("other_model", [False, True], ids=["same-model", "other-model"])
def test_a_slower_run_loses_to_a_commit_that_finished_and_cleaned_up(tmp_path, fmt, other_model):
    (tmp_path / "slow_prep.py").write_text(PREP)
    (tmp_path / "barrier").mkdir()
    numeric_project(tmp_path, shards=SHARDS, rows=ROWS, batch={"rows": BATCH},
                    preprocess="slow_prep:transform", output=OUTPUTS[fmt])
    second: tuple[str, ...] = ()
    if other_model:
        make_mlp_onnx(tmp_path / "models" / "other.onnx", seed=5)
        stamped = run_cli("stamp", "models/other.onnx", "--job", "job.yaml",
                          "--model-version", "model:2", cwd=tmp_path)
        assert stamped.returncode == 0, stamped.stderr
        second = ("--set", "model.uri=models/other.onnx")
    barrier, later = {"BARRIER": str(tmp_path / "barrier")}, tmp_path / "later"
    procs = [start_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path, env=barrier, track=False),
             start_cli("run", "job.yaml", "--ds", DS, *second, cwd=tmp_path,
                       env={**barrier, "LATER": str(later)}, track=False)]
    try:
        release_at_barrier(procs, tmp_path / "barrier")
        fast_rc, fast_out, fast_err = finish_all(procs[:1])[0]
        assert procs[1].poll() is None, "the later run ended before the first one had committed"
    finally:
        later.touch()
        slow_rc, slow_out, slow_err = finish_all(procs[1:])[0]

    assert fast_rc == 0 and "already committed" not in fast_out, fast_err
    manifest = json.loads((records(tmp_path, fmt) / "_manifest.json").read_text())
    assert manifest["triple"]["model_version"] == "model:1"
    if other_model:
        assert slow_rc == 3, (slow_out, slow_err)
        line = one_line_error(subprocess.CompletedProcess([], slow_rc, slow_out, slow_err))
        assert "another triple" in line and "model:1" in line and "model:2" in line, line
    else:
        assert slow_rc == 0, slow_err
        assert f"already committed by attempt {manifest['attempt']}" in slow_out, slow_out
    # The winner's commit stands alone: its files only, no scratch, one generation.
    assert attempts_on_disk(tmp_path, fmt) == {manifest["attempt"]}
    assert not (records(tmp_path, fmt) / "_tmp").exists()
    if fmt != "files":
        assert manifest["table"]["generation"] == 1
        assert generations(tmp_path, fmt) == ["1"]
        rows = table_rows(tmp_path, fmt)
        assert rows.num_rows == SHARDS * ROWS
        assert set(rows["_model_version"].to_pylist()) == {"model:1"}
        assert {i.rsplit("-", 2)[0] for i in rows["_inference_id"].to_pylist()} == {manifest["attempt"]}
    shown = run_cli("inspect", str(records(tmp_path, fmt)), cwd=tmp_path)
    assert shown.returncode == 0 and manifest["attempt"] in shown.stdout, shown.stderr
