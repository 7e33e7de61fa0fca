"""The history page: a :class:`~batchinfer.app.job_history.History` as one self-contained HTML file
(inline CSS and SVG, no script, no network), styled and escaped as the job report is
(:mod:`batchinfer.app.html_parts`).

Every plot has the same date axis, so a date is at the same x on each: gaps (dates with no
committed partition) are grey columns on every plot, and each change of the triple or of the
declared model options is a numbered dashed line on every plot, numbered as in the table of
changes. Made to stay readable at 365 dates × 50 features: heatmap cells shrink to the width
the page has, date and row labels thin out, and cells of one colour next to each other are drawn
as one path (the page of 365 × 50 is a few hundred KB, tests/unit/test_job_history.py). Pure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .html_parts import COLORS, CSS, Raw, number, pill, table
from .html_parts import escape as e
from .job_history import History

WIDTH, LEFT, RIGHT = 1120, 170, 14      # every plot's width and its margins (px)
GAP, CHANGE, SCORED = "#cfd8dc", "#6a1b9a", "#1565c0"
EXTRA_CSS = ".legend{font-size:12px;color:#5b6570}.legend i{display:inline-block;width:12px;height:10px;" \
            "margin:0 4px 0 10px;vertical-align:-1px}"
# PSI cells, by where the value lies against the warn (w) and fail (f) limits.
PSI_COLORS = ("#e8f5e9", "#c8e6c9", "#fff59d", "#ffcc80", "#ff8a65", "#e53935", "#8e0000")
COUNT_COLORS = ("#fff3e0", "#ffe0b2", "#ffb74d", "#fb8c00", "#e65100", "#8d3300")
COUNT_CUTS = (10, 100, 1000, 10_000, 100_000)
DEFAULT_PSI = (0.1, 0.25)   # the usual rule of thumb, for a history whose runs had no PSI limits


@dataclass(frozen=True)
class Axis:
    """The date axis every plot shares: date ``i`` is the column from :meth:`x` ``(i)`` to
    ``x(i) + step``."""

    n: int

    @property
    def step(self) -> float:
        return (WIDTH - LEFT - RIGHT) / max(self.n, 1)

    def x(self, i: float) -> float:
        return LEFT + i * self.step

    def centre(self, i: int) -> float:
        return self.x(i) + self.step / 2


def runs(flags: Sequence[bool]) -> list[tuple[int, int]]:
    """(first, past-last) index of each run of True in ``flags``."""
    out, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            out.append((start, i))
            start = None
    return out


def overlay(history: History, axis: Axis, top: float, bottom: float) -> str:
    """The gaps (grey columns) and the changes (numbered dashed lines) between ``top`` and
    ``bottom``, drawn under the plot's own marks."""
    parts = [f'<rect x="{axis.x(a):.1f}" y="{top:.1f}" width="{(b - a) * axis.step:.1f}" '
             f'height="{bottom - top:.1f}" fill="{GAP}"><title>no committed partition: '
             f'{e(history.dates[a])}{" to " + e(history.dates[b - 1]) if b - a > 1 else ""}</title></rect>'
             for a, b in runs([s != "committed" for s in history.states])]
    where = {ds: i for i, ds in enumerate(history.dates)}
    for number_, change in enumerate(history.changes, 1):
        x = axis.x(where[change.ds])
        parts.append(f'<line x1="{x:.1f}" y1="{top - 12:.1f}" x2="{x:.1f}" y2="{bottom:.1f}" '
                     f'stroke="{CHANGE}" stroke-width="1.5" stroke-dasharray="4 3"/>'
                     f'<text x="{x + 2:.1f}" y="{top - 3:.1f}" font-size="10" fill="{CHANGE}">'
                     f'{number_}<title>{e(change_text(change.parts))}</title></text>')
    return "".join(parts)


def date_labels(history: History, axis: Axis, y: float) -> str:
    """Date labels under a plot, thinned to one every 72 px or more."""
    every = max(1, math.ceil(72 / axis.step))
    return "".join(f'<text x="{axis.x(i):.1f}" y="{y:.1f}" font-size="10" fill="#5b6570">'
                   f'{e(history.dates[i])}</text>' for i in range(0, axis.n, every))


def svg(height: float, body: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0f}" '
            f'viewBox="0 0 {WIDTH} {height:.0f}" role="img">{body}</svg>')


def bars_plot(history: History, stacks: Sequence[tuple[str, str, Sequence[Any]]], *,
              unit: str = "", line: tuple[str, str, Sequence[Any]] | None = None) -> str:
    """Stacked bars per date (label, colour, values), optionally a line (label, colour, values)
    on the same scale; a legend, the top value, the date labels and the overlay."""
    axis, top, plot_h = Axis(len(history.dates)), 24, 150
    bottom = top + plot_h
    sums = [sum(float(v[i] or 0) for _, _, v in stacks) for i in range(axis.n)]
    high = max(sums + [float(v) for v in (line[2] if line else ()) if v is not None] + [1e-12])
    width = max(axis.step * 0.8, 0.6)
    parts = [overlay(history, axis, top, bottom),
             f'<line x1="{LEFT}" y1="{bottom}" x2="{WIDTH - RIGHT}" y2="{bottom}" stroke="#999"/>',
             f'<text x="{LEFT - 6}" y="{top + 8}" font-size="10" text-anchor="end">{number(high)}{e(unit)}</text>',
             f'<text x="{LEFT - 6}" y="{bottom}" font-size="10" text-anchor="end">0</text>']
    base = [0.0] * axis.n   # each series is stacked on those before it
    for label, color, values in stacks:   # one path per series: a rectangle per date
        path = []
        for i, value in enumerate(values):
            if value:
                h = plot_h * float(value) / high
                y = bottom - plot_h * base[i] / high - h
                path.append(f"M{axis.x(i) + (axis.step - width) / 2:.1f} {y:.1f}h{width:.1f}v{h:.1f}h-{width:.1f}z")
        for i, value in enumerate(values):
            base[i] += float(value or 0)
        parts.append(f'<path d="{"".join(path)}" fill="{color}"><title>{e(label)}</title></path>')
    if line is not None:
        parts.append(polyline(axis, line[2], lambda v: bottom - plot_h * v / high, line[1]))
    parts.append(date_labels(history, axis, bottom + 14))
    legend = [(label, color) for label, color, _ in stacks] + ([(line[0], line[1])] if line else [])
    return svg(bottom + 22, "".join(parts)) + _legend(legend)


def polyline(axis: Axis, values: Sequence[Any], y: Callable[[float], float], color: str,
             width: float = 1.5, dash: str = "") -> str:
    """A line through the dates' values, broken where a date has none (one point: a dot)."""
    parts = []
    for a, b in runs([v is not None for v in values]):
        points = " ".join(f"{axis.centre(i):.1f},{y(float(values[i])):.1f}" for i in range(a, b))
        if b - a == 1:
            parts.append(f'<circle cx="{axis.centre(a):.1f}" cy="{y(float(values[a])):.1f}" r="2" fill="{color}"/>')
        else:
            style = f' stroke-dasharray="{dash}"' if dash else ""
            parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" '
                         f'stroke-width="{width}"{style}/>')
    return "".join(parts)


def band(axis: Axis, low: Sequence[Any], high: Sequence[Any], y: Callable[[float], float],
         color: str) -> str:
    """A filled band between two series, broken where either has no value."""
    parts = []
    for a, b in runs([lo is not None and hi is not None for lo, hi in zip(low, high)]):
        if b - a == 1:   # one date: its whole column
            x0, x1 = axis.x(a), axis.x(a) + axis.step
            top = [f"{x0:.1f},{y(float(high[a])):.1f}", f"{x1:.1f},{y(float(high[a])):.1f}"]
            under = [f"{x1:.1f},{y(float(low[a])):.1f}", f"{x0:.1f},{y(float(low[a])):.1f}"]
        else:
            top = [f"{axis.centre(i):.1f},{y(float(high[i])):.1f}" for i in range(a, b)]
            under = [f"{axis.centre(i):.1f},{y(float(low[i])):.1f}" for i in range(b - 1, a - 1, -1)]
        parts.append(f'<polygon points="{" ".join(top + under)}" fill="{color}"/>')
    return "".join(parts)


def heatmap(history: History, labels: Sequence[str], rows: Sequence[Sequence[Any]],
            level: Callable[[float], int], colors: Sequence[str], *, empty: str = "#ffffff") -> str:
    """Rows × dates cells, coloured by ``level(value)`` (an index into ``colors``; None: the
    ``empty`` colour, gaps: grey). Runs of one colour in a row are one subpath, so a page of
    365 × 50 cells stays small; row labels thin out past 60 rows."""
    axis = Axis(len(history.dates))
    row_h = max(2.0, min(14.0, 720 / max(len(rows), 1)))
    top = 16
    bottom = top + row_h * len(rows)
    paths: dict[str, list[str]] = {}
    committed = [s == "committed" for s in history.states]
    for r, values in enumerate(rows):
        y = top + r * row_h
        shades = [None if not committed[i] else (empty if v is None else colors[level(float(v))])
                  for i, v in enumerate(values)]
        i = 0
        while i < len(shades):
            j = i + 1
            while j < len(shades) and shades[j] == shades[i]:
                j += 1
            if shades[i] is not None:
                w = (j - i) * axis.step
                paths.setdefault(shades[i], []).append(  # type: ignore[arg-type]
                    f"M{axis.x(i):.1f} {y:.1f}h{w:.1f}v{row_h - 0.5:.1f}h-{w:.1f}z")
            i = j
    parts = [overlay(history, axis, top, bottom)]
    parts += [f'<path d="{"".join(p)}" fill="{color}"/>' for color, p in paths.items()]
    every = max(1, math.ceil(11 / row_h))
    for r in range(0, len(rows), every):
        name = labels[r]
        short = name if len(name) <= 26 else name[:25] + "…"
        parts.append(f'<text x="{LEFT - 6}" y="{top + r * row_h + min(row_h, 11) - 1:.1f}" font-size="'
                     f'{min(11, max(row_h, 8)):.0f}" text-anchor="end"><title>{e(name)}</title>{e(short)}</text>')
    parts.append(date_labels(history, axis, bottom + 13))
    return svg(bottom + 20, "".join(parts))


def psi_level(warn: float, fail: float) -> Callable[[float], int]:
    cuts = (warn / 4, warn / 2, warn, (warn + fail) / 2, fail, 2 * fail)
    return lambda v: sum(v >= c for c in cuts)


def count_level(v: float) -> int:
    return sum(v >= c for c in COUNT_CUTS)


def _legend(items: Sequence[tuple[str, str]], note: str = "") -> str:
    return ('<p class="legend">' + "".join(f'<i style="background:{c}"></i>{e(t)}' for t, c in items)
            + f'<i style="background:{GAP}"></i>no committed partition'
            + f'<i style="background:{CHANGE};height:2px;vertical-align:3px"></i>change (numbered as in '
            f'the table of changes){e(note)}</p>')


def change_text(parts: dict[str, tuple[str, str]]) -> str:
    return "; ".join(f"{k} {_short(a)} → {_short(b)}" for k, (a, b) in parts.items())


def _short(value: str) -> str:
    return value[:12] if len(value) == 64 and all(c in "0123456789abcdef" for c in value) else (value or "–")


def render_history(history: History) -> str:
    """The page's HTML."""
    counts = history.counts()
    heading = f"{history.job or 'batchinfer job'}: {history.dates[0]} to {history.dates[-1]}"
    out = [f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{e(heading)} · '
           f'batchinfer history</title><style>{CSS}{EXTRA_CSS}</style></head><body>',
           f'<header><h1>{e(heading)}</h1><div class="sub">{e(history.source)} · {counts["committed"]} of '
           f'{counts["dates"]} dates committed · read from each date\'s manifest, metrics and profile'
           f'</div></header><main>']
    rows_in = sum(v or 0 for v in history.rows["in"])
    quarantined = sum(v or 0 for v in history.rows["quarantined"])
    cards = [("dates", counts["dates"]), ("committed", counts["committed"]), ("gaps", counts["gaps"]),
             ("rows in", rows_in), ("quarantined", quarantined), ("changes", len(history.changes))]
    out.append('<section><div class="cards">' + "".join(
        f'<div class="card"><b>{number(v)}</b><span>{e(k)}</span></div>' for k, v in cards)
        + "</div>" + _gaps_line(history) + "</section>")
    out.append(_changes_section(history))
    out.append("<section><h2>Rows per date</h2>" + bars_plot(
        history, [("scored", SCORED, history.rows["scored"]),
                  ("quarantined", COLORS["warn"], history.rows["quarantined"])]) + "</section>")
    out.append(_quarantine_section(history))
    out.append(_drift_section(history))
    out.append(_scores_section(history))
    out.append(_compute_section(history))
    out.append(_dates_section(history))
    out.append('<p class="muted">batchinfer history · self-contained: no script, no network</p>'
               "</main></body></html>")
    return "".join(out)


def _gaps_line(history: History) -> str:
    gaps = history.gaps
    if not gaps:
        return '<p class="muted">no gap: every date has a committed partition</p>'
    counts = history.counts()
    by = ", ".join(f"{counts[s]} {s}" for s in ("missing", "uncommitted", "unreadable") if counts[s])
    shown = ", ".join(gaps[:12]) + (f" and {len(gaps) - 12} more" if len(gaps) > 12 else "")
    return f'<p class="muted">gaps ({e(by)}): {e(shown)} — grey on every plot; notes in the table of dates</p>'


def _changes_section(history: History) -> str:
    if not history.changes:
        return ('<section><h2>Changes</h2><p class="muted">the same triple and model options on '
                "every committed date</p></section>")
    rows = [(n, c.ds, c.since, Raw("<br>".join(f"<b>{e(k)}</b> <code>{e(_short(a))}</code> → "
                                               f"<code>{e(_short(b))}</code>" for k, (a, b) in c.parts.items())))
            for n, c in enumerate(history.changes, 1)]
    return ("<section><h2>Changes of the triple and the model options</h2>"
            + table(["#", "from", "committed date before", "what changed"], rows, (0,))
            + '<p class="muted">dashed lines on every plot, numbered as here</p></section>')


def _quarantine_section(history: History) -> str:
    if not history.quarantine:
        return ('<section><h2>Quarantine by reason</h2><p class="muted">no row was quarantined on '
                "any committed date</p></section>")
    reasons = list(history.quarantine)
    shown = reasons[:20]
    rows = [history.quarantine[r] for r in shown]
    if len(reasons) > 20:   # the rest as one row: the page stays one screen wide and tall
        rest = [sum(history.quarantine[r][i] or 0 for r in reasons[20:]) if history.states[i] == "committed"
                else None for i in range(len(history.dates))]
        shown, rows = [*shown, f"{len(reasons) - 20} other reasons"], [*rows, rest]
    legend = [(f"≥ {c:,}" if i else f"1–{COUNT_CUTS[0] - 1}", COUNT_COLORS[i])
              for i, c in enumerate((1, *COUNT_CUTS))]
    totals = [(r, sum(v or 0 for v in history.quarantine[r])) for r in reasons]
    return ("<section><h2>Quarantined rows by reason (column: check)</h2>"
            + heatmap(history, shown, rows, count_level, COUNT_COLORS) + _legend(legend, "; white: none")
            + table(["column: check", "rows over the range"], totals, (1,)) + "</section>")


def _drift_section(history: History) -> str:
    if not history.psi:
        return ('<section><h2>Drift per feature</h2><p class="muted">no committed date was compared with '
                "a baseline: set <code>monitor.baseline</code> (written by <code>batchinfer profile</code>)"
                "</p></section>")
    warn = history.limits.get("warn") or DEFAULT_PSI[0]
    fail = history.limits.get("fail") or max(DEFAULT_PSI[1], warn * 2)
    cuts = (0, warn / 4, warn / 2, warn, (warn + fail) / 2, fail, 2 * fail)
    legend = [(f"≥ {c:.3g}" if i else f"< {cuts[1]:.3g}", PSI_COLORS[i]) for i, c in enumerate(cuts)]
    said = "" if history.limits.get("warn") or history.limits.get("fail") else " (no PSI limits recorded: 0.1 and 0.25)"
    labels = [f"{c} (prediction)" if history.kinds.get(c) == "prediction" else c for c in history.psi]
    worst = []
    for column, values in list(history.psi.items())[:15]:
        at = max((i for i, v in enumerate(values) if v is not None), key=lambda i: values[i], default=None)
        if at is not None:
            worst.append((column, history.kinds.get(column), values[at], history.dates[at]))
    return (f"<section><h2>Drift per feature: PSI against the baseline, worst first</h2>"
            f'<p class="muted">warn {number(warn)}, fail {number(fail)}{e(said)}; rows: columns, '
            f"columns: dates</p>" + heatmap(history, labels, list(history.psi.values()),
                                            psi_level(warn, fail), PSI_COLORS)
            + _legend(legend, "; white: no PSI (no scored values)")
            + table(["column", "kind", "largest PSI", "on"], worst, (2,)) + "</section>")


def _scores_section(history: History) -> str:
    if not history.scores:
        return ('<section><h2>Scores</h2><p class="muted">no committed date has a profile of its '
                "predictions</p></section>")
    figures = []
    for name, stats in history.scores.items():
        figures.append(f"<h3 style=\"font-size:14px;margin:6px 0\">{e(name)}</h3>" + _score_plot(history, stats))
    return ("<section><h2>Scores over time</h2><p class=\"muted\">quantiles as each run's profile has "
            "them (read off its histogram over the baseline's bins: a run without a baseline has only "
            "mean, min and max)</p>" + "".join(figures) + "</section>")


def _score_plot(history: History, stats: dict[str, list]) -> str:
    axis, top, plot_h = Axis(len(history.dates)), 20, 160
    bottom = top + plot_h
    values = [float(v) for s in stats.values() for v in s if v is not None]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    span = (hi - lo) or 1.0

    def y(v: float) -> float:
        return bottom - plot_h * (v - lo) / span

    parts = [overlay(history, axis, top, bottom),
             f'<line x1="{LEFT}" y1="{bottom}" x2="{WIDTH - RIGHT}" y2="{bottom}" stroke="#999"/>',
             f'<text x="{LEFT - 6}" y="{top + 8}" font-size="10" text-anchor="end">{number(hi)}</text>',
             f'<text x="{LEFT - 6}" y="{bottom}" font-size="10" text-anchor="end">{number(lo)}</text>']
    legend = []
    for low, high, color in (("min", "max", "#e3f2fd"), ("0.05", "0.95", "#bbdefb"), ("0.25", "0.75", "#64b5f6")):
        if low in stats and high in stats and any(v is not None for v in stats[low]):
            parts.append(band(axis, stats[low], stats[high], y, color))
            legend.append((f"{low}–{high}", color))
    for key, color, dash in (("0.5", "#0d47a1", ""), ("mean", "#263238", "3 2")):
        if key in stats and any(v is not None for v in stats[key]):
            parts.append(polyline(axis, stats[key], y, color, dash=dash))
            legend.append(("median" if key == "0.5" else "mean", color))
    parts.append(date_labels(history, axis, bottom + 14))
    return svg(bottom + 22, "".join(parts)) + _legend(legend)


def _compute_section(history: History) -> str:
    c = history.compute
    reused = [v if v else None for v in c["shards_reused"]]
    return ("<section><h2>Compute, wall and reuse</h2>"
            + bars_plot(history, [("wall s", "#90a4ae", c["wall_seconds"])], unit=" s",
                        line=("compute s (stages summed over batches)", "#263238", c["compute_seconds"]))
            + '<p class="muted">wall: the run from start to commit; compute: every stage\'s seconds summed '
            "over batches (work, which overlaps across workers). Reused: shards an earlier attempt "
            "scored (a crashed one the run resumed, or the partition an update kept)</p>"
            + (bars_plot(history, [("shards reused", "#00897b", reused)]) if any(reused) else
               '<p class="muted">no committed date reused a shard: each scored all of its own</p>')
            + "</section>")


def _dates_section(history: History) -> str:
    c = history.compute
    rows = []
    for i, ds in enumerate(history.dates):
        state = history.states[i]
        worst = max(((col, s[i]) for col, s in history.psi.items() if s[i] is not None),
                    key=lambda kv: kv[1], default=None)
        level = history.drift_level[i]
        reused = (f"{c['shards_reused'][i]} of {c['shards'][i]} ({c['rows_reused'][i]:,} rows) from "
                  f"{', '.join(history.reused_from[i] or [])}" if c["shards_reused"][i] else "")
        rows.append((ds, state if state == "committed" else pill_for(state), history.attempts[i],
                     history.rows["in"][i], history.rows["scored"][i], history.rows["quarantined"][i],
                     pill(level) if level and level != "none" else (level or ""),
                     f"{worst[0]} {worst[1]:.3g}" if worst else "", c["wall_seconds"][i],
                     c["compute_seconds"][i], reused, "; ".join(history.notes.get(ds, ()))))
    return ("<section><h2>Every date</h2>" + table(
        ["date", "state", "attempt", "rows in", "scored", "quarantined", "drift", "largest PSI",
         "wall s", "compute s", "reused", "notes"], rows, (3, 4, 5, 8, 9)) + "</section>")


def pill_for(state: str) -> Raw:
    return Raw(f'<span class="pill" style="background:{COLORS["fail"] if state == "unreadable" else "#78909c"}">'
               f"{e(state)}</span>")
