"""The prediction file's first columns: the job's id columns, copied from the input, then the
model's outputs under their column names (``output.predictions``, else each output's own name).

Pure: Arrow and numpy, no I/O.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa

from ...rows.arrow_types import plain_array
from .scored import ScoredBatch
from .table import ColumnPart


class PredictionColumns(ColumnPart):
    """The part that writes the id and prediction columns of one model's files."""

    def __init__(self, id_columns: Sequence[str], prediction_names: dict[str, str] | None):
        self.id_columns = tuple(id_columns)
        self.prediction_names = prediction_names

    def columns(self, batch: ScoredBatch) -> dict[str, pa.Array]:
        assert batch.scored is not None, "a prediction file holds scored rows"
        columns: dict[str, pa.Array] = {}
        for column in self.id_columns:  # one type per column in every file of the partition
            columns[column] = plain_array(batch.scored.column(column))
        for output, column in self.names(batch.outputs).items():
            columns[column] = prediction_array(batch.outputs[output])
        return columns

    def names(self, outputs: dict[str, np.ndarray]) -> dict[str, str]:
        """Output name → its prediction column."""
        return self.prediction_names or {k: k for k in outputs}


def prediction_array(values: np.ndarray) -> pa.Array:
    """A model output as an Arrow column: [N] or [N, 1] → scalars, [N, K, ...] → fixed-size lists."""
    values = np.asarray(values)
    if values.ndim == 2 and values.shape[1] == 1:
        values = values[:, 0]
    if values.ndim <= 1:
        return pa.array(np.ascontiguousarray(values))
    flat = pa.array(np.ascontiguousarray(values).reshape(-1))
    for size in reversed(values.shape[1:]):
        flat = pa.FixedSizeListArray.from_arrays(flat, size)
    return flat
