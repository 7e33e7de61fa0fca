"""The prediction file's audit columns (contract §4), last, in the order rows/columns.py
declares them: where each row came from, its input hash, the model's triple, the inference and
the model's time.

A column's name, Arrow type, encoding and whether ``diff`` compares it are declared in
``rows/columns.py`` (``AUDIT``); what it holds is computed here, one entry per column in
:meth:`AuditColumns.values`. ``tests/unit/test_output_columns.py`` holds the two to each other.

Pure: Arrow and numpy, no I/O.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from ...rows.columns import AUDIT, COMPUTE_MS, INFERENCE_ID, INPUT_HASH, SOURCE_ROW, SOURCE_SHARD, TRIPLE
from ...triple.contract import Triple
from .scored import ScoredBatch
from .table import ColumnPart


class AuditColumns(ColumnPart):
    """The part that writes one model's audit columns.

    ``attempt``: this run's attempt id, in each row's ``_inference_id``; ``triple``: the model's
    (the champion's, or a challenger's own)."""

    def __init__(self, attempt: str, triple: Triple):
        self.attempt = attempt
        self.triple = triple
        self._parts = tuple(triple.as_dict().items())   # once, not per batch (dataclasses.asdict)

    def columns(self, batch: ScoredBatch) -> dict[str, pa.Array]:
        values = self.values(batch)
        return {column.name: values[column.name] for column in AUDIT}

    def values(self, batch: ScoredBatch) -> dict[str, pa.Array]:
        """Each audit column's values for the batch's scored rows, by column name."""
        n = int(batch.ok.size)
        inference_id = f"{self.attempt}-{batch.shard:05d}-{batch.number:05d}"
        return {
            SOURCE_SHARD.name: pa.repeat(batch.shard_name, n).cast(pa.string()),
            SOURCE_ROW.name: pa.array(batch.payload.source_rows[batch.ok], pa.int64()),
            INPUT_HASH.name: batch.input_hash,
            **{TRIPLE[part].name: constant(value, n) for part, value in self._parts},
            INFERENCE_ID.name: pa.repeat(inference_id, n).cast(pa.string()),
            COMPUTE_MS.name: pa.repeat(float(batch.inference.compute_ms), n).cast(pa.float64()),
        }


def constant(value: str, n: int) -> pa.Array:
    """``n`` rows of one string, dictionary-encoded: one value per batch (the triple's)."""
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)), pa.array([value]))
