"""The Beam pipeline of a run: the manifest known before any work, the plans the pipeline is
built from, the job a dry run builds without submitting it, and Beam's errors made ours.
"""
from __future__ import annotations

import contextlib
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from .. import backends, runners
from ..clock import rfc3339
from ..errors import BatchInferError, RuntimeFailure, SpecError
from ..io.commit import Attempt
from ..io.records import Challenger, InputTable, Manifest, Plugin, Totals
from ..io.resume import Resume
from ..redaction import Deferred
from ..rows.drift import Baseline, DriftGate
from ..spec import COMPLETE_METHODS, Job
from .drift_baseline import load_baseline
from .resolve import Resolved, sink_of

if TYPE_CHECKING:
    from ..pipeline.transforms import ModelRun


def manifest_header(job: Job, attempt: Attempt, champion: "ModelRun", started: datetime,
                    mlflow_run_id: str | None,
                    challengers: "Sequence[ModelRun]" = (),
                    input_table: InputTable | None = None) -> Manifest:
    """The manifest as known before any work (``input_table``: the table version a table
    input's shards are of); the commit step adds shards, totals, end time (and each
    challenger's shards)."""
    spec = job.spec
    entries = tuple(Challenger(name=c.name, triple=c.triple.as_dict(), backend=c.backend,
                               device=c.device, model_options=c.model_options)
                    for c in challengers)
    return Manifest(job=spec.name, ds=job.ds, attempt=attempt.attempt,
                    triple=champion.triple.as_dict(), job_spec_sha256=job.spec_sha256,
                    runner=spec.runner.name, device=champion.device, backend=champion.backend,
                    model_options=champion.model_options, started_at=rfc3339(started),
                    finished_at="", mlflow_run_id=mlflow_run_id, totals=Totals.of([]), shards=(),
                    challengers=entries, input_table=input_table,
                    plugins=plugins_of(spec.runner.name, (champion.backend, *(c.backend for c in challengers))))


def plugins_of(runner: str, backends_used: Sequence[str]) -> tuple[Plugin, ...]:
    """The run's backends and runner that are not batchinfer's own, with the distribution
    that holds each (the manifest names them: predictions made by a third party's code say
    whose)."""
    found = []
    for name in dict.fromkeys(backends_used):
        where = backends.provenance(name)
        if where is not None and not where.builtin:
            found.append(Plugin(kind="backend", name=name, distribution=where.distribution,
                                version=where.version))
    where = runners.provenance(runner)
    if where is not None and not where.builtin:
        found.append(Plugin(kind="runner", name=runner, distribution=where.distribution,
                            version=where.version))
    return tuple(found)


def build_job(resolved: Resolved, champion: "ModelRun", attempt: Attempt,
              header: Manifest, challengers: "Sequence[ModelRun]" = (),
              resume: Resume | None = None) -> str:
    """Build the runner's job without submitting it; return a summary of its graph."""
    from ..beam_compat import beam
    from ..pipeline.runner_options import job_summary, pipeline_options
    from ..pipeline.transforms import build

    spec = resolved.job.spec
    options = pipeline_options(spec.runner.name, {**spec.runner.options, "dry_run": "true"})
    try:
        pipeline = beam.Pipeline(options=options)
        baseline = load_baseline(resolved.job, resolved.model.declaration)
        build(pipeline, *pipeline_plans(resolved, attempt, header, baseline, resume),
              models=(champion, *challengers))
        result = pipeline.run()
    except (ImportError, ValueError) as exc:  # a missing extra, options Beam refuses
        raise SpecError(f"runner {spec.runner.name}: {last_line(exc)}") from exc
    return job_summary(result)


def run_pipeline(resolved: Resolved, champion: "ModelRun", attempt: Attempt, header: Manifest,
                 baseline: Baseline | None = None,
                 watch: "Callable[[int, str], Any] | None" = None,
                 challengers: "Sequence[ModelRun]" = (), resume: Resume | None = None, *,
                 run_id: Any = None) -> None:
    """Run the Beam pipeline into ``attempt``, up to and including its commit step; it scores
    the shards ``resume`` does not adopt (all without one); ``run_id`` (an
    :class:`~batchinfer.pipeline.commit_step.InThisProcess`) gives the commit step the MLflow
    run's id that the header leaves out.

    ``watch(shards, live)`` gives a context manager that shows progress while the pipeline runs
    (``app/run_progress.py``): ``live`` says where figures come from on this runner
    (``Runner.live_metrics``); it is told the pipeline's result once the runner hands it over
    (``follow``: a runner that returns while the job runs) and once the job has ended (``end``:
    the final figures, from the result's Beam metrics).

    Raises:
        BatchInferError: one that a transform raised on purpose (its own message and code).
        KeyboardInterrupt: Ctrl-C, however Beam wrapped it.
        RuntimeFailure: the pipeline failed otherwise.
    """
    from ..beam_compat import pipeline_handing_over
    from ..pipeline.runner_options import live_metrics, pipeline_options
    from ..pipeline.transforms import build

    spec = resolved.job.spec
    options = pipeline_options(spec.runner.name, spec.runner.options)
    live = live_metrics(spec.runner.name, spec.runner.options)
    try:
        to_score = len(resolved.shards) - (len(resume.adopted) if resume else 0)
        with watch(to_score, live) if watch else contextlib.nullcontext() as watching:
            follow = watching.follow if watching is not None else (lambda result: None)
            with pipeline_handing_over(options, follow) as pipeline:
                build(pipeline, *pipeline_plans(resolved, attempt, header, baseline, resume, run_id),
                      models=(champion, *challengers))
            if watching is not None:
                watching.end(pipeline.result)
    except Exception as exc:
        if _interrupted(exc):  # Beam wraps a Ctrl-C inside a transform in an Exception
            raise KeyboardInterrupt from None
        ours = _our_error(exc)
        if ours is not None:
            # Its own cause stays (a preprocessing fault's is the function's exception, which
            # --debug shows); Beam's wrapping goes.
            raise ours from ours.__cause__
        raise RuntimeFailure(f"the scoring pipeline failed: {last_line(exc)}") from exc


def pipeline_plans(resolved: Resolved, attempt: Attempt, header: Manifest,
                   baseline: Baseline | None = None, resume: Resume | None = None,
                   run_id: Any = None) -> tuple[Any, Any]:
    """The pipeline's :class:`ScoringPlan` and :class:`CommitPlan` for ``attempt``; with a
    ``resume``, the pipeline reads and scores only the shards it does not adopt, and the commit
    step takes the adopted ones' results as they are; with a baseline, the writer stage counts
    columns into its cuts and the commit step refuses a partition that drifted above the
    ``fail`` limits (:class:`~batchinfer.rows.drift.DriftGate`)."""
    from ..pipeline.commit_step import CommitPlan
    from ..pipeline.transforms import ScoringPlan

    job = resolved.job
    spec = job.spec
    # The graph holds no secret's value: the workers fill them in (docs/runners.md "What
    # travels to the workers").
    output = Deferred.of(spec.output.path, job.secrets)
    sink = sink_of(job)
    adopted = dict(resume.adopted) if resume else {}
    plan = ScoringPlan(
        shard_urls=tuple(Deferred.of(s.url, job.secrets) for s in resolved.shards),
        shard_names=resolved.shard_names(),
        output_url=output, attempt=attempt.attempt, batch_rows=spec.batch.rows,
        schema=resolved.schema, preprocessor=resolved.preprocessor,
        id_columns=tuple(spec.output.id_columns), hash_columns=resolved.schema.columns,
        profile_features=tuple(resolved.features), profile_cuts=baseline.cuts() if baseline else {},
        scored=tuple(i for i in range(len(resolved.shards)) if i not in adopted) if adopted else None,
        sink=sink)
    gate = DriftGate.of(resolved.features, baseline) if baseline is not None else None
    commit = CommitPlan(output_url=output, attempt=attempt.attempt, sink=sink,
                        replacing=attempt.replacing, shard_count=len(resolved.shards),
                        header=header, breach=spec.quarantine.breach, drift=gate,
                        preprocess=spec.preprocess, clock=attempt.clock, adopted=adopted, run_id=run_id,
                        max_incomplete=(spec.explain.max_incomplete_fraction
                                        if spec.explain and spec.explain.method in COMPLETE_METHODS
                                        else None))
    return plan, commit


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


def last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:400]
