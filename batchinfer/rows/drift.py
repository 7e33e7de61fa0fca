"""The drift gate: a run's column statistics against a baseline → a verdict (pure: no I/O).

Every shard's result carries its columns' statistics, counted into the baseline's cuts by the
writer stage (:func:`batchinfer.pipeline.shard_reports.fold_shard`), so a verdict needs no data:
:func:`run_columns` merges them, :func:`batchinfer.rows.column_profiles.drift` compares them with the
baseline, and :class:`DriftGate` says whether the partition may commit. The gate is plain data
that pickles, because the pipeline's commit step applies it on whichever worker commits
(docs/runners.md). The baseline is read, and given the job's limits, at the edge
(:mod:`batchinfer.app.drift_baseline`); what the launcher does with a verdict (the drift report,
the metrics) is :mod:`batchinfer.app.run_record`'s.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

from ..errors import SpecError
from .column_profiles import ColumnDrift, ColumnProfile, ColumnStats, drift, run_column

log = logging.getLogger("batchinfer")

# One shard's column statistics as its result carries them: column → ColumnStats.to_dict().
ShardProfile = Mapping[str, Mapping[str, Any]]
Limits = Mapping[str, "float | None"]


def run_columns(profiles: Iterable[ShardProfile], features: Sequence[str],
                cuts: Mapping[str, Sequence[float]]) -> dict[str, ColumnProfile]:
    """The run's column profiles: every shard's statistics merged, quantiles off the histogram
    (over the baseline's ``cuts``; none without a baseline)."""
    merged: dict[str, ColumnStats] = {}
    for profile in profiles:
        for name, data in profile.items():
            stats = ColumnStats.from_dict(data)
            merged[name] = merged[name] + stats if name in merged else stats
    feature_set = set(features)
    return {name: run_column("feature" if name in feature_set else "prediction", stats, cuts.get(name, ()))
            for name, stats in merged.items()}


class MergedProfiles:
    """The shards' column statistics merged as they come, in shard order, as :func:`run_columns`
    merges them: one profile whose verdict (:func:`observe`, :meth:`DriftGate.refusal`) is the
    shards' own. What the commit step folds the shards' results with (io/records.py
    ``ResultsFold``: the io layer keeps the statistics as plain data)."""

    def __init__(self) -> None:
        self._merged: dict[str, ColumnStats] = {}

    def add(self, profile: ShardProfile) -> None:
        merged = self._merged
        for name, data in profile.items():
            stats = ColumnStats.from_dict(data)
            merged[name] = merged[name] + stats if name in merged else stats

    def profiles(self) -> tuple[dict[str, dict[str, Any]], ...]:
        """The merged profile (none when no shard had one)."""
        return ({name: stats.to_dict() for name, stats in self._merged.items()},) if self._merged else ()


def listed(names: Sequence[str] | Mapping[str, Any], limit: int = 8) -> str:
    """``a, b, c and 4 more`` (``none`` when empty): names in one line of a message."""
    names = list(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return (", ".join(names[:limit]) + more) or "none"


@dataclass(frozen=True)
class Baseline:
    """A baseline profile as ``batchinfer profile`` wrote it, and what a run is held to
    against it. Plain data that pickles: the commit step's gate carries it.

    Attributes:
        path: its URL. shown: as messages show it. what: what named it (``monitor.baseline``,
            or the model's declaration).
        warn, fail: the job's ``monitor`` limits (statistic → limit; None: no limit).
        accept: how to accept a drift against it, worded for the job (a refusal says it).
    """

    path: str
    columns: dict[str, ColumnProfile]
    about: dict[str, Any] = field(default_factory=dict)
    shown: str = ""
    what: str = "monitor.baseline"
    warn: Limits = field(default_factory=dict)
    fail: Limits = field(default_factory=dict)
    accept: str = ""

    def cuts(self) -> dict[str, tuple[float, ...]]:
        return {name: col.cuts for name, col in self.columns.items() if col.cuts}

    def for_run(self, columns: Sequence[str]) -> "Baseline":
        """The baseline restricted to what a run of ``columns`` (its features and prediction
        columns) can be compared on — before any work. A baseline column the run does not
        have, or one without values (no histogram) in the baseline, is named in a warning.

        Raises:
            SpecError: no column left (exit 2): the drift gate would check nothing.
        """
        run = set(columns)
        kept = {n: c for n, c in self.columns.items() if n in run and c.cuts}
        absent = sorted(set(self.columns) - run)
        empty = sorted(n for n, c in self.columns.items() if n in run and not c.cuts)
        if not kept:
            raise SpecError(f"{self.what} {self.shown} shares no column with this run (baseline: "
                            f"{listed(self.columns)}; run: {listed(columns)}"
                            f"{'; without values in the baseline: ' + listed(empty) if empty else ''}"
                            f"): profile a partition of this job (batchinfer profile JOB.yaml --ds D "
                            f"--out {self.shown})")
        if absent:
            log.warning("drift: %s %s has column(s) this run does not have, not compared: %s",
                        self.what, self.shown, listed(absent))
        if empty:
            log.warning("drift: %s %s has no values (no histogram) of column(s) %s, not compared",
                        self.what, self.shown, listed(empty))
        return replace(self, columns=kept)


@dataclass(frozen=True, kw_only=True)
class DriftVerdict:
    """What a run's columns are against the baseline: their profiles, and each baseline
    column's drift, worst first.

    Attributes:
        compared: whether there was a baseline (without one a run only has its columns).
        warn, fail: the limits the drifts were judged by (statistic → limit; None: no limit).
    """

    columns: dict[str, ColumnProfile]
    drifts: tuple[ColumnDrift, ...] = ()
    compared: bool = False
    warn: Limits = field(default_factory=dict)
    fail: Limits = field(default_factory=dict)

    @property
    def level(self) -> str:
        """``fail``, ``warn``, ``ok``, or ``none`` without a baseline."""
        if not self.compared:
            return "none"
        levels = {d.level for d in self.drifts}
        return "fail" if "fail" in levels else "warn" if "warn" in levels else "ok"

    def above(self, level: str) -> list[ColumnDrift]:
        return [d for d in self.drifts if d.level == level]

    def summary(self, level: str, limit: int = 5) -> str:
        """One line naming the worst columns at ``level``, worst first, each with the
        statistics above their limits."""
        worst = self.above(level)
        parts = [f"{d.column} ({', '.join(d.breached)})" for d in worst[:limit]]
        more = f" and {len(worst) - limit} more" if len(worst) > limit else ""
        return f"{len(worst)} column(s) drifted above the {level} limits: {'; '.join(parts)}{more}"


def observe(profiles: Iterable[ShardProfile], features: Sequence[str],
            baseline: Baseline | None) -> DriftVerdict:
    """The verdict on a run's shards: their columns, and with a ``baseline`` each of its
    columns' drift, judged by its limits."""
    columns = run_columns(profiles, features, baseline.cuts() if baseline else {})
    if baseline is None:
        return DriftVerdict(columns=columns)
    found = drift(baseline.columns, {k: v.stats for k, v in columns.items()}, baseline.warn, baseline.fail)
    return DriftVerdict(columns=columns, drifts=tuple(found), compared=True, warn=baseline.warn,
                        fail=baseline.fail)


@dataclass(frozen=True)
class DriftGate:
    """The drift decision of the pipeline's commit step: the partition is not committed when a
    column drifted above the ``fail`` limits (contract §6 "Drift").

    Attributes:
        features: the schema's feature columns (the rest are prediction columns).
        baseline: the baseline matched with the run's columns (:meth:`Baseline.for_run`).
    """

    features: tuple[str, ...]
    baseline: Baseline

    @classmethod
    def of(cls, features: Sequence[str], baseline: Baseline) -> "DriftGate":
        """The gate of ``baseline``, holding only what a verdict needs: its columns and limits.
        Its URL (which may hold a secret), how messages show it, what it says about itself and
        how to accept a drift (which names the job's file) stay with the launcher, which adds
        them to a refusal: the gate travels in the job graph (docs/runners.md "What travels to
        the workers")."""
        return cls(tuple(features), Baseline("", baseline.columns, what=baseline.what,
                                             warn=baseline.warn, fail=baseline.fail))

    def refusal(self, profiles: Iterable[ShardProfile]) -> str | None:
        """Why the partition must not commit (the message of exit 4, but for how to accept the
        drift and where the launcher keeps the drift report), or None."""
        verdict = observe(profiles, self.features, self.baseline)
        if verdict.level != "fail":
            return None
        warned = [d.column for d in verdict.above("warn")]
        also = f"; above warn: {listed(warned, 5)}" if warned else ""
        return f"drift: {verdict.summary('fail')}{also}; nothing committed"
