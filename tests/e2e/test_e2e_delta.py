"""``output.format: delta`` as a user runs it (contract §4 "Tables"), read back by readers that
batchinfer does not write with: deltalake's own table and its pyarrow dataset, polars over the
Delta log, DuckDB on the Arrow they return.

One module fixture scores a project of three shards (one with two bad rows) into a Delta table
root, twice for one date (the second run an ``--overwrite``) and once for another date, the two
dates at the same time; a run killed between the table commit and the manifest is finished by
the next one; two runs of one new partition at once commit it once. About ten CLI runs.
"""
from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml
from deltalake import DeltaTable

from factories import (
    BARRIER_SOURCE,
    DS,
    make_mlp_onnx,
    make_shards,
    numeric_project,
    one_line_error,
    release_at_barrier,
    run_cli,
    spoil_rows,
)
from servers import finish_all, start_cli

pytestmark = pytest.mark.slow

OTHER, THIRD, WATCHED, ORPHAN, LATE = "2026-01-16", "2026-01-17", "2026-01-18", "2026-01-19", "2026-01-20"
SHARDS, ROWS, BAD = 3, 1000, {1: [5, 600]}


def records(root: Path, ds: str) -> Path:
    return root / "tables" / "_batchinfer" / f"dt={ds}"


def manifest(root: Path, ds: str) -> dict:
    return json.loads((records(root, ds) / "_manifest.json").read_text())


def run(root: Path, ds: str, *args: str, env: dict | None = None):
    return run_cli("run", "job.yaml", "--ds", ds, *args, cwd=root, env=env)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("delta")
    numeric_project(root, shards=SHARDS, rows=ROWS, batch={"rows": 400},
                    output={"path": "tables", "format": "delta", "id_columns": ["id"]},
                    quarantine={"max_bad_fraction": 0.01})
    data = root / "data" / f"dt={DS}"
    for shard, rows in BAD.items():
        spoil_rows(data / f"part-{shard:05d}.parquet", rows)
    for ds, seed in ((OTHER, 3), (THIRD, 4), (ORPHAN, 7), (LATE, 8)):
        make_shards(root / "data" / f"dt={ds}", shards=1, rows=500, seed=seed)
    make_shards(root / "data" / f"dt={WATCHED}", shards=SHARDS, rows=ROWS, seed=6)
    make_mlp_onnx(root / "models" / "other.onnx", seed=5)
    stamped = run_cli("stamp", "models/other.onnx", "--job", "job.yaml", "--model-version", "model:2", cwd=root)
    assert stamped.returncode == 0, stamped.stderr
    spec = yaml.safe_load((root / "job.yaml").read_text())
    spec["model"]["challengers"] = [{"name": "other", "uri": "models/other.onnx", "device": "cpu"}]
    (root / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    first = run(root, DS)
    assert first.returncode == 0, first.stderr
    out = {"root": root, "first": first, "first_manifest": manifest(root, DS),
           "rerun": run(root, DS)}
    out["version_after_rerun"] = DeltaTable(str(root / "tables")).version()
    # Another date, and an --overwrite of the first, at the same time: both land.
    procs = [start_cli("run", "job.yaml", "--ds", OTHER, cwd=root),
             start_cli("run", "job.yaml", "--ds", DS, "--overwrite", cwd=root)]
    out["both"] = finish_all(procs)
    out["second_manifest"] = manifest(root, DS)
    return out


def test_a_run_commits_the_partition_to_a_delta_table_that_other_readers_see(project):
    root, committed = project["root"], project["first_manifest"]
    assert project["first"].returncode == 0
    assert "Delta partition dt=2026-01-15" in project["first"].stdout
    totals = committed["totals"]
    assert (totals["rows_scored"], totals["rows_quarantined"]) == (SHARDS * ROWS - 2, 2)
    table = committed["table"]
    assert table["format"] == "delta" and table["partition"] == {"dt": DS} and table["generation"] == 1
    kinds = {t["kind"]: t for t in table["tables"]}
    assert set(kinds) == {"predictions", "quarantine", "challengers/other"}
    assert kinds["challengers/other"]["table"] == "_challengers/other"
    assert (kinds["predictions"]["table"], kinds["quarantine"]["table"]) == ("", "_quarantine")
    # Time travel to the version the manifest names: exactly the manifest's files and rows.
    first = DeltaTable(str(root / "tables"), version=kinds["predictions"]["version"])
    listed = {f["path"] for s in committed["shards"] for f in s["files"] if not f["path"].startswith("_")}
    assert {Path(u).relative_to(root / "tables").as_posix() for u in first.file_uris()} == listed
    by_polars = pl.read_delta(str(root / "tables"), version=kinds["predictions"]["version"])
    assert by_polars.height == totals["rows_scored"]
    assert set(by_polars["dt"].unique()) == {DS}   # the partition column comes from the log
    keys = set(zip(by_polars["_source_shard"], by_polars["_source_row"]))
    assert len(keys) == by_polars.height
    # The same rows as the manifest's own files, value for value.
    ours = pa.concat_tables([pq.read_table(root / "tables" / p) for p in sorted(listed)])
    assert sorted(ours["_input_hash"].to_pylist()) == sorted(by_polars["_input_hash"].to_list())
    quarantine = DeltaTable(str(root / "tables" / "_quarantine"), version=kinds["quarantine"]["version"])
    bad = quarantine.to_pyarrow_table()
    assert bad.num_rows == 2 and set(bad["_source_row"].to_pylist()) == set(BAD[1])
    assert all("f0" in reason for reason in bad["_reason"].to_pylist())
    history = {h["version"]: h for h in DeltaTable(str(root / "tables")).history()}
    metrics = json.loads((records(root, DS) / "_metrics.json").read_text())   # the last run's
    latest = project["second_manifest"]["table"]["tables"][0]["version"]
    assert metrics["metrics"]["commit_seconds"] > 0
    assert metrics["tags"]["batchinfer.table.predictions"] == f"@{latest}"
    assert history[kinds["predictions"]["version"]]["batchinfer.attempt"] == committed["attempt"]
    assert history[kinds["predictions"]["version"]]["batchinfer.model_version"] == "model:1"


def test_a_rerun_is_a_no_op_and_writes_no_table_version(project):
    rerun = project["rerun"]
    assert rerun.returncode == 0, rerun.stderr
    assert "nothing to do" in rerun.stdout
    assert project["version_after_rerun"] == project["first_manifest"]["table"]["tables"][0]["version"]


def test_two_dates_at_once_both_land_and_an_overwrite_replaces_its_partition(project):
    root = project["root"]
    assert [rc for rc, _, _ in project["both"]] == [0, 0], project["both"]
    now = DeltaTable(str(root / "tables"))
    counts = dict(duckdb.from_arrow(now.to_pyarrow_table()).aggregate("dt, count(*)").fetchall())
    assert counts == {DS: SHARDS * ROWS - 2, OTHER: 500}       # replaced, never appended
    before, after = project["first_manifest"], project["second_manifest"]
    assert after["table"]["generation"] == 2 and after["attempt"] != before["attempt"]
    # The previous version still reads (time travel): the first attempt's predictions.
    old = pl.read_delta(str(root / "tables"), version=before["table"]["tables"][0]["version"])
    assert set(old.filter(pl.col("dt") == DS)["_inference_id"].str.replace(r"-\d{5}-\d{5}$", "")) == {before["attempt"]}
    new = pl.read_delta(str(root / "tables")).filter(pl.col("dt") == DS)
    assert set(new["_inference_id"].str.replace(r"-\d{5}-\d{5}$", "")) == {after["attempt"]}
    # pyarrow's dataset over the Delta log, filtered to one partition.
    dataset = now.to_pyarrow_dataset()
    assert dataset.count_rows(filter=pc.field("dt") == OTHER) == 500


def test_a_challenger_has_its_own_table_and_diff_reads_it_through_the_manifest(project):
    root, committed = project["root"], project["second_manifest"]
    version = {t["kind"]: t["version"] for t in committed["table"]["tables"]}["challengers/other"]
    challenger = pl.read_delta(str(root / "tables" / "_challengers" / "other"), version=version)
    assert challenger.filter(pl.col("dt") == DS).height == committed["challengers"][0]["rows_scored"]
    assert set(challenger["_model_version"]) == {"model:2"}
    diffed = run_cli("diff", f"tables/dt={DS}", "--challenger", "other", "--json", cwd=root)
    assert diffed.returncode in (0, 1), diffed.stderr
    report = json.loads(diffed.stdout)
    assert report["rows"]["scored_both"] == SHARDS * ROWS - 2
    assert report["rows"]["scored_only_a"] == report["rows"]["scored_only_b"] == 0


def test_inspect_names_the_partition_by_its_folder_in_the_table(project):
    root = project["root"]
    shown = run_cli("inspect", f"tables/dt={DS}", cwd=root)
    assert shown.returncode == 0, shown.stderr
    assert project["second_manifest"]["attempt"] in shown.stdout
    rebuilt = run_cli("report", f"tables/dt={DS}", cwd=root)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert (records(root, DS) / "report.html").exists()


def test_a_run_killed_after_the_table_commit_is_finished_by_the_next_run(project):
    root = project["root"]
    killed = run(root, THIRD, env={"BATCHINFER_FAULT": "after_table_commit"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    table = DeltaTable(str(root / "tables"))
    assert table.transaction_version(f"batchinfer:dt={THIRD}") == 1
    assert not (records(root, THIRD) / "_manifest.json").exists()
    version = table.version()
    again = run(root, THIRD)
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stdout        # finished, not scored again
    finished = manifest(root, THIRD)
    assert finished["table"]["generation"] == 1
    assert finished["table"]["tables"][0]["version"] <= version
    assert DeltaTable(str(root / "tables")).version() == version   # no second write
    rows = pl.read_delta(str(root / "tables")).filter(pl.col("dt") == THIRD)
    assert rows.height == 500 and rows["_source_row"].n_unique() == 500
    assert not (records(root, THIRD) / "_tmp").exists()   # finished: a committed attempt's


def test_an_update_adds_the_late_shard_and_keeps_the_committed_files_in_the_table(project):
    root = project["root"]
    assert run(root, LATE).returncode == 0
    before = manifest(root, LATE)
    make_shards(root / "late", shards=1, rows=200, seed=9)
    (root / "late" / "part-00000.parquet").rename(root / "data" / f"dt={LATE}" / "part-00001.parquet")
    updated = run(root, LATE, "--update")
    assert updated.returncode == 0, updated.stderr
    after = manifest(root, LATE)
    assert after["table"]["generation"] == 2
    kept = {f["path"] for f in before["shards"][0]["files"]}
    assert {f["path"] for f in after["shards"][0]["files"]} == kept   # where they were
    version = after["table"]["tables"][0]["version"]
    held = {Path(u).relative_to(root / "tables").as_posix() for u in
            DeltaTable(str(root / "tables"), version=version).file_uris()
            if f"dt={LATE}/" in u}
    assert held == {f["path"] for s in after["shards"] for f in s["files"]}
    rows = pl.read_delta(str(root / "tables")).filter(pl.col("dt") == LATE)
    assert rows.height == 700


def test_a_table_commit_whose_run_left_nothing_to_finish_it_is_replaced(project):
    """Killed after the table commit, its scratch then lost: no pending manifest to finish it
    from. The next run commits the next generation over it (never stuck, never doubled)."""
    root = project["root"]
    killed = run(root, ORPHAN, env={"BATCHINFER_FAULT": "after_table_commit"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    shutil.rmtree(records(root, ORPHAN) / "_tmp")
    again = run(root, ORPHAN)
    assert again.returncode == 0, again.stderr
    finished = manifest(root, ORPHAN)
    assert finished["table"]["generation"] == 2
    rows = pl.read_delta(str(root / "tables")).filter(pl.col("dt") == ORPHAN)
    assert rows.height == 500 and rows["_source_row"].n_unique() == 500
    assert set(rows["_inference_id"].str.replace(r"-\d{5}-\d{5}$", "")) == {finished["attempt"]}


def test_a_reader_during_a_run_sees_the_partition_whole_or_not_at_all(project):
    root = project["root"]
    proc = start_cli("run", "job.yaml", "--ds", WATCHED, cwd=root)
    seen = []
    while proc.poll() is None:
        if (root / "tables" / f"dt={WATCHED}").exists():   # the run is writing its files
            table = DeltaTable(str(root / "tables")).to_pyarrow_dataset()
            seen.append(table.count_rows(filter=pc.field("dt") == WATCHED))
    assert finish_all([proc])[0][0] == 0
    assert seen and set(seen) <= {0, SHARDS * ROWS}, sorted(set(seen))
    assert DeltaTable(str(root / "tables")).to_pyarrow_dataset().count_rows(
        filter=pc.field("dt") == WATCHED) == SHARDS * ROWS


def test_a_table_output_refuses_a_date_in_its_path_and_a_run_without_a_date(project, tmp_path):
    root = project["root"]
    spec = yaml.safe_load((root / "job.yaml").read_text())
    spec["output"]["path"] = "tables/dt={ds}"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    refused = run_cli("run", str(tmp_path / "job.yaml"), "--ds", DS, cwd=root)
    assert refused.returncode == 2
    assert "leave {ds} out" in one_line_error(refused)
    # The tables' partition column named like a column the job writes: the model's output y
    # (known once the model loads), or an id column (known from the spec). Nothing written.
    for column in ("y", "id"):
        collides = run(root, OTHER, "--set", f"output.partition_column={column}")
        assert collides.returncode == 2, collides.stderr
        assert f"output.partition_column {column!r} is also a column the job writes" in one_line_error(collides)
        assert not (root / "tables" / f"{column}={OTHER}").exists()
        assert not (root / "tables" / "_batchinfer" / f"{column}={OTHER}").exists()


def test_two_runs_of_one_new_partition_at_once_commit_it_once(tmp_path):
    """Both past their decision (held at a barrier in the preprocessing) when either commits:
    the predictions table takes one generation 1, the other run exits 0 and removes its files."""
    (tmp_path / "barrier_prep.py").write_text(BARRIER_SOURCE)
    numeric_project(tmp_path, shards=2, rows=500, preprocess="barrier_prep:transform",
                    output={"path": "tables", "format": "delta", "id_columns": ["id"]})
    (tmp_path / "barrier").mkdir()
    procs = [start_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path,
                       env={"BARRIER": str(tmp_path / "barrier")}) for _ in range(2)]
    release_at_barrier(procs, tmp_path / "barrier")
    results = finish_all(procs)
    assert [rc for rc, _, _ in results] == [0, 0], results
    lost = [out for _, out, _ in results if "already committed by attempt" in out]
    assert len(lost) == 1, results
    winner = json.loads((tmp_path / "tables" / "_batchinfer" / f"dt={DS}" / "_manifest.json").read_text())
    assert winner["table"]["generation"] == 1
    table = DeltaTable(str(tmp_path / "tables"))
    assert table.version() == 0 and table.to_pyarrow_table().num_rows == 1000
    assert [p.name for p in (tmp_path / "tables" / f"dt={DS}").iterdir()] == [winner["attempt"]]

