"""``batchinfer run``: score one partition and commit it.

:func:`run_job` runs five phases in the contract's order (contract §1, §4, §5), each a function
from one typed record to the next, so a run reads top to bottom:

1. :func:`resolve_run` → :class:`Resolution`: everything resolved (schema, preprocessing, shards,
   model, baseline) and the triple checked against the model's declaration — before any work;
2. :func:`decide` → :class:`~batchinfer.io.commit.Decision`: the partition as it is —
   committed already as this run would commit it (reuse: :func:`reuse`, a no-op), or exit 3
   (another triple, job, date or set of shards) unless ``--overwrite`` (replace) — or, with
   ``--update``, :func:`updating` → :class:`~batchinfer.io.update.Update`: the committed shards
   kept, the new and rewritten ones to score, the removed ones dropped. ``--dry-run`` stops here
   (:func:`rehearse`);
3. :func:`launch` → :class:`Launch`: the models loaded (:mod:`batchinfer.app.model_runs`:
   exit 5 before any work), the attempt begun, the MLflow run opened; then :func:`score` →
   :class:`Scored`: the Beam pipeline into the attempt (:mod:`batchinfer.app.pipeline_run`).
   Its last step applies the quarantine thresholds and the drift gate (exit 4, nothing
   committed) and commits: exactly one run creates the manifest
   (:mod:`batchinfer.pipeline.commit_step`, :class:`~batchinfer.io.commit.PartitionCommit`). The
   commit happens inside the pipeline so that it does not depend on this process outliving a
   remote job (docs/runners.md);
4. :func:`read_back` → :class:`ReadBack`: what the commit step did, and the drift verdict;
5. :func:`publish` → :class:`Outcome`: a refusal's exit code (and the drift report it keeps),
   or the committed run's record to MLflow, ``_metrics.json`` and the report
   (:mod:`batchinfer.app.run_record`), which can fail without undoing anything.

One clock (``run_job``'s) stamps the attempt id, ``started_at`` and, in the commit step,
``finished_at``.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

from .. import errors, runners
from ..app import model_runs, pipeline_run, run_record
from ..app.drift_baseline import load_baseline
from ..app.resolve import (
    Resolved,
    list_job_input,
    partition_listing,
    partition_of,
    pinned_version,
    resolve,
    shown_partition,
    sink_of,
)
from ..app.run_lineage import RunLineageLog
from ..clock import Clock, utc_now
from ..errors import (
    BatchInferError,
    ContractError,
    DataQualityError,
    ModelError,
    PreprocessError,
    one_line,
)
from ..io.commit import Attempt, CommitOutcome, Decision, Identity, PartitionCommit, not_committed, triple_conflict
from ..io.commit import decide as decide_partition
from ..io.records import AttemptKey, Challenger, Manifest, ResultsSummary, Totals
from ..io.resume import Resume
from ..io.resume import find as resume_shards
from ..io.update import Update, current_digests, plan_update
from ..pipeline.runner_options import check as check_runner
from ..redaction import mask, redact
from ..rows.columns import attribution_column
from ..rows.drift import Baseline, DriftVerdict, observe
from ..spec import Job
from .remedies import error_line

if TYPE_CHECKING:
    from ..io.tracking import TrackingRun
    from ..pipeline.transforms import ModelRun

log = logging.getLogger("batchinfer")


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


def run_job(job: Job, *, overwrite: bool = False, update: bool = False, dry_run: bool = False,
            clock: Clock = utc_now,
            progress: Callable[[str], None] = lambda line: None,
            tracking: "TrackingRun | None" = None,
            watch: "Callable[[int, str], Any] | None" = None) -> Outcome:
    """Score one partition and commit it (see the module docstring for the phases).

    Args:
        update: ``--update``: a committed partition whose shards changed gets only its new and
            rewritten shards scored, keeps the others' files and drops the removed ones'
            (contract §5.3 "Update"; not with ``overwrite``).
        clock: the run's clock: the attempt id, ``started_at`` and the commit's ``finished_at``.
        tracking: a :class:`~batchinfer.io.tracking.TrackingRun` for the job's store that the
            caller started early (its helper needs seconds to be ready); by default one is
            started here. It is closed without a run if the job stops before scoring.
        watch: called with the number of shards and where the runner's live figures come
            from when scoring starts; returns a context manager that shows live progress while
            the pipeline runs (see ``app/run_progress.py`` and ``pipeline_run.run_pipeline``).

    Raises:
        BatchInferError: with the exit code of what went wrong (contract §2).
    """
    t0, started = time.perf_counter(), clock()
    spec = job.spec
    attempt_id = new_attempt(started)
    if tracking is None and not dry_run:
        from ..io.tracking import TrackingRun

        tracking = TrackingRun(spec.tracking.uri, spec.tracking.experiment or spec.name)
    # The run's OpenLineage events (contract §6 "Lineage"); a dry run does no work and has none.
    lineage = None if dry_run else RunLineageLog.of(job, attempt_id, started, clock)
    try:
        run = resolve_run(job, started=started, t0=t0, clock=clock, update=update,
                          overwrite=overwrite, attempt=attempt_id)
        if lineage is not None:
            lineage.resolved(run.resolved, run.wanted.model_options, run.wanted.challengers)
        decision = decide(run, overwrite, update)
        if decision.action == "reuse":
            return _reused(job, reuse(run, decision, dry_run), lineage)
        updated = updating(run, decision)
        if updated is not None and updated.unchanged:
            return _reused(job, reuse(run, decision, dry_run, updated), lineage)
        resumed = resume(run, decision, updated)
        if dry_run:
            return rehearse(run, decision, resumed, updated)
        assert tracking is not None
        if lineage is not None:
            lineage.start()
        launched = launch(run, decision, resumed, tracking, progress, updated)
        scored = score(run, launched, tracking, watch)
        if isinstance(scored, Outcome):  # another run committed first, while this one scored
            return _reused(job, scored, lineage)
        return publish(run, launched, scored, read_back(run, launched), tracking, lineage,
                       "update" if updated is not None else "score")
    except KeyboardInterrupt:
        if lineage is not None:
            lineage.abort()
        raise
    except Exception as exc:
        if lineage is not None:
            code = exc.exit_code if isinstance(exc, BatchInferError) else 5
            line = error_line(exc) if isinstance(exc, BatchInferError) else (
                f"unexpected {type(exc).__name__}: {one_line(exc)}")
            lineage.fail(job.display(redact(line)), code, type(exc).__name__)
        raise
    finally:
        if tracking is not None:
            tracking.close()  # a no-op once the run was finished; else no run is left behind


@dataclass(frozen=True, kw_only=True)
class Resolution:
    """Phase 1: what the run is, resolved and checked before any work.

    Attributes:
        baseline: the job's baseline as read (None without ``monitor``); :func:`launch`
            restricts it to the run's columns once the model is loaded.
        shown: ``output.path`` as messages show it.
        wanted: what a committed partition must be to be this run's (:func:`decide`).
        started, t0: when the run started (by its clock; by ``perf_counter`` for its wall time).
    """

    job: Job
    resolved: Resolved
    baseline: Baseline | None
    partition: PartitionCommit
    shown: str
    wanted: Identity
    started: datetime
    t0: float
    clock: Clock
    attempt: str = ""   # the attempt id a launch begins (its lineage events' run id is of it)


@dataclass(frozen=True, kw_only=True)
class Launch:
    """Phase 3, before the pipeline: the models loaded, the attempt begun, the MLflow run open.

    Attributes:
        champion: the champion's model run (its handler, device, folder and policy).
        challengers: each challenger's model run, in the job's order.
        load_s: the models' load time.
        baseline: the baseline restricted to the run's columns (None without one).
        header: the manifest as known before any work (it names the MLflow run).
        resume: the shards it adopts instead of scoring them: from crashed attempts, and with
            ``--update`` the committed shards it keeps.
        run_id: the MLflow run's id for a commit step in this process, asked for at the commit
            (None: it is in the header).
    """

    champion: "ModelRun"
    challengers: "Sequence[ModelRun]"
    load_s: float
    baseline: Baseline | None
    attempt: Attempt
    header: Manifest
    resume: Resume = field(default_factory=Resume)
    run_id: Any = None   # pipeline.commit_step.InThisProcess (imported with Beam, when it runs)


@dataclass(frozen=True, kw_only=True)
class Scored:
    """Phase 3's end: the pipeline ran (its commit step included)."""

    pipeline_s: float


@dataclass(frozen=True, kw_only=True)
class ReadBack:
    """Phase 4: what the commit step did, its shards' results folded (an empty summary when the
    commit step's record was lost: then the manifest has the counts), and the drift verdict on
    them."""

    outcome: CommitOutcome
    summary: ResultsSummary
    totals: Totals
    verdict: DriftVerdict


def _reused(job: Job, outcome: Outcome, lineage: RunLineageLog | None) -> Outcome:
    """A run that found the partition committed as it would commit it (a no-op, or a lost race
    to another run): START and COMPLETE, with that commit (action ``noop`` or ``lost_race``)."""
    if lineage is not None and outcome.manifest is not None:
        lineage.complete(job, outcome.manifest, outcome.status)
    return outcome


def resolve_run(job: Job, *, started: datetime, t0: float, clock: Clock,
                update: bool = False, overwrite: bool = False, attempt: str = "") -> Resolution:
    """Phase 1: resolve and check the contract, the runner's options and the baseline. A table
    input is read at the version the committed partition's manifest names, unless the job
    names one or ``update`` (then the latest:
    :func:`~batchinfer.app.resolve.list_partition_input`).

    Raises:
        BatchInferError: exit 2 (or 3, 5) before any work.
    """
    spec = job.spec
    partition = partition_of(job)
    resolved = resolve(job, listing=partition_listing(job, partition, update=update,
                                                      reading=overwrite))
    check_runner(spec.runner.name, spec.runner.options)
    # exit 2 before any work when it cannot be read
    baseline = load_baseline(job, resolved.model.declaration)
    return Resolution(job=job, resolved=resolved, baseline=baseline,
                      partition=partition, shown=shown_partition(job),
                      wanted=_identity(job, resolved),
                      started=started, t0=t0, clock=clock, attempt=attempt or new_attempt(started))


def _identity(job: Job, resolved: Resolved) -> Identity:
    """What a committed partition must be to be this run's (:class:`~batchinfer.io.commit.Identity`)."""
    return Identity(job=job.spec.name, ds=job.ds, shards=frozenset(resolved.shard_names()),
                    # Partitions committed before only secrets were masked name their shards
                    # with every ${NAME} value put back: the same shards, named as then.
                    shards_as_then=frozenset(mask(s.url, job.templated) for s in resolved.shards),
                    triple=resolved.triple.as_dict(),
                    model_options=model_runs.declared(job.spec.model, job.spec.explain),
                    challengers=tuple(model_runs.challenger_identity(c, job.spec.explain)
                                      for c in resolved.challengers))


def decide(run: Resolution, overwrite: bool, update: bool = False) -> Decision:
    """Phase 2: reuse the committed partition, or replace it (or nothing) with a new attempt;
    with ``update``, update it (:func:`updating` says how).

    Raises:
        SpecError: ``output.path`` is a file.
        ContractError: committed as another partition (another triple, job, date, set of
            shards — unless ``update`` —, declared options, or without a challenger this run
            declares), without ``--overwrite``.
    """
    decision = run.partition.decide(run.wanted, overwrite=overwrite, shown=run.shown, update=update)
    if decision.refusal is not None:   # a conflict, and the error that says which
        raise decision.refusal
    return decision


def updating(run: Resolution, decision: Decision) -> Update | None:
    """Phase 2 of ``--update``: which committed shards it keeps (hashed again: a shard rewritten
    since is scored again), which it scores and which it drops (contract §5.3 "Update"); None
    for any other decision.

    Raises:
        ContractError: the shards changed and the job spec did too (exit 3: ``--overwrite``).
    """
    if decision.action != "update" or decision.manifest is None:
        return None
    updated = _plan_update(run.job, run.resolved, decision.manifest, run.shown)
    if updated.refusal is not None:
        raise updated.refusal
    return updated


def _plan_update(job: Job, resolved: Resolved, committed: Manifest, shown: str) -> Update:
    names = resolved.shard_names()
    as_then = [mask(s.url, job.templated) for s in resolved.shards]
    held = {s.path for s in committed.shards}
    # Only a shard the partition holds is hashed now: a new one is scored whatever its bytes
    # (and hashed as it is read).
    digests = current_digests([s.url if name in held or then in held else None
                               for s, name, then in zip(resolved.shards, names, as_then)])
    return plan_update(committed, list(zip(names, digests)), job_spec_sha256=job.spec_sha256,
                       challengers=[c.name for c in resolved.challengers], shown=shown,
                       as_then=as_then)


def resume_key(job: Job, resolved: Resolved) -> AttemptKey:
    """What an attempt of this run scores, as its scratch records it (io/resume.py): its spec
    hash leaves the runner out (``Job.work_sha256``)."""
    wanted = _identity(job, resolved)
    return AttemptKey(job=wanted.job, ds=wanted.ds, job_spec_sha256=job.work_sha256 or job.spec_sha256,
                      triple=wanted.triple, model_options=wanted.model_options,
                      challengers=tuple(Challenger(name=n, triple=t, model_options=o)
                                        for n, t, o in wanted.challengers))


def resume(run: Resolution, decision: Decision, updated: Update | None = None) -> Resume:
    """The shards this run adopts from crashed attempts of the partition (contract §5.3
    "Resume"): when nothing is committed there (a committed partition is reused, or replaced
    whole by ``--overwrite``), or, for an ``--update``, among the shards it would score (a
    killed update's finished shards)."""
    if updated is not None:
        found = _find_resume(run.job, run.resolved)
        return Resume({i: r for i, r in found.adopted.items() if i not in updated.kept},
                      found.changed, found.damaged)
    if decision.manifest is not None:
        return Resume()
    return _find_resume(run.job, run.resolved)


def adopting(resumed: Resume, updated: Update | None) -> Resume:
    """Every shard the pipeline does not score: the committed ones an update keeps, and those
    crashed attempts finished."""
    if updated is None:
        return resumed
    return Resume({**updated.kept, **resumed.adopted}, resumed.changed, resumed.damaged)


def _find_resume(job: Job, resolved: Resolved) -> Resume:
    shards = [(name, shard.url) for name, shard in zip(resolved.shard_names(), resolved.shards)]
    return resume_shards(job.spec.output.path, resume_key(job, resolved), shards,
                         partition=sink_of(job).partition)


def planned(job: Job, resolved: Resolved) -> str:
    """What a run would do with the partition as it is now, for ``batchinfer plan``: reuse the
    commit (or refuse it), and what ``--update`` would keep, score and drop (the shards hashed
    again, as the update does); or score, adopting what crashed attempts finished (shards and
    files hashed again, as the run does)."""
    committed = partition_of(job).committed()
    if committed is not None:
        shown, wanted = shown_partition(job), _identity(job, resolved)
        plain = decide_partition(committed, wanted, overwrite=False, shown=shown)
        line = f"committed by attempt {committed.attempt}: " + (
            "a run reuses it (nothing to do)" if plain.action == "reuse"
            else f"a run exits 3 ({error_line(plain.refusal) if plain.refusal else 'conflict'})")
        if resolved.table is not None and pinned_version(job, committed) is not None:
            # --update reads the table's latest version, where a plain run reads the pinned one
            listing = list_job_input(job)
            resolved = dataclasses.replace(resolved, shards=listing.shards, table=listing.table)
            wanted = _identity(job, resolved)
        if decide_partition(committed, wanted, overwrite=False, shown=shown,
                            update=True).action != "update":
            return line
        updated = _plan_update(job, resolved, committed, shown)
        if updated.refusal:
            return f"{line}; --update exits 3 too"
        if updated.unchanged:
            return f"{line}; --update reuses it too (no shard new, rewritten or removed)"
        return f"{line}; {updated.summary(len(resolved.shards), '--update would keep')}"
    found = _find_resume(job, resolved)
    if found.adopted or found.changed or found.damaged:
        return found.summary(len(resolved.shards))
    return f"nothing to reuse: would score all {len(resolved.shards)} shards"


def reuse(run: Resolution, decision: Decision, dry_run: bool,
          updated: Update | None = None) -> Outcome:
    """The no-op of a partition committed already as this run would commit it (``updated``:
    an ``--update`` that found no shard new, rewritten or removed)."""
    existing = decision.manifest
    assert existing is not None
    if not dry_run:  # a run that crashed after its commit left debris behind
        run.partition.tidy(existing)
    same = " (--update: no shard new, rewritten or removed)" if updated is not None else ""
    return Outcome("noop", f"{run.shown} is already committed with this triple (attempt "
                           f"{existing.attempt}){same}; nothing to do", existing, run.shown)


def rehearse(run: Resolution, decision: Decision, resumed: Resume | None = None,
             updated: Update | None = None) -> Outcome:
    """``--dry-run``: what would be scored, and for a runner that can, its job built."""
    job, resolved, started = run.job, run.resolved, run.started
    spec = job.spec
    crashed = resumed or Resume()
    resumed = adopting(crashed, updated)
    total = len(resolved.shards)
    message = f"dry run: would score {total - len(resumed.adopted)} shards into {run.shown}"
    if updated is not None:
        message += f" ({updated.summary(total)})"
    if crashed.adopted:
        message += f" ({crashed.summary(total, total - len(resumed.adopted))})"
    if runners.get(spec.runner.name).builds_job:  # build the runner's job too, submit nothing
        champion = model_runs.load_champion(resolved)
        challengers = model_runs.load_challengers(resolved, champion)
        attempt = run.partition.begin(run.attempt, replacing=decision.manifest,
                                      clock=run.clock)
        header = pipeline_run.manifest_header(job, attempt, champion, started, None, challengers,
                                         resolved.input_table())
        message += f"\n{pipeline_run.build_job(resolved, champion, attempt, header, challengers, resumed)}"
    return Outcome("dry_run", message, None, run.shown)


def launch(run: Resolution, decision: Decision, resumed: Resume, tracking: "TrackingRun",
           progress: Callable[[str], None], updated: Update | None = None) -> Launch:
    """Phase 3, before the pipeline: load the models (exit 5, or 2 for their outputs, before any
    work), match the baseline with the run's columns (exit 2 if none), then touch the store:
    begin the attempt (its key in scratch, before any shard: a rerun after a crash adopts what
    it finished) and open the MLflow run."""
    job, resolved = run.job, run.resolved
    spec = job.spec
    t_load = time.perf_counter()
    champion = model_runs.load_champion(resolved)
    challengers = model_runs.load_challengers(resolved, champion)
    load_s = time.perf_counter() - t_load
    baseline = run.baseline
    if baseline is not None:  # the columns it is compared on, known now (exit 2 if none)
        attributions = [attribution_column(f) for f in champion.explain.known_names()] if (
            champion.explain is not None) else []
        baseline = baseline.for_run([*resolved.features, *champion.columns, *attributions])
    tracking.prepare()  # the checks passed: the store may be touched
    attempt = run.partition.begin(run.attempt, replacing=decision.manifest,
                                  clock=run.clock)
    attempt.start(resume_key(job, resolved))
    tracking.open(f"{spec.name}-{job.ds or attempt.attempt}",
                  {"batchinfer.job": spec.name, "batchinfer.attempt": attempt.attempt,
                   "batchinfer.ds": job.ds or ""}, started=run.started)
    if resolved.ignored:
        progress(f"ignoring {len(resolved.ignored)} metadata file(s) that input.path matched "
                 f"(names starting with _ or .; `batchinfer plan` lists them)")
    table = resolved.input_table()
    if table is not None:
        where = " and ".join(f"{k} = {v!r}" for k, v in table.filter.items())
        progress(f"reading {table.format} table {table.table} at version {table.version}"
                 + (f" (where {where})" if where else ""))
    total, adopted = len(resolved.shards), adopting(resumed, updated)
    if updated is not None:
        progress(updated.summary(total))
    if resumed.adopted or resumed.changed or resumed.damaged:
        progress(resumed.summary(total, total - len(adopted.adopted)))
    progress(f"scoring {total - len(adopted.adopted)} shards into {run.shown} "
             f"(attempt {attempt.attempt}, {spec.runner.name} runner, {champion.device})")
    # The manifest names the MLflow run. A commit step in this process asks for its id when it
    # writes the manifest, so the pipeline starts while the helper opens the run (~0.5-0.9 s of
    # the start otherwise); one elsewhere gets it in the graph, waited for here.
    from ..pipeline.commit_step import InThisProcess
    from ..pipeline.runner_options import live_metrics

    here = live_metrics(spec.runner.name, spec.runner.options) == "process"
    run_id = InThisProcess(tracking.wait) if here else None
    header = pipeline_run.manifest_header(job, attempt, champion, run.started,
                                          None if here else tracking.wait(),
                                          challengers, resolved.input_table())
    return Launch(champion=champion, challengers=challengers, load_s=load_s,
                  baseline=baseline, attempt=attempt, header=header, resume=adopted, run_id=run_id)


def score(run: Resolution, launched: Launch, tracking: "TrackingRun",
          watch: "Callable[[int, str], Any] | None") -> "Scored | Outcome":
    """Phase 3: score into the attempt and commit, in the pipeline. A failure or Ctrl-C keeps
    the shards the attempt finished for the next run (``Attempt.stop``) — unless its commit
    happened (the runner may fail after the commit step): then the run goes on to read it back.
    Returns the lost race's outcome when another run committed the same triple meanwhile (this
    run's files removed).

    Raises:
        KeyboardInterrupt: Ctrl-C (the MLflow run is KILLED).
        BatchInferError: the pipeline failed (the MLflow run is FAILED).
    """
    resolved, attempt = run.resolved, launched.attempt
    t_pipeline = time.perf_counter()
    try:
        pipeline_run.run_pipeline(resolved, launched.champion, attempt, launched.header,
                                  launched.baseline, watch, launched.challengers, launched.resume,
                                  run_id=launched.run_id)
    except KeyboardInterrupt:  # Ctrl-C: commit nothing, keep what is finished, say so in MLflow
        winner = attempt.committed_meanwhile()
        if winner is None or winner.attempt != attempt.attempt:  # never undo a commit
            _stopped(attempt, run)
        tracking.finish({"attempt": attempt.attempt}, {}, {}, "KILLED", timeout=10.0)
        raise
    except Exception:
        winner = attempt.committed_meanwhile()
        if winner is None or winner.attempt != attempt.attempt:
            # Never touch a commit that happened: the runner may fail after the commit step.
            if winner is not None and winner.triple == resolved.triple.as_dict():
                attempt.abort()
                tracking.finish({"attempt": attempt.attempt}, {}, {}, "KILLED")
                return _lost(winner, run)
            _stopped(attempt, run)
            tracking.finish({"attempt": attempt.attempt}, {}, {}, "FAILED")
            raise
    finally:
        if launched.run_id is not None:
            launched.run_id.forget()
    return Scored(pipeline_s=time.perf_counter() - t_pipeline)


def _stopped(attempt: Attempt, run: Resolution) -> None:
    """Keep what ``attempt`` finished for the next run (logged with --debug: a failed command
    prints one line, contract §2; the rerun says what it reuses)."""
    kept = attempt.stop()
    if kept:
        log.info("kept %d finished shard(s) of attempt %s in %s: the next run of this "
                    "partition reuses them", kept, attempt.attempt, run.shown)


def read_back(run: Resolution, launched: Launch) -> ReadBack:
    """Phase 4: what the commit step did (its record, or the manifest), and the verdict of the
    run's shards against the baseline."""
    outcome = launched.attempt.outcome(run.resolved.triple.as_dict())
    summary = outcome.summary if outcome.summary is not None else ResultsSummary()
    return ReadBack(outcome=outcome, summary=summary, totals=summary.totals,
                    verdict=observe(summary.profiles, run.resolved.features, launched.baseline))


def publish(run: Resolution, launched: Launch, scored: Scored, read: ReadBack,
            tracking: "TrackingRun", lineage: RunLineageLog | None = None,
            action: str = "score") -> Outcome:
    """Phase 5: a refusal becomes its exit code, a lost race exit 0 (or 3); a commit is logged
    to MLflow and kept in ``_metrics.json``, ``_profile.json`` and ``report.html``. Nothing here
    can undo a commit.

    Raises:
        BatchInferError: the commit step refused (exit 4, 5, or 2 for a preprocessing fault), or
            another triple was committed meanwhile (exit 3).
    """
    outcome, attempt, verdict = read.outcome, launched.attempt, read.verdict
    if outcome.status == "refused":
        _refused(run, launched, scored, read, tracking)
    if verdict.level == "warn":
        log.warning("drift: %s", verdict.summary("warn"))
    if outcome.status != "committed" or outcome.manifest is None:
        attempt.abort()
        tracking.finish({"attempt": attempt.attempt}, {}, {}, "KILLED")
        if outcome.status == "conflict":
            raise triple_conflict(
                run.shown, outcome.manifest.triple if outcome.manifest else {}, run.wanted.triple)
        return _reused(run.job, _lost(outcome.manifest, run), lineage)
    manifest = outcome.manifest
    run.partition.tidy(manifest)  # the commit step's record
    if lineage is not None:   # after the commit, before MLflow: its metrics count what failed
        lineage.complete(run.job, manifest, action, quarantine=run_record.quarantine_counts(read.summary),
                         drift_level=verdict.level, drift=[d.to_dict() for d in verdict.drifts])
    # Without results the record was lost; the manifest has the counts.
    totals = read.totals if read.totals.shards else manifest.totals
    job, device = run.job, launched.champion.device
    wall_s = time.perf_counter() - run.t0
    tags = run_record.run_tags(job, attempt.attempt, device)
    if verdict.level != "none":
        tags["batchinfer.drift"] = verdict.level
    kept = run_record.RunRecord(
        params=run_record.run_params(job, run.resolved, attempt.attempt, device),
        metrics={**run_record.run_metrics(totals, scored.pipeline_s, wall_s, read.summary,
                                     launched.load_s, verdict, attempt=attempt.attempt),
                 "commit_seconds": outcome.seconds,
                 **({"lineage_errors": float(lineage.errors)} if lineage is not None else {})},
        tags={**tags, **run_record.table_tags(manifest)})
    line = run_record.publish(job, tracking, attempt.layout, manifest, kept,
                          run_record.profile_record(job, verdict, launched.baseline, read.summary))
    return Outcome("committed", f"committed {run.shown} (attempt {attempt.attempt})", manifest,
                   run.shown, line, {"wall_s": wall_s, "pipeline_s": scored.pipeline_s},
                   verdict.level)


def _refused(run: Resolution, launched: Launch, scored: Scored, read: ReadBack,
             tracking: "TrackingRun") -> NoReturn:
    """Raise the error of the commit step's refusal, once the MLflow run says FAILED (with the
    drift report a run that drift stopped keeps under ``output.path``, as artifacts)."""
    job, attempt, device = run.job, launched.attempt, launched.champion.device
    _stopped(attempt, run)  # the commit step kept the finished shards: a rerun adopts them
    drifted = (read.outcome.message or "").startswith("drift:")
    kept: dict[str, str] = {}
    where = None
    if drifted:  # _drift/ is kept: no cleanup there
        kept, where = run_record.keep_drift_report(job, attempt.layout, read.verdict,
                                               launched.baseline, read.summary)
    accept = launched.baseline.accept if drifted and launched.baseline is not None else None
    error = _refusal(read.outcome, where, accept)
    tags = {**run_record.run_tags(job, attempt.attempt, device), "batchinfer.error": error_line(error),
            "batchinfer.exit_code": str(error.exit_code)}
    if drifted:
        tags["batchinfer.drift"] = "fail"
    tracking.finish(run_record.run_params(job, run.resolved, attempt.attempt, device),
                    run_record.run_metrics(read.totals, scored.pipeline_s, 0.0, read.summary,
                                       launched.load_s, read.verdict, attempt=attempt.attempt),
                    kept, "FAILED", tags=tags)
    raise error


def _refusal(outcome: CommitOutcome, kept: str | None = None,
             accept: str | None = None) -> BatchInferError:
    """The error of a refused commit, of the class and with the message the commit step recorded
    (and, for a run that drift stopped, how to ``accept`` the drift and where its drift report
    is ``kept``: the launcher's words, which name its files)."""
    message = outcome.message or "nothing committed"
    cls = _refused_as(outcome)
    if issubclass(cls, PreprocessError):
        # The function's exception stayed on the worker; its traceback came back as text.
        trace = outcome.summary.preprocess.trace if outcome.summary is not None else None
        if trace:
            log.debug("the preprocessing's first failure:\n%s", trace.rstrip())
        return cls(message)
    if accept:
        message = f"{message}; {accept}"
    if kept:
        message = f"{message}; {kept}"
    return cls(message)


def _refused_as(outcome: CommitOutcome) -> type[BatchInferError]:
    """The class of error the commit step refused with (``outcome.error``); for an outcome
    written before the class was recorded, the one its exit code stood for then."""
    named = getattr(errors, outcome.error, None) if outcome.error else None
    if isinstance(named, type) and issubclass(named, BatchInferError) and named.exit_code == outcome.code:
        return named
    older: dict[int, type[BatchInferError]] = {PreprocessError.exit_code: PreprocessError,
                                                ModelError.exit_code: ModelError}
    return older.get(outcome.code, DataQualityError)


def _lost(winner: Manifest | None, run: Resolution) -> Outcome:
    """The outcome of a run that another run beat to the commit (same triple), whose files are
    gone: exit 0 when the winner holds every challenger this run declares, as a rerun would
    find it (:func:`decide`).

    Raises:
        ContractError: the winner lacks one of this run's challengers (it was never scored).
    """
    attempt = winner.attempt if winner else "?"
    missing = not_committed(winner, run.wanted.challengers) if winner else []
    if missing:
        raise ContractError(
            f"{run.shown} was committed meanwhile by attempt {attempt} without challenger "
            f"{', '.join(missing)}; this run's files were removed: rerun it with --overwrite to "
            f"score the partition with this run's challengers")
    by = f"attempt {attempt}" if winner else "another run (its manifest still being written)"
    return Outcome("lost_race", f"{run.shown} was already committed by {by}; this run's files "
                                f"were removed", winner, run.shown)


