"""What a commit that replaces a partition leaves in every table, and what readers see of a
commit that a kill left half done (contract §4 "Tables").

- A job that dropped its challenger, then ``--overwrite`` of a committed partition: the new
  manifest lists no challenger, so no table may serve the challenger's old rows of that date
  (found from outside: its Delta table still served every one). Files output likewise: no
  ``challengers/<name>/`` files of the partition stay. (``--update`` of it is refused: the job
  spec changed.)
- A run killed between its predictions-table commit and its manifest: the tables serve its
  rows, so our readers (``inspect``, ``diff``, ``report``) finish the commit from its scratch
  before reading — they never say "no committed partition" of a partition every other reader
  of the table sees — and one that cannot finish it (the catalog's secret is not in its
  environment) says so in one line, exit 5.

Rerun with ``.venv/bin/pytest tests/e2e/test_tables_replace.py -q``.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import yaml

from factories import DS, make_mlp_onnx, make_shards, numeric_project, one_line_error, run_cli

pytestmark = pytest.mark.slow

SHARDS, ROWS = 2, 300
OUTPUTS = {
    "files": {"path": "out/dt={ds}", "id_columns": ["id"]},
    "delta": {"path": "tables", "format": "delta", "id_columns": ["id"]},
    "iceberg": {"path": "tables", "format": "iceberg", "id_columns": ["id"]},
}
ICEBERG = "batchinfer.testjob"


def records(root: Path, fmt: str, ds: str = DS) -> Path:
    return root / "out" / f"dt={ds}" if fmt == "files" else root / "tables" / "_batchinfer" / f"dt={ds}"


def manifest_of(root: Path, fmt: str, ds: str = DS) -> dict:
    return json.loads((records(root, fmt, ds) / "_manifest.json").read_text())


def catalog(root: Path):
    from pyiceberg.catalog import load_catalog

    return load_catalog("batchinfer", type="sql", uri=f"sqlite:///{root}/tables/_catalog.db")


def challenger_rows(root: Path, fmt: str, version: int | None = None) -> int:
    """Rows of the partition that challenger ``other`` serves now (or at ``version``), as the
    table's own library reads them; for files, the rows of its files on disk."""
    if fmt == "files":
        import pyarrow.parquet as pq

        folder = records(root, fmt) / "challengers" / "other"
        return sum(pq.read_metadata(p).num_rows for p in folder.rglob("*.parquet")) if folder.exists() else 0
    if fmt == "delta":
        import pyarrow.compute as pc
        from deltalake import DeltaTable

        table = DeltaTable(str(root / "tables" / "_challengers" / "other"), version=version)
        return table.to_pyarrow_dataset().count_rows(filter=pc.field("dt") == DS)
    from pyiceberg.expressions import EqualTo

    table = catalog(root).load_table(f"{ICEBERG}__challenger_other")
    return table.scan(row_filter=EqualTo("dt", DS), snapshot_id=version).to_arrow().num_rows


@pytest.mark.parametrize("fmt", sorted(OUTPUTS))
def test_an_overwrite_without_the_challenger_replaces_the_partition_in_its_table(tmp_path, fmt):
    numeric_project(tmp_path, shards=SHARDS, rows=ROWS, output=OUTPUTS[fmt])
    make_mlp_onnx(tmp_path / "models" / "other.onnx", seed=5)
    assert run_cli("stamp", "models/other.onnx", "--job", "job.yaml", "--model-version", "model:2",
                   cwd=tmp_path).returncode == 0
    spec = yaml.safe_load((tmp_path / "job.yaml").read_text())
    spec["model"]["challengers"] = [{"name": "other", "uri": "models/other.onnx", "device": "cpu"}]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    first = run_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = manifest_of(tmp_path, fmt)
    assert [c["name"] for c in before["challengers"]] == ["other"]
    assert challenger_rows(tmp_path, fmt) == SHARDS * ROWS

    del spec["model"]["challengers"]                 # the job no longer has the challenger
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    # --update of it is refused (another job spec: exit 3), the challenger's rows still listed.
    make_shards(tmp_path / "late", shards=1, rows=50, seed=9)
    (tmp_path / "late" / "part-00000.parquet").rename(
        tmp_path / "data" / f"dt={DS}" / f"part-{SHARDS:05d}.parquet")
    update = run_cli("run", "job.yaml", "--ds", DS, "--update", cwd=tmp_path)
    assert update.returncode == 3 and "another job spec" in one_line_error(update), update.stderr
    assert manifest_of(tmp_path, fmt) == before and challenger_rows(tmp_path, fmt) == SHARDS * ROWS

    again = run_cli("run", "job.yaml", "--ds", DS, "--overwrite", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    after = manifest_of(tmp_path, fmt)
    assert after["attempt"] != before["attempt"] and "challengers" not in after
    assert after["totals"]["rows_scored"] == SHARDS * ROWS + 50
    # No table (and no file of the partition) holds a row that the manifest does not list.
    assert challenger_rows(tmp_path, fmt) == 0
    if fmt != "files":
        assert after["table"]["generation"] == 2
        emptied = {t["kind"]: t["version"] for t in after["table"]["tables"]}["challengers/other"]
        assert challenger_rows(tmp_path, fmt, emptied) == 0
        # ... and the table's earlier version still has them (time travel, until VACUUM).
        held = {t["kind"]: t["version"] for t in before["table"]["tables"]}["challengers/other"]
        assert challenger_rows(tmp_path, fmt, held) == SHARDS * ROWS
    else:
        assert not (records(tmp_path, fmt) / "challengers").exists()


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
def test_a_reader_finishes_a_commit_that_a_kill_left_between_the_tables_and_the_manifest(tmp_path, fmt):
    numeric_project(tmp_path, shards=SHARDS, rows=ROWS, output=OUTPUTS[fmt])
    first = run_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    committed = manifest_of(tmp_path, fmt)
    # The overwrite is killed right after its predictions-table commit: the tables serve
    # generation 2, the manifest in place still names generation 1.
    killed = run_cli("run", "job.yaml", "--ds", DS, "--overwrite", cwd=tmp_path,
                     env={"BATCHINFER_FAULT": "after_table_commit"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert manifest_of(tmp_path, fmt)["attempt"] == committed["attempt"]
    (pending,) = [p.name for p in (records(tmp_path, fmt) / "_tmp").iterdir()]

    shown = run_cli("inspect", f"tables/dt={DS}", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert f"attempt {pending}" in shown.stdout, shown.stdout
    finished = manifest_of(tmp_path, fmt)
    assert finished["attempt"] == pending and finished["table"]["generation"] == 2
    assert {t["kind"] for t in finished["table"]["tables"]} >= {"predictions"}
    assert not (records(tmp_path, fmt) / "_tmp").exists()
    # Finished once: the next run finds it committed, and writes no table again.
    rerun = run_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path)
    assert rerun.returncode == 0 and "nothing to do" in rerun.stdout, rerun.stdout + rerun.stderr
    assert manifest_of(tmp_path, fmt) == finished


def test_a_reader_that_cannot_finish_the_commit_says_so_in_one_line(tmp_path):
    """The Iceberg catalog's secret is in the job's environment, not in the reader's: the reader
    cannot open the catalog to finish the commit, and says what to do (exit 5), writing nothing;
    with the secret it finishes it."""
    output = {**OUTPUTS["iceberg"], "catalog": {
        "uri": f"sqlite:///{tmp_path}/tables/_catalog.db",
        "properties": {"credential": "${CATALOG_TOKEN}"}}}
    numeric_project(tmp_path, shards=SHARDS, rows=ROWS, output=output, stamp=False)
    secret = {"CATALOG_TOKEN": "s3cr3t-token-value"}
    stamped = run_cli("stamp", "models/model.onnx", "--job", "job.yaml", "--model-version", "model:1",
                      cwd=tmp_path, env=secret)
    assert stamped.returncode == 0, stamped.stderr
    killed = run_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path,
                     env={**secret, "BATCHINFER_FAULT": "after_table_commit"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    scratch = records(tmp_path, "iceberg") / "_tmp"
    (pending,) = [p.name for p in scratch.iterdir()]
    assert "s3cr3t" not in (scratch / pending / "sink.json").read_text()   # the template only

    refused = run_cli("inspect", f"tables/_batchinfer/dt={DS}", cwd=tmp_path)   # no CATALOG_TOKEN
    assert refused.returncode == 5, refused.stdout + refused.stderr
    line = one_line_error(refused, "inspect")
    assert f"attempt {pending}" in line and "CATALOG_TOKEN" in line and "run the job" in line, line
    assert not (records(tmp_path, "iceberg") / "_manifest.json").exists()

    shown = run_cli("inspect", f"tables/_batchinfer/dt={DS}", cwd=tmp_path, env=secret)
    assert shown.returncode == 0, shown.stderr
    assert f"attempt {pending}" in shown.stdout
    assert manifest_of(tmp_path, "iceberg")["table"]["generation"] == 1
