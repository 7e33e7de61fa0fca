"""Shards of one partition that differ in shape or type, and outputs whose columns differ in
width (issue 18, item 13), driven through the CLI and checked from the files:

- a column the schema declares optional (``required=False``) that one shard lacks: the run
  commits, the column is all null for that shard's rows (hashed, and given to the preprocessing,
  as a null of the schema's type: the same ``_input_hash`` as a shard holding it null);
- id columns stored as ``string``, ``large_string`` and ``string_view`` (binary likewise) in
  three shards of one partition: every prediction file has one type per column, so the
  partition reads as one table, with the predictions and ``_input_hash`` of plain strings;
- ``diff --challenger`` against a challenger whose score is float64 beside the champion's float32:
  compared by value, and the types said to differ.
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from factories import DS, check_partition, make_mlp_onnx, read_partition, run_cli, save_onnx, write_job

pytestmark = pytest.mark.slow

ROWS = 200
FEATURES = ["f0", "f1", "f2", "f3"]


def features(seed: int, rows: int = ROWS) -> dict[str, pa.Array]:
    x = np.clip(np.random.default_rng(seed).standard_normal((rows, 4)), -3, 3).astype(np.float32)
    return {f: pa.array(x[:, i]) for i, f in enumerate(FEATURES)}


def stamp(folder: Path, model: str = "models/model.onnx", version: str = "model:1") -> None:
    result = run_cli("stamp", model, "--job", "job.yaml", "--model-version", version, cwd=folder)
    assert result.returncode == 0, result.stderr


def project(folder: Path, schema: str, shards: list[pa.Table], files: dict[str, str] | None = None,
            **job) -> Path:
    """A stamped job over ``shards`` (data/dt=DS/part-0000N.parquet) with schema ``feats@1``;
    ``files``: more files of the job's folder (name → text)."""
    for name, text in (files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(textwrap.dedent(text))
    (folder / "schemas" / "feats").mkdir(parents=True)
    (folder / "schemas" / "feats" / "v1.py").write_text(textwrap.dedent(schema))
    data = folder / "data" / f"dt={DS}"
    data.mkdir(parents=True)
    for i, table in enumerate(shards):
        pq.write_table(table, data / f"part-{i:05d}.parquet")
    make_mlp_onnx(folder / "models" / "model.onnx")
    write_job(folder, **job)
    stamp(folder)
    return folder


def by_shard(predictions: pa.Table, shard: Path) -> pa.Table:
    rows = predictions.filter(pc.equal(predictions["_source_shard"], str(shard)))
    return rows.sort_by("_source_row")


# -- an optional schema column that one shard lacks -----------------------------------------------

OPTIONAL = {
    "polars": """\
        import pandera.polars as pa
        import polars as pl

        SCHEMA = pa.DataFrameSchema({
            "id": pa.Column(pl.Int64, nullable=False),
            **{f"f{i}": pa.Column(pl.Float32, checks=pa.Check.in_range(-10, 10)) for i in range(4)},
            "weight": pa.Column(pl.Float32, required=False, nullable=True),
            "note": pa.Column(pl.String, required=False, nullable=True),
        }, strict=True)
        FEATURES = ["f0", "f1", "f2", "f3"]
        """,
    "pandas": """\
        import pandera.pandas as pa

        SCHEMA = pa.DataFrameSchema({
            "id": pa.Column("Int64", nullable=False),
            **{f"f{i}": pa.Column("float32", checks=pa.Check.in_range(-10, 10)) for i in range(4)},
            "weight": pa.Column("float32", required=False, nullable=True),
            "note": pa.Column(str, required=False, nullable=True),
        }, strict=True)
        FEATURES = ["f0", "f1", "f2", "f3"]
        """,
}

# The preprocessing sees both optional columns on every batch, in the schema's types, and uses
# one: f0 + weight (a null weight counts 0).
PREPROCESS = """\
    import numpy as np
    import pyarrow as pa


    def transform(batch):
        assert batch.schema.field("weight").type == pa.float32(), batch.schema
        assert batch.schema.field("note").type == pa.string(), batch.schema
        x = np.stack([batch.column(f).to_numpy(zero_copy_only=False) for f in ("f0", "f1", "f2", "f3")], 1)
        weight = batch.column("weight").to_numpy(zero_copy_only=False)
        x[:, 0] += np.nan_to_num(weight, nan=0.0)
        return x.astype(np.float32)
    """
BAD_ROW = 7   # f0 out of range in the shards without weights: quarantined in both


@pytest.mark.parametrize("kind", ["polars", "pandas"])
def test_an_optional_column_a_shard_lacks_is_null_for_its_rows(tmp_path, kind):
    ids = pa.array(np.arange(1000, 1000 + ROWS, dtype=np.int64))
    cols = features(1)
    f0 = cols["f0"].to_numpy().copy()
    f0[BAD_ROW] = 99.0
    cols["f0"] = pa.array(f0)
    with_values = pa.table({"id": pa.array(np.arange(ROWS, dtype=np.int64)), **features(0),
                            "weight": pa.array(np.full(ROWS, 0.5, np.float32)),
                            "note": pa.array(["a"] * ROWS)})
    lacking = pa.table({"id": ids, **cols})
    null = pa.table({"id": ids, **cols, "weight": pa.nulls(ROWS, pa.float32()),
                     "note": pa.nulls(ROWS, pa.string())})
    folder = project(tmp_path, OPTIONAL[kind], [with_values, lacking, null],
                     {"prep.py": PREPROCESS}, preprocess="prep:transform")

    checked = run_cli("validate", "job.yaml", "--ds", DS, cwd=folder)
    assert checked.returncode == 0, checked.stderr
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=folder)
    assert result.returncode == 0, result.stderr
    shards = sorted((folder / "data" / f"dt={DS}").resolve().glob("*.parquet"))
    predictions, quarantine, manifest = check_partition(folder / "out" / f"dt={DS}", shards)
    assert [s["rows_quarantined"] for s in manifest["shards"]] == [0, 1, 1]

    # Absent and present-and-null give the same hash and prediction, row by row...
    absent, present = by_shard(predictions, shards[1]), by_shard(predictions, shards[2])
    assert absent.num_rows == present.num_rows == ROWS - 1
    assert absent["_input_hash"].equals(present["_input_hash"])
    assert absent["y"].equals(present["y"])
    # ...which is docs/hashing.md's hash of the row with the column null, in the schema's type.
    from batchinfer.rows.hashing import row_hashes

    columns = ["id", *FEATURES, "weight", "note"]
    expected = row_hashes(null.filter(pc.not_equal(pa.array(np.arange(ROWS)), BAD_ROW)), columns)
    assert absent["_input_hash"].combine_chunks().equals(expected)
    # The weights that are there reach the model (f0 + 0.5), the missing ones count 0.
    from factories import mlp_reference

    first = by_shard(predictions, shards[0])
    x = np.stack([with_values[f].to_numpy() for f in FEATURES], 1)
    x[:, 0] += 0.5
    np.testing.assert_allclose(first["y"].to_numpy(), mlp_reference(x), rtol=1e-5)
    # A quarantined row keeps the row as it was read: no column the shard did not have.
    values = {row["_source_shard"]: json.loads(row["_values"]) for row in quarantine.to_pylist()}
    assert set(values[str(shards[1])]) == {"id", *FEATURES}
    assert values[str(shards[2])]["weight"] is None and "note" in values[str(shards[2])]


# -- one partition, three physical string (and binary) types ---------------------------------------

STRING_IDS = """\
    import pandera.polars as pa
    import polars as pl

    SCHEMA = pa.DataFrameSchema({
        "id": pa.Column(pl.String, nullable=False),
        "key": pa.Column(pl.Binary, nullable=False),
        **{f"f{i}": pa.Column(pl.Float32, checks=pa.Check.in_range(-10, 10)) for i in range(4)},
    }, strict=True)
    FEATURES = ["f0", "f1", "f2", "f3"]
    """
KINDS = [(pa.string(), pa.binary()), (pa.large_string(), pa.large_binary()),
         (pa.string_view(), pa.binary_view())]


def id_shard(index: int, string_type: pa.DataType, binary_type: pa.DataType) -> pa.Table:
    ids = [f"c-{index}-{i}" for i in range(ROWS)]
    return pa.table({"id": pa.array(ids, string_type),
                     "key": pa.array([i.encode() for i in ids], binary_type), **features(index)})


def test_one_partition_of_three_string_kinds_reads_as_one_table(tmp_path):
    shards = [id_shard(i, s, b) for i, (s, b) in enumerate(KINDS)]
    folder = project(tmp_path, STRING_IDS, shards,
                     output={"path": "out/dt={ds}", "id_columns": ["id", "key"]})
    paths = sorted((folder / "data" / f"dt={DS}").resolve().glob("*.parquet"))
    assert [pq.read_schema(p).field("id").type for p in paths] == [s for s, _ in KINDS]
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=folder)
    assert result.returncode == 0, result.stderr
    out = folder / "out" / f"dt={DS}"
    predictions, _, manifest = check_partition(out, paths)   # one pa.concat_tables, no promotion
    for shard in manifest["shards"]:
        for f in shard["files"]:
            schema = pq.read_schema(out / f["path"])
            assert (schema.field("id").type, schema.field("key").type) == (pa.string(), pa.binary())

    # The same rows written as plain string and binary: the same predictions and _input_hash
    # (docs/hashing.md: the physical kinds of one type hash alike).
    plain = folder / "plain"
    plain.mkdir()
    for i, _ in enumerate(KINDS):
        pq.write_table(id_shard(i, pa.string(), pa.binary()), plain / f"part-{i:05d}.parquet")
    again = run_cli("run", "job.yaml", "--ds", DS, "--set", "input.path=plain/*.parquet",
                    "--set", "output.path=out-plain", cwd=folder)
    assert again.returncode == 0, again.stderr
    reference, _, _ = read_partition(folder / "out-plain")
    ordered = predictions.sort_by("id")
    expected = reference.sort_by("id")
    for column in ("id", "key", "y", "_input_hash", "_source_row"):
        assert ordered[column].equals(expected[column]), column
    from batchinfer.rows.hashing import row_hashes

    for i, shard in enumerate(shards):   # each kind's hash is the plain rows' hash
        rows = by_shard(predictions, paths[i])
        assert rows["_input_hash"].combine_chunks().equals(
            row_hashes(id_shard(i, pa.string(), pa.binary()), ["id", "key", *FEATURES]))
        assert rows["_input_hash"].combine_chunks().equals(row_hashes(shard, ["id", "key", *FEATURES]))


def test_plain_types_of_every_kind():
    from batchinfer.rows.arrow_types import plain_array, plain_type

    assert plain_type(pa.large_list(pa.field("x", pa.string_view()))) == pa.list_(pa.field("x", pa.string()))
    assert plain_type(pa.list_view(pa.large_binary())) == pa.list_(pa.binary())
    assert plain_type(pa.dictionary(pa.int8(), pa.large_string())) == pa.string()
    assert plain_type(pa.struct([("a", pa.large_string())])) == pa.struct([("a", pa.string())])
    assert plain_type(pa.map_(pa.large_string(), pa.binary_view())) == pa.map_(pa.string(), pa.binary())
    assert plain_type(pa.list_(pa.large_string(), 3)) == pa.list_(pa.string(), 3)
    for plain in (pa.int32(), pa.float32(), pa.timestamp("us", tz="UTC"), pa.string(), pa.binary()):
        assert plain_type(plain) == plain
    encoded = pc.run_end_encode(pa.array(["a", "a", None], pa.large_string()))
    assert plain_array(encoded).equals(pa.array(["a", "a", None]))
    same = pa.array([1, 2])
    assert plain_array(same) is same


# -- diff by value across float and integer widths -------------------------------------------------

def make_wide_onnx(path: Path) -> Path:
    """The champion's MLP (seed 0), its output cast to float64: the same values, wider."""
    import onnx
    from onnx import TensorProto, helper

    champion = onnx.load(str(make_mlp_onnx(path, output_name="y32")))
    graph = champion.graph
    graph.node.append(helper.make_node("Cast", ["y32"], ["y"], to=TensorProto.DOUBLE))
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["N", 1]))
    return save_onnx(graph, path)


def test_diff_compares_a_float64_challenger_by_value(tmp_path):
    shards = [pa.table({"id": pa.array(np.arange(i * ROWS, (i + 1) * ROWS, dtype=np.int64)),
                        **features(i)}) for i in range(2)]
    from factories import write_schema

    write_schema(tmp_path / "schemas")
    folder = project(tmp_path / "p", (tmp_path / "schemas" / "feats" / "v1.py").read_text(), shards)
    make_wide_onnx(folder / "models" / "wide.onnx")
    stamp(folder, "models/wide.onnx", "wide:1")
    spec = yaml.safe_load((folder / "job.yaml").read_text())
    spec["model"]["challengers"] = [{"uri": "models/wide.onnx", "device": "cpu"}]
    (folder / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=folder)
    assert result.returncode == 0, result.stderr
    out = folder / "out" / f"dt={DS}"

    report = run_cli("diff", str(out), "--challenger", "wide", "--json", cwd=folder)
    assert report.returncode == 0, report.stderr
    found = json.loads(report.stdout)
    assert found["columns"]["y"] == {"differ": 0, "max_abs_diff": 0.0,
                                     "types": {"a": "float", "b": "double"}}
    assert found["columns"]["id"] == {"differ": 0, "max_abs_diff": 0.0}
    assert found["scores"]["y"]["rows"] == 2 * ROWS and found["scores"]["y"]["spearman"] == 1.0
    assert found["scores"]["y"]["abs_diff"]["max"] == 0.0 and found["top_movers"]["y"] == []
    assert found["identical"] is False   # the same values, but not the same files
    text = run_cli("diff", str(out), "--challenger", "wide", cwd=folder)
    assert text.returncode == 0, text.stderr
    assert "column y: 0 row(s) differ, max |A - B| 0 (types differ: A float, B double)" in text.stdout
    assert "score y: spearman 1;" in text.stdout and text.stdout.rstrip().endswith("verdict: different")


def test_columns_of_other_widths_compare_by_value():
    from batchinfer.commands.diff import _column_difference, _kind

    def column(values, arrow_type):
        return pa.chunked_array([pa.array(values, arrow_type)])

    assert _column_difference(column([1, 2, None], pa.int32()), column([1, 3, None], pa.int64())) == (1, 1.0)
    assert _column_difference(column([0.1, float("nan")], pa.float32()),
                              column([0.1, float("nan")], pa.float64()))[0] == 1  # 0.1f ≠ 0.1
    assert _column_difference(column([0.5, float("nan")], pa.float32()),
                              column([0.5, float("nan")], pa.float64())) == (0, 0.0)
    assert _column_difference(column(["a", "b"], pa.string()), column(["a", "c"], pa.large_string()))[0] == 1
    assert _column_difference(column(["1"], pa.string()), column([1], pa.int64())) == (1, None)
    assert (_kind(pa.float32(), pa.float64()), _kind(pa.int32(), pa.int64()),
            _kind(pa.int64(), pa.float64()), _kind(pa.string(), pa.large_string()),
            _kind(pa.string(), pa.int64())) == ("score", "label", "score", "label", None)
