"""pipeline/prepare.py: a preprocessing function that raises on every row is a fault of the
function (exit 2), one that raises on some rows has them quarantined — the two rules of
contract §6 "Preprocessing faults", at their edges. Rerun with
``.venv/bin/pytest tests/unit/test_preprocess_faults.py -q``.
"""
from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pytest

from batchinfer.errors import PreprocessError
from batchinfer.io.records import PreprocessStats
from batchinfer.pipeline.prepare import FAULT_MIN_ROWS, prepare_batch, preprocess_fault
from batchinfer.triple.preprocess import load_preprocessor
from batchinfer.triple.schemas import resolve_schema
from factories import write_schema

SOURCE = '''\
import numpy as np


def transform(batch):
    ids = batch.column("id").to_numpy()
    if (ids % 2 == 1).any():
        raise ValueError("odd id")
    if (ids >= 1_000_000).any():
        raise TypeError("big id")
    if (ids < 0).any():
        raise KeyError("negative")
    return np.stack([batch.column(f"f{i}").to_numpy() for i in range(4)], 1).astype(np.float32)
'''
_modules = itertools.count()


@pytest.fixture
def setup(tmp_path):
    write_schema(tmp_path / "schemas")
    schema = resolve_schema(tmp_path / "schemas", "feats@1")
    name = f"prep_faults_{next(_modules)}"
    (tmp_path / f"{name}.py").write_text(SOURCE)
    return schema, load_preprocessor(f"{name}:transform", tmp_path, [f"f{i}" for i in range(4)])


def batch_of(ids) -> pa.RecordBatch:
    ids = np.asarray(ids, np.int64)
    columns = {"id": ids, **{f"f{i}": np.zeros(len(ids), np.float32) for i in range(4)}}
    return pa.RecordBatch.from_pydict(columns)


def prepare(setup, ids):
    schema, preprocessor = setup
    return prepare_batch(batch_of(ids), schema, preprocessor, source_shard="s.parquet", first_row=0)


def test_a_batch_every_row_of_which_raises_one_type_is_a_fault(setup):
    with pytest.raises(PreprocessError) as info:
        prepare(setup, 2 * np.arange(FAULT_MIN_ROWS) + 1)             # every id odd
    line = str(info.value)
    assert "raised ValueError: odd id on a batch of 64 rows of s.parquet" in line, line
    assert "fault of the preprocessing" in line and info.value.exit_code == 2
    assert isinstance(info.value.__cause__, ValueError)             # --debug shows its traceback


def test_a_smaller_batch_is_quarantined_and_counted(setup):
    prepared = prepare(setup, 2 * np.arange(FAULT_MIN_ROWS - 1) + 1)  # the tail of a shard, say
    assert prepared.valid.num_rows == 0 and prepared.features is None
    assert sum(q.num_rows for q in prepared.quarantine) == FAULT_MIN_ROWS - 1
    assert prepared.stats.rows == 63 and prepared.stats.raised == {"ValueError": 63}
    assert prepared.stats.first == {"ValueError": "ValueError: odd id"}
    assert "in transform" in prepared.stats.trace and "ValueError: odd id" in prepared.stats.trace


def test_a_row_that_passes_or_two_types_are_rows_not_a_fault(setup):
    prepared = prepare(setup, [0] + [2 * i + 1 for i in range(100)])  # one row passes
    assert prepared.valid.num_rows == 1 and prepared.stats.raised == {"ValueError": 100}
    mixed = prepare(setup, [1, 3, 5] * 30 + [-2] * 10)               # ValueError and KeyError
    assert mixed.valid.num_rows == 0 and mixed.stats.raised == {"ValueError": 90, "KeyError": 10}
    reasons = {r for q in mixed.quarantine for r in q.column("_reason").to_pylist()}
    assert reasons == {"preprocessing failed: ValueError: odd id",
                       "preprocessing failed: KeyError: 'negative'"}


def test_the_threshold_rule_names_a_type_that_rejected_most_rows():
    def stats(rows, **raised):
        return PreprocessStats(rows, raised, {k: f"{k}: first" for k in raised})

    assert preprocess_fault(stats(100), "m:f") is None
    assert preprocess_fault(stats(100, ValueError=50), "m:f") is None          # half: rows
    line = preprocess_fault(stats(100, ValueError=51, KeyError=49), "m:f")
    assert line.startswith("preprocess m:f raised ValueError: first on 51 of the 100 rows"), line
    line = preprocess_fault(stats(7, TypeError=7), None)
    assert line.startswith("the default preprocessing (FEATURES as float32) raised TypeError: "
                           "first on every one of the 7 rows it was given"), line
    merged = stats(10, ValueError=3) + stats(20, ValueError=4, KeyError=16)
    assert merged.rows == 30 and merged.raised == {"ValueError": 7, "KeyError": 16}
    assert PreprocessStats.from_dict({"rows": 30, "raised": merged.raised, "first": merged.first}) == merged
