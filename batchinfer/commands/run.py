"""What the commands do: plan, validate, run (score and commit), stamp, inspect.

The order of :func:`run_job` is the contract's (SPEC §1, §4):

1. resolve everything (schema, preprocessing, shards, model) and check the triple against the
   model's declaration — before any work;
2. look at the partition: committed with the same triple → no-op; another triple → exit 3
   unless ``--overwrite``;
3. run the Beam pipeline into this attempt's folder;
4. apply the quarantine thresholds (exit 4, nothing committed);
5. create ``_manifest.json`` exclusively — the commit; then remove other attempts and scratch;
6. tracking, which can fail without undoing anything.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from .. import faults
from ..triple.contract import Triple, check_contract, model_digest, refuse_pickle
from ..rows.columns import check_output_columns
from ..errors import (BatchInferError, ContractError, DataQualityError, ModelError, RuntimeFailure,
                     SpecError)
from ..io.manifest import (MANIFEST_VERSION, clean_after_commit, commit, read_manifest,
                          remove_attempt)
from ..io.outputs import METRICS, Layout, read_json, write_json
from ..io.shards import Shard, list_input
from ..io.storage import url_to_fs
from ..triple.models import ResolvedModel, declare, resolve_model
from ..triple.preprocess import Preprocessor, load_preprocessor
from ..triple.schemas import SchemaVersion, resolve_schema
from ..spec import Job, resolve_path

log = logging.getLogger("batchinfer")


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def new_attempt(now: datetime) -> str:
    return f"{now:%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"


@dataclass
class Resolved:
    """A job with everything it names looked up and the triple computed."""

    job: Job
    schema: SchemaVersion
    preprocessor: Preprocessor
    features: tuple[str, ...]
    model: ResolvedModel
    triple: Triple
    shards: list[Shard] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)   # metadata files input.path matched

    def shard_names(self) -> tuple[str, ...]:
        return tuple(self.job.display(s.url) for s in self.shards)


def resolve_inputs(job: Job) -> tuple[SchemaVersion, tuple[str, ...], Preprocessor]:
    """The job's schema version, the model's feature columns and the preprocessing step."""
    spec = job.spec
    schema = resolve_schema(spec.schemas.root, spec.schema_)
    missing_ids = [c for c in spec.output.id_columns if c not in schema.columns]
    if missing_ids:
        raise SpecError(f"output.id_columns {missing_ids} are not columns of schema {schema.ref}")
    features = schema.features_for(spec.output.id_columns)
    return schema, features, load_preprocessor(spec.preprocess, job.folder, features)


def resolve(job: Job, *, list_input_files: bool = True, check: bool = True) -> Resolved:
    """Look up schema, preprocessing, model and shards; compute the triple; check the contract."""
    spec = job.spec
    schema, features, preprocessor = resolve_inputs(job)
    refuse_pickle(spec.model.uri, bool(spec.model.options.get("allow_pickle", False)))
    model = resolve_model(spec.model.uri, spec.model.backend, spec.tracking.uri)
    digest = model_digest(model.path, spec.model.backend)
    declared_version = (model.declaration or {}).get("model_version") or spec.model.version or ""
    triple = Triple(declared_version, digest, schema.ref, preprocessor.hash)
    if check:
        check_contract(job.display(spec.model.uri), model.declaration, triple, spec.model.version)
    listing = list_input(spec.input.path) if list_input_files else None
    return Resolved(job, schema, preprocessor, features, model, triple,
                    listing.shards if listing else [], listing.ignored if listing else [])


# -- stamp -------------------------------------------------------------------------------------

def stamp(job: Job, model_uri: str | None, model_version: str | None) -> tuple[Triple, str]:
    """Write the model's declaration for this job's schema and preprocessing."""
    spec = job.spec
    if model_uri is not None:
        job = _with_model(job, model_uri)
    resolved = resolve(job, list_input_files=False, check=False)
    version = model_version or spec.model.version
    if not version:
        if resolved.model.registry:
            version = ":".join(resolved.model.registry)
        else:
            raise SpecError("stamp needs a model version: pass --model-version NAME:V or set "
                            "model.version in the job")
    triple = Triple(version, resolved.triple.model_digest, resolved.triple.schema_version,
                    resolved.triple.preprocess_hash)
    where = declare(resolved.model, triple, job.spec.tracking.uri)
    return triple, where


def _with_model(job: Job, model_uri: str) -> Job:
    """``job`` with ``model.uri`` replaced; a relative path is the user's, from the cwd."""
    model = job.spec.model.model_copy(update={"uri": resolve_path(model_uri, Path.cwd())})
    return dataclasses.replace(job, spec=job.spec.model_copy(update={"model": model}))


# -- run ---------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What a run did, for the CLI to print."""

    status: str                       # committed | noop | lost_race | dry_run
    message: str
    manifest: dict | None = None
    output: str = ""
    tracking: str = ""
    timings: dict = field(default_factory=dict)


def run_job(job: Job, *, overwrite: bool = False, dry_run: bool = False,
            clock: Callable[[], datetime] = utc_now,
            progress: Callable[[str], None] = lambda line: None,
            tracking=None) -> Outcome:
    """Score one partition and commit it (see the module docstring for the order).

    ``tracking`` is a :class:`~batchinfer.io.tracking.TrackingRun` for the job's store that the
    caller started early (its helper needs seconds to be ready); by default one is started here.
    It is closed without a run if the job stops before scoring.
    """
    t_start = time.perf_counter()
    started = clock()
    spec = job.spec
    if tracking is None and not dry_run:
        from ..io.tracking import TrackingRun

        tracking = TrackingRun(spec.tracking.uri, spec.tracking.experiment)
    try:
        return _run_job(job, tracking, overwrite, dry_run, clock, progress, t_start, started)
    finally:
        if tracking is not None:
            tracking.close()  # a no-op once the run was finished; else no run is left behind


def _run_job(job: Job, tracking, overwrite: bool, dry_run: bool, clock, progress,
             t_start: float, started: datetime) -> Outcome:
    spec = job.spec
    resolved = resolve(job)
    out_fs, out_root = url_to_fs(spec.output.path)
    shown_output = job.display(spec.output.path)
    if out_fs.isfile(out_root):
        raise SpecError(f"output.path {shown_output} is a file; it must be a folder (or not exist)")
    existing = read_manifest(out_fs, out_root)
    if existing is not None:
        _refuse_other_partition(existing, job, resolved, shown_output, overwrite)
        same = existing.get("triple") == resolved.triple.as_dict()
        if same and not overwrite:
            if not dry_run:  # a run that crashed after its commit left debris behind
                clean_after_commit(Layout(out_fs, out_root, existing.get("attempt", "")), existing)
            return Outcome("noop", f"{shown_output} is already committed with this triple "
                                   f"(attempt {existing.get('attempt')}); nothing to do",
                           existing, shown_output)
        if not same and not overwrite:
            raise ContractError(_triple_conflict(shown_output, existing.get("triple", {}),
                                                 resolved.triple.as_dict()))
    if dry_run:
        return Outcome("dry_run", f"dry run: would score {len(resolved.shards)} shards into "
                                  f"{shown_output}", None, shown_output)

    handler, device = _handler(resolved)  # the model loads (exit 5) and its outputs are named
    tracking.prepare()  # the checks passed: the store may be touched
    attempt = new_attempt(started)
    tracking.open(f"{spec.name}-{job.ds or attempt}",
                  {"batchinfer.commands.run": spec.name, "batchinfer.attempt": attempt,
                   "batchinfer.ds": job.ds or ""})
    layout = Layout(out_fs, out_root, attempt)
    if resolved.ignored:
        progress(f"ignoring {len(resolved.ignored)} metadata file(s) that input.path matched "
                 f"(names starting with _ or .; `batchinfer plan` lists them)")
    progress(f"scoring {len(resolved.shards)} shards into {shown_output} (attempt {attempt}, "
             f"{spec.runner.name} runner, {device})")
    t_pipeline = time.perf_counter()
    try:
        _run_pipeline(resolved, handler, layout)
        shards = _collect(layout, resolved)
    except KeyboardInterrupt:  # Ctrl-C: leave nothing, and say so in MLflow
        remove_attempt(layout, attempt)
        tracking.finish({"attempt": attempt}, {}, {}, "KILLED", timeout=10.0)
        raise
    except Exception:
        remove_attempt(layout, attempt)
        try:  # a run that committed meanwhile cleans up other attempts, this one's included
            winner = read_manifest(out_fs, out_root)
        except Exception:
            winner = None
        if (winner is not None and winner.get("attempt") != (existing or {}).get("attempt")
                and winner.get("triple") == resolved.triple.as_dict()):
            tracking.finish({"attempt": attempt}, {}, {}, "KILLED")
            return Outcome("lost_race", f"{shown_output} was already committed by attempt "
                                        f"{winner.get('attempt')}; this run's files were removed",
                           winner, shown_output)
        tracking.finish({"attempt": attempt}, {}, {}, "FAILED")
        raise
    pipeline_s = time.perf_counter() - t_pipeline

    totals = _totals(shards)
    _refuse_uncommittable(shards, totals, spec.quarantine, layout, tracking, pipeline_s)

    run_id = tracking.wait()
    finished = clock()
    manifest = {
        "manifest_version": MANIFEST_VERSION, "job": spec.name, "ds": job.ds, "attempt": attempt,
        "triple": resolved.triple.as_dict(), "job_spec_sha256": job.spec_sha256,
        "runner": spec.runner.name, "device": device,
        "started_at": rfc3339(started), "finished_at": rfc3339(finished),
        "mlflow_run_id": run_id, "totals": totals,
        "shards": [{k: v for k, v in s.items() if k not in ("seconds", "model")} for s in shards],
    }
    faults.point("before_commit")
    # Replace only the manifest this run set out to replace: if another --overwrite run
    # committed meanwhile (and its cleanup removed this attempt's files), this run lost.
    replace = overwrite and existing is not None and (
        (read_manifest(out_fs, out_root) or {}).get("attempt") == existing.get("attempt"))
    if not commit(layout, manifest, replace=replace):
        winner = read_manifest(out_fs, out_root) or {}
        remove_attempt(layout, attempt)
        tracking.finish({"attempt": attempt}, {}, {}, "KILLED")
        if winner.get("triple") != resolved.triple.as_dict():
            raise ContractError(_triple_conflict(shown_output, winner.get("triple", {}),
                                                 resolved.triple.as_dict()))
        return Outcome("lost_race", f"{shown_output} was already committed by attempt "
                                    f"{winner.get('attempt')}; this run's files were removed",
                       winner, shown_output)
    faults.point("after_commit")
    if existing is not None and overwrite:
        remove_attempt(layout, existing.get("attempt", ""))
    clean_after_commit(layout, manifest)

    wall_s = time.perf_counter() - t_start
    tracking_line = _finish_tracking(job, resolved, tracking, layout, manifest, device,
                                     _metrics(totals, pipeline_s, wall_s, shards))
    return Outcome("committed", f"committed {shown_output} (attempt {attempt})", manifest,
                   shown_output, tracking_line, {"wall_s": wall_s, "pipeline_s": pipeline_s})


def _refuse_other_partition(existing: dict, job: Job, resolved: Resolved, shown_output: str,
                            overwrite: bool) -> None:
    """A committed manifest is "this partition" only if it is of this job, this date and these
    shards; otherwise a same-triple run would call another partition's predictions its own
    (exit 0, nothing scored). ContractError (exit 3) unless ``--overwrite``."""
    if overwrite:
        return
    spec = job.spec
    if existing.get("job") != spec.name or existing.get("ds") != job.ds:
        raise ContractError(
            f"{shown_output} holds the partition of job {existing.get('job')!r}, ds "
            f"{existing.get('ds')!r}, not of job {spec.name!r}, ds {job.ds!r}: give each job and "
            f"date its own output.path (e.g. out/dt={{ds}}), or pass --overwrite to replace it")
    committed = {s.get("path") for s in existing.get("shards", [])}
    listed = set(resolved.shard_names())
    if committed != listed:
        added, gone = len(listed - committed), len(committed - listed)
        raise ContractError(
            f"{shown_output} was committed from other shards than input.path lists now ({added} "
            f"new, {gone} no longer listed; e.g. {sorted(listed ^ committed)[0]}): pass "
            f"--overwrite to score the partition as it is now")


def _refuse_uncommittable(shards: list[dict], totals: dict, q, layout: Layout, tracking,
                          pipeline_s: float) -> None:
    """Raise (after removing this attempt's files) when the run must not commit: a model that
    raised on every row it was given (exit 5), or bad rows/shards above the thresholds (exit 4)."""
    given = sum((s.get("model") or {}).get("rows", 0) for s in shards)
    raised = sum((s.get("model") or {}).get("raised", 0) for s in shards)
    if given and raised == given:
        # Not the data's fault: a model that raises on every row it is given cannot run at all.
        remove_attempt(layout, layout.attempt)
        tracking.finish({"attempt": layout.attempt}, {}, {}, "FAILED")
        error = next(s["model"]["error"] for s in shards if (s.get("model") or {}).get("error"))
        raise ModelError(f"the model raised on every one of the {given} rows it was given "
                         f"(first error: {error}); nothing committed")
    bad_fraction = totals["rows_quarantined"] / totals["rows_in"] if totals["rows_in"] else 0.0
    if bad_fraction > q.max_bad_fraction or totals["shards_unreadable"] > q.max_bad_shards:
        remove_attempt(layout, layout.attempt)
        tracking.finish({"attempt": layout.attempt}, _metrics(totals, pipeline_s, 0.0, shards),
                        {}, "FAILED")
        raise DataQualityError(
            f"data quality: {totals['rows_quarantined']} of {totals['rows_in']} rows quarantined "
            f"({bad_fraction:.2%}, max {q.max_bad_fraction:.2%}) and "
            f"{totals['shards_unreadable']} unreadable shards (max {q.max_bad_shards}); nothing "
            f"committed: run `batchinfer validate` to see why")


def _finish_tracking(job: Job, resolved: Resolved, tracking, layout: Layout, manifest: dict,
                     device: str, metrics: dict) -> str:
    """Log the committed run to MLflow and keep the same record in ``_metrics.json``; return
    the line to print. Nothing here can undo the commit."""
    spec, attempt = job.spec, layout.attempt
    params = {**{f"triple.{k}": v for k, v in resolved.triple.as_dict().items()},
              "job": spec.name, "ds": job.ds or "", "attempt": attempt,
              "job_spec_sha256": job.spec_sha256, "runner": spec.runner.name, "device": device,
              "schema": resolved.schema.ref, "backend": spec.model.backend}
    uploaded = tracking.finish(params, metrics, {"manifest.json": json.dumps(manifest, indent=2)})
    # MLflow's errors quote the tracking URI, which may hold a ${NAME} value (SPEC §3).
    error = job.display(tracking.error) if tracking.error else None
    record = {"mlflow_run_id": manifest["mlflow_run_id"], "uploaded": uploaded, "error": error,
              "tracking_uri": job.display(spec.tracking.uri), "experiment": spec.tracking.experiment,
              "run_name": f"{spec.name}-{job.ds or attempt}", "params": params, "metrics": metrics,
              "tags": {"batchinfer.commands.run": spec.name, "batchinfer.attempt": attempt}}
    try:
        write_json(layout.fs, layout.abs(METRICS), record)
    except Exception as exc:  # the partition is committed; a missing metrics file is not fatal
        log.warning("could not write %s: %s", METRICS, exc)
    shown_output = job.display(spec.output.path)
    if uploaded:
        return f"MLflow run {manifest['mlflow_run_id']} in {job.display(spec.tracking.uri)}"
    return (f"MLflow unavailable ({error}); metrics kept in {shown_output}/{METRICS}: upload "
            f"later with `batchinfer track {shown_output}`")


def _handler(resolved: Resolved):
    """Build the backend's handler and load the model once before any work (exit 5 early);
    in-process workers reuse this load (see handlers.base.shared_model)."""
    from ..handlers import handler_class

    spec = resolved.job.spec.model
    cls = handler_class(spec.backend)
    options = {k: v for k, v in spec.options.items() if k != "allow_pickle"}
    handler = cls(str(resolved.model.path), digest=resolved.triple.model_digest,
                  device=spec.device, options=options)
    model = handler.load_model()
    outputs = handler.output_names(model)
    output_spec = resolved.job.spec.output
    wanted = output_spec.predictions
    if wanted:
        unknown = [o for o in wanted if o not in outputs]
        if unknown:
            raise SpecError(f"output.predictions names {unknown}, which the model does not output "
                            f"(its outputs: {outputs})")
    else:  # each output becomes a column of its own name: it must not take an id's or ours
        check_output_columns(output_spec.id_columns, {o: o for o in outputs},
                             source="the model's outputs (output.predictions maps none)")
    return handler, handler.device_used()


def _run_pipeline(resolved: Resolved, handler, layout: Layout) -> None:
    import apache_beam as beam

    from ..pipeline.transforms import ScoringPlan, build
    from ..pipeline.runners import pipeline_options

    spec = resolved.job.spec
    plan = ScoringPlan(
        shard_urls=tuple(s.url for s in resolved.shards), shard_names=resolved.shard_names(),
        output_url=spec.output.path, attempt=layout.attempt, batch_rows=spec.batch.rows,
        schema=resolved.schema, preprocessor=resolved.preprocessor, triple=resolved.triple,
        id_columns=tuple(spec.output.id_columns),
        prediction_names=dict(spec.output.predictions) if spec.output.predictions else None,
        hash_columns=resolved.schema.columns)
    options = pipeline_options(spec.runner.name, spec.runner.options)
    try:
        with beam.Pipeline(options=options) as pipeline:
            build(pipeline, plan, handler)
    except Exception as exc:
        if _interrupted(exc):  # Beam wraps a Ctrl-C inside a transform in an Exception
            raise KeyboardInterrupt from None
        ours = _our_error(exc)
        if ours is not None:  # raised on purpose inside a transform: its own message and code
            raise ours from None
        raise RuntimeFailure(f"the scoring pipeline failed: {_last_line(exc)}") from exc


def _our_error(exc: BaseException) -> BatchInferError | None:
    """The first BatchInferError a transform raised, from the chain Beam wraps it in (Beam
    re-raises the same type with "[while running 'Stage']" appended, the original as cause)."""
    found, seen = None, set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, BatchInferError):
            found = exc
        exc = exc.__cause__ or exc.__context__
    return found


def _interrupted(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _collect(layout: Layout, resolved: Resolved) -> list[dict]:
    shards = []
    for shard in resolved.shards:
        try:
            shards.append(read_json(layout.fs, layout.shard_result(shard.index)))
        except FileNotFoundError:
            raise RuntimeFailure(f"shard {resolved.shard_names()[shard.index]} has no result: the "
                                 f"pipeline ended without finishing it (or another run removed "
                                 f"this attempt's files)") from None
    return shards


def _totals(shards: list[dict]) -> dict:
    return {"shards": len(shards),
            "rows_in": sum(s["rows_in"] or 0 for s in shards),
            "rows_scored": sum(s["rows_scored"] for s in shards),
            "rows_quarantined": sum(s["rows_quarantined"] for s in shards),
            "shards_unreadable": sum(s["status"] == "unreadable" for s in shards)}


def _metrics(totals: dict, pipeline_s: float, wall_s: float, shards: list[dict]) -> dict:
    metrics = {k: float(v) for k, v in totals.items()}
    metrics["pipeline_seconds"] = pipeline_s
    # Where the time went, per stage, summed over batches (stages overlap across workers).
    for shard in shards:
        for stage, value in (shard.get("seconds") or {}).items():
            key = f"stage_seconds_{stage}"
            metrics[key] = metrics.get(key, 0.0) + value
    if wall_s:
        metrics["wall_seconds"] = wall_s
        metrics["rows_per_second"] = totals["rows_in"] / wall_s if wall_s else 0.0
    return metrics


def _triple_conflict(output: str, committed: dict, wanted: dict) -> str:
    diffs = [f"{k} committed {committed.get(k)} now {wanted[k]}" for k in wanted
             if committed.get(k) != wanted[k]]
    return (f"{output} is committed under another triple ({'; '.join(diffs)}): pass --overwrite "
            f"to replace it")


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:400]


# -- validate ----------------------------------------------------------------------------------

@dataclass
class ValidationReport:
    shards: int
    rows_in: int
    rows_bad: int
    unreadable: list[tuple[str, str]]
    by_reason: dict[tuple[str, str], int]     # (column, check) → rows whose first failure it is
    ignored: list[str] = field(default_factory=list)   # metadata files input.path matched

    @property
    def bad_fraction(self) -> float:
        return self.rows_bad / self.rows_in if self.rows_in else 0.0


def validate_input(job: Job) -> ValidationReport:
    """Check every shard against the schema only (no preprocessing, no model, no writes).

    Unlike ``run``, this needs no model declaration: it answers "is this data fit?" alone.
    """
    from ..io.shards import ShardReader, Unreadable
    from ..rows.validation import validate_batch

    spec = job.spec
    schema = resolve_schema(spec.schemas.root, spec.schema_)
    listing = list_input(spec.input.path)
    shards = listing.shards
    rows_in = rows_bad = 0
    unreadable: list[tuple[str, str]] = []
    by_reason: dict[tuple[str, str], int] = {}
    for shard in shards:
        name = job.display(shard.url)
        try:
            reader = ShardReader(shard.url)
            first = 0
            counts: dict[tuple[str, str], int] = {}
            bad = 0
            for batch in reader.batches(spec.batch.rows):
                result = validate_batch(batch, schema.schema, source_shard=name, first_row=first)
                first += batch.num_rows
                q = result.quarantine
                bad += q.num_rows
                if q.num_rows:
                    pairs = zip(q.column("_column").to_pylist(), q.column("_check").to_pylist())
                    for column, check in pairs:
                        key = (column or "", check)
                        counts[key] = counts.get(key, 0) + 1
        except Unreadable as exc:
            unreadable.append((name, str(exc)))
            continue
        rows_in += reader.num_rows
        rows_bad += bad
        for key, n in counts.items():
            by_reason[key] = by_reason.get(key, 0) + n
    return ValidationReport(len(shards), rows_in, rows_bad, unreadable, by_reason,
                            [job.display(url) for url in listing.ignored])


# -- inspect -----------------------------------------------------------------------------------

def inspect_output(url: str) -> dict:
    """The committed manifest of ``url`` (raises SpecError when nothing is committed there)."""
    fs, root = url_to_fs(url)
    manifest = read_manifest(fs, root)
    if manifest is None:
        raise SpecError(f"{url} holds no committed partition (no _manifest.json)")
    return manifest


def upload_tracking(url: str, tracking_uri: str | None = None) -> str:
    """Upload the ``_metrics.json`` of a committed output that MLflow missed; return run id."""
    from ..io.tracking import upload_pending

    fs, root = url_to_fs(url)
    manifest = inspect_output(url)
    from ..io.storage import join

    try:
        record = read_json(fs, join(root, METRICS))
    except FileNotFoundError:
        raise SpecError(f"{url} has no {METRICS} to upload") from None
    if record.get("uploaded"):
        return record.get("mlflow_run_id") or ""
    record["manifest_text"] = json.dumps(manifest, indent=2)
    # The record shows ${NAME} in place of environment values (SPEC §3): expand them again.
    uri = tracking_uri or os.path.expandvars(record["tracking_uri"])
    run_id = upload_pending(uri, record["experiment"], record)
    record.pop("manifest_text")
    record.update({"uploaded": True, "mlflow_run_id": run_id, "error": None})
    write_json(fs, join(root, METRICS), record)
    return run_id
