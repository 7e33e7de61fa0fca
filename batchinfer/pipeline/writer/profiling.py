"""The drift statistics of one batch (rows/column_profiles.py's :class:`ColumnStats`): of the scored
rows' profiled features, of each prediction column and, with ``explain``, of each feature's
attribution as ``_explanation`` holds it — counted into the baseline's cuts where it has them.
A few numpy reductions and one ``searchsorted`` per column; no per-row Python.

Pure: numpy and Arrow, no I/O.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ...rows.column_profiles import ColumnStats, numeric_values
from ...rows.columns import attribution_column
from .scored import ScoredBatch


class BatchProfile:
    """The part that profiles one model's batches (the champion's: its statistics are the
    partition's, and the drift gate's).

    ``features``: the feature columns profiled; ``cuts``: the baseline's histogram cuts by
    column (a column without: moments only); ``prediction_names``: output → prediction column
    (None: each output its own name)."""

    def __init__(self, features: Sequence[str], cuts: Mapping[str, tuple[float, ...]],
                 prediction_names: dict[str, str] | None):
        self.features = tuple(features)
        self.cuts = dict(cuts)
        self.prediction_names = prediction_names

    def of(self, batch: ScoredBatch) -> dict[str, ColumnStats]:
        """The batch's statistics by column; none when it scored no row."""
        if batch.scored is None:
            return {}
        stats: dict[str, ColumnStats] = {}
        names = batch.scored.schema.names
        for column in self.features:
            values = numeric_values(batch.scored.column(column)) if column in names else None
            if values is not None:
                stats[column] = ColumnStats.of(values, self.cuts.get(column))
        for output, column in (self.prediction_names or {k: k for k in batch.outputs}).items():
            values = numeric_values(batch.outputs[output])
            if values is not None:
                stats[column] = ColumnStats.of(values, self.cuts.get(column))
        explained, shown = batch.explained, batch.shown
        if explained is not None and shown is not None and explained.rows.size:
            # the drift of "why": each feature's attribution over the rows explained, as
            # _explanation holds it (0 where a row's top k leave the feature out)
            dense = np.zeros((shown.values.shape[0], len(shown.names)))
            np.put_along_axis(dense, shown.positions, shown.values, axis=1)
            for j, feature in enumerate(shown.names):
                column = attribution_column(str(feature))
                stats[column] = ColumnStats.of(dense[:, j], self.cuts.get(column))
        return stats
