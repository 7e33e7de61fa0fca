"""The Beam pipeline that scores one partition (docs/architecture.md, "One run, file by file").

    Create(shards) → Reshuffle → ReadShard ──batches──→ Prepare → RunInference → WriteBatch ─┐
                                   │                        └─→ RunInference[c] → WriteChallenger[c] ─┤
                                   └──shards without rows, unreadable────────────────────────────────┴→
                                      finished shards' indices → GroupByKey(one key) → CommitPartition
                                                                         (pipeline/commit_step.py)

A shard's result (``_tmp/<attempt>/shards/SSSSS.json``, and each challenger's part of it) is
written by the writer the moment the shard's last file is written: the last batch of a shard
carries the shard's :class:`ShardInfo`, and the writer folds the records of the batches it wrote
(pipeline/writer/finished.py). No GroupByKey stands between a shard's files and its result — a
GroupByKey waits for the whole partition on every batch runner — so a run killed at any moment
leaves every finished shard to the next (contract §5.3). The only barrier is the commit's.

Each model is a :class:`ModelRun` — the champion, then each challenger ``c``
(``model.challengers``) — and gets the same prepared batches: one read, one validation, one
preprocessing. Each has its own RunInference and the one writer, :class:`WritePredictions`,
whose policy is the run's: the champion's rejected rows are quarantined and its batches carry
the partition's accounting and drift statistics; a challenger's files go to
``challengers/<c>/<attempt>/``, its rejected rows are only counted, and its records meet the
champion's at the commit, so they are committed (or not) with the partition.

Elements are Arrow RecordBatches of ``batch.rows`` rows, never single rows. Nothing here raises
for bad data: bad rows become quarantine rows and unreadable shards become shard records, so the
outcome travels as data (exceptions crossing Beam workers may lose their type). Only a step that
breaks its contract — a model or preprocessing function that returns another number of rows, say
— raises a BatchInferError, which the driver reports with its own message and exit code. The last
step applies the thresholds and commits, inside the pipeline, so that a job commits on a remote
runner even if the process that launched it is gone (docs/runners.md); the driver
(:mod:`batchinfer.commands.run`) reads back what it did.

The keyed steps carry KV type hints: runners that translate GroupByKey themselves (Beam's
DaskRunner) refuse a GroupByKey whose input is not typed as key-value pairs.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence, cast

import numpy as np
import pyarrow as pa

from .. import faults
from ..beam_compat import PredictionResult, RunInference, beam, in_global_window
from ..errors import SpecError
from ..handlers.base import BatchModelHandler, Inference, Prepared
from ..handlers.explain import Attributions, ExplainPlan, explain_rows, selected
from ..io.outputs import QUARANTINE, parquet_bytes, put_file, write_scratch_json
from ..io.records import FileRecord
from ..io.shards import ShardReader, Unreadable, decoded_ahead
from ..io.sinks import FILES, Sink
from ..redaction import Deferred
from ..rows.columns import prediction_encoding
from ..rows.hashing import row_hashes
from ..triple.contract import Triple
from ..triple.preprocess import Preprocessor
from ..triple.schemas import SchemaVersion
from . import counters
from .coders import register_coders
from .commit_step import CommitPlan, add_commit
from .prepare import prepare_batch
from .shard_reports import BatchRecord, ChallengerBatchRecord, ShardInfo, fold_shard
from .writer.audit import AuditColumns
from .writer.explanations import ExplanationColumns
from .writer.finished import OpenShards
from .writer.policy import WritePolicy
from .writer.predictions import PredictionColumns
from .writer.profiling import BatchProfile
from .writer.scored import Payload, ScoredBatch, scored_rows, screen_outputs
from .writer.table import ColumnPart, prediction_table


@dataclass(frozen=True, kw_only=True)
class ModelRun:
    """A model the pipeline scores every prepared batch with — the champion, or one of its
    challengers — and how its results are written.

    Attributes:
        name: a challenger's name (its steps' labels); "" for the champion.
        triple: written on every one of its prediction rows.
        handler: its loaded handler (RunInference's; the writer does not carry it).
        device: the device it runs on, as the manifest records it.
        backend: ``model.backend``; model_options: its declared options (they change
            predictions), as the manifest records them.
        policy: how its batches are written (pipeline/writer/policy.py): the champion's
            (``WritePolicy.champion()``: its files in ``predictions``, its rejected rows
            quarantined, its batches profiled, carrying the partition's accounting and drift
            statistics) or a challenger's (``WritePolicy.challenger(name)``: its files in
            ``challengers/<name>``, its rejected rows only counted — the input row is the
            champion's business, and a challenger must never change what the partition
            commits).
        prediction_names: its output name → prediction column (None: each output its own name).
        columns: the prediction columns it writes, in order (known once the model is loaded).
    """

    name: str
    triple: Triple
    handler: BatchModelHandler
    device: str
    backend: str
    model_options: dict[str, str]
    policy: WritePolicy
    prediction_names: dict[str, str] | None = None
    columns: tuple[str, ...] = ()
    explain: ExplainPlan | None = None   # the job's explain, resolved for this model

    @property
    def labels(self) -> tuple[str, str]:
        """Its RunInference's and its writer's step names (the champion's are unsuffixed)."""
        return f"RunInference{self._suffix}", self.policy.step

    @property
    def explain_label(self) -> str:
        """Its Explain step's name (with explain only)."""
        return f"Explain{self._suffix}"

    @property
    def _suffix(self) -> str:
        return "" if self.policy.quarantines else f"[{self.name}]"


@dataclass(frozen=True, kw_only=True)
class ScoringPlan:
    """What the pipeline's workers need besides the models; plain, picklable data, without a
    secret's value (docs/runners.md "What travels to the workers").

    Attributes:
        shard_urls: shard URLs to read, by shard index (secret values as ``${NAME}``, filled in
            by the worker that reads them).
        shard_names: what ``_source_shard`` records for each (``${NAME}`` values put back).
        output_url: ``output.path`` (the same); ``sink`` says how the partition is stored.
        attempt: this run's attempt id.
        batch_rows: rows per RecordBatch.
        schema: the loaded schema version (its source travels, not the module).
        preprocessor: the preprocessing step.
        id_columns: copied from input to predictions.
        hash_columns: the columns ``_input_hash`` covers.
        scored: the indices of the shards to read and score (None: all); a resumed run adopts
            the others (io/resume.py). Files and results keep the shard's index in the listing.
    """

    shard_urls: tuple[Deferred, ...]
    shard_names: tuple[str, ...]
    output_url: Deferred
    attempt: str
    batch_rows: int
    schema: SchemaVersion
    preprocessor: Preprocessor
    id_columns: tuple[str, ...]
    hash_columns: tuple[str, ...] = field(default=())
    # Drift monitoring (rows/column_profiles.py): the feature columns profiled, and the baseline's
    # histogram cuts by column (features and prediction columns); a column without cuts gets
    # moments only.
    profile_features: tuple[str, ...] = field(default=())
    profile_cuts: dict[str, tuple[float, ...]] = field(default_factory=dict)
    scored: tuple[int, ...] | None = None
    sink: Sink = FILES    # how the partition is stored (io/sinks.py): where files go

    def to_score(self) -> list[tuple[int, Deferred]]:
        """(index, url) of every shard the pipeline reads."""
        indices = range(len(self.shard_urls)) if self.scored is None else self.scored
        return [(i, self.shard_urls[i]) for i in indices]


@dataclass
class Chunk:
    """One RecordBatch of a shard, as read."""

    shard: int
    number: int
    first_row: int
    batch: pa.RecordBatch
    read_s: float
    last: bool = False             # the shard's last batch (its footer's rows all read)
    info: ShardInfo | None = None  # on the last batch: the shard as read (its sha256, its rows)

    def nbytes(self) -> int:
        return self.batch.nbytes


def build(pipeline: beam.Pipeline, plan: ScoringPlan, commit: CommitPlan, *,
          models: Sequence[ModelRun]):
    """Add the scoring transforms and the commit step to ``pipeline``; returns the commit step's
    output (one status string). ``models``: the champion first, then its challengers."""
    champion, *challengers = models
    if not champion.policy.quarantines or any(c.policy.quarantines for c in challengers):
        raise ValueError("build() takes the champion first, then its challengers")
    shards = (pipeline
              | "Shards" >> beam.Create(plan.to_score())
              | "Spread" >> beam.Reshuffle())
    register_coders(Chunk, Prepared, PredictionResult)
    # One output split by two filters, not a multi-output ParDo: Beam's DaskRunner hands every
    # output of a ParDo to each consumer, whatever its tag (transform_evaluator.ParDo in 2.77).
    read = shards | "ReadShard" >> beam.ParDo(ReadShard(plan))
    read.element_type = Chunk  # so Beam uses SizedPickleCoder (cheap size estimates) here
    batches = read | "Batches" >> beam.Filter(_is_chunk).with_output_types(Chunk)
    ended = read | "ShardEnded" >> beam.Filter(_is_index).with_output_types(int)
    prepared = (batches | "Prepare" >> beam.ParDo(PrepareBatch(plan))
                .with_output_types(Prepared))
    written = []
    for run in models:
        infer, write = run.labels
        scored = prepared | infer >> RunInference(run.handler).with_output_types(PredictionResult)
        if run.explain is not None:   # without explain the graph is what it always was
            scored = (scored | run.explain_label >> beam.ParDo(ExplainBatch(plan, run))
                      .with_output_types(PredictionResult))
        written.append(scored
                       | write >> beam.ParDo(WritePredictions(plan, run))
                       .with_output_types(int))
    finished = (ended, *written) | "Finished" >> beam.Flatten().with_output_types(int)
    return add_commit(finished, commit)


def _is_chunk(element: Any) -> bool:
    return isinstance(element, Chunk)


def _is_index(element: Any) -> bool:
    return not isinstance(element, Chunk)


class ReadShard(beam.DoFn):
    """(shard index, url as a :class:`~batchinfer.redaction.Deferred`) → the shard's
    :class:`Chunk` RecordBatches, the last one carrying its :class:`ShardInfo` — or, for a
    shard without rows or one that cannot be read, its result written to scratch here (no
    writer sees it) and its index.

    The shard's sha256 is computed on a helper thread while its batches are decoded and scored
    downstream. Each batch is sent on as soon as it is decoded, except the last by the footer's
    row count, which waits until the reader is done and then carries the digest: a shard whose
    bytes turn out unreadable after its last row (a streamed shard that changed) is never
    finished by a writer.
    """

    def __init__(self, plan: ScoringPlan):
        self.plan = plan

    def setup(self):
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batchinfer-sha256")
        self._decoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batchinfer-decode")
        self.layout = self.plan.sink.layout(self.plan.output_url.value(), self.plan.attempt)

    def teardown(self):
        for pool in (getattr(self, "_hasher", None), getattr(self, "_decoder", None)):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def process(self, element) -> Iterator[Any]:
        index, deferred = element
        t0 = time.perf_counter()
        try:
            reader = ShardReader(deferred.value(), hasher=self._hasher, pooled_decode=False)
        except Unreadable as exc:
            counters.shard_unreadable(index)
            yield self._finished(index, ShardInfo(None, None, str(exc)))
            return
        faults.point("read")
        counters.shard_opened(index, reader.num_rows or 0)
        opened_s = time.perf_counter() - t0
        first_row, held, sent = 0, None, 0
        try:
            # the next batch decodes while this one is validated, scored and written downstream
            batches = decoded_ahead(reader.batches(self.plan.batch_rows), self._decoder)
            for number, (batch, decode_s) in enumerate(batches):
                if held is not None:   # more rows than the footer said: not the last after all
                    yield held
                    held, sent = None, sent + 1
                chunk = Chunk(index, number, first_row, batch, decode_s)
                first_row += batch.num_rows
                if reader.num_rows is not None and first_row >= reader.num_rows:
                    held = chunk   # the last by the footer: sent on once the reader is done
                else:
                    yield chunk
                    sent += 1
            info = ShardInfo(reader.sha256, reader.num_rows, None, {"read": opened_s})
        except Unreadable as exc:
            # The batches already sent on are written, but no writer finishes the shard (its last
            # batch never comes): it counts as unreadable, and the cleanup removes their files.
            counters.shard_unreadable(index)
            yield self._finished(index, ShardInfo(reader.sha256, None, str(exc)))
            return
        if held is not None:
            yield dataclasses.replace(held, last=True, info=info)
        elif not sent:
            yield self._finished(index, info)
        else:   # fewer rows than its footer said (never seen): no batch can carry the shard's end
            counters.shard_unreadable(index)
            yield self._finished(index, ShardInfo(
                reader.sha256, None, f"its footer says {reader.num_rows} rows, its pages hold {first_row}"))

    def _finished(self, index: int, info: ShardInfo) -> int:
        """A shard no writer finishes (no rows, or unreadable): its result, written here."""
        result = fold_shard(self.plan.shard_names[index], [info])
        result = dataclasses.replace(result, record=dataclasses.replace(result.record,
                                                                        scored_by=self.plan.attempt))
        write_scratch_json(self.layout.fs, self.layout.shard_result(index), result.to_dict())
        counters.shard_finished(index)
        faults.point("shard_done")
        return index


class PrepareBatch(beam.DoFn):
    """Validate and preprocess one batch (:func:`~.prepare.prepare_batch`); bad rows go to the
    payload's quarantine."""

    def __init__(self, plan: ScoringPlan):
        self.plan = plan

    def process(self, element) -> Iterator[Prepared]:
        plan = self.plan
        prepared = prepare_batch(element.batch, plan.schema, plan.preprocessor,
                                 source_shard=plan.shard_names[element.shard],
                                 first_row=element.first_row)
        seconds = {"read": element.read_s, **prepared.seconds}
        yield Prepared(key=(element.shard, element.number), rows=prepared.valid.num_rows,
                       features=prepared.features,
                       payload=Payload(element.first_row, element.batch.num_rows, prepared.valid,
                                       prepared.source_rows, prepared.quarantine, seconds,
                                       prepared.stats, element.last, element.info))


class ExplainBatch(beam.DoFn):
    """One model's results → the same results with the batch's attributions
    (:class:`~batchinfer.handlers.explain.Attributions` in ``inference.explained``) of the rows
    the model scored that ``explain.fraction`` picks by ``_input_hash`` (contract §6
    "Explanations"). It holds the model its RunInference loaded (the process's model cache
    gives both one copy) and calls it through its ``LoadedModel``."""

    def __init__(self, plan: ScoringPlan, run: ModelRun):
        assert run.explain is not None
        self.plan = plan
        self.explain = run.explain
        self.handler = run.handler

    def setup(self):
        self._loaded = self.handler.load_model()

    def process(self, result: PredictionResult) -> Iterator[PredictionResult]:
        t0 = time.perf_counter()
        item = cast(Prepared, result.example)
        inference = cast(Inference, result.inference)
        ok, _, _ = screen_outputs(inference)   # what the writer writes: finite rows only
        if not ok.size:
            yield result
            return
        plan = self.explain
        features = item.features
        x = np.asarray(features[plan.input] if isinstance(features, Mapping) else features)
        if x.ndim != 2:
            raise SpecError(f"explain attributes a model input of [rows, positions]; the "
                            f"preprocessing returned {plan.input!r} as {list(x.shape)}")
        hashes = None
        rows = np.arange(ok.size, dtype=np.int64)
        if plan.fraction < 1.0:
            hashes = row_hashes(scored_rows(item.payload, ok), self.plan.hash_columns)
            rows = np.flatnonzero(selected(hashes.to_numpy(zero_copy_only=False), plan.fraction)).astype(np.int64)
        chosen = x[ok[rows]]
        loaded = self._loaded

        def predict(z: np.ndarray) -> np.ndarray:
            out = np.asarray(loaded.predict({plan.input: z})[plan.output], dtype=np.float64)
            if out.size != z.shape[0]:
                raise SpecError(f"explain.output {plan.output!r} has {out.size // max(z.shape[0], 1)} "
                                f"values per row: explain explains one score per row")
            return out.reshape(z.shape[0])

        def gradients(z: np.ndarray, base: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return loaded.attribute(plan.input, z, base, plan.output, plan.method, plan.steps)

        if chosen.shape[0]:
            values, baseline_value, gap = explain_rows(plan, chosen, predict, gradients)
        else:
            values, baseline_value = np.zeros((0, x.shape[1])), 0.0
            gap = np.zeros(0)
        # ~(<=), not >: a NaN gap is never complete
        missed = ~(np.abs(gap) <= plan.tolerance) if plan.complete else np.zeros(gap.size, bool)
        explained = Attributions(rows=rows, values=values, baseline_value=baseline_value,
                                 incomplete=int(missed.sum()),
                                 max_gap=float(np.abs(gap).max()) if plan.complete and gap.size else 0.0,
                                 hashes=hashes, seconds=time.perf_counter() - t0)
        yield PredictionResult(item, dataclasses.replace(inference, explained=explained))


class WritePredictions(beam.DoFn):
    """One model's results → this attempt's files, and each shard's result (or a challenger's part
    of it) the moment the shard's last file is written; the index of each shard it finished
    out. The one writer: the
    champion's batches and each challenger's are written by this code, from the parts in
    pipeline/writer/ — the prediction file's columns (id and predictions, explanations, audit),
    the drift statistics, the rejected rows — and the run's :class:`WritePolicy` says what
    differs (where its files go, whether its rejected rows are quarantined or only counted,
    whether it is profiled, which record it emits).

    The work (row hashes, the predictions table, Parquet encoding, the put and its sha256) runs
    on one writer thread while this worker's main thread reads, validates and scores the next
    batches: that work is mostly single-threaded and releases the GIL, so it fills the core
    that scoring leaves idle (bench/README.md). At most ``IN_FLIGHT`` batches wait for the
    writer; finished shards come out in order, the last ones at the end of the bundle.
    """

    IN_FLIGHT = 2

    def __init__(self, plan: ScoringPlan, run: ModelRun):
        self.plan = plan
        # What is written, not the handler: RunInference carries that one.
        self.policy = run.policy
        self.explain = run.explain
        self.explanations = ExplanationColumns(run.explain) if run.explain is not None else None
        self.parts: tuple[ColumnPart, ...] = (
            PredictionColumns(plan.id_columns, run.prediction_names),
            *((self.explanations,) if self.explanations is not None else ()),
            AuditColumns(plan.attempt, run.triple))
        self.profile = (BatchProfile(plan.profile_features, plan.profile_cuts, run.prediction_names)
                        if self.policy.profiles else None)
        self.encoding = prediction_encoding(plan.id_columns)
        # Iceberg reads a file's partition from its partition column's min/max: without them
        # the file would land in the null partition.
        self.encoding["statistics"] += list(plan.sink.constants())

    def setup(self):
        self.layout = self.plan.sink.layout(self.plan.output_url.value(), self.plan.attempt)
        self.constants = self.plan.sink.constants()
        self.arrow_schema = self.plan.sink.arrow_schema
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batchinfer-write")
        # Only the writer thread touches it: a shard's records, until its last batch is written.
        self._open = OpenShards(self.policy, self.plan.shard_names, self.plan.attempt)

    def start_bundle(self):
        self._pending: collections.deque = collections.deque()

    def process(self, result: PredictionResult) -> Iterator[int]:
        self._pending.append(self._writer.submit(self._complete, result))
        while len(self._pending) > self.IN_FLIGHT:
            yield from self._counted(self._pending.popleft().result())

    def finish_bundle(self) -> Iterator[Any]:
        while self._pending:
            for index in self._counted(self._pending.popleft().result()):
                yield in_global_window(index)

    def _counted(self, out: tuple[int, BatchRecord | ChallengerBatchRecord, bool]) -> Iterator[int]:
        """``out`` (a batch's record, and whether it finished its shard), counted for progress —
        here, on the thread Beam runs the step on, where its metrics count
        (pipeline/counters.py); the shard's index if it is finished."""
        index, record, finished = out
        if isinstance(record, BatchRecord):
            counters.rows_written(index, record.rows_in, record.rows_quarantined,
                                  last=record.last)
            counters.batch_timings(record.rows_in, record.seconds, record.compute_ms)
        if finished:
            counters.shard_finished(index)
            yield index

    def teardown(self):
        writer = getattr(self, "_writer", None)
        if writer is not None:
            writer.shutdown(wait=True, cancel_futures=True)

    def _complete(self, result: PredictionResult) -> tuple[int, BatchRecord | ChallengerBatchRecord, bool]:
        """One batch's files and its record, on the writer thread: the parts, composed; and if it
        is the shard's last to be written, the shard's result (whether it is: the third).

        The result of a shard is written before its last batch's files are put, never after:
        were the process killed in between, the shard would have all its rows on the store and
        no result, and a user counting the files would see a finished shard the rerun scores
        again. This way round resume finds the result, checks each file's sha256, and scores the
        shard again only if a file is missing (io/resume.py). So the last batch's ``write``
        seconds leave out its puts.
        """
        t0 = time.perf_counter()
        batch = ScoredBatch.of(cast(Prepared, result.example), cast(Inference, result.inference),
                               shard_names=self.plan.shard_names,
                               hash_columns=self.plan.hash_columns, explain=self.explain)
        encoded: list[tuple[FileRecord, bytes]] = []
        profile, profile_s = {}, 0.0
        if batch.scored is not None:
            if self.profile is not None:   # the partition's model: its drift statistics
                t1 = time.perf_counter()
                profile = self.profile.of(batch)
                profile_s = time.perf_counter() - t1
            encoded.append(self._encode(self.policy.folder, batch, prediction_table(self.parts, batch),
                                        self.encoding))
        rejected = self.policy.rejected(batch)
        if rejected.table is not None:
            encoded.append(self._encode(QUARANTINE, batch, rejected.table))
        last = self._open.finishes(batch.shard, batch.number, batch.payload.info)
        if not last:
            self._put(encoded)
        seconds = dict(batch.payload.seconds, infer=batch.inference.compute_ms / 1000.0,
                       hash=batch.hash_s, profile=profile_s,
                       write=time.perf_counter() - t0 - batch.hash_s - profile_s)
        if batch.explained is not None:
            seconds["explain"] = batch.explained.seconds
        explanation = self.explanations.stats(batch) if self.explanations is not None else {}
        record = self.policy.record(batch, tuple(f for f, _ in encoded), rejected, seconds=seconds,
                                    profile=profile, explanation=explanation)
        shard = self._open.add(batch.shard, batch.number, record, batch.payload.info)
        if shard is not None:
            write_scratch_json(self.layout.fs, self.policy.result_path(self.layout, batch.shard), shard.to_dict())
            self._put(encoded)
            faults.point("shard_done")
        return batch.shard, record, shard is not None

    def _encode(self, kind: str, batch: ScoredBatch, table: pa.Table,
                encoding: dict | None = None) -> tuple[FileRecord, bytes]:
        """A file of the batch: its record (path, rows, sha256) and its bytes, not yet put."""
        relative = self.layout.part(kind, batch.shard, batch.number)
        for name, value in self.constants.items():   # Iceberg's partition column (io/sinks.py)
            table = table.append_column(name, pa.array([value] * table.num_rows, pa.string()))
        data = parquet_bytes(table, **(encoding or {}), arrow_schema=self.arrow_schema)
        return FileRecord(relative, table.num_rows, hashlib.sha256(data).hexdigest()), data

    def _put(self, encoded: list[tuple[FileRecord, bytes]]) -> None:
        for file, data in encoded:
            path = self.layout.abs(file.path)
            if faults.armed("mid_write"):
                put_file(self.layout.fs, path, data[: len(data) // 2])
                faults.point("mid_write")
            put_file(self.layout.fs, path, data)
            faults.point("write")
