"""The record of a run: one set of params, metrics and tags that goes to MLflow
(:mod:`batchinfer.io.tracking`), into ``_metrics.json`` and into the job report, beside the
run's column statistics (``_profile.json``) — contract §6 "Tracking record", "Inference health",
"Drift", "Job report".

Metric names are made here and nowhere else (:func:`metric_part`); so are the files a run keeps
beside its manifest, after the commit, and the drift report of a run that drift stopped. Nothing
here can undo a commit: a file that cannot be written is a warning, or a line of the error.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..backends import declared_options
from ..io.outputs import DRIFT, METRICS, PROFILE, REPORT, Layout, write_json
from ..io.records import Manifest, MetricsRecord, ModelStats, ResultsSummary, Totals
from ..profile_records import PROFILE_VERSION, BaselineAbout, LimitsRecord, RunProfile
from ..rows.drift import Baseline, DriftVerdict
from ..spec import Job
from .job_report import render_report
from .resolve import records_url

if TYPE_CHECKING:
    from ..io.tracking import TrackingRun
    from .resolve import Resolved

log = logging.getLogger("batchinfer")
_METRIC_NAME = re.compile(r"[^A-Za-z0-9_\-]+")


def metric_part(name: str | None) -> str:
    """A column or check name as one part of a metric name: runs of other characters than
    MLflow allows (and dots, which separate the parts) become one ``_``; a row-level check's
    missing column is ``_row``."""
    if name is None:
        return "_row"
    return _METRIC_NAME.sub("_", name).strip("_")[:200] or "_"


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """What MLflow gets of a run, and ``_metrics.json`` keeps and the report shows."""

    params: dict[str, str]
    metrics: dict[str, Any]
    tags: dict[str, str]


def run_params(job: Job, resolved: "Resolved", attempt: str, device: str) -> dict[str, str]:
    """The MLflow params of a run, committed or refused: the triple and how it ran."""
    spec = job.spec
    return {**{f"triple.{k}": v for k, v in resolved.triple.as_dict().items()},
            "job": spec.name, "ds": job.ds or "", "attempt": attempt,
            "job_spec_sha256": job.spec_sha256, "runner": spec.runner.name, "device": device,
            "schema": resolved.schema.ref, "backend": spec.model.backend,
            **{f"model.options.{k}": v for k, v in declared_options(spec.model.backend,
                                                                    spec.model.options).items()},
            **model_facts(resolved.model.declaration), **table_params(resolved)}


def table_params(resolved: "Resolved") -> dict[str, str]:
    """For a table input, what was read: ``input.format``, ``input.table``, ``input.version``
    (the manifest's ``input_table``)."""
    table = resolved.input_table()
    if table is None:
        return {}
    return {"input.format": table.format, "input.table": table.table,
            "input.version": str(table.version)}


# What a model's declaration says of how it was made faster (export --quantize): a run reports
# it beside its precision, so the figures that signed the model off travel with its predictions.
FACT_PREFIXES = ("quantization_", "calibration_", "parity_", "sample_", "source_model_sha256")


def model_facts(declaration: Mapping[str, str] | None) -> dict[str, str]:
    return {f"model.{k}": v for k, v in (declaration or {}).items() if k.startswith(FACT_PREFIXES)}


def run_tags(job: Job, attempt: str, device: str) -> dict[str, str]:
    return {"batchinfer.job": job.spec.name, "batchinfer.attempt": attempt,
            "batchinfer.device": device}


def table_tags(manifest: Manifest) -> dict[str, str]:
    """A table output's commit, as MLflow tags: the format, the generation and each table's
    folder or identifier and version (``batchinfer.table.quarantine`` → ``_quarantine@3``)."""
    table = manifest.table
    if table is None:
        return {}
    return {"batchinfer.table.format": table.format,
            "batchinfer.table.generation": str(table.generation),
            **{f"batchinfer.table.{t.kind}": f"{t.table}@{t.version}" for t in table.tables}}


def run_metrics(totals: Totals, pipeline_s: float, wall_s: float, summary: ResultsSummary,
                load_s: float | None, verdict: DriftVerdict, *,
                attempt: str | None = None) -> dict[str, Any]:
    """Every metric of a run: its totals, the shards and rows it reused (adopted from crashed
    attempts, not scored by ``attempt``), time per stage, model health, challengers, drift —
    from its shards' results folded (``summary``). The partition's figures (stages, model
    health) cover every shard, reused ones with the time their attempt spent;
    ``rows_per_second`` counts only the rows this run scored."""
    metrics: dict[str, Any] = {k: float(v) for k, v in totals.to_dict().items()}
    reused = summary.reused(attempt)
    metrics["shards_reused"] = float(reused.shards)
    metrics["rows_reused"] = float(reused.rows_in)
    metrics["pipeline_seconds"] = pipeline_s
    # Where the time went, per stage, summed over batches (stages overlap across workers).
    for stage, value in summary.seconds.items():
        metrics[f"stage_seconds_{stage}"] = value
    model = summary.model
    metrics["model_oom_backoffs"] = float(model.oom_backoffs)
    if model.chunk_rows:
        metrics["model_chunk_rows"] = float(model.chunk_rows)
    if wall_s:
        metrics["wall_seconds"] = wall_s
        metrics["rows_per_second"] = (totals.rows_in - metrics["rows_reused"]) / wall_s
    metrics.update(health_metrics(summary, load_s))
    metrics.update(explain_metrics(model))
    metrics.update(challenger_metrics(summary))
    metrics.update(drift_metrics(verdict))
    return metrics


def explain_metrics(model: ModelStats) -> dict[str, float]:
    """With explain (contract §6 "Explanations"): ``explain_rows``, ``explain_incomplete_rows``,
    ``explain_max_completeness_gap`` (0 for a method without completeness) and, per feature,
    ``explain_mean_abs.<feature>``, its mean |attribution| over the rows explained (what drives
    the partition's scores); nothing for a run without explain."""
    if not model.explained:
        return {}
    metrics = {"explain_rows": float(model.explained),
               "explain_incomplete_rows": float(model.incomplete),
               "explain_max_completeness_gap": model.max_gap}
    for feature, total in model.abs_attribution.items():
        metrics[f"explain_mean_abs.{metric_part(feature)}"] = total / model.explained
    return metrics


def challenger_metrics(summary: ResultsSummary) -> dict[str, float]:
    """``challenger.<name>.rows_scored``, ``.rows_rejected`` and ``.compute_ms`` (its model
    time, summed over batches) for each challenger."""
    metrics: dict[str, float] = {}
    for name, sums in summary.challengers.items():
        metrics[f"challenger.{name}.rows_scored"] = float(sums.rows_scored)
        metrics[f"challenger.{name}.rows_rejected"] = float(sums.rows_rejected)
        metrics[f"challenger.{name}.compute_ms"] = sums.compute_ms
    return metrics


def drift_metrics(verdict: DriftVerdict) -> dict[str, float]:
    """``drift_psi.<column>``, ``drift_ks.<column>``, and with a baseline the number of columns
    above each level."""
    out: dict[str, float] = {}
    for d in verdict.drifts:  # a column with no scored values has no PSI or KS to log
        if math.isfinite(d.psi):
            out[f"drift_psi.{metric_part(d.column)}"] = d.psi
        if math.isfinite(d.ks):
            out[f"drift_ks.{metric_part(d.column)}"] = d.ks
    if verdict.compared:
        out["drift_columns_warn"] = float(len(verdict.above("warn")))
        out["drift_columns_fail"] = float(len(verdict.above("fail")))
    return out


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100.0
    lo = int(math.floor(rank))
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def quarantine_counts(summary: ResultsSummary | None) -> list[tuple[str | None, str, int]]:
    """Quarantined rows by (column, check) over all shards, most first."""
    counts: dict[tuple[str | None, str], int] = {}
    for column, check, n in summary.quarantine if summary is not None else ():
        counts[(column, check)] = counts.get((column, check), 0) + n
    return sorted(((c, k, n) for (c, k), n in counts.items()), key=lambda t: (-t[2], str(t[0]), t[1]))


def health_metrics(summary: ResultsSummary, load_seconds: float | None) -> dict[str, float]:
    """Inference health: model latency per batch, batch sizes, model throughput, quarantine
    counts by check and by column and check, model load and warm-up time, and for sequence
    models the real and padded tokens (of the shards' results folded: ``summary``)."""
    out: dict[str, float] = {}
    batches = summary.batches
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
    for column, check, n in quarantine_counts(summary):
        for key in (f"quarantine_rows.{metric_part(check)}",
                    f"quarantine_rows.{metric_part(column)}.{metric_part(check)}"):
            out[key] = out.get(key, 0.0) + n
    model = summary.model
    out["model_warmup_ms"] = model.warmup_ms
    if model.tokens:
        # A model with a lengths input (handlers/tokens.py): what padding cost.
        out["model_tokens"] = float(model.tokens)
        out["model_padded_tokens"] = float(model.padded_tokens)
        out["model_padding_ratio"] = model.padded_tokens / model.tokens
    if load_seconds is not None:
        out["model_load_seconds"] = load_seconds
    return out


def profile_record(job: Job, verdict: DriftVerdict, baseline: Baseline | None,
                   summary: ResultsSummary | None = None) -> dict[str, Any]:
    """What ``_profile.json`` (and a stopped run's ``_drift/<attempt>.json``) holds: a
    :class:`~batchinfer.profile_records.RunProfile`."""
    about = (None if baseline is None else
             BaselineAbout(path=job.display(baseline.path), about=dict(baseline.about),
                           columns={k: v.record() for k, v in baseline.columns.items()}))
    return RunProfile(profile_version=PROFILE_VERSION, job=job.spec.name, ds=job.ds,
                      quarantine=quarantine_counts(summary),
                      level=verdict.level,  # type: ignore[arg-type]
                      baseline=about,
                      limits=LimitsRecord(warn=dict(verdict.warn), fail=dict(verdict.fail)),
                      drift=[d.record() for d in verdict.drifts],
                      columns={k: v.record() for k, v in verdict.columns.items()}).to_dict()


def input_dataset(manifest: Manifest) -> dict[str, str]:
    """The input partition as MLflow dataset tracking names it: its digest covers every shard's
    name and sha256, so two runs over the same bytes log the same dataset."""
    text = "\n".join(f"{s.path}\t{s.sha256 or '-'}" for s in sorted(manifest.shards, key=lambda s: s.path))
    return {"name": f"{manifest.job}-input-{manifest.ds or manifest.attempt}",
            "digest": hashlib.sha256(text.encode()).hexdigest()[:32],
            "source": manifest.shards[0].path.rsplit("/", 1)[0] if manifest.shards else "",
            "rows": str(manifest.totals.rows_in), "shards": str(manifest.totals.shards)}


def keep_drift_report(job: Job, layout: Layout, verdict: DriftVerdict, baseline: Baseline | None,
                      summary: ResultsSummary) -> tuple[dict[str, str], str]:
    """Keep the drift report of a run that drift stopped as ``_drift/<attempt>.json`` and
    ``.html`` (the job report) under ``output.path``, which no cleanup removes. Returns what
    is kept there as MLflow artifacts (``report.html`` and ``drift.json``; what cannot be read
    back is left out), and where it is kept for the error line — or why it could not be (the run
    fails anyway)."""
    shown = job.display(records_url(job))
    kept = f"{DRIFT}/{layout.attempt}"
    where = f"drift report kept in {shown}/{kept}.json"
    profile = profile_record(job, verdict, baseline, summary)
    try:
        write_json(layout.fs, layout.record(f"{kept}.json"), profile)
        metrics = {**health_metrics(summary, None), **drift_metrics(verdict)}
        html = render_report(None, {"metrics": metrics, "params": {"attempt": layout.attempt}}, profile,
                             title=f"{job.spec.name} {job.ds or ''}: stopped by drift")
        layout.fs.pipe_file(layout.record(f"{kept}.html"), html.encode())
    except Exception as exc:  # say why the report is missing
        where = f"the drift report could not be kept ({type(exc).__name__}: {str(exc)[:120]})"
    artifacts = {}
    for suffix, name in ((".html", REPORT), (".json", "drift.json")):
        try:
            artifacts[name] = layout.fs.cat_file(layout.record(f"{kept}{suffix}")).decode()
        except (OSError, UnicodeDecodeError):
            pass
    return artifacts, where


def publish(job: Job, tracking: "TrackingRun", layout: Layout, manifest: Manifest, record: RunRecord,
            profile: dict[str, Any]) -> str:
    """Log the committed run to MLflow and keep the same record in ``_metrics.json``, with
    ``_profile.json`` and ``report.html`` beside it; return the line to print. Nothing here can
    undo the commit."""
    spec = job.spec
    report = render_report(manifest, {"metrics": record.metrics, "params": record.params}, profile)
    uploaded = tracking.finish(record.params, record.metrics,
                               {"manifest.json": json.dumps(manifest.to_dict(), indent=2),
                                REPORT: report},
                               tags=record.tags, dataset=input_dataset(manifest))
    # MLflow's errors quote the tracking URI, which may hold a ${NAME} value (contract §3).
    error = job.display(tracking.error) if tracking.error else None
    kept = MetricsRecord(mlflow_run_id=manifest.mlflow_run_id, uploaded=uploaded, error=error,
                         tracking_uri=job.display(spec.tracking.uri),
                         experiment=spec.tracking.experiment or spec.name,
                         run_name=f"{spec.name}-{job.ds or layout.attempt}",
                         params=dict(record.params), metrics=dict(record.metrics),
                         tags=dict(record.tags)).to_dict()
    try:
        write_json(layout.fs, layout.record(PROFILE), profile)
        write_json(layout.fs, layout.record(METRICS), kept)
        layout.fs.pipe_file(layout.record(REPORT), report.encode())
    except Exception as exc:  # the partition is committed; a missing metrics file is not fatal
        log.warning("could not write %s: %s", METRICS, exc)
    shown = job.display(records_url(job))
    if uploaded:
        return f"MLflow run {manifest.mlflow_run_id} in {job.display(spec.tracking.uri)}"
    return (f"MLflow unavailable ({error}); metrics kept in {shown}/{METRICS}: upload "
            f"later with `batchinfer track {shown}`")
