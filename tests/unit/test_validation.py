"""Tests for batchinfer.rows.validation and batchinfer.rows.quarantine (contract §4 quarantine, §5.1 accounting)."""
from __future__ import annotations

import json
import pickle
import warnings
from datetime import date, datetime, timezone
from decimal import Decimal

import numpy as np
import pandas as pd
import pandera.pandas as pdp
import pandera.polars as pap
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchinfer.errors import UsageError
from batchinfer.rows.quarantine import (
    QUARANTINE_SCHEMA,
    Failure,
    build_quarantine,
    empty_quarantine,
    values_json,
)
from batchinfer.rows.validation import (
    MAX_MESSAGE_CHARS,
    ValidationResult,
    compile_schema,
    quarantine_all,
    schema_columns,
    schema_kind,
    to_pandas_frame,
    validate_batch,
)

SHARD = "file:///data/dt=2024-01-01/part-0.parquet"
CATS = ["a", "b", "c"]


def strict_loads(text: str):
    """json.loads that refuses NaN/Infinity literals (strict JSON)."""

    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


# --- schemas: the same rules in both backends ----------------------------------------------


def polars_schema(strict=False, x_nullable=False):
    return pap.DataFrameSchema(
        {
            "id": pap.Column(pl.Int64, nullable=False),
            "x": pap.Column(pl.Float32, pap.Check.in_range(0, 10), nullable=x_nullable),
            "cat": pap.Column(pl.Utf8, pap.Check.isin(CATS), nullable=False),
        },
        strict=strict,
    )


def pandas_schema(strict=False, x_nullable=False):
    return pdp.DataFrameSchema(
        {
            "id": pdp.Column("Int64", nullable=False),
            "x": pdp.Column("float32", pdp.Check.in_range(0, 10), nullable=x_nullable),
            "cat": pdp.Column(str, pdp.Check.isin(CATS), nullable=False),
        },
        strict=strict,
    )


class PolarsModel(pap.DataFrameModel):
    id: pl.Int64 = pap.Field(nullable=False)
    x: pl.Float32 = pap.Field(in_range={"min_value": 0, "max_value": 10}, nullable=False)
    cat: pl.Utf8 = pap.Field(isin=CATS, nullable=False)


class PandasModel(pdp.DataFrameModel):
    id: pd.Int64Dtype = pdp.Field(nullable=False)
    x: np.float32 = pdp.Field(in_range={"min_value": 0, "max_value": 10}, nullable=False)
    cat: str = pdp.Field(isin=CATS, nullable=False)


SCHEMAS = {
    "polars": polars_schema,
    "pandas": pandas_schema,
    "polars-model": lambda strict=False: PolarsModel,
    "pandas-model": lambda strict=False: PandasModel,
}
BACKENDS = pytest.mark.parametrize("make_schema", list(SCHEMAS.values()), ids=list(SCHEMAS))
TWO_BACKENDS = pytest.mark.parametrize("make_schema", [polars_schema, pandas_schema], ids=["polars", "pandas"])


def make_batch(ids, xs, cats, **extra) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {
            "id": pa.array(ids, pa.int64()),
            "x": pa.array(xs, pa.float32()),
            "cat": pa.array(cats, pa.string()),
            **extra,
        }
    )


def same_rows(a: pa.RecordBatch, b: pa.RecordBatch) -> bool:
    """Equal schemas and values, NaN equal to NaN (RecordBatch.equals says NaN != NaN)."""
    if a.schema != b.schema or a.num_rows != b.num_rows:
        return False
    for x, y in zip(a.columns, b.columns):
        both_nan = pc.and_kleene(pc.is_nan(x), pc.is_nan(y)) if pa.types.is_floating(x.type) else None
        equal = pc.equal(x, y)
        if both_nan is not None:
            equal = pc.or_kleene(equal, both_nan)
        if x.is_null().to_pylist() != y.is_null().to_pylist():
            return False
        if pc.all(equal).as_py() is False:  # nulls (same places, checked above) are skipped
            return False
    return True


def check_accounting(result: ValidationResult, batch: pa.RecordBatch, first_row: int = 0) -> set[int]:
    """contract §5.1 for one batch; returns the quarantined row indices (within the batch)."""
    n = batch.num_rows
    assert isinstance(result.valid, pa.RecordBatch)
    assert result.valid_rows.dtype == np.int64
    assert np.all(np.diff(result.valid_rows) > 0)
    assert result.quarantine.schema == QUARANTINE_SCHEMA
    q_rows = np.asarray(result.quarantine.column("_source_row").to_pylist(), dtype=np.int64) - first_row
    assert len(set(q_rows.tolist())) == len(q_rows), "one quarantine row per bad input row"
    assert np.all(np.diff(q_rows) > 0), "quarantine rows in input order"
    assert not set(q_rows.tolist()) & set(result.valid_rows.tolist()), "a row is both valid and quarantined"
    assert sorted(q_rows.tolist() + result.valid_rows.tolist()) == list(range(n)), "a row went missing"
    # valid holds the ORIGINAL rows, untouched (same schema, same values).
    assert result.valid.schema == batch.schema
    expected_valid = batch.take(pa.array(result.valid_rows, pa.int64()))
    assert same_rows(result.valid, expected_valid)
    assert set(result.quarantine.column("_source_shard").to_pylist()) <= {SHARD}
    for row in result.quarantine.to_pylist():
        assert row["_reasons"], "every quarantine row has a failure"
        first = row["_reasons"][0]
        assert (row["_reason"], row["_column"], row["_check"]) == (first["message"], first["column"], first["check"])
        for reason in row["_reasons"]:
            assert "\n" not in reason["message"] and "\r" not in reason["message"]
            assert len(reason["message"]) <= MAX_MESSAGE_CHARS + 32
        values = strict_loads(row["_values"])
        assert list(values) == batch.schema.names
    return set(q_rows.tolist())


def reasons_of(result: ValidationResult, first_row: int = 0) -> dict[int, list[tuple]]:
    return {
        row["_source_row"] - first_row: [(r["column"], r["check"]) for r in row["_reasons"]]
        for row in result.quarantine.to_pylist()
    }


# --- the common cases -----------------------------------------------------------------------


@BACKENDS
def test_clean_batch_passes_untouched(make_schema):
    batch = make_batch([1, 2, 3], [0.0, 5.5, 10.0], ["a", "b", "c"])
    result = validate_batch(batch, make_schema(), source_shard=SHARD)
    assert result.valid.equals(batch)
    assert result.valid_rows.tolist() == [0, 1, 2]
    assert result.quarantine.num_rows == 0
    assert result.quarantine.schema == QUARANTINE_SCHEMA


@BACKENDS
def test_bad_values_each_quarantined_once(make_schema):
    inf = float("inf")
    batch = make_batch(
        [1, 2, 3, 4, 5, 6, 7, 8, 9],
        [1.0, None, float("nan"), inf, -inf, 10.5, -0.5, 2.0, 3.0],
        ["a", "a", "a", "a", "a", "a", "a", "zz", None],
    )
    result = validate_batch(batch, make_schema(), source_shard=SHARD)
    bad = check_accounting(result, batch)
    assert bad == {1, 2, 3, 4, 5, 6, 7, 8}
    assert result.valid_rows.tolist() == [0]
    reasons = reasons_of(result)
    assert reasons[1][0] == ("x", "not_nullable")
    assert reasons[2][0] == ("x", "not_nullable")  # NaN counts as null for nullable=False
    for row in (3, 4, 5, 6):
        assert reasons[row] == [("x", "in_range(0, 10)")]
    assert reasons[7] == [("cat", "isin(['a', 'b', 'c'])")]
    assert reasons[8] == [("cat", "not_nullable")]


@BACKENDS
def test_row_failing_several_checks_is_one_row_with_all_reasons(make_schema):
    batch = make_batch([None, 2], [float("nan"), 1.0], ["zz", "a"])
    result = validate_batch(batch, make_schema(), source_shard=SHARD)
    assert check_accounting(result, batch) == {0}
    checks = set(reasons_of(result)[0])
    assert {("id", "not_nullable"), ("x", "not_nullable"), ("cat", "isin(['a', 'b', 'c'])")} <= checks


@TWO_BACKENDS
def test_message_format(make_schema):
    batch = make_batch([1], [-3.0], ["a"])
    row = validate_batch(batch, make_schema(), source_shard=SHARD).quarantine.to_pylist()[0]
    assert row["_reason"] == "x: in_range(0, 10) failed for value -3.0"
    assert row["_column"] == "x" and row["_check"] == "in_range(0, 10)"


def test_int_message_format_both_backends():
    batch = pa.RecordBatch.from_pydict({"age": pa.array([30, -3], pa.int64())})
    for schema in (
        pap.DataFrameSchema({"age": pap.Column(pl.Int64, pap.Check.in_range(18, 100))}),
        pdp.DataFrameSchema({"age": pdp.Column("Int64", pdp.Check.in_range(18, 100))}),
    ):
        result = validate_batch(batch, schema, source_shard=SHARD)
        assert result.quarantine.column("_reason").to_pylist() == ["age: in_range(18, 100) failed for value -3"]


def test_polars_nan_fails_range_even_when_nullable():
    # pandera-polars: NaN is not null for checks, so a nullable column still rejects NaN.
    batch = make_batch([1, 2], [None, float("nan")], ["a", "a"])
    result = validate_batch(batch, polars_schema(x_nullable=True), source_shard=SHARD)
    assert check_accounting(result, batch) == {1}
    assert reasons_of(result)[1] == [("x", "in_range(0, 10)")]


def test_pandas_nan_is_null_when_nullable():
    # pandas conversion: null float → NaN, and pandera-pandas skips NaN in checks of nullable columns.
    batch = make_batch([1, 2], [None, float("nan")], ["a", "a"])
    result = validate_batch(batch, pandas_schema(x_nullable=True), source_shard=SHARD)
    assert check_accounting(result, batch) == set()


@TWO_BACKENDS
def test_nullable_int_column_with_null_only_fails_that_row(make_schema):
    batch = make_batch([1, None, 3], [1.0, 2.0, 3.0], ["a", "b", "c"])
    result = validate_batch(batch, make_schema(), source_shard=SHARD)
    assert check_accounting(result, batch) == {1}
    assert reasons_of(result) == {1: [("id", "not_nullable")]}  # no dtype failure: still an int column
    assert result.valid.column("id").type == pa.int64()


def test_nullable_int_column_allowed_nulls_pass_in_pandas():
    schema = pdp.DataFrameSchema({"n": pdp.Column("Int32", pdp.Check.ge(0), nullable=True)})
    batch = pa.RecordBatch.from_pydict({"n": pa.array([1, None, -1], pa.int32())})
    result = validate_batch(batch, schema, source_shard=SHARD)
    assert check_accounting(result, batch) == {2}


def test_pandas_conversion_rules():
    batch = pa.RecordBatch.from_pydict(
        {
            "i64": pa.array([1, None], pa.int64()),
            "i32": pa.array([1, None], pa.int32()),
            "u8": pa.array([1, None], pa.uint8()),
            "b": pa.array([True, None]),
            "f32": pa.array([1.5, None], pa.float32()),
            "f64": pa.array([float("nan"), None], pa.float64()),
            "s": pa.array(["x", None]),
        }
    )
    df = to_pandas_frame(batch)
    assert str(df["i64"].dtype) == "Int64" and df["i64"].isna().tolist() == [False, True]
    assert str(df["i32"].dtype) == "Int32"
    assert str(df["u8"].dtype) == "UInt8"
    assert str(df["b"].dtype) == "boolean"
    assert df["f32"].dtype == np.float32 and np.isnan(df["f32"].iloc[1])
    assert df["f64"].dtype == np.float64 and df["f64"].isna().all()  # null and NaN both NaN
    assert df["s"].dtype == pd.StringDtype(na_value=np.nan) and df["s"].isna().tolist() == [False, True]
    assert list(df.index) == [0, 1]


# --- column- and frame-level failures -------------------------------------------------------


@TWO_BACKENDS
def test_wrong_dtype_column_quarantines_every_row(make_schema):
    batch = pa.RecordBatch.from_pydict(
        {"id": pa.array([1.0, 2.0, 3.0]), "x": pa.array([1.0, 2.0, 3.0], pa.float32()), "cat": ["a", "b", "c"]}
    )
    result = validate_batch(batch, make_schema(), source_shard=SHARD)
    assert check_accounting(result, batch) == {0, 1, 2}
    for row in result.quarantine.to_pylist():
        assert row["_column"] == "id"
        assert row["_check"] == "dtype('Int64')"
        assert "id" in row["_reason"] and "\n" not in row["_reason"]


@TWO_BACKENDS
def test_missing_column_quarantines_every_row(make_schema):
    batch = pa.RecordBatch.from_pydict({"id": pa.array([1, 2], pa.int64()), "x": pa.array([1.0, 2.0], pa.float32())})
    result = validate_batch(batch, make_schema(), source_shard=SHARD)
    assert check_accounting(result, batch) == {0, 1}
    assert set(result.quarantine.column("_check").to_pylist()) == {"column_in_dataframe"}
    assert set(result.quarantine.column("_column").to_pylist()) == {"cat"}


@TWO_BACKENDS
def test_extra_column_strict_true_quarantines_every_row(make_schema):
    batch = make_batch([1, 2], [1.0, 2.0], ["a", "b"], extra=pa.array([7, 8]))
    result = validate_batch(batch, make_schema(strict=True), source_shard=SHARD)
    assert check_accounting(result, batch) == {0, 1}
    assert set(result.quarantine.column("_check").to_pylist()) == {"column_in_schema"}
    assert set(result.quarantine.column("_column").to_pylist()) == {"extra"}


@TWO_BACKENDS
def test_extra_column_strict_false_passes_through(make_schema):
    batch = make_batch([1, 2], [1.0, 20.0], ["a", "b"], extra=pa.array(["keep", "me"]))
    result = validate_batch(batch, make_schema(strict=False), source_shard=SHARD)
    assert check_accounting(result, batch) == {1}
    assert result.valid.schema.names == ["id", "x", "cat", "extra"]
    assert result.valid.column("extra").to_pylist() == ["keep"]
    assert strict_loads(result.quarantine.column("_values")[0].as_py())["extra"] == "me"


@TWO_BACKENDS
def test_frame_level_failures_come_first(make_schema):
    batch = make_batch([1, None], [1.0, 2.0], ["a", "b"], extra=pa.array([0, 0]))
    result = validate_batch(batch, make_schema(strict=True), source_shard=SHARD)
    assert check_accounting(result, batch) == {0, 1}
    reasons = reasons_of(result)
    assert reasons[0] == [("extra", "column_in_schema")]
    assert reasons[1] == [("extra", "column_in_schema"), ("id", "not_nullable")]


def boom(_):
    raise ValueError("kaboom\nsecond line")


@pytest.mark.parametrize(
    "schema",
    [
        pap.DataFrameSchema({"x": pap.Column(pl.Float64, pap.Check(boom))}),
        pdp.DataFrameSchema({"x": pdp.Column(float, pdp.Check(boom))}),
    ],
    ids=["polars", "pandas"],
)
def test_check_that_raises_fails_every_row(schema):
    batch = pa.RecordBatch.from_pydict({"x": pa.array([1.0, 2.0, 3.0])})
    result = validate_batch(batch, schema, source_shard=SHARD)
    assert check_accounting(result, batch) == {0, 1, 2}
    for row in result.quarantine.to_pylist():
        assert row["_check"] == "boom"
        assert "kaboom" in row["_reason"] and "\n" not in row["_reason"]


def test_check_that_raises_plus_row_failures_polars():
    schema = pap.DataFrameSchema(
        {"x": pap.Column(pl.Float64, pap.Check(boom)), "y": pap.Column(pl.Float64, pap.Check.ge(0))}
    )
    batch = pa.RecordBatch.from_pydict({"x": [1.0, 2.0], "y": [1.0, -1.0]})
    result = validate_batch(batch, schema, source_shard=SHARD)
    assert check_accounting(result, batch) == {0, 1}
    reasons = reasons_of(result)
    assert reasons[0] == [("x", "boom")]
    assert reasons[1] == [("x", "boom"), ("y", "greater_than_or_equal_to(0)")]


class ExplodingSchema(pap.DataFrameSchema):
    """A schema whose validation crashes outside pandera's failure reporting."""

    def validate(self, *args, **kwargs):
        raise RuntimeError("backend exploded\nwith detail")


def test_validation_crash_quarantines_every_row_instead_of_failing_the_job():
    schema = ExplodingSchema({"x": pap.Column(pl.Float64)})
    batch = pa.RecordBatch.from_pydict({"x": [1.0, 2.0]})
    result = validate_batch(batch, schema, source_shard=SHARD, first_row=10)
    assert check_accounting(result, batch, first_row=10) == {0, 1}
    row = result.quarantine.to_pylist()[0]
    assert row["_check"] == "validation_error" and row["_column"] is None
    assert "RuntimeError: backend exploded" in row["_reason"] and "\n" not in row["_reason"]


@pytest.mark.parametrize("backend", ["polars", "pandas"])
def test_dataframe_wide_check_row_level(backend):
    if backend == "polars":
        schema = pap.DataFrameSchema(
            {"a": pap.Column(pl.Float64), "b": pap.Column(pl.Float64)},
            checks=[pap.Check(lambda d: d.lazyframe.select(pl.col("a") < pl.col("b")), name="a_lt_b")],
        )
    else:
        schema = pdp.DataFrameSchema(
            {"a": pdp.Column(float), "b": pdp.Column(float)},
            checks=[pdp.Check(lambda d: d["a"] < d["b"], name="a_lt_b")],
        )
    batch = pa.RecordBatch.from_pydict({"a": [1.0, 2.0, 3.0], "b": [2.0, 1.0, 4.0]})
    result = validate_batch(batch, schema, source_shard=SHARD)
    assert check_accounting(result, batch) == {1}
    assert {check for _, check in reasons_of(result)[1]} == {"a_lt_b"}


def test_scalar_false_check_fails_every_row_pandas():
    schema = pdp.DataFrameSchema({"a": pdp.Column(float)}, checks=[pdp.Check(lambda d: False, name="never")])
    batch = pa.RecordBatch.from_pydict({"a": [1.0, 2.0]})
    result = validate_batch(batch, schema, source_shard=SHARD)
    assert check_accounting(result, batch) == {0, 1}
    assert set(result.quarantine.column("_check").to_pylist()) == {"never"}


def test_pandera_config_cannot_switch_data_checks_off():
    from pandera.config import ValidationDepth, config_context

    batch = make_batch([1, 2], [1.0, 99.0], ["a", "b"])
    with config_context(validation_depth=ValidationDepth.SCHEMA_ONLY):
        result = validate_batch(batch, polars_schema(), source_shard=SHARD)
    assert check_accounting(result, batch) == {1}


def test_coercing_schema_does_not_change_valid_rows():
    schema = pdp.DataFrameSchema({"n": pdp.Column(float, pdp.Check.ge(0), coerce=True)})
    batch = pa.RecordBatch.from_pydict({"n": pa.array([1, -2, 3], pa.int64())})
    result = validate_batch(batch, schema, source_shard=SHARD)
    assert check_accounting(result, batch) == {1}
    assert result.valid.column("n").type == pa.int64()
    assert result.valid.column("n").to_pylist() == [1, 3]


# --- offsets, empty batches, helpers ------------------------------------------------------


@BACKENDS
def test_first_row_offset_applied(make_schema):
    batch = make_batch([1, 2, 3], [1.0, 50.0, 2.0], ["a", "b", "c"])
    result = validate_batch(batch, make_schema(), source_shard=SHARD, first_row=65536)
    assert result.quarantine.column("_source_row").to_pylist() == [65537]
    assert result.valid_rows.tolist() == [0, 2]  # valid_rows stay batch-relative
    check_accounting(result, batch, first_row=65536)


@BACKENDS
def test_empty_batch(make_schema):
    batch = make_batch([], [], [])
    result = validate_batch(batch, make_schema(), source_shard=SHARD, first_row=5)
    assert result.valid.num_rows == 0 and result.valid.schema == batch.schema
    assert result.valid_rows.dtype == np.int64 and len(result.valid_rows) == 0
    assert result.quarantine.num_rows == 0 and result.quarantine.schema == QUARANTINE_SCHEMA


def test_empty_batch_with_missing_columns_quarantines_nothing():
    batch = pa.RecordBatch.from_pydict({"other": pa.array([], pa.int64())})
    result = validate_batch(batch, polars_schema(), source_shard=SHARD)
    assert result.valid.num_rows == 0 and result.quarantine.num_rows == 0


def test_schema_kind_and_columns():
    assert schema_kind(polars_schema()) == "polars"
    assert schema_kind(pandas_schema()) == "pandas"
    assert schema_kind(PolarsModel) == "polars"
    assert schema_kind(PandasModel) == "pandas"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pandera

        top_level = pandera.DataFrameSchema({"b": pandera.Column(int), "a": pandera.Column(float)})
    assert schema_kind(top_level) == "pandas"
    assert schema_columns(top_level) == ["b", "a"]
    assert schema_columns(polars_schema()) == ["id", "x", "cat"]
    assert schema_columns(PandasModel) == ["id", "x", "cat"]
    for bad in ({"x": int}, "credit@1", pdp.SeriesSchema(int), int, None):
        with pytest.raises(UsageError):
            schema_kind(bad)
        with pytest.raises(UsageError):
            validate_batch(make_batch([1], [1.0], ["a"]), bad, source_shard=SHARD)


def test_model_converted_once(monkeypatch):
    class Model(pap.DataFrameModel):
        v: pl.Float64 = pap.Field(ge=0)

    calls = []
    original = Model.to_schema

    def counting(cls):
        calls.append(cls)
        return original()

    monkeypatch.setattr(Model, "to_schema", classmethod(counting))
    batch = pa.RecordBatch.from_pydict({"v": [1.0, -1.0]})
    compiled = compile_schema(Model)      # what a job does, once per schema version
    for _ in range(3):
        result = validate_batch(batch, compiled, source_shard=SHARD)
        assert result.quarantine.num_rows == 1
    assert len(calls) == 1
    # it travels to Beam workers as the converted schema, and compiles there once
    clone = pickle.loads(pickle.dumps(compiled))
    assert validate_batch(batch, clone, source_shard=SHARD).quarantine.num_rows == 1
    assert clone.columns == ("v",) and len(calls) == 1


def test_quarantine_all():
    batch = make_batch([1, 2, 3], [1.0, 2.0, 3.0], ["a", "b", "c"])
    failures = [Failure("x", "dtype('Float64')", "x: dtype('Float64') failed: found float"),
                Failure(None, "shard", "bad")]
    table = quarantine_all(batch, failures, source_shard=SHARD, first_row=100)
    assert table.schema == QUARANTINE_SCHEMA
    assert table.column("_source_row").to_pylist() == [100, 101, 102]
    assert table.column("_check").to_pylist() == ["dtype('Float64')"] * 3
    assert table.column("_column").to_pylist() == ["x"] * 3
    for row in table.to_pylist():
        assert row["_reasons"] == [
            {"column": "x", "check": "dtype('Float64')", "message": "x: dtype('Float64') failed: found float"},
            {"column": None, "check": "shard", "message": "bad"},
        ]
    assert [strict_loads(v)["id"] for v in table.column("_values").to_pylist()] == [1, 2, 3]
    with pytest.raises(ValueError):
        quarantine_all(batch, [], source_shard=SHARD, first_row=0)
    assert quarantine_all(batch.slice(0, 0), failures, source_shard=SHARD, first_row=0).num_rows == 0


def test_build_quarantine_checks_lengths():
    batch = make_batch([1, 2], [1.0, 2.0], ["a", "b"])
    f = [Failure(None, "model", "non-finite output")]
    with pytest.raises(ValueError):
        build_quarantine(SHARD, np.array([0, 1]), [f], batch)
    with pytest.raises(ValueError):
        build_quarantine(SHARD, np.array([0, 1]), [f, []], batch)
    with pytest.raises(ValueError):
        build_quarantine(SHARD, np.array([0]), [f], batch)
    table = build_quarantine(SHARD, np.array([7, 9]), [f, f + [Failure("x", "c", "m")]], batch)
    assert table.column("_source_row").to_pylist() == [7, 9]
    assert [len(r) for r in table.column("_reasons").to_pylist()] == [1, 2]
    assert empty_quarantine().num_rows == 0 and empty_quarantine().schema == QUARANTINE_SCHEMA


# --- _values encoding -----------------------------------------------------------------------


def test_values_json_unicode_and_long_strings():
    long = "ü☃😀" * 4000 + "tail"
    tricky = 'quote " backslash \\ newline \n tab \t nul \x00 bell \x07 é'
    table = pa.table({"s": [long, tricky, "plain", None], "k": [1, 2, 3, 4]})
    out = values_json(table)
    assert [strict_loads(v) for v in out] == [
        {"s": long, "k": 1},
        {"s": tricky, "k": 2},
        {"s": "plain", "k": 3},
        {"s": None, "k": 4},
    ]
    assert "😀" in out[0]  # UTF-8, not \u-escaped
    assert all("\n" not in v for v in out)


def test_values_json_in_quarantine_row_for_long_unicode_value():
    long = "ß" * 5000
    batch = pa.RecordBatch.from_pydict({"cat": [long, "a"], "note": ["日本語 ✓", "x"]})
    schema = pap.DataFrameSchema({"cat": pap.Column(pl.Utf8, pap.Check.isin(CATS))})
    result = validate_batch(batch, schema, source_shard=SHARD)
    assert check_accounting(result, batch) == {0}
    row = result.quarantine.to_pylist()[0]
    assert strict_loads(row["_values"]) == {"cat": long, "note": "日本語 ✓"}
    assert len(row["_reason"]) < 400  # the failing value is truncated in the message


def test_values_json_floats_and_non_finite():
    table = pa.table(
        {
            "f32": pa.array([0.1, float("nan"), float("inf"), -float("inf"), 2.0, None], pa.float32()),
            "f64": pa.array([0.1, 1e-7, -0.0, 1e300, 123456789.0, 5e-324], pa.float64()),
        }
    )
    out = values_json(table)
    assert out == [
        '{"f32":0.1,"f64":0.1}',
        '{"f32":"NaN","f64":1e-7}',
        '{"f32":"Infinity","f64":-0.0}',
        '{"f32":"-Infinity","f64":1e+300}',
        '{"f32":2.0,"f64":123456789.0}',
        '{"f32":null,"f64":5e-324}',
    ]
    for v in out:
        strict_loads(v)
    # float values round-trip exactly at their width
    parsed = [strict_loads(v)["f64"] for v in out]
    assert parsed == table.column("f64").to_pylist()


def test_values_json_other_types():
    ts = datetime(2024, 1, 2, 3, 4, 5, 123456)
    table = pa.table(
        {
            "b": pa.array([True, None]),
            "u64": pa.array([2**64 - 1, None], pa.uint64()),
            "bin": pa.array([b"\x00\xffhi", None], pa.binary()),
            "d": pa.array([date(2024, 2, 29), None], pa.date32()),
            "ts": pa.array([ts, None], pa.timestamp("us")),
            "tsz": pa.array([datetime(2024, 1, 2, tzinfo=timezone.utc), None], pa.timestamp("ns", tz="Europe/Paris")),
            "dec": pa.array([Decimal("1.10"), None], pa.decimal128(5, 2)),
            "dur": pa.array([1500, None], pa.duration("ms")),
            "lst": pa.array([[1.5, float("nan")], None], pa.list_(pa.float64())),
            "st": pa.array([{"a": 1, "b": "x"}, None], pa.struct([("a", pa.int64()), ("b", pa.string())])),
            "mp": pa.array([[("k", 1)], None], pa.map_(pa.string(), pa.int64())),
            "dic": pa.array(["red", None]).dictionary_encode(),
            "nul": pa.nulls(2),
            "ls": pa.array(["big", None], pa.large_string()),
            "fsl": pa.array([[1, 2], None], pa.list_(pa.int32(), 2)),
        }
    )
    out = values_json(table)
    first = strict_loads(out[0])
    assert first == {
        "b": True,
        "u64": 2**64 - 1,
        "bin": "AP9oaQ==",
        "d": "2024-02-29",
        "ts": "2024-01-02T03:04:05.123456",
        "tsz": "2024-01-02T00:00:00.000000000Z",
        "dec": "1.10",
        "dur": 1500,
        "lst": [1.5, "NaN"],
        "st": {"a": 1, "b": "x"},
        "mp": [["k", 1]],
        "dic": "red",
        "nul": None,
        "ls": "big",
        "fsl": [1, 2],
    }
    assert list(first) == table.schema.names  # column order kept
    assert set(strict_loads(out[1]).values()) == {None}
    assert values_json(table) == out  # deterministic


def test_values_json_record_batch_and_sliced_chunked_inputs():
    table = pa.concat_tables([pa.table({"a": [1, 2]}), pa.table({"a": [3, 4]})])
    assert values_json(table.slice(1, 2)) == ['{"a":2}', '{"a":3}']
    batch = pa.RecordBatch.from_pydict({"a": [[1], [2, 3], None]})
    assert values_json(batch.slice(1)) == ['{"a":[2,3]}', '{"a":null}']
    assert values_json(pa.table({"a": pa.array([], pa.int64())})) == []


# --- property: accounting holds on random data with random mutations -----------------------

MUTATIONS = ["none", "null_id", "null_x", "nan_x", "inf_x", "neg_inf_x", "big_x", "neg_x", "null_cat", "bad_cat"]
FRAME_MUTATIONS = ["none", "drop_cat", "extra_strict", "extra_lax", "x_as_float64"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(
        st.tuples(
            st.integers(-(2**40), 2**40),
            st.floats(0, 10, width=32),
            st.sampled_from(CATS),
            st.sampled_from(MUTATIONS),
        ),
        max_size=40,
    ),
    frame_mutation=st.sampled_from(FRAME_MUTATIONS),
    backend=st.sampled_from(["polars", "pandas"]),
    first_row=st.integers(0, 2**40),
)
def test_property_accounting(rows, frame_mutation, backend, first_row):
    ids, xs, cats, expected_bad = [], [], [], set()
    for i, (id_, x, cat, mutation) in enumerate(rows):
        x = {
            "null_x": None,
            "nan_x": float("nan"),
            "inf_x": float("inf"),
            "neg_inf_x": -float("inf"),
            "big_x": 10.5,
            "neg_x": -0.25,
        }.get(mutation, x)
        ids.append(None if mutation == "null_id" else id_)
        xs.append(x)
        cats.append({"null_cat": None, "bad_cat": "zzz"}.get(mutation, cat))
        if mutation != "none":
            expected_bad.add(i)
    extra = {}
    if frame_mutation in ("extra_strict", "extra_lax"):
        extra["extra"] = pa.array(list(range(len(rows))), pa.int64())
    batch = make_batch(ids, xs, cats, **extra)
    if frame_mutation == "drop_cat":
        batch = batch.drop_columns(["cat"])
    if frame_mutation == "x_as_float64":
        batch = batch.set_column(1, "x", batch.column("x").cast(pa.float64()))
    if frame_mutation in ("drop_cat", "extra_strict", "x_as_float64"):
        expected_bad = set(range(len(rows)))
    make = polars_schema if backend == "polars" else pandas_schema
    result = validate_batch(batch, make(strict=frame_mutation == "extra_strict"), source_shard=SHARD,
                            first_row=first_row)
    assert check_accounting(result, batch, first_row=first_row) == expected_bad
    for row in result.quarantine.to_pylist():
        values = strict_loads(row["_values"])
        i = row["_source_row"] - first_row
        assert values["id"] == batch.column("id")[i].as_py()
        x = batch.column("x")[i].as_py()
        if x is None or np.isfinite(x):
            assert values["x"] == (None if x is None else pytest.approx(x, rel=1e-6))
        else:
            assert values["x"] == ("NaN" if np.isnan(x) else "Infinity" if x > 0 else "-Infinity")


def test_scalar_false_check_with_row_failures_polars_never_crashes():
    # pandera-polars may fail to combine a boolean frame-level failure with string ones;
    # either way every row must be accounted for, all of them quarantined.
    schema = pap.DataFrameSchema(
        {"a": pap.Column(pl.Float64, pap.Check.ge(0))}, checks=[pap.Check(lambda d: False, name="never")]
    )
    batch = pa.RecordBatch.from_pydict({"a": [1.0, -1.0, 2.0]})
    result = validate_batch(batch, schema, source_shard=SHARD)
    assert check_accounting(result, batch) == {0, 1, 2}
    assert set(result.quarantine.column("_check").to_pylist()) <= {"never", "validation_error"}


@pytest.mark.parametrize("backend", ["polars", "pandas"])
def test_optional_columns_a_batch_lacks_are_added_as_nulls_of_the_schema_type(backend):
    """A column the schema declares ``required=False`` that the batch lacks passes (pandera's
    rule), and ``valid`` holds it as an all-null column of the schema's plain Arrow type; the
    quarantine keeps the rows as they were read."""
    if backend == "polars":
        schema = pap.DataFrameSchema({
            "id": pap.Column(pl.Int64, pap.Check.ge(0)),
            "w": pap.Column(pl.Float32, required=False),          # nullable=False: not checked
            "s": pap.Column(pl.String, required=False, nullable=True),
            "t": pap.Column(pl.Datetime("us", "UTC"), required=False, nullable=True),
            "n": pap.Column(pl.Int64, required=False, nullable=True),
        })
        types = {"w": pa.float32(), "s": pa.string(), "t": pa.timestamp("us", tz="UTC"), "n": pa.int64()}
    else:
        schema = pdp.DataFrameSchema({
            "id": pdp.Column("Int64", pdp.Check.ge(0)),
            "w": pdp.Column("float32", required=False),
            "s": pdp.Column(str, required=False, nullable=True),
            "t": pdp.Column(required=False, nullable=True),       # no dtype: a null column
            "n": pdp.Column("Int64", required=False, nullable=True),
        })
        types = {"w": pa.float32(), "s": pa.string(), "t": pa.null(), "n": pa.int64()}
    batch = pa.RecordBatch.from_pydict({"id": pa.array([1, -2, 3], pa.int64()),
                                        "n": pa.array([None, 5, 6], pa.int64())})
    for _ in range(2):   # the second batch of this structure may skip pandera (the pre-check)
        result = validate_batch(batch, schema, source_shard=SHARD)
        assert result.valid_rows.tolist() == [0, 2]
        assert result.valid.schema.names == ["id", "n", "w", "s", "t"]
        for name, arrow_type in types.items():
            assert result.valid.schema.field(name).type == arrow_type, name
        assert result.valid.column("w").null_count == 2 and result.valid.column("n").to_pylist() == [None, 6]
        assert strict_loads(result.quarantine.column("_values")[0].as_py()) == {"id": -2, "n": 5}
    compiled = compile_schema(schema)
    clean = pa.RecordBatch.from_pydict({"id": pa.array([1], pa.int64())})
    assert validate_batch(clean, compiled, source_shard=SHARD).valid.num_columns == 5
    # pandera passed this structure once: the pre-check proves the next such batch clean
    assert compiled.precheck.clean(clean)
    assert validate_batch(clean, compiled, source_shard=SHARD).valid.num_columns == 5
    assert validate_batch(clean.slice(0, 0), compiled, source_shard=SHARD).valid.num_columns == 5
