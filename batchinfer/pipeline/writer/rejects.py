"""What becomes of a batch's rejected rows: the champion quarantines them — the rows its model
raised on or gave non-finite outputs for, beside those the batch rejected before the model
(schema, preprocessing) — in one quarantine file sorted by ``_source_row``, counted by failed
column and check; a challenger only counts the rows its model rejected (the input rows are the
champion's business, and a challenger never changes what the partition commits).

Pure: Arrow and numpy, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ...rows.columns import CHECK, FAILED_COLUMN, REASON, SOURCE_ROW
from ...rows.quarantine import Failure, build_quarantine
from .scored import ScoredBatch


@dataclass(frozen=True)
class Rejected:
    """A batch's rejected rows, as its policy keeps them.

    Attributes:
        rows: how many (quarantined: with those rejected before the model).
        first_reason: the first one's reason, in row order (None: none).
        table: the quarantine file's rows (None: nothing to write).
        by_check: rows quarantined by (failed column, check).
    """

    rows: int = 0
    first_reason: str | None = None
    table: pa.Table | None = None
    by_check: dict[tuple[str | None, str], int] = field(default_factory=dict)


def quarantined(batch: ScoredBatch) -> Rejected:
    """Every row of the batch rejected before or by the model, as quarantine rows."""
    quarantine = list(batch.payload.quarantine)
    if batch.failed:
        rows = np.array([r for r, _ in batch.failed], dtype=np.int64)
        quarantine.append(build_quarantine(
            batch.shard_name, batch.payload.source_rows[rows],
            [[Failure(None, "model", msg)] for _, msg in batch.failed],
            batch.payload.valid.take(pa.array(rows))))
    if not quarantine:
        return Rejected()
    table = pa.concat_tables(quarantine).sort_by(SOURCE_ROW.name)
    counted = (table.group_by([FAILED_COLUMN.name, CHECK.name])
               .aggregate([(SOURCE_ROW.name, "count")]))
    by_check = {(c, k): n for c, k, n in zip(counted.column(FAILED_COLUMN.name).to_pylist(),
                                             counted.column(CHECK.name).to_pylist(),
                                             counted.column(f"{SOURCE_ROW.name}_count").to_pylist())}
    return Rejected(rows=table.num_rows, first_reason=table.column(REASON.name)[0].as_py(),
                    table=table, by_check=by_check)


def counted(batch: ScoredBatch) -> Rejected:
    """The rows the model rejected, only counted."""
    return Rejected(rows=len(batch.failed),
                    first_reason=batch.failed[0][1] if batch.failed else None)
