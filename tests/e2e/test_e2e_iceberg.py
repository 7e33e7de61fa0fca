"""``output.format: iceberg`` as a user runs it (contract §4): a job scored into the Iceberg tables
under ``output.path`` (the default sqlite catalog in ``_catalog.db``), read back by readers that
batchinfer does not write with — pyiceberg scans, DuckDB on the Arrow they return, polars'
``scan_iceberg`` — whose counts are the manifest's; ``inspect`` of the partition's folder; a
rerun that changes nothing; ``--overwrite`` that replaces the partition (not appends) with time
travel to the previous predictions; quarantined rows in the quarantine table; and a run killed
right after its predictions-table commit (``after_table_commit``), which the next run finishes
from the pending manifest without writing the table again.

Seven CLI runs (forked from the session's fork server), one module fixture.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest
from pyiceberg.catalog import load_catalog
from pyiceberg.expressions import EqualTo

from factories import DS, numeric_project, run_cli, spoil_rows

pytestmark = pytest.mark.slow

DS2 = "2026-01-16"
BAD = {0: [3, 200]}           # rows out of range: quarantined
TABLE = "batchinfer.testjob"


def run_args(ds: str, *more: str) -> tuple[str, ...]:
    return ("run", "job.yaml", "--ds", ds, "--set", "output.format=iceberg",
            "--set", "output.path=tables", *more)


def manifest_of(root: Path, ds: str) -> dict:
    return json.loads((root / "tables" / "_batchinfer" / f"dt={ds}" / "_manifest.json").read_text())


def catalog(root: Path):
    return load_catalog("batchinfer", type="sql", uri=f"sqlite:///{root}/tables/_catalog.db")


def partition_snapshots(table, ds: str) -> list:
    return [s for s in table.snapshots()
            if s.summary.additional_properties.get("batchinfer.partition") == f"dt={ds}"]


@pytest.fixture(scope="module")
def project(tmp_path_factory, monkeypatch_module) -> dict:
    monkeypatch_module.setenv("POLARS_ICEBERG_PLANNER", "pyiceberg")   # no polars_iceberg here
    root = tmp_path_factory.mktemp("iceberg")
    numeric_project(root, shards=2, rows=400, batch={"rows": 200})
    data = root / "data" / f"dt={DS}"
    for shard, rows in BAD.items():
        spoil_rows(data / f"part-{shard:05d}.parquet", rows)
    shutil.copytree(data, root / "data" / f"dt={DS2}")

    out: dict = {"root": root, "first": run_cli(*run_args(DS), cwd=root)}
    assert out["first"].returncode == 0, out["first"].stderr
    out["manifest1"] = manifest_of(root, DS)
    out["inspect"] = run_cli("inspect", f"tables/dt={DS}", cwd=root)
    out["metadata"] = sorted(p.name for p in (root / "tables" / "metadata").iterdir())
    out["rerun"] = run_cli(*run_args(DS), cwd=root)
    out["metadata_after_rerun"] = sorted(p.name for p in (root / "tables" / "metadata").iterdir())
    out["overwrite"] = run_cli(*run_args(DS, "--overwrite"), cwd=root)
    assert out["overwrite"].returncode == 0, out["overwrite"].stderr
    out["manifest2"] = manifest_of(root, DS)

    out["killed"] = run_cli(*run_args(DS2), cwd=root, env={"BATCHINFER_FAULT": "after_table_commit"})
    out["killed_manifest"] = (root / "tables" / "_batchinfer" / f"dt={DS2}" / "_manifest.json").exists()
    out["killed_snapshots"] = [s.summary.additional_properties for s in
                               partition_snapshots(catalog(root).load_table(TABLE), DS2)]
    out["killed_quarantine"] = partition_snapshots(catalog(root).load_table(f"{TABLE}__quarantine"), DS2)
    out["finished"] = run_cli(*run_args(DS2), cwd=root)
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_the_tables_hold_the_manifests_rows_for_every_reader(project):
    root, manifest = project["root"], project["manifest1"]
    totals = manifest["totals"]
    assert manifest["table"]["format"] == "iceberg" and manifest["table"]["generation"] == 1
    versions = {t["kind"]: t for t in manifest["table"]["tables"]}
    assert versions["predictions"]["table"] == TABLE
    assert versions["quarantine"]["table"] == f"{TABLE}__quarantine"

    predictions = catalog(root).load_table(TABLE)
    scanned = predictions.scan(row_filter=EqualTo("dt", DS), snapshot_id=versions["predictions"]["version"]).to_arrow()
    assert scanned.num_rows == totals["rows_scored"] == 800 - len(BAD[0])
    ((keys,),) = duckdb.sql("SELECT count(DISTINCT (_source_shard, _source_row)) FROM scanned").fetchall()
    assert keys == totals["rows_scored"]
    frame = pl.scan_iceberg(predictions, snapshot_id=versions["predictions"]["version"]) \
        .filter(pl.col("dt") == DS).select(pl.len()).collect()
    assert frame.item() == totals["rows_scored"]
    # the table's files are the manifest's, where the run wrote them
    listed = {f"file://{root}/tables/{f['path']}" for s in manifest["shards"] for f in s["files"]
              if not f["path"].startswith("_quarantine/")}
    planned = {t.file.file_path for t in predictions.scan(snapshot_id=versions["predictions"]["version"]).plan_files()}
    assert planned == listed

    quarantine = catalog(root).load_table(f"{TABLE}__quarantine")
    rejected = quarantine.scan(row_filter=EqualTo("dt", DS)).to_arrow()
    assert rejected.num_rows == totals["rows_quarantined"] == len(BAD[0])
    assert sorted(rejected["_source_row"].to_pylist()) == BAD[0]
    assert rejected["_reasons"].type.value_type.num_fields == 3


def test_inspect_reads_the_partition_folder(project):
    result = project["inspect"]
    assert result.returncode == 0, result.stderr
    assert f"attempt {project['manifest1']['attempt']}" in result.stdout
    assert f"{project['manifest1']['totals']['rows_scored']} scored" in result.stdout


def test_a_rerun_changes_nothing(project):
    rerun = project["rerun"]
    assert rerun.returncode == 0, rerun.stderr
    assert "already committed" in rerun.stdout + rerun.stderr
    assert project["metadata_after_rerun"] == project["metadata"], "the rerun wrote the tables"


def test_overwrite_replaces_the_partition_and_time_travel_gives_the_previous_predictions(project):
    root, before, after = project["root"], project["manifest1"], project["manifest2"]
    assert after["table"]["generation"] == 2 and after["attempt"] != before["attempt"]
    predictions = catalog(root).load_table(TABLE)
    now = predictions.scan(row_filter=EqualTo("dt", DS)).to_arrow()
    assert now.num_rows == before["totals"]["rows_scored"], "the overwrite appended"
    old_version = {t["kind"]: t["version"] for t in before["table"]["tables"]}["predictions"]
    then = predictions.scan(row_filter=EqualTo("dt", DS), snapshot_id=old_version).to_arrow()
    ids_now, ids_then = set(now["_inference_id"].to_pylist()), set(then["_inference_id"].to_pylist())
    assert ids_then and ids_now and not ids_now & ids_then
    first_files = [root / "tables" / f["path"] for s in before["shards"] for f in s["files"]
                   if not f["path"].startswith("_quarantine/")]
    assert ids_then == {i for f in first_files for i in pq.read_table(f)["_inference_id"].to_pylist()}
    quarantine = catalog(root).load_table(f"{TABLE}__quarantine")
    assert quarantine.scan(row_filter=EqualTo("dt", DS)).to_arrow().num_rows == len(BAD[0])
    assert [s.summary.additional_properties["batchinfer.generation"]
            for s in partition_snapshots(predictions, DS)] == ["1", "2"]


def test_a_run_killed_after_its_table_commit_is_finished_from_its_pending_manifest(project):
    root = project["root"]
    assert project["killed"].returncode != 0
    assert not project["killed_manifest"]
    (killed,) = project["killed_snapshots"]          # the predictions table holds the killed run's
    assert project["killed_quarantine"] == []         # ... and the quarantine table not yet
    finished = project["finished"]
    assert finished.returncode == 0, finished.stderr
    assert "already committed" in finished.stdout + finished.stderr
    manifest = manifest_of(root, DS2)
    assert manifest["attempt"] == killed["batchinfer.attempt"]
    predictions = catalog(root).load_table(TABLE)
    (snapshot,) = partition_snapshots(predictions, DS2)   # one snapshot for that generation
    versions = {t["kind"]: t["version"] for t in manifest["table"]["tables"]}
    assert versions["predictions"] == snapshot.snapshot_id
    assert predictions.scan(row_filter=EqualTo("dt", DS2)).to_arrow().num_rows == manifest["totals"]["rows_scored"]
    quarantine = catalog(root).load_table(f"{TABLE}__quarantine")
    (q_snapshot,) = partition_snapshots(quarantine, DS2)
    assert versions["quarantine"] == q_snapshot.snapshot_id
    assert q_snapshot.summary.additional_properties["batchinfer.attempt"] == manifest["attempt"]
    assert not (root / "tables" / "_batchinfer" / f"dt={DS2}" / "_tmp").exists()
