"""The job report: one self-contained HTML file (inline CSS and SVG, no script, no network).

Built from what a run keeps beside its manifest — ``_manifest.json``, ``_metrics.json`` and
``_profile.json`` — so ``batchinfer report OUTPUT`` rebuilds exactly what the run wrote. Plots are
hand-made SVG: a few bars and rectangles need no plotting library, and the file stays small.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from ..errors import SpecError
from ..io.outputs import MANIFEST, METRICS, PROFILE, REPORT
from ..io.partitions import open_partition
from ..io.readback import check
from ..io.records import Manifest, MetricsRecord
from ..profile_records import RunProfile
from ..triple.contract import PARTS

# Shared with the history page (app/history_page.py), under the names this module always used.
from .html_parts import COLORS, CSS, Raw
from .html_parts import escape as _e
from .html_parts import number as _num
from .html_parts import pill as _pill
from .html_parts import table as _table

BASE, RUN = "#90a4ae", "#1565c0"
STAGES = ("read", "validate", "preprocess", "infer", "hash", "profile", "write")


def hbars(items: Sequence[tuple[str, float, str]], *, width: int = 560, unit: str = "",
          marks: Sequence[tuple[float, str]] = ()) -> str:
    """A horizontal bar chart as inline SVG: (label, value, colour) per bar, optional vertical
    marks (value, colour) such as the warn and fail limits."""
    if not items:
        return '<p class="muted">nothing to show</p>'
    label_w, bar_h, gap = 190, 16, 6
    top = max([v for _, v, _ in items] + [m for m, _ in marks] + [1e-12])
    plot_w = width - label_w - 70
    height = len(items) * (bar_h + gap) + gap
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img">']
    for i, (label, value, color) in enumerate(items):
        y = gap + i * (bar_h + gap)
        w = max(plot_w * value / top, 1.0 if value > 0 else 0.0)
        short = label if len(label) <= 26 else label[:25] + "…"  # the label column is 190 px
        parts.append(f'<text x="{label_w - 6}" y="{y + 12}" font-size="12" text-anchor="end">'
                     f'<title>{_e(label)}</title>{_e(short)}</text>')
        parts.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{color}"/>')
        parts.append(f'<text x="{label_w + w + 4:.1f}" y="{y + 12}" font-size="11">{_num(value)}{_e(unit)}</text>')
    for value, color in marks:
        x = label_w + plot_w * value / top
        parts.append(f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{height}" stroke="{color}" '
                     f'stroke-dasharray="4 3"/>')
    parts.append("</svg>")
    return "".join(parts)


def histogram_pair(name: str, cuts: Sequence[float], base: Sequence[int], run: Sequence[int],
                   width: int = 360, height: int = 170) -> str:
    """Baseline and run shares per bin of the baseline's histogram, side by side, as SVG."""
    total_b, total_r = sum(base) or 1, sum(run) or 1
    pb = [c / total_b for c in base]
    pr = [c / total_r for c in run]
    top = max(pb + pr + [1e-12])
    n = len(base)
    left, bottom, plot_h = 34, 26, height - 40
    slot = (width - left - 6) / max(n, 1)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img">',
             f'<text x="{left}" y="11" font-size="12" font-weight="bold">{_e(name[:40])}</text>',
             f'<line x1="{left}" y1="{height - bottom}" x2="{width - 4}" y2="{height - bottom}" stroke="#999"/>']
    for i in range(n):
        x = left + i * slot
        for j, (share, color) in enumerate(((pb[i], BASE), (pr[i], RUN))):
            h = plot_h * share / top
            parts.append(f'<rect x="{x + 1 + j * slot / 2:.1f}" y="{height - bottom - h:.1f}" '
                         f'width="{max(slot / 2 - 1, 0.5):.1f}" height="{h:.1f}" fill="{color}"/>')
    if cuts:
        for i in (0, len(cuts) // 2, len(cuts) - 1):
            x = left + (i + 1) * slot
            parts.append(f'<text x="{x:.1f}" y="{height - 12}" font-size="10" text-anchor="middle">'
                         f'{_num(float(cuts[i]), 3)}</text>')
    parts.append(f'<text x="2" y="{height - bottom}" font-size="10">0</text>'
                 f'<text x="2" y="{height - bottom - plot_h + 8:.1f}" font-size="10">{top:.0%}</text>')
    parts.append(f'<rect x="{width - 150}" y="3" width="10" height="10" fill="{BASE}"/>'
                 f'<text x="{width - 136}" y="12" font-size="11">baseline</text>'
                 f'<rect x="{width - 80}" y="3" width="10" height="10" fill="{RUN}"/>'
                 f'<text x="{width - 66}" y="12" font-size="11">this run</text></svg>')
    return "".join(parts)


def render_report(manifest: Manifest | None, record: Mapping[str, Any], profile: Mapping[str, Any] | None,
                  *, title: str | None = None) -> str:
    """The report's HTML from the manifest (None for a run that did not commit), the
    ``_metrics.json`` record and the ``_profile.json`` record."""
    metrics: Mapping[str, float] = record.get("metrics", {}) or {}
    params: Mapping[str, Any] = record.get("params", {}) or {}
    profile = profile or {}
    level = str(profile.get("level", "none"))
    job = manifest.job if manifest else profile.get("job", "")
    ds = manifest.ds if manifest else profile.get("ds")
    heading = title or f"{job} {ds or ''}"
    sub = (f"attempt {manifest.attempt} · {manifest.runner} runner · {manifest.backend or 'onnxruntime'} on "
           f"{manifest.device} · {manifest.started_at} → {manifest.finished_at}" if manifest
           else f"attempt {params.get('attempt', '?')} · not committed")
    out = [f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(heading)} · '
           f'batchinfer report</title><style>{CSS}</style></head><body>',
           f"<header><h1>{_e(heading)}</h1><div class=\"sub\">{_e(sub)}</div></header><main>"]
    rows_in = metrics.get("rows_in", manifest.totals.rows_in if manifest else None)
    cards = [("rows in", rows_in), ("scored", metrics.get("rows_scored")),
             ("quarantined", metrics.get("rows_quarantined")), ("rows / s", metrics.get("rows_per_second")),
             ("wall s", metrics.get("wall_seconds")), ("model p95 ms", metrics.get("model_latency_ms_p95"))]
    out.append('<section><div class="cards">' + "".join(
        f"<div class=\"card\"><b>{_num(v, 4)}</b><span>{_e(k)}</span></div>" for k, v in cards)
        + f'<div class="card"><b>{_pill(level)}</b><span>drift</span></div></div></section>')
    if manifest:
        out.append("<section><h2>Version triple</h2>" + _table(
            ["part", "value"],
            # in the contract's order, whichever order the manifest's JSON came in
            [(k, Raw(f"<code>{_e(manifest.triple.get(k, ''))}</code>")) for k in PARTS]) + "</section>")
        shard_rows: list[tuple[Any, ...]] = [
            (s.path.rsplit("/", 1)[-1], _pill(s.status) if s.status != "scored" else "scored",
             s.rows_in, s.rows_scored, s.rows_quarantined, s.reason or "") for s in manifest.shards]
        headers = ["shard", "status", "rows in", "scored", "quarantined", "reason"]
        reused = manifest.reused()
        note = ""
        if reused:  # a resumed or updated run: who scored each shard (contract §5.3)
            headers.append("scored by")
            shard_rows = [(*row, "this attempt" if manifest.scored_by(s) == manifest.attempt
                           else manifest.scored_by(s)) for row, s in zip(shard_rows, manifest.shards)]
            note = (f'<p class="muted">reused: {len(reused)} of {len(manifest.shards)} shards '
                    f'({sum(s.rows_in or 0 for s in reused):,} rows) scored by earlier '
                    f'attempt(s) (a crashed one, or the partition an update kept) and not '
                    f'again; {len(manifest.shards) - len(reused)} scored by this attempt</p>')
        out.append("<section><h2>Accounting per shard</h2>" + _table(headers, shard_rows, (2, 3, 4))
                   + note + "</section>")
        out.append(_challengers_section(manifest))
    out.append(_drift_section(profile, level))
    out.append(_histograms(profile))
    out.append(_explain_section(metrics))
    out.append(_quarantine_section(profile, metrics))
    stages = [(s, metrics[f"stage_seconds_{s}"], RUN) for s in STAGES if f"stage_seconds_{s}" in metrics]
    out.append("<section><h2>Time per stage (summed over batches)</h2>" + hbars(stages, unit=" s")
               + f'<p class="muted">pipeline {_num(metrics.get("pipeline_seconds"))} s, wall '
               f'{_num(metrics.get("wall_seconds"))} s; hashing, profiling and writing run on a '
               f'writer thread beside scoring, so stages can add up to more than the wall.</p></section>')
    sizes = " / ".join(_num(metrics.get(k)) for k in ("batch_rows_min", "batch_rows_p50", "batch_rows_max"))
    health = [(name, _num(metrics.get(key)) if key else sizes) for name, key in (
        ("model latency p50 (ms per batch)", "model_latency_ms_p50"),
        ("model latency p95", "model_latency_ms_p95"), ("model latency p99", "model_latency_ms_p99"),
        ("model latency max", "model_latency_ms_max"), ("model rows / s", "model_rows_per_second"),
        ("batches", "model_batches"), ("rows per batch min / p50 / max", None),
        ("model load s", "model_load_seconds"), ("model warm-up ms", "model_warmup_ms"),
        ("rows per model call", "model_chunk_rows"), ("OOM back-offs", "model_oom_backoffs"))]
    device = params.get("device", manifest.device if manifest else "?")
    out.append("<section><h2>Inference health</h2>" + _table(["", "value"], health)
               + f'<p class="muted">device {_e(device)}</p></section>')
    out.append(_columns_section(profile))
    out.append('<p class="muted">batchinfer job report · self-contained: no script, no network</p>'
               "</main></body></html>")
    return "".join(out)


def _explain_section(metrics: Mapping[str, float]) -> str:
    """With explain: the partition's top features by mean |attribution| (what drives its scores),
    the rows explained and those that missed completeness (contract §6 "Explanations")."""
    if not metrics.get("explain_rows"):
        return ""
    found = sorted(((k.split(".", 1)[1], float(v)) for k, v in metrics.items()
                    if k.startswith("explain_mean_abs.")), key=lambda kv: (-kv[1], kv[0]))
    return ("<section><h2>Explanations: top features by mean |attribution|</h2>"
            + hbars([(name, value, RUN) for name, value in found[:15]])
            + f'<p class="muted">{_num(metrics.get("explain_rows"))} rows explained, '
            f'{_num(metrics.get("explain_incomplete_rows"))} outside the completeness tolerance; '
            f"per row: the <code>_explanation</code> column</p></section>")


def _challengers_section(manifest: Manifest) -> str:
    """The challengers scored beside the champion (none: nothing shown)."""
    if not manifest.challengers:
        return ""
    rows = [(c.name, Raw(f"<code>{_e(c.triple.get('model_version', ''))}</code>"),
             Raw(f"<code>{_e(c.triple.get('model_digest', '')[:16])}</code>"),
             f"{c.backend}, {c.device}", c.rows_scored, c.rows_rejected, _num(c.compute_ms / 1000.0))
            for c in manifest.challengers]
    return ("<section><h2>Challengers</h2>" + _table(
        ["challenger", "model version", "digest", "backend, device", "scored", "rejected",
         "model s"], rows, (4, 5, 6))
        + '<p class="muted">same prepared batches as the champion; compare with '
        "<code>batchinfer diff OUTPUT --challenger NAME</code></p></section>")


def _quarantine_section(profile: Mapping[str, Any], metrics: Mapping[str, float]) -> str:
    if "quarantine" in profile:  # (column, check, rows) as the run counted them
        reasons = [(f"{c if c is not None else '(row)'}: {k}", float(n)) for c, k, n in profile["quarantine"]]
    else:  # an older output: the metric names
        reasons = [(k[len("quarantine_rows."):], v) for k, v in metrics.items()
                   if k.startswith("quarantine_rows.") and k.count(".") >= 2]
    reasons.sort(key=lambda kv: (-kv[1], kv[0]))
    if not reasons:
        return '<section><h2>Quarantine reasons</h2><p class="muted">no row was quarantined</p></section>'
    return ("<section><h2>Quarantine reasons (column: check)</h2>"
            + hbars([(k, v, COLORS["warn"]) for k, v in reasons[:20]])
            + _table(["column: check", "rows"], reasons, (1,)) + "</section>")


def _drift_section(profile: Mapping[str, Any], level: str) -> str:
    drifts = profile.get("drift") or []
    if not profile.get("baseline"):
        return ('<section><h2>Drift</h2><p class="muted">no baseline: set <code>monitor.baseline</code> '
                "(write one with <code>batchinfer profile</code>) to compare runs with it</p></section>")
    limits = profile.get("limits", {})
    warn, fail = limits.get("warn", {}).get("psi"), limits.get("fail", {}).get("psi")
    marks = [(v, COLORS[k]) for k, v in (("warn", warn), ("fail", fail)) if v is not None]
    # A column with no scored values has no PSI (None): no bar; its row says why.
    bars = hbars([(d["column"], d["psi"] or 0.0, COLORS[d["level"]]) for d in drifts[:25]], marks=marks)
    # Shown as the run wrote it, and a field the reader's model defaults may be absent.
    rows = [(d["column"], d["kind"], d["psi"], d["ks"], _pill(d["level"]),
             "; ".join(d.get("breached") or [])) for d in drifts]
    return (f"<section><h2>Drift against the baseline, worst first {_pill(level)}</h2>"
            f'<p class="muted">baseline {_e(profile["baseline"].get("path", ""))} (ds '
            f'{_e(profile["baseline"].get("ds"))}); warn above {_e(_limits(limits.get("warn")))}, fail '
            f'above {_e(_limits(limits.get("fail")))}; bars: PSI, dashed lines: the PSI limits</p>{bars}'
            + _table(["column", "kind", "PSI", "KS", "level", "above"], rows, (2, 3)) + "</section>")


def _limits(limits: Mapping[str, Any] | None) -> str:
    shown = [f"{name.upper()} {value:g}" for name, value in sorted((limits or {}).items(), reverse=True)
             if value is not None]
    return " or ".join(shown) or "nothing"


def _histograms(profile: Mapping[str, Any]) -> str:
    baseline = (profile.get("baseline") or {}).get("columns") or {}
    columns = profile.get("columns") or {}
    order = [d["column"] for d in profile.get("drift") or []]
    predictions = [c for c in order if columns.get(c, {}).get("kind") == "prediction"]
    # The features that drifted past a limit, else the two nearest to one.
    drifted = [d["column"] for d in profile.get("drift") or [] if d.get("kind") == "feature"]
    above = [d["column"] for d in profile.get("drift") or [] if d.get("kind") == "feature" and d["level"] != "ok"]
    worst_features = above[:6] or drifted[:2]
    figures = []
    for name in predictions + worst_features:
        base, run = baseline.get(name, {}), columns.get(name, {})
        if base.get("counts") and run.get("counts") and len(base["counts"]) == len(run["counts"]):
            figures.append(f"<figure>{histogram_pair(name, base.get('cuts', []), base['counts'], run['counts'])}"
                           f"<figcaption>{_e(run.get('kind'))} {_e(name)}: share of rows per baseline "
                           f"bin</figcaption></figure>")
    if not figures:
        return ""
    return ("<section><h2>Predictions (and the most drifted features) against the baseline</h2>"
            f'<div class="grid">{"".join(figures)}</div></section>')


def _columns_section(profile: Mapping[str, Any]) -> str:
    columns = profile.get("columns") or {}
    if not columns:
        return ""
    baseline = (profile.get("baseline") or {}).get("columns") or {}
    rows = []
    for name, col in sorted(columns.items(), key=lambda kv: (kv[1].get("kind") != "prediction", kv[0])):
        q = col.get("quantiles") or {}
        rows.append((name, col.get("kind"), col.get("count"), col.get("nulls"), col.get("mean"),
                     (baseline.get(name) or {}).get("mean"), col.get("std"), col.get("min"), q.get("0.5"),
                     col.get("max")))
    return ("<section><h2>Column statistics (scored rows)</h2>" + _table(
        ["column", "kind", "count", "nulls", "mean", "baseline mean", "std", "min", "median", "max"],
        rows, (2, 3, 4, 5, 6, 7, 8, 9)) + "</section>")


def rebuild_report(output: str) -> str:
    """``batchinfer report OUTPUT``: write ``report.html`` again from a committed output's own
    records, each checked as it is read (:mod:`batchinfer.io.readback`); return its path.

    Raises:
        SpecError: ``OUTPUT`` is not a committed partition, or its ``_metrics.json`` or
            ``_profile.json`` is malformed (exit 2).
        ContractError: its manifest is malformed (exit 3).
    """
    partition = open_partition(output)
    if partition is None:
        raise SpecError(f"{output} is not a committed output (no {MANIFEST})")
    fs, manifest = partition.layout.fs, partition.manifest
    record: dict = {}
    profile: dict = {}
    for name, into, schema in ((METRICS, record, MetricsRecord), (PROFILE, profile, RunProfile)):
        path = partition.record(name)
        try:
            data = fs.cat_file(path)
        except FileNotFoundError:  # a run from before reports, or a run that could not write it
            continue
        check(schema, data, path, SpecError, f"rebuild it by scoring the partition again "
                                             f"(batchinfer run --overwrite), or remove {name}")
        into.update(json.loads(data))   # as the run wrote it: the report shows what it holds
    path = partition.record(REPORT)
    fs.pipe_file(path, render_report(manifest, record, profile).encode())
    return path
