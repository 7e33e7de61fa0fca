"""The pipeline's last step: decide and commit the partition (docs/runners.md).

    finished shards' indices ─→ OnePartition (key 0) → GroupByKey → CommitPartition

Every finished shard's index (the champion's writer's, each challenger's, ReadShard's for a
shard without rows or unreadable) meets the others on one key, so exactly one element reaches
:class:`CommitPartition`, on one worker, once every shard's result is in scratch. This is the
pipeline's only barrier: each shard's result was written the moment its files were
(pipeline/transforms.py), so a run killed before it leaves every finished shard for the next.

It applies the thresholds (contract §5.1) and commits through :mod:`batchinfer.io.commit` (the exclusive create of
``_manifest.json``), whichever process the runner gives it: the launcher's own on the direct
runner, a worker on Dataflow, Flink or Dask. It records what it did in the attempt's scratch; the
launching process reads that back for its exit code and tracking. A launcher that dies (an
Airflow worker lost mid-job) therefore loses nothing: the job commits without it, and the retry
finds the partition committed (a no-op), or races the still-running job and the exclusive create
picks one.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Tuple

from ..beam_compat import beam
from ..clock import Clock, rfc3339, utc_now
from ..errors import BatchInferError, DataQualityError, ModelError, PreprocessError, RuntimeFailure
from ..io.commit import Attempt, CommitOutcome, PartitionCommit
from ..io.records import Manifest, ResultsSummary, ShardResult
from ..io.sinks import FILES, Sink
from ..redaction import Deferred
from ..rows.drift import DriftGate, MergedProfiles
from .prepare import preprocess_fault


class InThisProcess:
    """A value this process learns later (the MLflow run's id: the helper opens the run while the
    pipeline scores), for a step that runs in this process (the commit step on the in-process
    direct runner). Beam pickles every step as it builds the graph; what travels is a key into
    this process's table, so building never waits, and :meth:`value` asks when the step needs it.
    A copy that finds no entry (a process that is not the launcher's) has None: the manifest
    then names no MLflow run, as when tracking failed, and the launcher's record says why."""

    _table: dict[str, Callable[[], "str | None"]] = {}

    def __init__(self, get: Callable[[], "str | None"]):
        import uuid

        self.key = uuid.uuid4().hex
        InThisProcess._table[self.key] = get

    def value(self) -> "str | None":
        get = InThisProcess._table.get(self.key)
        return get() if get is not None else None

    def forget(self) -> None:
        InThisProcess._table.pop(self.key, None)


# The quarantine thresholds: (rows_in, rows quarantined, unreadable shards) → why the partition
# must not commit, or None (spec.QuarantineSpec.breach; a bound method of a pydantic model pickles).
Breach = Callable[[int, int, int], "str | None"]


@dataclass(frozen=True)
class CommitPlan:
    """What the commit step needs; plain, picklable data.

    Attributes:
        output_url: ``output.path`` (secret values as ``${NAME}``: the worker fills them in).
        attempt: this run's attempt id.
        replacing: the manifest an ``--overwrite`` run replaces, or None.
        shard_count: how many shards the partition has (each must have a result).
        adopted: by shard index, the results of shards an earlier, crashed attempt finished,
            which this run adopts instead of scoring them (io/resume.py); the pipeline scores
            the others.
        header: the manifest as the launcher knows it before any work (job, ds, triple, spec hash,
            runner, device, start time, MLflow run id); the commit step adds the end time, the
            shards and the totals.
        run_id: the MLflow run's id where the launcher did not know it as the graph was built
            (:class:`InThisProcess`: the commit step runs in the launcher's process), asked for
            as the manifest is made; None: the header's.
        breach: the quarantine thresholds (see :data:`Breach`).
        drift: with a monitoring baseline, the gate that refuses a partition that drifted above
            the ``fail`` limits (exit 4; the launcher keeps the drift report); None without one.
        preprocess: the job's ``preprocess`` (``module:function``; None: the default), named by
            a preprocessing fault's line.
        clock: the run's clock (``run_job``'s), which stamps the manifest's ``finished_at``.
    """

    output_url: Deferred
    attempt: str
    replacing: Manifest | None
    shard_count: int
    header: Manifest
    breach: Breach
    drift: DriftGate | None = None
    preprocess: str | None = None
    clock: Clock = utc_now
    adopted: dict[int, ShardResult] = dataclasses.field(default_factory=dict)
    # explain.max_incomplete_fraction, for a method whose attributions are checked for
    # completeness (contract §6 "Explanations"); None: no such check.
    max_incomplete: float | None = None
    sink: Sink = FILES    # how the partition is stored (io/sinks.py)
    run_id: InThisProcess | None = None

    def begin(self) -> Attempt:
        return PartitionCommit(self.output_url.value(), self.sink).begin(self.attempt, replacing=self.replacing,
                                                      clock=self.clock)


def add_commit(finished, plan: CommitPlan):
    """Append the commit step to ``finished`` (the indices of the shards whose results are in
    scratch: every writer's and ReadShard's, pipeline/transforms.py). One more
    element, ``-1``, always joins them, so the commit step runs on the runner even when a
    resumed run has no shard left to score (every one adopted)."""
    seed = finished.pipeline | "Seed" >> beam.Create([-1]).with_output_types(int)
    return ((finished, seed)
            | "WithSeed" >> beam.Flatten().with_output_types(int)
            | "OnePartition" >> beam.Map(_one_key).with_output_types(Tuple[int, int])
            | "AllShards" >> beam.GroupByKey().with_output_types(Tuple[int, Iterable[int]])
            | "Commit" >> beam.ParDo(CommitPartition(plan)).with_output_types(str))


def _one_key(index: int) -> tuple[int, int]:
    return 0, index


class CommitPartition(beam.DoFn):
    """Every shard finished → refuse (recorded, nothing committed) or commit; yields the status."""

    def __init__(self, plan: CommitPlan):
        self.plan = plan

    def process(self, element):
        plan = self.plan
        attempt = plan.begin()
        # Folded as they are read: the manifest's entries and the sums, never every result.
        folded = attempt.fold(plan.shard_count, plan.adopted,
                              tuple(c.name for c in plan.header.challengers), MergedProfiles())
        summary = folded.summary()
        adopted = {f.path for r in plan.adopted.values() for f in r.record.files} | {
            f.path for r in plan.adopted.values() for c in r.challengers.values() for f in c.files}
        gone = attempt.missing(adopted) if adopted else []
        if gone:  # never commit a manifest that lists files that are not there
            raise RuntimeFailure(f"{len(gone)} file(s) of shards this run adopted from another "
                                 f"attempt were removed meanwhile (e.g. {gone[0]}): nothing "
                                 f"committed; run the job again")
        refusal = refuse(summary, plan.breach, plan.preprocess) or incomplete(summary, plan.max_incomplete)
        if refusal is None and plan.drift is not None:
            drifted = plan.drift.refusal(summary.profiles)
            refusal = DataQualityError(drifted) if drifted else None
        if refusal is not None:
            # The finished shards stay for a rerun to adopt (a fixed shard is scored again, the
            # others are not: io/resume.py); the record, for the launcher to turn into its exit
            # code.
            attempt.stop()
            outcome = CommitOutcome("refused", None, refusal.exit_code, refusal.message, summary,
                                    error=type(refusal).__name__)
        else:
            records = tuple(folded.records)
            header = plan.header if plan.run_id is None else dataclasses.replace(
                plan.header, mlflow_run_id=plan.run_id.value())
            manifest = dataclasses.replace(header, finished_at=rfc3339(plan.clock()),
                                           totals=summary.totals, shards=records,
                                           challengers=folded.challenger_entries(plan.header.challengers))
            t0 = time.perf_counter()
            committed = attempt.commit(manifest)
            outcome = dataclasses.replace(committed, summary=summary,
                                          seconds=time.perf_counter() - t0)
        attempt.record(outcome)
        yield outcome.status


def refuse(summary: ResultsSummary, breach: Breach,
           preprocess: str | None = None) -> BatchInferError | None:
    """Why the partition must not commit, or None: a model that raised on every row it was given
    (exit 5: not the data's fault), or bad rows or shards above the thresholds — mostly rows the
    preprocessing raised on for one reason (exit 2: its fault, pipeline/prepare.py rule (b)),
    otherwise exit 4. ``summary``: the shards' results folded."""
    model = summary.model
    if model.rows and model.raised == model.rows:
        return ModelError(f"the model raised on every one of the {model.rows} rows it was given "
                          f"(first error: {model.error}); nothing committed")
    totals = summary.totals
    why = breach(totals.rows_in, totals.rows_quarantined, totals.shards_unreadable)
    if why:
        fault = preprocess_fault(summary.preprocess, preprocess)
        if fault:
            return PreprocessError(fault)
        return DataQualityError(f"data quality: {why}; nothing committed: run `batchinfer validate` "
                                f"to see why")
    return None


def incomplete(summary: ResultsSummary, limit: float | None) -> BatchInferError | None:
    """Exit 4 when more of the explained rows than ``limit`` (a fraction) have attributions that
    do not sum to ``f(x) - f(baseline)`` within ``explain.tolerance``; None otherwise."""
    if limit is None:
        return None
    model = summary.model
    if not model.explained or model.incomplete / model.explained <= limit:
        return None
    return DataQualityError(
        f"explanations: {model.incomplete} of {model.explained} explained rows "
        f"({model.incomplete / model.explained:.2%}, max {limit:.2%}) have attributions that do "
        f"not sum to f(x) - f(baseline) within explain.tolerance; nothing committed: raise "
        f"explain.steps (or explain.tolerance)")
