"""A job over a range of dates (``batchinfer history``): what each date's committed partition
recorded — its manifest, ``_metrics.json`` and ``_profile.json`` — laid out as dates × series.

Pure: :func:`build_history` takes each date's records as read (:class:`DateRecords`, made by
:mod:`batchinfer.commands.history`, which does the I/O) and returns a :class:`History`;
:mod:`batchinfer.app.history_page` renders it, :meth:`History.to_dict` is its JSON. Nothing is
recomputed from the rows: every figure is one a run wrote. A date without a committed partition
stays in the history as a gap, with what the reader found there (nothing, a stopped or crashed
run's leftovers, a record it could not read).

Every series has one value per date, None where the date has none (a gap, or a run that did not
record it), so that the dates line up across the page and in the JSON.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from ..io.records import Manifest
from ..triple.contract import PARTS

HISTORY_VERSION = 1
MAX_DATES = 3660   # ten years of dates: a bound on what one page (and one command) reads
State = Literal["committed", "missing", "uncommitted", "unreadable"]
STATES: tuple[State, ...] = ("committed", "missing", "uncommitted", "unreadable")


@dataclass(frozen=True)
class DateRecords:
    """One date as the reader found it.

    Attributes:
        state: ``committed`` (a manifest), ``missing`` (nothing there), ``uncommitted``
            (something there but no manifest: a run that drift or quarantine stopped, one that
            crashed or is running) or ``unreadable`` (a manifest that cannot be read).
        manifest: the committed manifest (``committed`` only).
        metrics: ``_metrics.json``'s ``metrics`` (empty when the run wrote none or it is unreadable).
        profile: ``_profile.json`` as the run wrote it (empty likewise).
        notes: what the reader has to say about the date, one line each.
    """

    ds: str
    state: State = "missing"
    manifest: Manifest | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    profile: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Change:
    """What differs in a committed date's triple or declared model options from the committed
    date before it (``since``; the dates between are gaps): part → (before, after)."""

    ds: str
    since: str
    parts: dict[str, tuple[str, str]]

    def to_dict(self) -> dict[str, Any]:
        return {"ds": self.ds, "since": self.since,
                "parts": {k: list(v) for k, v in self.parts.items()}}


Series = list  # one value per date (float | int | str | None)


@dataclass(frozen=True)
class History:
    """A job's dates × series (module docstring). ``features``: the drifted columns, worst
    (largest PSI over the range) first; ``reasons``: quarantine reasons (``column: check``),
    most rows first; ``scores``: the prediction columns, each with ``mean``, ``min``, ``max``
    and its quantiles (``"0.5"``…) per date."""

    job: str
    source: str
    dates: tuple[str, ...]
    states: tuple[State, ...]
    notes: dict[str, tuple[str, ...]]
    attempts: Series
    triples: Series
    rows: dict[str, Series]
    quarantine: dict[str, Series]
    drift_level: Series
    psi: dict[str, Series]
    kinds: dict[str, str]
    limits: dict[str, float | None]
    scores: dict[str, dict[str, Series]]
    compute: dict[str, Series]
    reused_from: Series
    changes: tuple[Change, ...]

    @property
    def gaps(self) -> tuple[str, ...]:
        return tuple(ds for ds, state in zip(self.dates, self.states) if state != "committed")

    def counts(self) -> dict[str, int]:
        """Dates, committed, gaps, and the gaps by state."""
        return {"dates": len(self.dates), "committed": self.states.count("committed"),
                "gaps": len(self.gaps), **{s: self.states.count(s) for s in STATES[1:]}}

    def to_dict(self) -> dict[str, Any]:
        """The JSON of ``batchinfer history --json`` (docs/contract.md "History")."""
        return {"history_version": HISTORY_VERSION, "job": self.job, "source": self.source,
                "start": self.dates[0], "end": self.dates[-1], "dates": list(self.dates),
                "states": list(self.states), "counts": self.counts(), "gaps": list(self.gaps),
                "notes": {ds: list(n) for ds, n in self.notes.items()},
                "attempts": self.attempts, "triples": self.triples, "rows": self.rows,
                "quarantine": self.quarantine,
                "drift": {"level": self.drift_level, "limits": self.limits, "kinds": self.kinds,
                          "psi": self.psi},
                "scores": self.scores, "compute": {**self.compute, "reused_from": self.reused_from},
                "changes": [c.to_dict() for c in self.changes]}


def build_history(days: Sequence[DateRecords], *, job: str = "", source: str = "") -> History:
    """The :class:`History` of ``days`` (one per date, in date order).

    Args:
        job: the job's name (default: the first committed manifest's).
        source: what was read (the job spec, or the output), as the page shows it.
    """
    committed = [d for d in days if d.manifest is not None]
    n = len(days)
    rows: dict[str, Series] = {"in": [None] * n, "scored": [None] * n, "quarantined": [None] * n}
    compute: dict[str, Series] = {k: [None] * n for k in (
        "wall_seconds", "compute_seconds", "infer_seconds", "shards", "shards_reused", "rows_reused")}
    reused_from: Series = [None] * n
    for i, day in enumerate(days):
        if day.manifest is None:
            continue
        totals = day.manifest.totals
        rows["in"][i], rows["scored"][i] = totals.rows_in, totals.rows_scored
        rows["quarantined"][i] = totals.rows_quarantined
        _compute_of(day, i, compute, reused_from)
    drift_level, psi, kinds = _drift(days)
    return History(
        job=job or (committed[0].manifest.job if committed and committed[0].manifest else ""),
        source=source, dates=tuple(d.ds for d in days), states=tuple(d.state for d in days),
        notes={d.ds: d.notes for d in days if d.notes},
        attempts=[d.manifest.attempt if d.manifest else None for d in days],
        triples=[{k: d.manifest.triple.get(k, "") for k in PARTS} if d.manifest else None
                 for d in days],
        rows=rows, quarantine=_quarantine(days), drift_level=drift_level, psi=psi, kinds=kinds,
        limits=_limits(committed), scores=_scores(days), compute=compute,
        reused_from=reused_from, changes=changes_of(days))


def _compute_of(day: DateRecords, i: int, compute: dict[str, Series], reused_from: Series) -> None:
    """Wall, compute (the stages' seconds summed over batches: work, not elapsed time), the
    model's stage, and what the run reused: shards another attempt scored (a crashed one it
    resumed, or the partition an update kept), from the manifest."""
    manifest, metrics = day.manifest, day.metrics
    assert manifest is not None
    stages = [v for k, v in metrics.items() if k.startswith("stage_seconds_")]
    compute["wall_seconds"][i] = metrics.get("wall_seconds")
    compute["compute_seconds"][i] = sum(stages) if stages else None
    compute["infer_seconds"][i] = metrics.get("stage_seconds_infer")
    reused = manifest.reused()
    compute["shards"][i] = manifest.totals.shards
    compute["shards_reused"][i] = len(reused)
    compute["rows_reused"][i] = sum(s.rows_in or 0 for s in reused)
    reused_from[i] = sorted({manifest.scored_by(s) for s in reused})


def reasons_of(day: DateRecords) -> dict[str, int]:
    """A date's quarantined rows by reason, ``column: check`` as the job report names them: the
    profile's counts, or for an output from before them the metrics' names."""
    found: dict[str, int] = {}
    if "quarantine" in day.profile:
        for column, check, rows in day.profile["quarantine"]:
            key = f"{column if column is not None else '(row)'}: {check}"
            found[key] = found.get(key, 0) + int(rows)
        return found
    for key, value in day.metrics.items():
        if key.startswith("quarantine_rows.") and key.count(".") >= 2:
            column, check = key[len("quarantine_rows."):].split(".", 1)
            found[f"{column}: {check}"] = int(value)
    return found


def _quarantine(days: Sequence[DateRecords]) -> dict[str, Series]:
    by_date = [reasons_of(d) if d.manifest is not None else None for d in days]
    totals: dict[str, int] = {}
    for found in by_date:
        for reason, rows in (found or {}).items():
            totals[reason] = totals.get(reason, 0) + rows
    order = sorted(totals, key=lambda r: (-totals[r], r))
    # A committed date without a reason's rows quarantined none for it (0); a gap has no value.
    return {r: [None if f is None else f.get(r, 0) for f in by_date] for r in order}


def _drift(days: Sequence[DateRecords]) -> tuple[Series, dict[str, Series], dict[str, str]]:
    """Each date's drift level and each column's PSI (None: a gap, a run without a baseline,
    or a column without scored values), columns worst first."""
    levels: Series = [None] * len(days)
    psi: dict[str, Series] = {}
    kinds: dict[str, str] = {}
    for i, day in enumerate(days):
        if day.manifest is None:
            continue
        levels[i] = day.profile.get("level", "none") if day.profile else None
        for d in day.profile.get("drift") or ():
            psi.setdefault(d["column"], [None] * len(days))[i] = d.get("psi")
            kinds.setdefault(d["column"], d.get("kind", "feature"))
    worst = {c: max((v for v in s if v is not None), default=-1.0) for c, s in psi.items()}
    order = sorted(psi, key=lambda c: (-worst[c], c))
    return levels, {c: psi[c] for c in order}, {c: kinds[c] for c in order}


def _limits(committed: Sequence[DateRecords]) -> dict[str, float | None]:
    """The PSI limits of the latest committed run that had any (what its drift was judged by)."""
    for day in reversed(committed):
        limits = day.profile.get("limits") or {}
        warn, fail = (limits.get("warn") or {}).get("psi"), (limits.get("fail") or {}).get("psi")
        if warn is not None or fail is not None:
            return {"warn": warn, "fail": fail}
    return {"warn": None, "fail": None}


def _scores(days: Sequence[DateRecords]) -> dict[str, dict[str, Series]]:
    """Each prediction column's mean, min, max and quantiles per date, as its profile has them
    (a run's quantiles are read off its histogram, so a run without a baseline has none)."""
    out: dict[str, dict[str, Series]] = {}
    for i, day in enumerate(days):
        if day.manifest is None:
            continue
        for name, column in (day.profile.get("columns") or {}).items():
            if column.get("kind") != "prediction":
                continue
            values = {"mean": column.get("mean"), "min": column.get("min"), "max": column.get("max"),
                      **(column.get("quantiles") or {})}
            series = out.setdefault(name, {})
            for key, value in values.items():
                series.setdefault(key, [None] * len(days))[i] = value
    return {name: {k: v for k, v in sorted(s.items(), key=_stat_order)} for name, s in sorted(out.items())}


def _stat_order(item: tuple[str, Series]) -> tuple[int, float]:
    key = item[0]
    try:
        return (1, float(key))
    except ValueError:
        return (0, ("mean", "min", "max").index(key) if key in ("mean", "min", "max") else 3)


def what_changes(manifest: Manifest) -> dict[str, str]:
    """What a change is looked for in: the triple's parts and the declared model options."""
    return {**{k: manifest.triple.get(k, "") for k in PARTS},
            **{f"model_options.{k}": v for k, v in sorted(manifest.model_options.items())}}


def changes_of(days: Sequence[DateRecords]) -> tuple[Change, ...]:
    """Each committed date whose triple or declared model options differ from those of the
    committed date before it."""
    found = []
    before: tuple[str, dict[str, str]] | None = None
    for day in days:
        if day.manifest is None:
            continue
        now = what_changes(day.manifest)
        if before is not None:
            differ = {k: (before[1].get(k, ""), now.get(k, "")) for k in {*before[1], *now}
                      if before[1].get(k, "") != now.get(k, "")}
            if differ:
                order = [*PARTS, *sorted(k for k in differ if k not in PARTS)]
                found.append(Change(day.ds, before[0], {k: differ[k] for k in order if k in differ}))
        before = (day.ds, now)
    return tuple(found)
