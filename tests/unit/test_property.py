"""Property: the accounting invariant (contract §5.1) holds on any input (§5.5).

Schema-driven data (id Int64, f0..f3 Float32 in [-10, 10]) plus mutations — nulls, NaN, ±inf,
out-of-range values, wrong column types, missing and extra columns, empty shards, garbage,
zero-byte and truncated files — checked at two levels:

- the pure layers (``validate_batch``, ``fold_shard``), many examples;
- whole jobs in-process (``load_job`` + ``run_job`` on the DirectRunner), about 15 examples.
  MLflow is replaced by a stub there: tracking is not what is tested, and its helper process
  would cost seconds per example.

Rerun with ``.venv/bin/pytest tests/unit/test_property.py -q``.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from factories import DS, NoTracking, make_mlp_onnx, read_partition, write_job, write_schema

COLUMNS = ["id", "f0", "f1", "f2", "f3"]
BAD_VALUES = [None, math.nan, math.inf, -math.inf, 10.5, -11.0, 1e30]
GOOD_VALUES = [0.0, -10.0, 10.0, 2.5, -0.0]

mutation = st.tuples(st.integers(0, 10_000), st.sampled_from(COLUMNS),
                     st.sampled_from(BAD_VALUES + GOOD_VALUES))
shard_kind = st.sampled_from(["rows", "rows", "rows", "rows", "wrong_type", "missing_column",
                              "extra_column", "empty", "garbage", "zero_bytes", "truncated"])
shard_spec = st.fixed_dictionaries({
    "kind": shard_kind,
    "rows": st.integers(0, 60),
    "seed": st.integers(0, 2**16),
    "mutations": st.lists(mutation, max_size=12),
})


def is_bad(column: str, value) -> bool:
    if value is None:
        return True
    if column == "id":
        return False
    return not (-10 <= value <= 10)      # NaN compares False: bad too


def build(spec: dict) -> tuple[pa.Table | None, bytes | None, set[int]]:
    """(table, raw bytes, bad rows) for one shard spec; raw bytes for unreadable kinds."""
    n, kind = spec["rows"], spec["kind"]
    rng = np.random.default_rng(spec["seed"])
    cols = {"id": [int(i) for i in range(n)]}
    x = np.clip(rng.standard_normal((n, 4)), -3, 3).astype(np.float32)
    cols.update({f"f{i}": [float(v) for v in x[:, i]] for i in range(4)})
    bad: set[int] = set()
    if kind == "rows" and n:
        for row, column, value in spec["mutations"]:
            row %= n
            if column == "id" and value is not None:
                value = -7 * row - 1          # any non-null id is valid
            cols[column][row] = value
        bad = {r for r in range(n) if any(is_bad(c, cols[c][r]) for c in COLUMNS)}
    types = {"id": pa.int64(), **{f"f{i}": pa.float32() for i in range(4)}}
    table = pa.table({c: pa.array(v, types[c]) for c, v in cols.items()})
    if kind == "wrong_type":
        table = table.set_column(2, "f1", table["f1"].cast(pa.float64()))
    elif kind == "missing_column":
        table = table.drop_columns(["f2"])
    elif kind == "extra_column":
        table = table.append_column("extra", pa.array([1] * n, pa.int32()))
    elif kind == "empty":
        table = table.slice(0, 0)
    if kind in ("wrong_type", "missing_column", "extra_column"):
        bad = set(range(table.num_rows))
    if kind == "garbage":
        return None, bytes(rng.integers(0, 256, 64 + n, dtype=np.uint8)), set()
    if kind == "zero_bytes":
        return None, b"", set()
    if kind == "truncated":
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        data = sink.getvalue().to_pybytes()
        return None, data[: len(data) // 2], set()
    return table, None, bad


# -- the pure layers -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def schema(tmp_path_factory):
    from batchinfer.triple.schemas import resolve_schema

    root = tmp_path_factory.mktemp("prop_schema")
    write_schema(root)
    return resolve_schema(root, "feats@1")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=shard_spec.filter(lambda s: s["kind"] not in ("garbage", "zero_bytes", "truncated")),
       first_row=st.integers(0, 10**9))
def test_validate_batch_splits_every_row_exactly_once(schema, spec, first_row):
    from batchinfer.rows.validation import validate_batch

    table, _, bad = build(spec)
    n = table.num_rows
    batches = table.to_batches() or [pa.RecordBatch.from_pylist([], schema=table.schema)]
    batch = pa.concat_batches(batches) if len(batches) > 1 else batches[0]
    result = validate_batch(batch, schema.schema, source_shard="s", first_row=first_row)
    q = result.quarantine
    assert result.valid.num_rows + q.num_rows == n
    assert result.valid.num_rows == len(result.valid_rows)
    quarantined = (np.asarray(q["_source_row"].to_pylist(), dtype=np.int64) - first_row).tolist()
    assert len(quarantined) == len(set(quarantined))           # one row per bad input row
    assert set(quarantined) == bad
    assert sorted(quarantined + result.valid_rows.tolist()) == list(range(n))
    assert result.valid.equals(batch.take(pa.array(result.valid_rows, pa.int64())))
    for row in q.to_pylist():
        assert row["_source_shard"] == "s" and row["_reason"] and row["_check"]
        assert row["_reasons"] and row["_reasons"][0]["message"] == row["_reason"]
        values = json.loads(row["_values"])
        assert list(values) == batch.schema.names
        assert values["id"] == batch["id"][row["_source_row"] - first_row].as_py()


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 50), min_size=0, max_size=8), data=st.data())
def test_fold_shard_accounts_or_refuses(sizes, data):
    """A shard entry from batch records: rows_in = scored + quarantined when every batch
    reported; a missing or inconsistent batch record is an error, never a silent drop."""
    from batchinfer.io.records import FileRecord
    from batchinfer.pipeline.shard_reports import BatchRecord, ShardInfo, fold_shard

    batches = []
    for number, size in enumerate(sizes):
        q = data.draw(st.integers(0, size))
        files = ((FileRecord(f"predictions/a/part-00000-{number:05d}.parquet", size - q, "x"),)
                 if size - q else ())
        batches.append(BatchRecord(batch=number, rows_in=size, rows_scored=size - q,
                                   rows_quarantined=q, files=files, first_reason="r" if q else None))
    info = ShardInfo("abc", sum(sizes))
    order = data.draw(st.permutations(batches + [info]))
    entry = fold_shard("s", order).record
    assert entry.rows_in == entry.rows_scored + entry.rows_quarantined == sum(sizes)
    assert entry.status == ("empty" if not sum(sizes) else
                            "quarantined" if not entry.rows_scored else "scored")
    assert [f.path for f in entry.files] == [f.path for b in batches for f in b.files]
    nonempty = [b for b in batches if b.rows_in]
    if nonempty:
        dropped = data.draw(st.sampled_from(nonempty))
        with pytest.raises(RuntimeError, match="accounting failed"):
            fold_shard("s", [r for r in order if r is not dropped])
    unreadable = ShardInfo("abc", None, "corrupt")
    entry = fold_shard("s", [r if r is not info else unreadable for r in order]).record
    assert entry.status == "unreadable" and entry.rows_in is None and entry.files == ()


# -- whole jobs, in-process ----------------------------------------------------------------------



@pytest.fixture(scope="module")
def project(tmp_path_factory):
    from batchinfer.commands.stamp import stamp
    from batchinfer.spec import load_job

    folder = tmp_path_factory.mktemp("prop_jobs")
    write_schema(folder / "schemas")
    make_mlp_onnx(folder / "models" / "model.onnx")
    job = write_job(folder, batch={"rows": 16},
                    quarantine={"max_bad_fraction": 1.0, "max_bad_shards": 100})
    stamp(load_job(job, require_ds=False), None, "model:1")
    return folder, job


counter = itertools.count()


@pytest.fixture(scope="module")
def no_tracking():
    import batchinfer.io.tracking

    mp = pytest.MonkeyPatch()
    mp.setattr(batchinfer.io.tracking, "TrackingRun", NoTracking)
    yield
    mp.undo()


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(shards=st.lists(shard_spec, min_size=1, max_size=4))
def test_any_input_keeps_the_accounting_invariant(project, no_tracking, shards):
    from batchinfer.commands.run import run_job
    from batchinfer.spec import load_job

    folder, job = project
    n = next(counter)
    data = folder / "data" / f"ex{n}"
    data.mkdir(parents=True)
    expected = {}
    for i, spec in enumerate(shards):
        table, raw, bad = build(spec)
        path = data / f"part-{i:05d}.parquet"
        if raw is not None:
            path.write_bytes(raw)
        else:
            pq.write_table(table, path)
        expected[str(path)] = (spec["kind"], table.num_rows if table is not None else None, bad)
        event(f"shard kind {spec['kind']}" + (" with bad rows" if bad and spec["kind"] == "rows" else ""))
    out = folder / "out" / f"ex{n}"
    outcome = run_job(load_job(job, ds=DS, overrides=[f"input.path={data}/*.parquet",
                                                       f"output.path={out}"]))
    assert outcome.status == "committed", outcome.message
    preds, quar, manifest = read_partition(out)

    # per shard: status, counts, and exactly the expected rows quarantined
    assert sorted(s["path"] for s in manifest["shards"]) == sorted(expected)
    listed = set()
    for shard in manifest["shards"]:
        kind, rows, bad = expected[shard["path"]]
        for f in shard["files"]:
            assert hashlib.sha256((out / f["path"]).read_bytes()).hexdigest() == f["sha256"]
            listed.add(f["path"])
        if rows is None:
            assert shard["status"] == "unreadable" and shard["rows_in"] is None
            assert shard["files"] == [] and shard["reason"]
            continue
        assert shard["rows_in"] == rows == shard["rows_scored"] + shard["rows_quarantined"]
        assert shard["rows_quarantined"] == len(bad)
        assert shard["status"] == ("empty" if rows == 0 else "quarantined" if len(bad) == rows
                                   else "scored")
        mine = [r for s, r in zip(quar["_source_shard"].to_pylist(), quar["_source_row"].to_pylist())
                if s == shard["path"]] if quar.num_rows else []
        assert set(mine) == bad
    totals = manifest["totals"]
    assert totals["shards_unreadable"] == sum(v[1] is None for v in expected.values())
    assert totals["rows_scored"] == preds.num_rows and totals["rows_quarantined"] == quar.num_rows
    keys = []
    for table in (preds, quar):
        if table.num_rows:
            keys += zip(table["_source_shard"].to_pylist(), table["_source_row"].to_pylist())
    assert len(keys) == len(set(keys))
    assert set(keys) == {(p, i) for p, (_, rows, _) in expected.items() if rows for i in range(rows)}
    if preds.num_rows:
        assert np.isfinite(preds["y"].to_numpy()).all()
    on_disk = {str(p.relative_to(out)) for k in ("predictions", "quarantine") if (out / k).exists()
               for p in (out / k).rglob("*") if p.is_file()}
    assert on_disk == listed and not (out / "_tmp").exists()
