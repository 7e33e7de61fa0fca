"""How two models' predictions of the same rows compare (``batchinfer diff``; pure, numpy only).

For a score (a float column): Spearman's rank correlation and quantiles of ``|a - b|``; for a
label (an integer, boolean or string column): the fraction of rows that agree; for both sides
of a score, the rows that moved most (:class:`TopMovers`, bounded by N whatever the rows).
"""
from __future__ import annotations

import heapq
from typing import Any, TypedDict

import numpy as np

QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


class AbsDiff(TypedDict):
    """Quantiles and max of ``|a - b|`` (None: no rows)."""

    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


class ScoreSummary(TypedDict):
    rows: int
    spearman: float | None
    abs_diff: AbsDiff


class ExplanationAgreement(TypedDict):
    rows: int
    top1_agreement: float | None
    top_k_overlap: float | None
    spearman: float | None
    top_features_a: list[str]
    top_features_b: list[str]


def ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their average rank (as ``scipy.stats.rankdata``)."""
    values = np.asarray(values)
    order = np.argsort(values, kind="mergesort")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]]) if values.size else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], values.size]
    average = (starts + ends - 1) / 2.0 + 1.0
    out = np.empty(values.size, dtype=np.float64)
    out[order] = np.repeat(average, ends - starts)
    return out


def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's rank correlation of two equally long arrays; None when it is undefined (fewer
    than two rows, or a side that is constant)."""
    if a.size < 2:
        return None
    ra, rb = ranks(a), ranks(b)
    ra -= ra.mean()
    rb -= rb.mean()
    scale = float(np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    if scale == 0.0:
        return None
    return float(np.clip((ra * rb).sum() / scale, -1.0, 1.0))


def abs_diff_quantiles(a: np.ndarray, b: np.ndarray) -> AbsDiff:
    """p50, p90, p99 (numpy's linear interpolation) and max of ``|a - b|``."""
    gap = np.abs(a.astype(np.float64) - b.astype(np.float64))
    if not gap.size:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = (float(v) for v in np.quantile(gap, list(QUANTILES.values())))
    return {"p50": p50, "p90": p90, "p99": p99, "max": float(gap.max())}


def score_summary(a: np.ndarray, b: np.ndarray) -> ScoreSummary:
    return {"rows": int(a.size), "spearman": spearman(a, b), "abs_diff": abs_diff_quantiles(a, b)}


def agreement(a: np.ndarray, b: np.ndarray) -> int:
    """How many rows of two label arrays agree (nulls agree with nulls only)."""
    return int(np.count_nonzero(a == b))


class TopMovers:
    """The N rows with the largest ``|a - b| > 0`` seen so far; fed shard by shard, so memory is N
    rows, not the partition. Ties are broken by (shard, row), so the answer does not depend on
    the order shards are read in."""

    def __init__(self, n: int):
        self.n = n
        self._heap: list[tuple[float, tuple[str, int], dict]] = []   # smallest kept move first

    def add(self, shard: str, rows: np.ndarray, a: np.ndarray, b: np.ndarray,
            keys: dict[str, Any]) -> None:
        """Offer one shard's matched rows; ``keys`` are columns to show beside each mover (ids),
        arrays aligned with ``rows`` (only the movers' values are taken out of them)."""
        if self.n <= 0 or not rows.size:
            return
        gap = np.abs(a.astype(np.float64) - b.astype(np.float64))
        moved = np.flatnonzero(gap > 0)  # a row that did not move is no mover
        take = min(self.n, moved.size)
        if not take:
            return
        for i in moved[np.argpartition(-gap[moved], take - 1)[:take]]:
            # the heap orders by move, then prefers the lower (shard, row): keep the key negated
            entry = (float(gap[i]), _negated(shard, int(rows[i])),
                     {**{k: _plain(v[i]) for k, v in keys.items()}, "_source_shard": shard,
                      "_source_row": int(rows[i]), "a": float(a[i]), "b": float(b[i]),
                      "abs_diff": float(gap[i])})
            if len(self._heap) < self.n:
                heapq.heappush(self._heap, entry)
            elif entry[:2] > self._heap[0][:2]:
                heapq.heapreplace(self._heap, entry)

    def rows(self) -> list[dict]:
        """The movers, largest move first."""
        return [e[2] for e in sorted(self._heap, key=lambda e: e[:2], reverse=True)]


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python value (JSON-ready); other values as they are."""
    return value.item() if isinstance(value, np.generic) else value


def _negated(shard: str, row: int) -> tuple:
    # heapq compares tuples: a smaller (shard, row) must count as the *larger* entry.
    return tuple(-ord(c) for c in shard) + (0x110000, -row)


def explanation_agreement(a: list, b: list) -> ExplanationAgreement:
    """How two models' explanations of the same rows agree (``diff``, contract §6
    "Explanations"): ``a`` and ``b`` are the rows' ``_explanation`` lists (``[{feature,
    attribution}]``, largest |attribution| first; None for a row not explained), matched row
    by row. Over the rows explained on both sides: ``top1_agreement``, the fraction whose first
    feature is the same; ``top_k_overlap``, the mean share of features the two lists have in
    common; ``spearman``, the rank correlation of the features' mean |attribution| over those
    rows (a feature missing from a row's list counts 0 there), and both sides' top features.
    """
    rows = top1 = 0
    overlap = 0.0
    totals: dict[str, list[float]] = {}
    for left, right in zip(a, b):
        if not left or not right:
            continue
        rows += 1
        top1 += left[0]["feature"] == right[0]["feature"]
        names_a, names_b = {e["feature"] for e in left}, {e["feature"] for e in right}
        overlap += len(names_a & names_b) / max(len(names_a), len(names_b))
        for side, entries in ((0, left), (1, right)):
            for entry in entries:
                totals.setdefault(entry["feature"], [0.0, 0.0])[side] += abs(entry["attribution"])
    features = sorted(totals)
    mean_a = np.array([totals[f][0] for f in features]) / max(rows, 1)
    mean_b = np.array([totals[f][1] for f in features]) / max(rows, 1)

    def ranked(values: np.ndarray) -> list[str]:
        return [features[i] for i in sorted(range(len(features)), key=lambda i: (-values[i], features[i]))][:10]

    return {"rows": rows, "top1_agreement": top1 / rows if rows else None,
            "top_k_overlap": overlap / rows if rows else None,
            "spearman": spearman(mean_a, mean_b) if rows else None,
            "top_features_a": ranked(mean_a), "top_features_b": ranked(mean_b)}
