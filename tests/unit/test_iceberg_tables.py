"""``output.format: iceberg``'s side of a commit (io/iceberg_tables.py), on a real pyiceberg SQL
catalog on sqlite under tmp_path: a partition's commit is one snapshot that replaces exactly that
partition, in place; a retried commit is answered from the snapshot log; of two attempts at one
generation exactly one lands; two partitions committed at once both land; time travel gives the
previous predictions."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from pyiceberg.catalog import load_catalog
from pyiceberg.expressions import EqualTo
from pyiceberg.transforms import IdentityTransform

from batchinfer.errors import ContractError
from batchinfer.io.iceberg_tables import IcebergTables, catalog_properties
from batchinfer.io.outputs import QUARANTINE, Layout, challenger_folder, parquet_bytes, write_file
from batchinfer.io.records import FileRecord
from batchinfer.io.sinks import LostRace, Sink
from batchinfer.redaction import Deferred

A, B, C = "20260115T000000Z-aaaaaaaa", "20260115T000001Z-bbbbbbbb", "20260115T000002Z-cccccccc"
EXPLANATION = pa.list_(pa.struct([("feature", pa.string()), ("value", pa.float64())]))


def sink(root: Path, ds: str = "2026-01-15") -> Sink:
    catalog = {"name": "batchinfer", "type": "sql", "uri": f"sqlite:///{root}/_catalog.db",
               "warehouse": str(root)}
    return Sink(format="iceberg", column="dt", value=ds, table="batchinfer.job",
                catalog=tuple((k, Deferred(v)) for k, v in catalog.items()))


def tables(root: Path, ds: str = "2026-01-15") -> IcebergTables:
    return IcebergTables(str(root), sink(root, ds))


def write(root: Path, ds: str, attempt: str, shard: int, rows: int,
          kind: str = "predictions", extra: dict | None = None) -> tuple[Layout, FileRecord]:
    """One data file as the writer makes it: the audit columns dictionary-encoded, statistics on
    some columns only, the partition column as a constant."""
    layout = sink(root, ds).layout(str(root), attempt)
    relative = layout.part(kind, shard, 0)
    table = pa.table({
        "id": pa.array(range(shard * 1000, shard * 1000 + rows), pa.int64()),
        "score": pa.array([0.5] * rows, pa.float64()),
        "_model_version": pa.array(["model:1"] * rows).dictionary_encode(),
        "_inference_id": pa.array([f"{attempt}-{shard}"] * rows),
        "_explanation": pa.array([[{"feature": "f0", "value": 0.25}]] * rows, EXPLANATION),
        **{name: pa.array([value] * rows) for name, value in (extra or {}).items()},
        "dt": pa.array([ds] * rows),
    })
    data = parquet_bytes(table, dictionary=["_model_version"], statistics=["id", "dt"])
    digest = write_file(layout.fs, layout.abs(relative), data)
    return layout, FileRecord(path=relative, rows=rows, sha256=digest)


def commit(t: IcebergTables, layout: Layout, files: list[FileRecord], generation: int, attempt: str,
           kind: str = "predictions") -> int | None:
    return t.commit(layout, kind, files, generation=generation, attempt=attempt,
                    summary={"batchinfer.job": "job", "batchinfer.model_version": "model:1"})


def reader(root: Path, identifier: str = "batchinfer.job"):
    return load_catalog("batchinfer", type="sql", uri=f"sqlite:///{root}/_catalog.db").load_table(identifier)


def rows(table, ds: str = "2026-01-15", **scan) -> pa.Table:
    return table.scan(row_filter=EqualTo("dt", ds), **scan).to_arrow()


def test_commit_makes_the_files_the_partition_in_place(tmp_path):
    t = tables(tmp_path)
    assert t.generation() == (0, None)
    assert not (tmp_path / "_catalog.db").exists(), "reading the generation created the catalog"
    layout, f0 = write(tmp_path, "2026-01-15", A, 0, 5)
    _, f1 = write(tmp_path, "2026-01-15", A, 1, 3)
    snapshot = commit(t, layout, [f0, f1], 1, A)
    assert t.generation() == (1, A)

    table = reader(tmp_path)
    assert table.location() == f"file://{tmp_path}"
    (field,) = table.spec().fields
    assert (field.name, field.transform) == ("dt", IdentityTransform())
    assert table.schema().find_field("_explanation").field_type.element_type.fields[1].name == "value"
    current = table.current_snapshot()
    assert current.snapshot_id == snapshot
    summary = current.summary.additional_properties
    assert {k: summary[k] for k in ("batchinfer.attempt", "batchinfer.generation", "batchinfer.partition",
                                    "batchinfer.job", "batchinfer.model_version")} == {
        "batchinfer.attempt": A, "batchinfer.generation": "1", "batchinfer.partition": "dt=2026-01-15",
        "batchinfer.job": "job", "batchinfer.model_version": "model:1"}
    # nothing copied: the table's data files are the writer's files
    assert {task.file.file_path for task in table.scan().plan_files()} == {
        f"file://{layout.abs(f.path)}" for f in (f0, f1)}
    got = rows(table)
    assert got.num_rows == 8 and sorted(got["id"].to_pylist()) == [0, 1, 2, 3, 4, 1000, 1001, 1002]
    assert got["_explanation"].to_pylist()[0] == [{"feature": "f0", "value": 0.25}]


def test_a_retried_commit_is_answered_without_writing(tmp_path):
    t = tables(tmp_path)
    layout, f0 = write(tmp_path, "2026-01-15", A, 0, 5)
    first = commit(t, layout, [f0], 1, A)
    metadata = sorted((tmp_path / "metadata").glob("*.metadata.json"))
    assert commit(tables(tmp_path), layout, [f0], 1, A) == first
    assert sorted((tmp_path / "metadata").glob("*.metadata.json")) == metadata
    assert len(reader(tmp_path).snapshots()) == 1


def test_another_attempt_at_a_held_generation_loses(tmp_path):
    t = tables(tmp_path)
    layout_a, fa = write(tmp_path, "2026-01-15", A, 0, 5)
    layout_b, fb = write(tmp_path, "2026-01-15", B, 0, 7)
    commit(t, layout_a, [fa], 1, A)
    with pytest.raises(LostRace):
        commit(t, layout_b, [fb], 1, B)
    commit(t, layout_b, [fb], 2, B)
    with pytest.raises(LostRace):   # a later generation is held: the earlier one is over
        commit(t, layout_a, [fa], 1, A)
    assert rows(reader(tmp_path)).num_rows == 7
    assert t.generation() == (2, B)


def test_a_commit_replaces_the_partition_and_time_travel_gives_the_previous_rows(tmp_path):
    t = tables(tmp_path)
    layout_a, fa = write(tmp_path, "2026-01-15", A, 0, 5)
    other_layout, other = write(tmp_path, "2026-01-16", A, 0, 4)
    first = commit(t, layout_a, [fa], 1, A)
    commit(tables(tmp_path, "2026-01-16"), other_layout, [other], 1, A)
    layout_b, fb = write(tmp_path, "2026-01-15", B, 0, 6)
    second = commit(t, layout_b, [fb], 2, B)

    table = reader(tmp_path)
    now = rows(table)
    assert now.num_rows == 6 and set(now["_inference_id"].to_pylist()) == {f"{B}-0"}
    assert rows(table, "2026-01-16").num_rows == 4, "another partition was touched"
    assert table.snapshot_by_id(second).summary["deleted-data-files"] == "1"
    before = rows(table, snapshot_id=first)
    assert before.num_rows == 5 and set(before["_inference_id"].to_pylist()) == {f"{A}-0"}


def test_an_update_keeps_the_files_it_keeps(tmp_path):
    """``--update``: the kept shard's file stays in the table as it is (not removed and added
    again); the rewritten shard's file is replaced, the new one added."""
    t = tables(tmp_path)
    layout_a, a0 = write(tmp_path, "2026-01-15", A, 0, 5)
    _, a1 = write(tmp_path, "2026-01-15", A, 1, 3)
    commit(t, layout_a, [a0, a1], 1, A)
    layout_b, b1 = write(tmp_path, "2026-01-15", B, 1, 4)
    _, b2 = write(tmp_path, "2026-01-15", B, 2, 2)
    snapshot = commit(t, layout_b, [a0, b1, b2], 2, B)

    table = reader(tmp_path)
    summary = table.snapshot_by_id(snapshot).summary
    assert (summary["added-data-files"], summary["deleted-data-files"]) == ("2", "1")
    assert sorted(rows(table)["id"].to_pylist()) == [0, 1, 2, 3, 4, 1000, 1001, 1002, 1003, 2000, 2001]
    entries = table.inspect.entries().to_pylist()
    kept = [e for e in entries if e["data_file"]["file_path"].endswith(a0.path)]
    assert [e["status"] for e in kept] == [0], "the kept file was removed and added again"


def test_a_column_that_a_later_run_adds_is_added_to_the_table(tmp_path):
    t = tables(tmp_path)
    layout_a, fa = write(tmp_path, "2026-01-15", A, 0, 5)
    first = commit(t, layout_a, [fa], 1, A)
    layout_b, fb = write(tmp_path, "2026-01-15", B, 0, 3, extra={"_explanation_baseline": 0.5})
    commit(t, layout_b, [fb], 2, B)
    table = reader(tmp_path)
    assert rows(table)["_explanation_baseline"].to_pylist() == [0.5] * 3
    assert rows(table, snapshot_id=first).num_rows == 5


def test_a_column_a_later_run_writes_with_another_type_is_refused(tmp_path):
    t = tables(tmp_path)
    layout_a, fa = write(tmp_path, "2026-01-15", A, 0, 5)
    first = commit(t, layout_a, [fa], 1, A)
    layout_b, fb = write(tmp_path, "2026-01-15", B, 0, 3, extra={"score": "high"})
    with pytest.raises(ContractError, match="has a column this run writes with another type"):
        commit(t, layout_b, [fb], 2, B)
    assert reader(tmp_path).current_snapshot().snapshot_id == first


def test_no_files_and_no_table_make_no_table_but_an_existing_partition_is_emptied(tmp_path):
    t = tables(tmp_path)
    layout, f0 = write(tmp_path, "2026-01-15", A, 0, 5, kind=QUARANTINE)
    assert commit(t, layout, [], 1, A, kind=QUARANTINE) is None
    assert commit(t, layout, [f0], 1, A, kind=QUARANTINE) is not None
    quarantine = reader(tmp_path, "batchinfer.job__quarantine")
    assert quarantine.location() == f"file://{tmp_path}/_quarantine"
    assert rows(quarantine).num_rows == 5
    commit(t, sink(tmp_path).layout(str(tmp_path), B), [], 2, B, kind=QUARANTINE)
    assert rows(reader(tmp_path, "batchinfer.job__quarantine")).num_rows == 0


def test_challenger_tables_are_named_after_the_predictions_table(tmp_path):
    t = tables(tmp_path)
    names = {t.identifier(challenger_folder(n)) for n in ("credit_v4", "v.4", "v-4")}
    assert "batchinfer.job__challenger_credit_v4" in names and len(names) == 3
    assert all("." not in n.split(".", 1)[1] and "-" not in n for n in names)
    layout, f0 = write(tmp_path, "2026-01-15", A, 0, 5, kind=challenger_folder("v.4"))
    commit(t, layout, [f0], 1, A, kind=challenger_folder("v.4"))
    table = reader(tmp_path, t.identifier(challenger_folder("v.4")))
    assert table.location() == f"file://{tmp_path}/_challengers/v.4"
    assert rows(table).num_rows == 5


def _race(*jobs) -> list[object]:
    """Run each job on its own thread, released together; each job's result or exception."""
    barrier = threading.Barrier(len(jobs))
    results: list[object] = [None] * len(jobs)

    def go(i, job):
        barrier.wait()
        try:
            results[i] = job()
        except Exception as exc:  # the race's outcome, asserted by the caller
            results[i] = exc

    threads = [threading.Thread(target=go, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def _refused(root: Path) -> int:
    """Commits the catalog refused: each left a metadata file that no commit swapped in."""
    logged = {json.loads(p.read_text())["metadata-log"][-1]["metadata-file"]
              for p in (root / "metadata").glob("*.metadata.json")
              if json.loads(p.read_text())["metadata-log"]}
    current = reader(root).metadata_location
    written = {f"file://{p}" for p in (root / "metadata").glob("*.metadata.json")}
    return len(written - logged - {current})


def test_concurrent_commits_of_different_partitions_all_land(tmp_path):
    """Four partitions committed at once, in rounds until the catalog has refused at least one
    commit (a thread that read the table before another's commit landed): every one lands."""
    layout, f0 = write(tmp_path, "2026-01-01", A, 0, 3)
    commit(tables(tmp_path, "2026-01-01"), layout, [f0], 1, A)
    committed = 1
    for round_ in range(6):
        days = [f"2026-0{round_ + 2}-{d:02d}" for d in range(1, 5)]
        written = {ds: write(tmp_path, ds, A, 0, 10 + i) for i, ds in enumerate(days)}
        results = _race(*[lambda ds=ds, w=written[ds]: commit(tables(tmp_path, ds), w[0], [w[1]], 1, A)
                          for ds in days])
        assert all(isinstance(r, int) for r in results), results
        committed += len(days)
        table = reader(tmp_path)
        for i, ds in enumerate(days):
            assert rows(table, ds).num_rows == 10 + i
            assert tables(tmp_path, ds).generation() == (1, A)
        assert len(table.snapshots()) == committed
        if _refused(tmp_path):
            break
    assert _refused(tmp_path) >= 1, "no commit was refused: the race was never run"
    assert rows(reader(tmp_path), "2026-01-01").num_rows == 3


@pytest.mark.parametrize("existing", [False, True], ids=["new table", "existing table"])
def test_of_two_attempts_at_one_generation_exactly_one_lands(tmp_path, existing):
    if existing:   # another partition's commit made the table already
        layout, f0 = write(tmp_path, "2026-01-01", C, 0, 3)
        commit(tables(tmp_path, "2026-01-01"), layout, [f0], 1, C)
    layout_a, fa = write(tmp_path, "2026-01-15", A, 0, 5)
    layout_b, fb = write(tmp_path, "2026-01-15", B, 0, 7)
    results = _race(lambda: commit(tables(tmp_path), layout_a, [fa], 1, A),
                    lambda: commit(tables(tmp_path), layout_b, [fb], 1, B))
    lost = [r for r in results if isinstance(r, LostRace)]
    won = [r for r in results if isinstance(r, int)]
    assert len(lost) == 1 and len(won) == 1, results
    generation, winner = tables(tmp_path).generation()
    assert generation == 1 and winner == (A if isinstance(results[0], int) else B)
    got = rows(reader(tmp_path))
    assert got.num_rows == (5 if winner == A else 7)
    assert set(got["_inference_id"].to_pylist()) == {f"{winner}-0"}


def test_catalog_properties_fill_in_secrets_and_the_s3_endpoint(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.setenv("CATALOG_TOKEN", "s3cr3t")
    given = {"name": "prod", "type": "rest", "uri": "https://catalog.example", "token": "${CATALOG_TOKEN}"}
    deferred = tuple((k, Deferred(v, ("CATALOG_TOKEN",) if "$" in v else ())) for k, v in given.items())
    s3 = Sink(format="iceberg", column="dt", value="2026-01-15", table="a.b", catalog=deferred)
    name, properties = catalog_properties(s3, "s3://bucket/tables")
    assert name == "prod" and "name" not in properties
    assert properties == {"type": "rest", "uri": "https://catalog.example", "token": "s3cr3t",
                          "s3.endpoint": "http://127.0.0.1:9000", "s3.region": "eu-west-1"}
    mine = Sink(format="iceberg", column="dt", value="2026-01-15", table="a.b",
                catalog=(*deferred, ("s3.endpoint", Deferred("http://minio:9000"))))
    assert catalog_properties(mine, "s3://bucket/tables")[1]["s3.endpoint"] == "http://minio:9000"
    assert "s3.endpoint" not in catalog_properties(s3, "/local/tables")[1]
