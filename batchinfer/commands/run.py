"""``batchinfer run``: score one partition and commit it.

:func:`run_job` follows the contract's order (contract §1, §4, §5):

1. resolve everything (schema, preprocessing, shards, model) and check the triple against the
   model's declaration — before any work;
2. look at the partition: committed already → a no-op, or exit 3 (another triple, job, date or
   set of shards) unless ``--overwrite``; then load the model (exit 5 before any work);
3. run the Beam pipeline into a new attempt of the partition; its last step applies the
   quarantine thresholds (exit 4, nothing committed) and commits: exactly one run creates the
   manifest (:mod:`batchinfer.pipeline.commit`, :class:`~batchinfer.io.commit.PartitionCommit`).
   The commit happens inside the pipeline so that it does not depend on this process outliving
   a remote job (docs/runners.md);
4. read back what the commit step did (its exit code for a refusal);
5. tracking, which can fail without undoing anything.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ..backends import declared_options, handler_class
from ..errors import (
    BatchInferError,
    ContractError,
    DataQualityError,
    ModelError,
    PreprocessError,
    RuntimeFailure,
    SpecError,
)
from ..io.commit import Attempt, CommitOutcome, PartitionCommit
from ..io.outputs import DRIFT, METRICS, PROFILE, REPORT, write_json
from ..io.records import Challenger, Manifest, ModelStats, PreprocessStats, ShardResult, Totals
from ..pipeline.runners import check as check_runner
from ..redaction import mask
from ..rows.columns import check_output_columns
from ..spec import Job, ModelFields
from .monitor import Baseline, DriftGate, Monitoring, health_metrics, load_baseline, monitor
from .resolve import Resolved, ResolvedChallenger, resolve

if TYPE_CHECKING:
    from ..handlers.base import BatchModelHandler
    from ..io.tracking import TrackingRun
    from ..triple.models import ResolvedModel

log = logging.getLogger("batchinfer")


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def new_attempt(now: datetime) -> str:
    return f"{now:%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"


@dataclass
class Outcome:
    """What a run did, for the CLI to print."""

    status: str                       # committed | noop | lost_race | dry_run
    message: str
    manifest: Manifest | None = None
    output: str = ""
    tracking: str = ""
    timings: dict = field(default_factory=dict)
    drift: str = "none"               # the drift level: none (no baseline) | ok | warn


def run_job(job: Job, *, overwrite: bool = False, dry_run: bool = False,
            clock: Callable[[], datetime] = utc_now,
            progress: Callable[[str], None] = lambda line: None,
            tracking: "TrackingRun | None" = None,
            watch: "Callable[[int], Any] | None" = None) -> Outcome:
    """Score one partition and commit it (see the module docstring for the order).

    Args:
        tracking: a :class:`~batchinfer.io.tracking.TrackingRun` for the job's store that the
            caller started early (its helper needs seconds to be ready); by default one is
            started here. It is closed without a run if the job stops before scoring.
        watch: called with the number of shards when scoring starts; returns a context manager
            that shows live progress while the pipeline runs (see ``commands/progress.py``).

    Raises:
        BatchInferError: with the exit code of what went wrong (contract §2).
    """
    t_start = time.perf_counter()
    started = clock()
    spec = job.spec
    if tracking is None and not dry_run:
        from ..io.tracking import TrackingRun

        tracking = TrackingRun(spec.tracking.uri, spec.tracking.experiment or spec.name)
    try:
        # 1. resolve and check the contract, and the runner's options
        resolved = resolve(job)
        check_runner(spec.runner.name, spec.runner.options)
        # exit 2 before any work when it cannot be read
        baseline = load_baseline(job, resolved.model.declaration)
        # 2. the partition as it is
        partition = PartitionCommit(spec.output.path)
        shown = job.display(spec.output.path)
        existing = _look_at(partition, job, resolved, shown, overwrite)
        if existing is not None and not overwrite:
            if not dry_run:  # a run that crashed after its commit left debris behind
                partition.tidy(existing)
            return Outcome("noop", f"{shown} is already committed with this triple (attempt "
                                   f"{existing.attempt}); nothing to do", existing, shown)
        if dry_run:
            message = f"dry run: would score {len(resolved.shards)} shards into {shown}"
            if spec.runner.name in BUILDS_JOB:  # build the runner's job too, submit nothing
                handler, device = load_handler(resolved)
                challengers = load_challengers(resolved)
                attempt = partition.begin(new_attempt(started), replacing=existing)
                header = _header(job, resolved, attempt, device, started, None, challengers)
                message += f"\n{_build_job(resolved, handler, attempt, header, challengers)}"
            return Outcome("dry_run", message, None, shown)
        assert tracking is not None
        t_load = time.perf_counter()
        handler, device = load_handler(resolved)
        challengers = load_challengers(resolved)
        load_s = time.perf_counter() - t_load
        if baseline is not None:  # the columns it is compared on, known now (exit 2 if none)
            baseline = baseline.for_run([*resolved.features, *prediction_columns(resolved)])
        tracking.prepare()  # the checks passed: the store may be touched
        attempt = partition.begin(new_attempt(started), replacing=existing)
        tracking.open(f"{spec.name}-{job.ds or attempt.attempt}",
                      {"batchinfer.job": spec.name, "batchinfer.attempt": attempt.attempt,
                       "batchinfer.ds": job.ds or ""}, started=started)
        if resolved.ignored:
            progress(f"ignoring {len(resolved.ignored)} metadata file(s) that input.path matched "
                     f"(names starting with _ or .; `batchinfer plan` lists them)")
        progress(f"scoring {len(resolved.shards)} shards into {shown} (attempt "
                 f"{attempt.attempt}, {spec.runner.name} runner, {device})")
        # 3. score into the attempt and commit, in the pipeline. The manifest names the MLflow
        # run, so its id is needed before the pipeline starts (the helper opened it meanwhile).
        header = _header(job, resolved, attempt, device, started, tracking.wait(), challengers)
        t_pipeline = time.perf_counter()
        try:
            _score(resolved, handler, attempt, header, baseline, watch, challengers)
        except KeyboardInterrupt:  # Ctrl-C: leave nothing, and say so in MLflow
            winner = attempt.committed_meanwhile()
            if winner is None or winner.attempt != attempt.attempt:  # never undo a commit
                attempt.abort()
            tracking.finish({"attempt": attempt.attempt}, {}, {}, "KILLED", timeout=10.0)
            raise
        except Exception:
            winner = attempt.committed_meanwhile()
            if winner is None or winner.attempt != attempt.attempt:
                # Never abort a commit that happened: the runner may fail after the commit step.
                attempt.abort()
                if winner is not None and winner.triple == resolved.triple.as_dict():
                    tracking.finish({"attempt": attempt.attempt}, {}, {}, "KILLED")
                    return _lost(winner, shown, resolved)
                tracking.finish({"attempt": attempt.attempt}, {}, {}, "FAILED")
                raise
        pipeline_s = time.perf_counter() - t_pipeline
        # 4. what the commit step did
        outcome = attempt.outcome(resolved.triple.as_dict())
        results = list(outcome.results)
        totals = Totals.of([r.record for r in results])
        watched = monitor(job, results, resolved.features, baseline)
        if outcome.status == "refused":
            attempt.abort()  # its files went in the pipeline; the record goes now
            error = _refusal(outcome)
            drifted = (outcome.message or "").startswith("drift:")
            kept = _drift_report(attempt) if drifted else {}  # _drift/ is kept: no cleanup there
            tags = {**_run_tags(job, attempt, device), "batchinfer.error": error.message,
                    "batchinfer.exit_code": str(error.exit_code)}
            if drifted:
                tags["batchinfer.drift"] = "fail"
            tracking.finish(_run_params(job, resolved, attempt, device),
                            {**_metrics(totals, pipeline_s, 0.0, results, load_s), **watched.metrics()},
                            kept, "FAILED", tags=tags)
            raise error
        if watched.level == "warn":
            log.warning("drift: %s", watched.summary("warn"))
        if outcome.status != "committed" or outcome.manifest is None:
            attempt.abort()
            tracking.finish({"attempt": attempt.attempt}, {}, {}, "KILLED")
            if outcome.status == "conflict":
                raise ContractError(_triple_conflict(
                    shown, outcome.manifest.triple if outcome.manifest else {},
                    resolved.triple.as_dict()))
            return _lost(outcome.manifest, shown, resolved)
        manifest = outcome.manifest
        partition.tidy(manifest)  # the commit step's record
        if not results:  # the record was lost; the manifest has the counts
            totals = manifest.totals
        # 5. tracking
        wall_s = time.perf_counter() - t_start
        line = _finish_tracking(job, resolved, tracking, attempt, manifest, device,
                                {**_metrics(totals, pipeline_s, wall_s, results, load_s),
                                 **watched.metrics()}, watched, results)
        return Outcome("committed", f"committed {shown} (attempt {attempt.attempt})", manifest,
                       shown, line, {"wall_s": wall_s, "pipeline_s": pipeline_s}, watched.level)
    finally:
        if tracking is not None:
            tracking.close()  # a no-op once the run was finished; else no run is left behind


def _look_at(partition: PartitionCommit, job: Job, resolved: Resolved, shown: str,
             overwrite: bool) -> Manifest | None:
    """The manifest committed at the output now, if it is this partition's (a no-op, or the one
    ``--overwrite`` replaces).

    A committed manifest is "this partition" only if it is of this job, this date and these
    shards, with this triple; otherwise a run would call another partition's predictions its
    own (exit 0, nothing scored).

    Raises:
        SpecError: ``output.path`` is a file.
        ContractError: another triple, job, date or set of shards, without ``--overwrite``.
    """
    if partition.is_file():
        raise SpecError(f"output.path {shown} is a file; it must be a folder (or not exist)")
    existing = partition.committed()
    if existing is None or overwrite:
        return existing
    spec = job.spec
    if existing.job != spec.name or existing.ds != job.ds:
        raise ContractError(
            f"{shown} holds the partition of job {existing.job!r}, ds {existing.ds!r}, not of job "
            f"{spec.name!r}, ds {job.ds!r}: give each job and date its own output.path (e.g. "
            f"out/dt={{ds}}), or pass --overwrite to replace it")
    committed = {s.path for s in existing.shards}
    listed = set(resolved.shard_names())
    # Partitions committed before only secrets were masked name their shards with every
    # ${NAME} value put back: the same shards, named as then.
    if committed != listed and committed != {mask(s.url, job.templated) for s in resolved.shards}:
        added, gone = len(listed - committed), len(committed - listed)
        raise ContractError(
            f"{shown} was committed from other shards than input.path lists now ({added} new, "
            f"{gone} no longer listed; e.g. {sorted(listed ^ committed)[0]}): pass --overwrite "
            f"to score the partition as it is now")
    if existing.triple != resolved.triple.as_dict():
        raise ContractError(_triple_conflict(shown, existing.triple, resolved.triple.as_dict()))
    declared = _declared(job.spec.model)
    if existing.model_options != declared:
        raise ContractError(
            f"{shown} was committed with model.options {existing.model_options or '{}'}, which "
            f"change predictions; this run has {declared}: pass --overwrite to replace it")
    missing = _not_committed(existing, resolved.challengers)
    if missing:
        # The job asks for challenger predictions the partition does not have: a silent no-op
        # would leave the user without them. Challengers it has and this run does not ask for
        # (an analyst's one-off comparison) are no reason to refuse: the champion's are here.
        names = ", ".join(c.name for c in existing.challengers) or "none"
        raise ContractError(
            f"{shown} was committed without challenger {', '.join(missing)} as this run declares "
            f"it (committed: {names}; a challenger counts only with the same name, triple and "
            f"declared options): pass --overwrite to score the partition with this run's "
            f"challengers")
    return existing


def _not_committed(manifest: Manifest, challengers: Sequence[ResolvedChallenger]) -> list[str]:
    """The names of ``challengers`` that ``manifest`` does not hold as they are declared now
    (same name, triple and declared options); the manifest may hold others besides."""
    committed = [c.as_run() for c in manifest.challengers]
    return [c.name for c in challengers if _challenger_run(c) not in committed]


def _declared(model: ModelFields) -> dict[str, str]:
    """The values of a model's backend's declared options (they change predictions)."""
    return declared_options(model.backend, model.options)


def _challenger_run(challenger: ResolvedChallenger) -> tuple[str, dict[str, str], dict[str, str]]:
    return challenger.name, challenger.triple.as_dict(), _declared(challenger.spec)


def load_handler(resolved: Resolved) -> "tuple[BatchModelHandler, str]":
    """Build the champion's handler and load the model once before any work (exit 5 early; in-
    process workers reuse this load, see handlers.base.shared_model). The model's outputs must
    name prediction columns that collide with nothing (exit 2). Returns the handler and the
    device the model runs on."""
    handler, device, _ = _load(resolved, resolved.job.spec.model, resolved.model,
                               resolved.triple.model_digest, resolved.job.spec.output.predictions)
    return handler, device


def load_challengers(resolved: Resolved) -> "list[tuple[BatchModelHandler, str]]":
    """Each challenger's handler and device, loaded before any work like the champion's; an
    error names the challenger (the exit code stays the champion's: 5 not loading, 2 outputs).
    A challenger writes exactly the champion's prediction columns, in their order: through its
    own ``predictions`` mapping, else through ``output.predictions``, else its outputs must be
    named as the champion's (exit 2 otherwise)."""
    if not resolved.challengers:
        return []
    output = resolved.job.spec.output
    columns = prediction_columns(resolved)   # the champion's outputs, or as mapped
    loaded = []
    for challenger in resolved.challengers:
        own = challenger.spec.predictions
        try:
            handler, device, outputs = _load(
                resolved, challenger.spec, challenger.model, challenger.triple.model_digest,
                output.predictions if own is None else own,
                "output.predictions" if own is None else "its predictions")
            hint = (f"map them with the challenger's predictions: "
                    f"{{{', '.join(f'{o}: {c}' for o, c in zip(outputs, columns))}}}"
                    if len(outputs) == len(columns) else "map them with the challenger's predictions")
            if own is not None and list(own.values()) != columns:
                raise SpecError(f"its predictions map to the columns {list(own.values())}, not "
                                f"to the champion's prediction columns {columns} (the same "
                                f"names in the same order): {hint}")
            if own is None and not output.predictions and outputs != columns:
                raise SpecError(f"its outputs {outputs} are not the champion's {columns}: "
                                f"{hint}, or export it with the champion's output names")
        except BatchInferError as exc:
            raise type(exc)(f"challenger {challenger.name}: {exc.message}") from None
        loaded.append((handler, device))
    return loaded


def _load(resolved: Resolved, spec: ModelFields, found: "ResolvedModel", digest: str,
          predictions: dict[str, str] | None,
          key: str = "output.predictions") -> "tuple[BatchModelHandler, str, list[str]]":
    """Load one model; ``predictions`` (named ``key`` in errors) maps its outputs to columns."""
    batch = resolved.job.spec.batch   # a challenger gets the champion's batches: sized alike
    cls = handler_class(spec.backend)
    options = {k: v for k, v in spec.options.items() if k != "allow_pickle"}
    handler = cls(str(found.path), digest=digest, device=spec.device, options=options,
                  tokens=batch.tokens, lengths_from=batch.lengths_from,
                  sequence_inputs=batch.sequence_inputs)
    declared = found.declaration or {}
    for key, here in handler.runtime_facts().items():
        # e.g. a TensorRT engine runs only under the TensorRT version and on the GPU
        # architecture it was built for; loading it elsewhere fails, or worse, does not.
        if key in declared and declared[key] != here:
            raise ModelError(f"{resolved.job.display(spec.uri)} was built for {key} "
                             f"{declared[key]} but this machine has {here}: rebuild the model "
                             f"here (batchinfer export) and stamp it, or run where it was built")
    model = handler.load_model()
    if batch.tokens:
        inputs = handler.loaded(model).input_names()
        if batch.lengths_from not in inputs:
            raise SpecError(f"batch.tokens sizes model calls by the lengths in the model input "
                            f"{batch.lengths_from!r}, which this model does not take (its inputs: "
                            f"{inputs}): set batch.lengths_from, or size batches by batch.rows")
        handler.sequence_inputs(model)   # which inputs a call cuts: exit 2 here if it cannot tell
    outputs = handler.loaded(model).output_names()
    output_spec = resolved.job.spec.output
    if predictions:
        unknown = [o for o in predictions if o not in outputs]
        if unknown:
            raise SpecError(f"{key} names {unknown}, which the model does not output "
                            f"(its outputs: {outputs})")
    else:  # each output becomes a column of its own name: it must not take an id's or ours
        check_output_columns(output_spec.id_columns, {o: o for o in outputs},
                             source="the model's outputs (output.predictions maps none)")
    return handler, handler.loaded(model).device_used(), list(outputs)


def _header(job: Job, resolved: Resolved, attempt: Attempt, device: str, started: datetime,
            mlflow_run_id: str | None,
            challengers: "Sequence[tuple[BatchModelHandler, str]]" = ()) -> Manifest:
    """The manifest as known before any work; the commit step adds shards, totals, end time
    (and each challenger's shards)."""
    spec = job.spec
    entries = tuple(Challenger(c.name, c.triple.as_dict(), c.spec.backend, its_device,
                               _declared(c.spec))
                    for c, (_, its_device) in zip(resolved.challengers, challengers, strict=True))
    return Manifest(job=spec.name, ds=job.ds, attempt=attempt.attempt,
                    triple=resolved.triple.as_dict(), job_spec_sha256=job.spec_sha256,
                    runner=spec.runner.name, device=device, backend=spec.model.backend,
                    model_options=_declared(spec.model), started_at=rfc3339(started),
                    finished_at="", mlflow_run_id=mlflow_run_id, totals=Totals.of([]), shards=(),
                    challengers=entries)


# Runners whose job `run --dry-run` builds for real (Beam's dry_run option: the job graph is
# built, the DoFns pickled, the options validated, nothing submitted). Only Beam's
# DataflowRunner honours dry_run; the others would run the job.
BUILDS_JOB = {"dataflow"}


def _build_job(resolved: Resolved, handler: "BatchModelHandler", attempt: Attempt,
               header: Manifest, challengers: "Sequence[tuple[BatchModelHandler, str]]") -> str:
    """Build the runner's job without submitting it; return a summary of its graph."""
    from ..beam_compat import beam
    from ..pipeline.runners import job_summary, pipeline_options
    from ..pipeline.transforms import build

    spec = resolved.job.spec
    options = pipeline_options(spec.runner.name, {**spec.runner.options, "dry_run": "true"})
    try:
        pipeline = beam.Pipeline(options=options)
        build(pipeline, *_plans(resolved, attempt, header, load_baseline(resolved.job, resolved.model.declaration)),
              handler=handler,
              challenger_handlers=[h for h, _ in challengers])
        result = pipeline.run()
    except (ImportError, ValueError) as exc:  # a missing extra, options Beam refuses
        raise SpecError(f"runner {spec.runner.name}: {_last_line(exc)}") from exc
    return job_summary(result)


def _score(resolved: Resolved, handler: "BatchModelHandler", attempt: Attempt, header: Manifest,
           baseline: Baseline | None = None, watch: "Callable[[int], Any] | None" = None,
           challengers: "Sequence[tuple[BatchModelHandler, str]]" = ()) -> None:
    """Run the Beam pipeline into ``attempt``, up to and including its commit step.

    Raises:
        BatchInferError: one that a transform raised on purpose (its own message and code).
        KeyboardInterrupt: Ctrl-C, however Beam wrapped it.
        RuntimeFailure: the pipeline failed otherwise.
    """
    from ..beam_compat import beam
    from ..pipeline.runners import pipeline_options
    from ..pipeline.transforms import build

    spec = resolved.job.spec
    options = pipeline_options(spec.runner.name, spec.runner.options)
    try:
        with watch(len(resolved.shards)) if watch else contextlib.nullcontext():
            with beam.Pipeline(options=options) as pipeline:
                build(pipeline, *_plans(resolved, attempt, header, baseline), handler=handler,
                      challenger_handlers=[h for h, _ in challengers])
    except Exception as exc:
        if _interrupted(exc):  # Beam wraps a Ctrl-C inside a transform in an Exception
            raise KeyboardInterrupt from None
        ours = _our_error(exc)
        if ours is not None:
            # Its own cause stays (a preprocessing fault's is the function's exception, which
            # --debug shows); Beam's wrapping goes.
            raise ours from ours.__cause__
        raise RuntimeFailure(f"the scoring pipeline failed: {_last_line(exc)}") from exc


def _plans(resolved: Resolved, attempt: Attempt, header: Manifest,
           baseline: Baseline | None = None) -> tuple[Any, Any]:
    """The pipeline's :class:`ScoringPlan` and :class:`CommitPlan` for ``attempt``; with a
    baseline, the writer stage counts columns into its cuts and the commit step refuses a
    partition that drifted above the ``fail`` limits (:class:`~.monitor.DriftGate`)."""
    from ..pipeline.commit import CommitPlan
    from ..pipeline.transforms import ChallengerPlan, ScoringPlan

    spec = resolved.job.spec
    plan = ScoringPlan(
        shard_urls=tuple(s.url for s in resolved.shards), shard_names=resolved.shard_names(),
        output_url=spec.output.path, attempt=attempt.attempt, batch_rows=spec.batch.rows,
        schema=resolved.schema, preprocessor=resolved.preprocessor, triple=resolved.triple,
        id_columns=tuple(spec.output.id_columns),
        prediction_names=dict(spec.output.predictions) if spec.output.predictions else None,
        hash_columns=resolved.schema.columns, profile_features=tuple(resolved.features),
        profile_cuts=baseline.cuts() if baseline else {},
        challengers=tuple(ChallengerPlan(c.name, c.triple, c.spec.predictions)
                          for c in resolved.challengers))
    gate = DriftGate(resolved.job, tuple(resolved.features), baseline) if baseline is not None else None
    commit = CommitPlan(output_url=spec.output.path, attempt=attempt.attempt,
                        replacing=attempt.replacing, shard_count=len(resolved.shards),
                        header=header, breach=spec.quarantine.breach, drift=gate,
                        preprocess=spec.preprocess)
    return plan, commit


def _refusal(outcome: CommitOutcome) -> BatchInferError:
    """The error of a refused commit, from the code and message the commit step recorded."""
    message = outcome.message or "nothing committed"
    if outcome.code == PreprocessError.exit_code:
        # The function's exception stayed on the worker; its traceback came back as text.
        trace = sum((r.preprocess for r in outcome.results), PreprocessStats()).trace
        if trace:
            log.debug("the preprocessing's first failure:\n%s", trace.rstrip())
        return PreprocessError(message)
    return ModelError(message) if outcome.code == ModelError.exit_code else DataQualityError(message)


def prediction_columns(resolved: Resolved) -> list[str]:
    """The champion's prediction columns: as ``output.predictions`` maps them, else the model's
    output names (the model is loaded already: a cache look-up)."""
    mapped = resolved.job.spec.output.predictions
    if mapped:
        return list(mapped.values())
    return _load(resolved, resolved.job.spec.model, resolved.model, resolved.triple.model_digest,
                 None)[2]


def _run_params(job: Job, resolved: Resolved, attempt: Attempt, device: str) -> dict[str, str]:
    """The MLflow params of a run, committed or refused: the triple and how it ran."""
    spec = job.spec
    return {**{f"triple.{k}": v for k, v in resolved.triple.as_dict().items()},
            "job": spec.name, "ds": job.ds or "", "attempt": attempt.attempt,
            "job_spec_sha256": job.spec_sha256, "runner": spec.runner.name, "device": device,
            "schema": resolved.schema.ref, "backend": spec.model.backend}


def _run_tags(job: Job, attempt: Attempt, device: str) -> dict[str, str]:
    return {"batchinfer.job": job.spec.name, "batchinfer.attempt": attempt.attempt,
            "batchinfer.device": device}


def _drift_report(attempt: Attempt) -> dict[str, str]:
    """The drift report that the commit step kept for a run drift stopped, as MLflow artifacts
    (``report.html``, the job report, and ``drift.json``); what cannot be read is left out."""
    layout, found = attempt.layout, {}
    for suffix, name in ((".html", REPORT), (".json", "drift.json")):
        try:
            found[name] = layout.fs.cat_file(layout.abs(f"{DRIFT}/{attempt.attempt}{suffix}")).decode()
        except (OSError, UnicodeDecodeError):
            pass
    return found


def _finish_tracking(job: Job, resolved: Resolved, tracking: "TrackingRun", attempt: Attempt,
                     manifest: Manifest, device: str, metrics: dict, watched: Monitoring,
                     results: list[ShardResult]) -> str:
    """Log the committed run to MLflow and keep the same record in ``_metrics.json``; return
    the line to print. Nothing here can undo the commit."""
    spec = job.spec
    params = _run_params(job, resolved, attempt, device)
    profile = watched.to_dict(job, results)
    tags = _run_tags(job, attempt, device)
    if watched.level != "none":
        tags["batchinfer.drift"] = watched.level
    from .report import render_report

    report = render_report(manifest, {"metrics": metrics, "params": params}, profile)
    uploaded = tracking.finish(params, metrics,
                               {"manifest.json": json.dumps(manifest.to_dict(), indent=2),
                                REPORT: report},
                               tags=tags, dataset=input_dataset(manifest))
    # MLflow's errors quote the tracking URI, which may hold a ${NAME} value (contract §3).
    error = job.display(tracking.error) if tracking.error else None
    record = {"mlflow_run_id": manifest.mlflow_run_id, "uploaded": uploaded, "error": error,
              "tracking_uri": job.display(spec.tracking.uri), "experiment": spec.tracking.experiment,
              "run_name": f"{spec.name}-{job.ds or attempt.attempt}", "params": params,
              "metrics": metrics, "tags": tags}
    layout = attempt.layout
    try:
        write_json(layout.fs, layout.abs(PROFILE), profile)
        write_json(layout.fs, layout.abs(METRICS), record)
        layout.fs.pipe_file(layout.abs(REPORT), report.encode())
    except Exception as exc:  # the partition is committed; a missing metrics file is not fatal
        log.warning("could not write %s: %s", METRICS, exc)
    shown = job.display(spec.output.path)
    if uploaded:
        return f"MLflow run {manifest.mlflow_run_id} in {job.display(spec.tracking.uri)}"
    return (f"MLflow unavailable ({error}); metrics kept in {shown}/{METRICS}: upload "
            f"later with `batchinfer track {shown}`")


def _lost(winner: Manifest | None, shown: str, resolved: Resolved) -> Outcome:
    """The outcome of a run that another run beat to the commit (same triple), whose files are
    gone: exit 0 when the winner holds every challenger this run declares, as a rerun would
    find it (:func:`_look_at`).

    Raises:
        ContractError: the winner lacks one of this run's challengers (it was never scored).
    """
    attempt = winner.attempt if winner else "?"
    missing = _not_committed(winner, resolved.challengers) if winner else []
    if missing:
        raise ContractError(
            f"{shown} was committed meanwhile by attempt {attempt} without challenger "
            f"{', '.join(missing)}; this run's files were removed: rerun it with --overwrite to "
            f"score the partition with this run's challengers")
    return Outcome("lost_race", f"{shown} was already committed by attempt {attempt}; this "
                                f"run's files were removed", winner, shown)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from, outermost first."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _our_error(exc: BaseException) -> BatchInferError | None:
    """The BatchInferError a transform raised, from the chain Beam wraps it in (Beam re-raises
    the same type with "[while running 'Stage']" appended, the original as cause): the
    innermost one, whose message is the transform's own."""
    ours = [e for e in _chain(exc) if isinstance(e, BatchInferError)]
    return ours[-1] if ours else None


def _interrupted(exc: BaseException) -> bool:
    return any(isinstance(e, KeyboardInterrupt) for e in _chain(exc))


def input_dataset(manifest: Manifest) -> dict[str, str]:
    """The input partition as MLflow dataset tracking names it: its digest covers every shard's
    name and sha256, so two runs over the same bytes log the same dataset."""
    import hashlib

    text = "\n".join(f"{s.path}\t{s.sha256 or '-'}" for s in sorted(manifest.shards, key=lambda s: s.path))
    return {"name": f"{manifest.job}-input-{manifest.ds or manifest.attempt}",
            "digest": hashlib.sha256(text.encode()).hexdigest()[:32],
            "source": manifest.shards[0].path.rsplit("/", 1)[0] if manifest.shards else "",
            "rows": str(manifest.totals.rows_in), "shards": str(manifest.totals.shards)}


def _metrics(totals: Totals, pipeline_s: float, wall_s: float,
             results: list[ShardResult], load_s: float | None = None) -> dict[str, Any]:
    metrics: dict[str, Any] = {k: float(v) for k, v in totals.to_dict().items()}
    metrics["pipeline_seconds"] = pipeline_s
    # Where the time went, per stage, summed over batches (stages overlap across workers).
    for result in results:
        for stage, value in result.seconds.items():
            key = f"stage_seconds_{stage}"
            metrics[key] = metrics.get(key, 0.0) + value
    model = sum((r.model for r in results), ModelStats())
    metrics["model_oom_backoffs"] = float(model.oom_backoffs)
    if model.chunk_rows:
        metrics["model_chunk_rows"] = float(model.chunk_rows)
    if wall_s:
        metrics["wall_seconds"] = wall_s
        metrics["rows_per_second"] = totals.rows_in / wall_s
    metrics.update(health_metrics(results, load_s))
    metrics.update(challenger_metrics(results))
    return metrics


def challenger_metrics(results: list[ShardResult]) -> dict[str, float]:
    """``challenger.<name>.rows_scored``, ``.rows_rejected`` and ``.compute_ms`` (its model
    time, summed over batches) for each challenger."""
    metrics: dict[str, float] = {}
    for result in results:
        for name, shard in result.challengers.items():
            for key, value in (("rows_scored", shard.rows_scored),
                               ("rows_rejected", shard.rows_rejected),
                               ("compute_ms", shard.compute_ms)):
                metrics[f"challenger.{name}.{key}"] = metrics.get(f"challenger.{name}.{key}", 0.0) + value
    return metrics


def _triple_conflict(output: str, committed: dict, wanted: dict) -> str:
    diffs = [f"{k} committed {committed.get(k)} now {wanted[k]}" for k in wanted
             if committed.get(k) != wanted[k]]
    return (f"{output} is committed under another triple ({'; '.join(diffs)}): pass --overwrite "
            f"to replace it")


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:400]
