"""With ``explain``, the prediction file's explanation columns (contract §6 "Explanations"):
``_explanation`` (each explained row's top features and their attributions, or every one) and
``_explanation_baseline``, null for the rows not explained; what they mean, in the file's
metadata; and the batch's explanation figures for its record.

Pure: Arrow, numpy and JSON, no I/O.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa

from ...handlers.explain import Attributions, ExplainPlan
from ...rows.columns import EXPLANATION, EXPLANATION_BASELINE
from .scored import ScoredBatch
from .table import ColumnPart

# The key of a prediction file's schema metadata that describes its explanation columns.
EXPLAIN_METADATA = "batchinfer.explain"


class ExplanationColumns(ColumnPart):
    """The part that writes one model's explanation columns (a model run with ``explain``)."""

    def __init__(self, plan: ExplainPlan):
        self.plan = plan

    def columns(self, batch: ScoredBatch) -> dict[str, pa.Array]:
        """``_explanation`` and ``_explanation_baseline`` for the scored rows: the explained
        rows' top features (or every one), null for the others."""
        explained, shown = batch.explained, batch.shown
        if explained is None or shown is None:
            return {}
        n = int(batch.ok.size)
        names, positions, values = shown.names, shown.positions, shown.values
        k = positions.shape[1]
        struct = pa.StructArray.from_arrays(
            [pa.array(names[positions.reshape(-1)] if k else [], pa.string()),
             pa.array(values.reshape(-1), pa.float64())],
            fields=[pa.field("feature", pa.string(), nullable=False),
                    pa.field("attribution", pa.float64(), nullable=False)])
        lengths = np.zeros(n, dtype=np.int32)
        lengths[explained.rows] = k
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        missing = np.ones(n, dtype=bool)
        missing[explained.rows] = False
        lists = pa.ListArray.from_arrays(pa.array(offsets), struct,
                                         type=pa.list_(struct.type), mask=pa.array(missing))
        baseline = np.full(n, explained.baseline_value, dtype=np.float64)
        return {EXPLANATION.name: lists,
                EXPLANATION_BASELINE.name: pa.array(baseline, pa.float64(), mask=missing)}

    def metadata(self, batch: ScoredBatch) -> dict[str, str]:
        """What the explanation columns mean: the method and its parameters as declared, where
        the feature names come from and what they are."""
        if batch.explained is None:
            return {}
        return {EXPLAIN_METADATA: self._described(batch.explained)}

    def _described(self, explained: Attributions) -> str:
        plan = self.plan
        width = int(np.shape(explained.values)[1]) if explained.values.size else 0
        return json.dumps({"declared": json.loads(plan.declared), "input": plan.input,
                           "output": plan.output, "features_from": plan.features_from,
                           "features": list(plan.names(width)) if width or plan.features else [],
                           "completeness_tolerance": plan.tolerance if plan.complete else None},
                          sort_keys=True)

    @staticmethod
    def stats(batch: ScoredBatch) -> dict[str, Any]:
        """The batch's explanation figures, as :class:`~batchinfer.io.records.ModelStats`
        fields: rows explained, rows that missed completeness, the largest gap, and
        |attribution| summed per feature."""
        explained, shown = batch.explained, batch.shown
        if explained is None or shown is None:
            return {}
        return {"explained": int(explained.rows.size), "incomplete": explained.incomplete,
                "max_gap": explained.max_gap,
                "abs_attribution": {name: float(v) for name, v in
                                    zip(shown.names, np.abs(shown.by_feature).sum(axis=0))}}
