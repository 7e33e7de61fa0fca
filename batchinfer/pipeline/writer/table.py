"""A prediction file's table, from the parts that make its columns: each part adds its columns
(and, if it has any, its entries of the file's schema metadata), in the order the parts are
given — id and prediction columns, explanation columns, audit columns (contract §4).

Pure: Arrow, no I/O.
"""
from __future__ import annotations

from typing import Sequence

import pyarrow as pa

from .scored import ScoredBatch


class ColumnPart:
    """A part of the writer that adds columns to each prediction file."""

    def columns(self, batch: ScoredBatch) -> dict[str, pa.Array]:
        """Its columns for the batch's scored rows, in order."""
        raise NotImplementedError

    def metadata(self, batch: ScoredBatch) -> dict[str, str]:
        """What it adds to the file's schema metadata (most parts: nothing)."""
        return {}


def prediction_table(parts: Sequence[ColumnPart], batch: ScoredBatch) -> pa.Table:
    """The batch's prediction table: each part's columns, in the parts' order."""
    columns: dict[str, pa.Array] = {}
    metadata: dict[str, str] = {}
    for part in parts:
        columns.update(part.columns(batch))
        metadata.update(part.metadata(batch))
    table = pa.table(columns)
    return table.replace_schema_metadata(metadata) if metadata else table
