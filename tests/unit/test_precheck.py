"""The pre-check may only ever say "clean" for batches pandera passes in full (soundness), and
should say it for ordinary clean data (else it buys nothing)."""
from __future__ import annotations

import math

import numpy as np
import pandera.pandas as ppd
import pandera.polars as ppl
import polars as pl
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from batchinfer.rows.precheck import Precheck
from batchinfer.rows.validation import validate_batch

BOUNDS = [0.1, -0.1, 1.0, 0.0, 1e-7, 3.4028234e38, 2.5]
SPECIAL = [0.1, -0.1, 1.0, 0.0, -0.0, 1e-7, np.float32(0.1).item(), np.nextafter(0.1, 1),
           np.nextafter(0.1, 0), math.inf, -math.inf, math.nan, None, 2.5, 3.0]


def pandera_passes(schema, batch: pa.RecordBatch, kind: str) -> bool:
    frame = pl.from_arrow(batch) if kind == "polars" else batch.to_pandas()
    errors = ppl.errors.SchemaErrors if kind == "polars" else ppd.errors.SchemaErrors
    try:
        schema.validate(frame, lazy=True)
        return True
    except errors:
        return False


def make_check(module, name, a, b, inc_lo, inc_hi):
    lo, hi = min(a, b), max(a, b)
    assume(lo < hi or (name != "in_range"))
    return {
        "in_range": lambda: module.Check.in_range(lo, hi, include_min=inc_lo, include_max=inc_hi),
        "ge": lambda: module.Check.ge(a), "gt": lambda: module.Check.gt(a),
        "le": lambda: module.Check.le(a), "lt": lambda: module.Check.lt(a),
    }[name]()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.lists(st.sampled_from(SPECIAL) | st.floats(-5, 5, width=32), min_size=1, max_size=12),
       width=st.sampled_from([32, 64]), check=st.sampled_from(["in_range", "ge", "gt", "le", "lt"]),
       a=st.sampled_from(BOUNDS), b=st.sampled_from(BOUNDS), inc_lo=st.booleans(),
       inc_hi=st.booleans(), nullable=st.booleans(), kind=st.sampled_from(["polars", "pandas"]))
def test_clean_implies_pandera_passes_for_floats(values, width, check, a, b, inc_lo, inc_hi,
                                                 nullable, kind):
    arrow_type = pa.float32() if width == 32 else pa.float64()
    batch = pa.record_batch({"x": pa.array(values, arrow_type)})
    if kind == "polars":
        dtype = pl.Float32 if width == 32 else pl.Float64
        schema = ppl.DataFrameSchema({"x": ppl.Column(dtype, checks=make_check(ppl, check, a, b, inc_lo, inc_hi),
                                                      nullable=nullable)})
    else:
        dtype = "float32" if width == 32 else "float64"
        schema = ppd.DataFrameSchema({"x": ppd.Column(dtype, checks=make_check(ppd, check, a, b, inc_lo, inc_hi),
                                                      nullable=nullable)})
    pre = Precheck(schema)
    pre.structure_ok(batch)  # structure proven elsewhere; here only the data checks are judged
    if pre.clean(batch):
        assert pandera_passes(schema, batch, kind), (values, check, a, b)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(-20, 20) | st.none(), min_size=1, max_size=12),
       allowed=st.sets(st.integers(-20, 20), max_size=8), lo=st.integers(-20, 20),
       nullable=st.booleans())
def test_clean_implies_pandera_passes_for_ints_and_isin(values, allowed, lo, nullable):
    batch = pa.record_batch({"n": pa.array(values, pa.int64())})
    schema = ppl.DataFrameSchema({"n": ppl.Column(pl.Int64, nullable=nullable, checks=[
        ppl.Check.ge(lo), ppl.Check.isin(sorted(allowed) or [0])])})
    pre = Precheck(schema)
    pre.structure_ok(batch)
    if pre.clean(batch):
        assert pandera_passes(schema, batch, "polars"), values


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.text(max_size=6) | st.none(), min_size=1, max_size=10),
       length=st.integers(0, 4))
def test_clean_implies_pandera_passes_for_strings(values, length):
    batch = pa.record_batch({"s": pa.array(values, pa.string())})
    schema = ppl.DataFrameSchema({"s": ppl.Column(pl.Utf8, nullable=True,
                                                  checks=ppl.Check.str_length(0, length))})
    pre = Precheck(schema)
    pre.structure_ok(batch)
    if pre.clean(batch):
        assert pandera_passes(schema, batch, "polars"), values


def clean_batch(n=1000):
    rng = np.random.default_rng(0)
    return pa.record_batch({"id": np.arange(n, dtype=np.int64),
                            "x": rng.uniform(-1, 1, n).astype(np.float32),
                            "s": pa.array(["a", "b"] * (n // 2))})


SCHEMA = ppl.DataFrameSchema({"id": ppl.Column(pl.Int64), "x": ppl.Column(pl.Float32, ppl.Check.in_range(-1, 1)),
                              "s": ppl.Column(pl.Utf8, ppl.Check.isin(["a", "b"]))}, strict=True)


def test_clean_data_is_proven_clean_after_one_pandera_run():
    batch = clean_batch()
    pre = Precheck(SCHEMA)
    assert pre.enabled
    assert not pre.clean(batch), "structure must be proven by pandera first"
    result = validate_batch(batch, SCHEMA, source_shard="s")  # runs pandera, records structure
    assert result.quarantine.num_rows == 0
    pre.structure_ok(batch)
    assert pre.clean(batch)


@pytest.mark.parametrize("mutate", [
    lambda b: b.set_column(1, "x", pa.array([float("nan")] + [0.0] * (b.num_rows - 1), pa.float32())),
    lambda b: b.set_column(1, "x", pa.array([2.0] + [0.0] * (b.num_rows - 1), pa.float32())),
    lambda b: b.set_column(0, "id", pa.array([None] + list(range(1, b.num_rows)), pa.int64())),
    lambda b: b.set_column(2, "s", pa.array(["c"] + ["a"] * (b.num_rows - 1))),
])
def test_any_bad_value_is_not_called_clean(mutate):
    pre = Precheck(SCHEMA)
    batch = mutate(clean_batch())
    pre.structure_ok(batch)
    assert not pre.clean(batch)


def test_schemas_with_custom_checks_are_never_prechecked():
    positive = ppl.Check(lambda d: d.lazyframe.select(pl.col("x") > 0))
    custom = ppl.DataFrameSchema({"x": ppl.Column(pl.Float32, positive)})
    assert not Precheck(custom).enabled
    unique = ppl.DataFrameSchema({"x": ppl.Column(pl.Float32, unique=True)})
    assert not Precheck(unique).enabled


def test_validation_results_are_identical_with_and_without_the_precheck():
    # Same partition of rows either way: the pre-check only skips work.
    batch = clean_batch()
    bad = batch.set_column(1, "x", pa.array([5.0] * 3 + [0.0] * (batch.num_rows - 3), pa.float32()))
    for b in (batch, bad, batch):
        result = validate_batch(b, SCHEMA, source_shard="s")
        assert result.valid.num_rows + result.quarantine.num_rows == b.num_rows
    assert validate_batch(bad, SCHEMA, source_shard="s").quarantine.num_rows == 3
