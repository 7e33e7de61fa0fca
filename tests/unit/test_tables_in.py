"""Table inputs (io/tables_in.py, contract §3 ``input``): a Delta or Iceberg table's partition
listed as its Parquet data files at one version, on real tables made here (deltalake's
``write_deltalake``, pyiceberg's SQL catalog on sqlite); what plain Parquet reading would get
wrong refused with one line and its exit code; the spec's table keys; the manifest's
``input_table`` read back, and absent for files."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from batchinfer.commands.remedies import error_line
from batchinfer.errors import Action, ContractError, NoShardsError, SpecError
from batchinfer.io.manifest import manifest_bytes
from batchinfer.io.readback import check
from batchinfer.io.records import InputTable, Manifest, Totals
from batchinfer.io.tables_in import list_table
from batchinfer.spec import load_job
from factories import DS, write_job, write_schema

OTHER = "2026-01-16"


def rows(ids: range, dt: str) -> pa.Table:
    return pa.table({"id": pa.array(list(ids), pa.int64()),
                     "f0": pa.array([float(i) for i in ids], pa.float32()),
                     "dt": [dt] * len(ids)})


@pytest.fixture
def delta(tmp_path) -> Path:
    """Version 0: two dates, one file each; version 1: one more file for DS."""
    root = tmp_path / "features"
    write_deltalake(root, pa.concat_tables([rows(range(0, 4), DS), rows(range(4, 8), OTHER)]),
                    partition_by=["dt"])
    write_deltalake(root, rows(range(8, 10), DS), partition_by=["dt"], mode="append")
    return root


def test_delta_partition_at_latest_and_pinned_versions(delta):
    latest = list_table("delta", str(delta), filter={"dt": DS}, version=None)
    assert latest.table == InputTable(format="delta", table=str(delta), version=1, filter={"dt": DS})
    assert len(latest.shards) == 2 and [s.index for s in latest.shards] == [0, 1]
    assert all(f"/dt={DS}/" in s.url and Path(s.url).is_file() for s in latest.shards)
    assert [s.url for s in latest.shards] == sorted(s.url for s in latest.shards)
    assert sum(pq.ParquetFile(s.url).metadata.num_rows for s in latest.shards) == 6
    assert latest.absent == ("dt",)   # in the log, not in the files
    assert "dt" not in pq.read_schema(latest.shards[0].url).names

    first = list_table("delta", str(delta), filter={"dt": DS}, version=0)
    assert first.table is not None and first.table.version == 0
    assert len(first.shards) == 1 and first.shards[0].url in {s.url for s in latest.shards}
    whole = list_table("delta", str(delta), filter={}, version=None)
    assert len(whole.shards) == 3


def test_delta_refusals(delta, tmp_path):
    with pytest.raises(SpecError, match="input.filter f0: not a partition column .*partition columns: dt"):
        list_table("delta", str(delta), filter={"f0": "1.0"}, version=None)
    with pytest.raises(SpecError, match="input.version 7: delta table .* has no such version"):
        list_table("delta", str(delta), filter={"dt": DS}, version=7)
    with pytest.raises(ContractError, match="scored from version 7 ") as gone:
        list_table("delta", str(delta), filter={"dt": DS}, version=7, pinned=True)
    assert [r.action for r in gone.value.remedies] == [Action.UPDATE, Action.UNPIN]
    assert gone.value.field == "input.version"
    assert error_line(gone.value).endswith(
        "pass --update to score the latest version (1: only what changed since), or drop the pin "
        "with --overwrite --set input.version=1")
    with pytest.raises(SpecError, match="is not a Delta table"):
        list_table("delta", str(tmp_path / "nothing"), filter={}, version=None)
    with pytest.raises(NoShardsError, match="no data file where dt = '2030-01-01' at version 1"):
        list_table("delta", str(delta), filter={"dt": "2030-01-01"}, version=None)

    mapped = tmp_path / "mapped"
    write_deltalake(mapped, rows(range(2), DS), partition_by=["dt"],
                    configuration={"delta.columnMapping.mode": "name"})
    with pytest.raises(SpecError, match="column mapping"):
        list_table("delta", str(mapped), filter={"dt": DS}, version=None)


def test_delta_deletion_vectors_refused(tmp_path):
    """delta-rs deletes by rewriting files, so the deletion vector (row 0 of the DS file) is
    written into the log here as Spark writes one inline: a RoaringBitmapArray, Z85."""
    root = tmp_path / "dv"
    write_deltalake(root, pa.concat_tables([rows(range(2), DS), rows(range(2, 4), OTHER)]),
                    partition_by=["dt"], configuration={"delta.enableDeletionVectors": "true"})
    assert len(list_table("delta", str(root), filter={"dt": DS}, version=None).shards) == 1
    _delete_first_row(root, DS)
    assert "deletionVectors" in DeltaTable(root).protocol().reader_features
    with pytest.raises(SpecError, match="1 of the selected files have deletion vectors"):
        list_table("delta", str(root), filter={"dt": DS}, version=None)
    # the other partition's file has none: it reads; so does the version before the delete
    assert len(list_table("delta", str(root), filter={"dt": OTHER}, version=None).shards) == 1
    assert len(list_table("delta", str(root), filter={"dt": DS}, version=0).shards) == 1


def _delete_first_row(root: Path, dt: str) -> None:
    actions = [json.loads(line) for line in (root / "_delta_log" / f"{0:020d}.json").open()]
    add = next(a["add"] for a in actions if "add" in a and a["add"]["partitionValues"]["dt"] == dt)
    container = struct.pack("<II", 12346, 1) + struct.pack("<HH", 0, 0) + struct.pack("<I", 16)
    data = struct.pack("<I", 1681511377) + struct.pack("<qI", 1, 0) + container + struct.pack("<H", 0)
    data += b"\0" * (-len(data) % 4)
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
    z85 = ""
    for i in range(0, len(data), 4):
        n, chars = int.from_bytes(data[i:i + 4], "big"), ""
        for _ in range(5):
            n, digit = divmod(n, 85)
            chars = alphabet[digit] + chars
        z85 += chars
    vector = {"storageType": "i", "pathOrInlineDv": z85, "sizeInBytes": len(data), "cardinality": 1}
    remove = {"path": add["path"], "dataChange": True, "deletionTimestamp": 1,
              "partitionValues": add["partitionValues"], "size": add["size"]}
    lines = [{"commitInfo": {"timestamp": 2, "operation": "DELETE"}}, {"remove": remove},
             {"add": {**add, "deletionVector": vector}}]
    (root / "_delta_log" / f"{1:020d}.json").write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.fixture
def iceberg(tmp_path) -> dict:
    from pyiceberg.catalog import load_catalog

    properties = {"type": "sql", "uri": f"sqlite:///{tmp_path / 'catalog.db'}",
                  "warehouse": f"file://{tmp_path / 'warehouse'}"}
    catalog = load_catalog("test", **properties)
    catalog.create_namespace("feats")
    table = catalog.create_table("feats.daily", schema=rows(range(1), DS).schema)
    with table.update_spec() as spec:
        spec.add_identity("dt")
    table.append(pa.concat_tables([rows(range(0, 4), DS), rows(range(4, 8), OTHER)]))
    first = table.current_snapshot().snapshot_id
    table.append(rows(range(8, 10), DS))
    return {"catalog": catalog, "properties": properties, "first": first,
            "latest": table.current_snapshot().snapshot_id}


def _delete_first_row_iceberg(table, dt: str) -> None:
    """A position delete file (row 0 of ``dt``'s file), as a merge-on-read engine writes one
    (pyiceberg's own deletes rewrite files); pyiceberg's scan then leaves that row out."""
    import os

    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
    from pyiceberg.typedef import Record

    target = next(t.file for t in table.scan().plan_files() if t.file.partition[0] == dt)
    path = Path(table.location().removeprefix("file://")) / "data" / "delete-0.parquet"
    pq.write_table(pa.table({"file_path": [target.file_path], "pos": pa.array([0], pa.int64())}), path)
    deletes = DataFile.from_args(content=DataFileContent.POSITION_DELETES, file_path=f"file://{path}",
                                 file_format=FileFormat.PARQUET, partition=Record(dt), record_count=1,
                                 file_size_in_bytes=os.path.getsize(path))
    deletes.spec_id = target.spec_id
    with table.transaction() as tx, tx.update_snapshot().fast_append() as append:
        append.append_data_file(deletes)
    rows_left = table.refresh().scan(row_filter=f"dt = '{dt}'").to_arrow().num_rows
    assert rows_left == target.record_count - 1


def _iceberg(ice: dict, table: str = "feats.daily", filter=None, version=None, pinned=False):
    return list_table("iceberg", table, filter={"dt": DS} if filter is None else filter,
                      version=version, pinned=pinned, catalog=ice["properties"], catalog_name="test")


def test_iceberg_partition_at_latest_and_pinned_snapshots(iceberg):
    latest = _iceberg(iceberg)
    assert latest.table == InputTable(format="iceberg", table="feats.daily",
                                      version=iceberg["latest"], filter={"dt": DS})
    assert len(latest.shards) == 2
    assert all(not s.url.startswith("file:") and Path(s.url).is_file() for s in latest.shards)
    assert sum(pq.ParquetFile(s.url).metadata.num_rows for s in latest.shards) == 6
    assert latest.absent == ()   # Iceberg files hold every column
    first = _iceberg(iceberg, version=iceberg["first"])
    assert len(first.shards) == 1 and first.table is not None and first.table.version == iceberg["first"]


def test_iceberg_refusals(iceberg):
    with pytest.raises(SpecError, match="input.path feats.nope: no such table in Iceberg catalog test"):
        _iceberg(iceberg, table="feats.nope")
    with pytest.raises(SpecError, match="input.version 12345: iceberg table .* has no such snapshot"):
        _iceberg(iceberg, version=12345)
    with pytest.raises(ContractError, match="scored from snapshot 12345"):
        _iceberg(iceberg, version=12345, pinned=True)
    with pytest.raises(SpecError, match="input.filter id: Iceberg table .* is not partitioned by id"):
        _iceberg(iceberg, filter={"id": "1"})
    with pytest.raises(SpecError, match="input.filter nope: not a column"):
        _iceberg(iceberg, filter={"nope": "1"})
    with pytest.raises(NoShardsError, match="no data file where dt = '2030-01-01'"):
        _iceberg(iceberg, filter={"dt": "2030-01-01"})
    table = iceberg["catalog"].load_table("feats.daily")
    _delete_first_row_iceberg(table, OTHER)
    with pytest.raises(SpecError, match="1 of the selected files have delete files"):
        _iceberg(iceberg, filter={"dt": OTHER})
    assert len(_iceberg(iceberg).shards) == 2   # DS's files have none
    with table.update_schema() as schema:
        schema.rename_column("f0", "feature0")
    with pytest.raises(SpecError, match="'feature0' was renamed from 'f0'"):
        _iceberg(iceberg)


# -- the spec's table keys ------------------------------------------------------------------------

def _job(tmp_path, **inputs) -> Path:
    return write_job(tmp_path, input=inputs)


def test_spec_table_keys(tmp_path):
    job = load_job(_job(tmp_path, path="tables/features", format="delta", filter={"dt": "{ds}"}), ds=DS)
    assert job.spec.input.filter == {"dt": DS}
    assert job.spec.input.path == str(tmp_path / "tables" / "features")
    ice = load_job(_job(tmp_path, path="feats.daily", format="iceberg", version=3,
                        catalog={"uri": "sqlite:///cat.db", "warehouse": "wh"}), ds=DS)
    assert ice.spec.input.path == "feats.daily"   # an identifier, not a path
    assert ice.spec.input.catalog_properties() == {"uri": f"sqlite:///{tmp_path / 'cat.db'}",
                                                   "warehouse": str(tmp_path / "wh")}
    for inputs, message in [
        ({"path": "data/*.parquet", "filter": {"dt": "{ds}"}}, "input.filter is for a table input"),
        ({"path": "data/*.parquet", "version": 2}, "input.version is for a table input"),
        ({"path": "t", "format": "delta", "catalog": {"uri": "sqlite:///c.db"}},
         "input.catalog is for input.format iceberg"),
        ({"path": "feats.daily", "format": "iceberg"}, "needs input.catalog"),
        ({"path": "tables/daily", "format": "iceberg", "catalog": {"uri": "sqlite:///c.db"}},
         "not an Iceberg table identifier"),
        ({"path": "t", "format": "delta", "filter": {"dt = 1 or": "x"}}, "is not a column name"),
        ({"path": "t", "format": "delta", "version": -1}, "input.version"),
    ]:
        with pytest.raises(SpecError, match=message) as caught:
            load_job(_job(tmp_path, **inputs), ds=DS)
        assert caught.value.exit_code == 2


def test_output_inside_a_delta_input_is_refused(tmp_path):
    path = write_job(tmp_path, input={"path": "tables/features", "format": "delta"},
                     output={"path": "tables/features/scores/dt={ds}", "id_columns": ["id"]})
    with pytest.raises(SpecError, match="inside input.path's reach"):
        load_job(path, ds=DS)


# -- the manifest's record of the table read ------------------------------------------------------

def test_manifest_input_table_reads_back_and_is_absent_for_files():
    read = InputTable(format="delta", table="s3://b/features", version=4, filter={"dt": DS})
    plain = Manifest(job="j", ds=DS, attempt="A", triple={}, job_spec_sha256="f" * 64,
                     runner="direct", device="cpu", started_at="t0", finished_at="t1",
                     mlflow_run_id=None, totals=Totals.of([]), shards=())
    assert "input_table" not in plain.to_dict()   # a manifest of files reads as before
    tabled = Manifest(**{**plain.__dict__, "input_table": read})
    assert json.loads(manifest_bytes(tabled))["input_table"] == {
        "format": "delta", "table": "s3://b/features", "version": 4, "filter": {"dt": DS}}
    for manifest in (plain, tabled):
        assert check(Manifest, manifest_bytes(manifest), "m", ContractError) == manifest
    broken = manifest_bytes(tabled).replace(b'"version": 4', b'"version": "4"')
    with pytest.raises(ContractError, match="input_table.version"):
        check(Manifest, broken, "m", ContractError)


def test_a_schema_needing_a_delta_partition_column_is_refused(delta, tmp_path):
    from batchinfer.app.resolve import check_table_columns, list_job_input
    from batchinfer.triple.schemas import resolve_schema

    write_schema(tmp_path / "schemas")
    with_dt = tmp_path / "schemas" / "feats" / "v2.py"
    with_dt.write_text((tmp_path / "schemas" / "feats" / "v1.py").read_text().replace(
        '"id": pa.Column(pl.Int64, nullable=False),',
        '"id": pa.Column(pl.Int64, nullable=False), "dt": pa.Column(pl.String),'))
    job = load_job(write_job(tmp_path, input={"path": str(delta), "format": "delta",
                                              "filter": {"dt": "{ds}"}}), ds=DS)
    listing = list_job_input(job)
    assert listing.table is not None and listing.table.version == 1
    check_table_columns(job, resolve_schema(job.spec.schemas.root, "feats@1"), listing)
    with pytest.raises(SpecError, match="schema feats@2 has dt, a partition column of Delta table"):
        check_table_columns(job, resolve_schema(job.spec.schemas.root, "feats@2"), listing)


def test_a_missing_library_is_exit_5_naming_the_extra(monkeypatch):
    from batchinfer.errors import RuntimeFailure

    monkeypatch.setitem(sys.modules, "deltalake", None)   # what an uninstalled package looks like
    with pytest.raises(RuntimeFailure, match=r"^input.format delta needs deltalake, .*pip install "
                                             r"'batchinfer\[delta\]'") as caught:
        list_table("delta", "tables/features", filter={}, version=None)
    assert caught.value.exit_code == 5
    monkeypatch.setitem(sys.modules, "pyiceberg", None)
    with pytest.raises(RuntimeFailure, match=r"batchinfer\[iceberg\]"):
        list_table("iceberg", "a.b", filter={}, version=None)


def test_a_pinned_version_gone_keeps_a_rerun_a_no_op(delta, tmp_path):
    """A plain rerun of a partition whose pinned version the table no longer has decides by the
    manifest's shards (reuse, or exit 3); what reads the shards (--overwrite, profile) exits 3."""
    from batchinfer.app.resolve import list_partition_input
    from batchinfer.errors import TableVersionGone
    from batchinfer.io.records import ShardRecord

    job = load_job(write_job(tmp_path, input={"path": str(delta), "format": "delta",
                                              "filter": {"dt": "{ds}"}}), ds=DS)
    shard = ShardRecord(path=f"{delta}/dt={DS}/gone.parquet", sha256="a" * 64, rows_in=1,
                        rows_scored=1, rows_quarantined=0, status="scored", reason=None)

    def committed(version: int) -> Manifest:
        return Manifest(job="j", ds=DS, attempt="A", triple={}, job_spec_sha256="f" * 64,
                        runner="direct", device="cpu", started_at="t0", finished_at="t1",
                        mlflow_run_id=None, totals=Totals.of([shard]), shards=(shard,),
                        input_table=InputTable(format="delta", table=str(delta), version=version,
                                               filter={"dt": DS}))

    assert list_partition_input(job, committed(0)).table.version == 0   # pinned, still there
    assert len(list_partition_input(job, committed(0), update=True).shards) == 2   # the latest
    held = list_partition_input(job, committed(9))
    assert [s.url for s in held.shards] == [shard.path] and held.table.version == 9
    with pytest.raises(TableVersionGone, match="scored from version 9") as caught:
        list_partition_input(job, committed(9), reading=True)
    assert caught.value.exit_code == 3
