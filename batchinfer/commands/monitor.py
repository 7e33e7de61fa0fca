"""Drift and inference health of a run: the baseline it is compared with, the run's column
statistics folded from its shards, PSI/KS per column, and the metrics they become.

The statistics themselves are pure (:mod:`batchinfer.rows.profile`); the pipeline's writer
stage counts every scored batch into the baseline's cuts and each shard's result carries the
merged counts (:func:`batchinfer.pipeline.records.fold_shard`), so nothing here reads data.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from ..errors import SpecError
from ..io import readback
from ..io.outputs import DRIFT, write_json
from ..io.records import ModelStats, ShardResult
from ..io.storage import url_to_fs
from ..rows.profile import PROFILE_VERSION, ColumnDrift, ColumnProfile, ColumnStats, drift, run_column
from ..spec import Job

log = logging.getLogger("batchinfer")
_METRIC_NAME = re.compile(r"[^A-Za-z0-9_\-]+")


def metric_part(name: str | None) -> str:
    """A column or check name as one part of a metric name: runs of other characters than
    MLflow allows (and dots, which separate the parts) become one ``_``; a row-level check's
    missing column is ``_row``."""
    if name is None:
        return "_row"
    return _METRIC_NAME.sub("_", name).strip("_")[:200] or "_"


@dataclass(frozen=True)
class Baseline:
    """A baseline profile as ``batchinfer profile`` wrote it.

    Attributes:
        path: its URL. shown: as messages show it. what: what named it (``monitor.baseline``,
            or the model's declaration).
    """

    path: str
    columns: dict[str, ColumnProfile]
    about: dict[str, Any] = field(default_factory=dict)
    shown: str = ""
    what: str = "monitor.baseline"

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
                            f"{_names(self.columns)}; run: {_names(columns)}"
                            f"{'; without values in the baseline: ' + _names(empty) if empty else ''}"
                            f"): profile a partition of this job (batchinfer profile JOB.yaml --ds D "
                            f"--out {self.shown})")
        if absent:
            log.warning("drift: %s %s has column(s) this run does not have, not compared: %s",
                        self.what, self.shown, _names(absent))
        if empty:
            log.warning("drift: %s %s has no values (no histogram) of column(s) %s, not compared",
                        self.what, self.shown, _names(empty))
        return replace(self, columns=kept)


def _names(names: Sequence[str] | Mapping[str, Any], limit: int = 8) -> str:
    names = list(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return (", ".join(names[:limit]) + more) or "none"


def read_profile(url: str, shown: str, what: str = "monitor.baseline") -> Baseline:
    """Read a baseline profile (as ``batchinfer profile`` writes it), checked at the edge
    (:mod:`batchinfer.io.readback`): every column's histogram fits its cuts, and there is at
    least one column.

    Raises:
        SpecError: missing, unreadable, malformed or not a batchinfer profile (exit 2, before
            any work), as ``<what> <file>: <field>: <what is wrong>``.
    """
    redo = f"write one with `batchinfer profile JOB.yaml --ds D --out {shown}`"
    try:
        fs, path = url_to_fs(url)
        data = fs.cat_file(path)
    except (OSError, ValueError) as exc:
        raise SpecError(f"{what} {shown} cannot be read ({type(exc).__name__}: "
                        f"{str(exc)[:160]}): {redo}") from None
    checked = readback.check(readback.ProfileModel, data, f"{what} {shown}", SpecError, redo)
    if not checked.columns:
        raise SpecError(f"{what} {shown}: columns: empty: a baseline needs at least one column: {redo}")
    columns = {name: ColumnProfile.from_dict(col.model_dump()) for name, col in checked.columns.items()}
    about = {k: v for k, v in json.loads(data).items() if k != "columns"}
    return Baseline(url, columns, about, shown, what)


def load_baseline(job: Job, declaration: Mapping[str, str] | None = None) -> Baseline | None:
    """The job's baseline: ``monitor.baseline``, else the one the model's declaration names.

    Raises:
        SpecError: ``monitor`` without a baseline anywhere, or one that cannot be read (exit 2).
    """
    monitor = job.spec.monitor
    if monitor is None:
        return None
    if monitor.baseline:
        return read_profile(monitor.baseline, job.display(monitor.baseline))
    url = (declaration or {}).get("baseline")
    if not url:
        raise SpecError("monitor has no baseline: set monitor.baseline, or stamp the model with "
                        "`batchinfer stamp MODEL --job JOB.yaml --baseline PROFILE`")
    return read_profile(url, url, "the model's declared baseline")


def run_columns(results: Sequence[ShardResult], features: Sequence[str],
                baseline: Baseline | None) -> dict[str, ColumnProfile]:
    """The run's column profiles: every shard's statistics merged, quantiles off the histogram."""
    merged: dict[str, ColumnStats] = {}
    for result in results:
        for name, data in result.profile.items():
            stats = ColumnStats.from_dict(data)
            merged[name] = merged[name] + stats if name in merged else stats
    cuts = baseline.cuts() if baseline else {}
    feature_set = set(features)
    return {name: run_column("feature" if name in feature_set else "prediction", stats, cuts.get(name, ()))
            for name, stats in merged.items()}


@dataclass(frozen=True)
class Monitoring:
    """What a run's monitoring found: its columns, and the drift of each against the baseline."""

    columns: dict[str, ColumnProfile]
    baseline: Baseline | None
    drifts: list[ColumnDrift]
    warn: dict[str, float | None] = field(default_factory=dict)
    fail: dict[str, float | None] = field(default_factory=dict)

    @property
    def level(self) -> str:
        """``fail``, ``warn``, ``ok``, or ``none`` without a baseline."""
        if self.baseline is None:
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

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for d in self.drifts:  # a column with no scored values has no PSI or KS to log
            if math.isfinite(d.psi):
                out[f"drift_psi.{metric_part(d.column)}"] = d.psi
            if math.isfinite(d.ks):
                out[f"drift_ks.{metric_part(d.column)}"] = d.ks
        if self.baseline is not None:
            out["drift_columns_warn"] = float(len(self.above("warn")))
            out["drift_columns_fail"] = float(len(self.above("fail")))
        return out

    def to_dict(self, job: Job, results: Sequence[ShardResult] = ()) -> dict[str, Any]:
        """What ``_profile.json`` (and a stopped run's ``_drift/<attempt>.json``) holds."""
        return {"profile_version": PROFILE_VERSION, "job": job.spec.name, "ds": job.ds,
                "quarantine": [list(q) for q in quarantine_counts(results)],
                "level": self.level,
                "baseline": (None if self.baseline is None else
                             {"path": job.display(self.baseline.path), **self.baseline.about,
                              "columns": {k: v.to_dict() for k, v in self.baseline.columns.items()}}),
                "limits": {"warn": self.warn, "fail": self.fail},
                "drift": [d.to_dict() for d in self.drifts],
                "columns": {k: v.to_dict() for k, v in self.columns.items()}}


def monitor(job: Job, results: Sequence[ShardResult], features: Sequence[str],
            baseline: Baseline | None) -> Monitoring:
    columns = run_columns(results, features, baseline)
    spec = job.spec.monitor
    if baseline is None or spec is None:
        return Monitoring(columns, None, [])
    warn, fail = spec.warn.as_dict(), spec.fail.as_dict()
    found = drift(baseline.columns, {k: v.stats for k, v in columns.items()}, warn, fail)
    return Monitoring(columns, baseline, found, warn, fail)


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100.0
    lo = int(math.floor(rank))
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def quarantine_counts(results: Sequence[ShardResult]) -> list[tuple[str | None, str, int]]:
    """Quarantined rows by (column, check) over all shards, most first."""
    counts: dict[tuple[str | None, str], int] = {}
    for result in results:
        for column, check, n in result.quarantine:
            counts[(column, check)] = counts.get((column, check), 0) + n
    return sorted(((c, k, n) for (c, k), n in counts.items()), key=lambda t: (-t[2], str(t[0]), t[1]))


def health_metrics(results: Sequence[ShardResult], load_seconds: float | None) -> dict[str, float]:
    """Inference health: model latency per batch, batch sizes, model throughput, quarantine
    counts by check and by column and check, model load and warm-up time, and for sequence
    models the real and padded tokens."""
    out: dict[str, float] = {}
    batches = [b for r in results for b in r.batches]
    if batches:
        latency = [ms for _, ms in batches]
        sizes = [float(rows) for rows, _ in batches]
        for q in (50, 95, 99):
            out[f"model_latency_ms_p{q}"] = _percentile(latency, q)
        out["model_latency_ms_max"] = max(latency)
        out["model_batches"] = float(len(batches))
        out["batch_rows_min"] = min(sizes)
        out["batch_rows_p50"] = _percentile(sizes, 50)
        out["batch_rows_max"] = max(sizes)
        model_s = sum(latency) / 1000.0
        if model_s > 0:
            out["model_rows_per_second"] = sum(sizes) / model_s
    for column, check, n in quarantine_counts(results):
        for key in (f"quarantine_rows.{metric_part(check)}",
                    f"quarantine_rows.{metric_part(column)}.{metric_part(check)}"):
            out[key] = out.get(key, 0.0) + n
    model = sum((r.model for r in results), ModelStats())
    out["model_warmup_ms"] = model.warmup_ms
    if model.tokens:
        # A model with a lengths input (handlers/tokens.py): what padding cost.
        out["model_tokens"] = float(model.tokens)
        out["model_padded_tokens"] = float(model.padded_tokens)
        out["model_padding_ratio"] = model.padded_tokens / model.tokens
    if load_seconds is not None:
        out["model_load_seconds"] = load_seconds
    return out


@dataclass(frozen=True)
class DriftGate:
    """The drift decision, made by the pipeline's commit step (docs/runners.md): the partition
    is not committed when a column drifted above the ``fail`` limits. Plain data that pickles —
    the job, the feature names and the baseline travel with the commit plan to whichever worker
    commits — and pure but for the report it keeps.
    """

    job: Job
    features: tuple[str, ...]
    baseline: Baseline

    def __call__(self, results: Sequence[ShardResult], layout: Any) -> str | None:
        """Why the partition must not commit (the message of exit 4), or None. A refused run's
        drift report is kept as ``_drift/<attempt>.json`` and ``.html`` under ``output.path``,
        which no cleanup removes."""
        watched = monitor(self.job, results, self.features, self.baseline)
        if watched.level != "fail":
            return None
        shown = self.job.display(self.job.spec.output.path)
        kept = f"{DRIFT}/{layout.attempt}.json"
        record = watched.to_dict(self.job, results)
        where = f"drift report kept in {shown}/{kept}"
        try:
            write_json(layout.fs, layout.abs(kept), record)
            from .report import render_report

            metrics = {**health_metrics(results, None), **watched.metrics()}
            html = render_report(None, {"metrics": metrics, "params": {"attempt": layout.attempt}}, record,
                                 title=f"{self.job.spec.name} {self.job.ds or ''}: stopped by drift")
            layout.fs.pipe_file(layout.abs(f"{DRIFT}/{layout.attempt}.html"), html.encode())
        except Exception as exc:  # the run fails anyway; say why the report is missing
            where = f"the drift report could not be kept ({type(exc).__name__}: {str(exc)[:120]})"
        warned = [d.column for d in watched.above("warn")]
        also = f"; above warn: {_names(warned, 5)}" if warned else ""
        return f"drift: {watched.summary('fail')}{also}; nothing committed; {self.accept()}; {where}"

    def accept(self) -> str:
        """How to accept a drift: a new baseline from a trusted partition, or other limits."""
        job = self.job.display(str(self.job.path))
        if self.baseline.what == "monitor.baseline":
            profile = f"`batchinfer profile {job} --ds D --out {self.baseline.shown}`"
        else:  # the model's declared baseline: declare the new one
            profile = (f"`batchinfer profile {job} --ds D --out PROFILE` and `batchinfer stamp "
                       f"MODEL --job {job} --baseline PROFILE`")
        return (f"to accept this drift, profile a baseline from a partition you trust ({profile}) "
                f"or raise the monitor.fail limits")
