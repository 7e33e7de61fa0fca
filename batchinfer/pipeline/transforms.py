"""The Beam pipeline that scores one partition (docs/architecture.md, "One run, file by file").

    Create(shards) → Reshuffle → ReadShard ──batches──→ Prepare → RunInference → WriteBatch ─┐
                                   │                        └─→ RunInference[c] → WriteChallenger[c] ─┤
                                   └────shard info───────────────────────────────────────────────────┴→
                                      GroupByKey(shard) → FinishShard (per-shard JSON in _tmp)
                                      → GroupByKey(one key) → CommitPartition (pipeline/commit.py)

Each model is a :class:`ModelRun` — the champion, then each challenger ``c``
(``model.challengers``) — and gets the same prepared batches: one read, one validation, one
preprocessing. Each has its own RunInference and the one writer, :class:`WritePredictions`,
whose policy is the run's: the champion's rejected rows are quarantined and its batches carry
the partition's accounting and drift statistics; a challenger's files go to
``challengers/<c>/<attempt>/``, its rejected rows are only counted, and its records meet the
champion's at FinishShard, so they are committed (or not) with the partition.

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
import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Literal, Mapping, Sequence, Tuple, cast

import numpy as np
import pyarrow as pa

from .. import faults
from ..beam_compat import PredictionResult, RunInference, beam, in_global_window
from ..errors import SpecError
from ..handlers.base import BatchModelHandler, Inference, Prepared
from ..handlers.explain import Attributions, ExplainPlan, explain_rows, grouped, selected, top
from ..io.outputs import QUARANTINE, parquet_bytes, write_file, write_json
from ..io.records import FileRecord, ModelStats, PreprocessStats
from ..io.shards import ShardReader, Unreadable
from ..io.sinks import FILES, Sink
from ..redaction import Deferred
from ..rows.arrow_types import plain_array
from ..rows.columns import (
    AUDIT,
    CHECK,
    COMPUTE_MS,
    EXPLANATION,
    EXPLANATION_BASELINE,
    FAILED_COLUMN,
    INFERENCE_ID,
    INPUT_HASH,
    REASON,
    SOURCE_ROW,
    SOURCE_SHARD,
    TRIPLE,
    attribution_column,
    prediction_encoding,
)
from ..rows.hashing import row_hashes
from ..rows.profile import ColumnStats, numeric_values
from ..rows.quarantine import Failure, build_quarantine
from ..triple.contract import Triple
from ..triple.preprocess import Preprocessor
from ..triple.schemas import SchemaVersion
from . import progress
from .coders import register_coders
from .commit import CommitPlan, add_commit
from .prepare import prepare_batch
from .records import BatchRecord, ChallengerBatchRecord, ShardInfo, fold_shard

RejectPolicy = Literal["quarantine", "count"]
# The key of a prediction file's schema metadata that describes its explanation columns.
EXPLAIN_METADATA = "batchinfer.explain"


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
        folder: where its prediction files go (``predictions``, ``challengers/<name>``).
        prediction_names: its output name → prediction column (None: each output its own name).
        columns: the prediction columns it writes, in order (known once the model is loaded).
        rejects: ``quarantine`` (the champion): rows it rejects (raised on, non-finite outputs)
            go to the partition's quarantine files, and its batches carry the partition's
            accounting and drift statistics (:class:`BatchRecord`); ``count`` (a challenger):
            they are counted, never quarantined — the input row is the champion's business, and
            a challenger must never change what the partition commits
            (:class:`ChallengerBatchRecord`).
    """

    name: str
    triple: Triple
    handler: BatchModelHandler
    device: str
    backend: str
    model_options: dict[str, str]
    folder: str
    prediction_names: dict[str, str] | None = None
    columns: tuple[str, ...] = ()
    rejects: RejectPolicy = "quarantine"
    explain: ExplainPlan | None = None   # the job's explain, resolved for this model

    @property
    def labels(self) -> tuple[str, str]:
        """Its RunInference's and its writer's step names (the champion's are unsuffixed)."""
        if self.rejects == "quarantine":
            return "RunInference", "WriteBatch"
        return f"RunInference[{self.name}]", f"WriteChallenger[{self.name}]"

    @property
    def explain_label(self) -> str:
        """Its Explain step's name (with explain only)."""
        return "Explain" if self.rejects == "quarantine" else f"Explain[{self.name}]"


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
    # Drift monitoring (rows/profile.py): the feature columns profiled, and the baseline's
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

    def nbytes(self) -> int:
        return self.batch.nbytes


@dataclass
class Payload:
    """What travels beside the features to the writer."""

    first_row: int
    rows_in: int
    valid: pa.RecordBatch          # original rows that passed validation and preprocessing
    source_rows: np.ndarray        # int64 row of each valid row within its shard
    quarantine: list[pa.Table]     # rows already quarantined (schema, preprocess)
    seconds: dict[str, float] = field(default_factory=dict)   # time spent per stage
    preprocess: PreprocessStats = PreprocessStats()
    last: bool = False             # the shard's last batch (pipeline/progress.py counts it done)


def build(pipeline: beam.Pipeline, plan: ScoringPlan, commit: CommitPlan, *,
          models: Sequence[ModelRun]):
    """Add the scoring transforms and the commit step to ``pipeline``; returns the commit step's
    output (one status string). ``models``: the champion first, then its challengers."""
    champion, *challengers = models
    if champion.rejects != "quarantine" or any(c.rejects != "count" for c in challengers):
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
    infos = read | "ShardInfo" >> beam.Filter(_is_shard_info).with_output_types(Tuple[int, Any])
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
                       .with_output_types(Tuple[int, Any]))
    finished = ((infos, *written)
                | "Merge" >> beam.Flatten().with_output_types(Tuple[int, Any])
                | "ByShard" >> beam.GroupByKey().with_output_types(Tuple[int, Iterable[Any]])
                | "FinishShard" >> beam.ParDo(FinishShard(plan, tuple(c.name for c in challengers)))
                .with_output_types(int))
    return add_commit(finished, commit)


def _is_chunk(element: Any) -> bool:
    return isinstance(element, Chunk)


def _is_shard_info(element: Any) -> bool:
    return not isinstance(element, Chunk)


class ReadShard(beam.DoFn):
    """(shard index, url as a :class:`~batchinfer.redaction.Deferred`) → :class:`Chunk`
    RecordBatches, then one ``(shard index, ShardInfo)``.

    The shard's sha256 is computed on a helper thread while its batches are decoded and scored
    downstream; the shard record, which carries it, comes out after the batches.
    """

    def __init__(self, plan: ScoringPlan):
        self.plan = plan

    def setup(self):
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batchinfer-sha256")

    def teardown(self):
        hasher = getattr(self, "_hasher", None)
        if hasher is not None:
            hasher.shutdown(wait=True, cancel_futures=True)

    def process(self, element) -> Iterator[Any]:
        index, deferred = element
        t0 = time.perf_counter()
        try:
            reader = ShardReader(deferred.value(), hasher=self._hasher)
        except Unreadable as exc:
            progress.shard_unreadable(index)
            yield index, ShardInfo(None, None, str(exc))
            return
        faults.point("read")
        progress.shard_opened(index, reader.num_rows or 0)
        opened_s = time.perf_counter() - t0
        first_row, last = 0, False
        try:
            batches = enumerate(reader.batches(self.plan.batch_rows))
            while True:
                t0 = time.perf_counter()  # decoding only: downstream work runs inside `yield`
                item = next(batches, None)
                if item is None:
                    break
                number, batch = item
                first_row += batch.num_rows
                last = reader.num_rows is not None and first_row >= reader.num_rows
                yield Chunk(index, number, first_row - batch.num_rows, batch,
                            time.perf_counter() - t0, last)
        except Unreadable as exc:
            # Batches already sent on are dropped by FinishShard: the shard counts as unreadable.
            progress.shard_unreadable(index, counted=last)
            yield index, ShardInfo(reader.sha256, None, str(exc))
            return
        info = ShardInfo(reader.sha256, reader.num_rows, None, {"read": opened_s})
        yield index, info


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
                                       prepared.stats, element.last))


class ExplainBatch(beam.DoFn):
    """One model's results → the same results with the batch's attributions
    (:class:`~batchinfer.handlers.explain.Attributions` in ``inference.explained``) of the rows
    the model scored that ``explain.fraction`` picks by ``_input_hash`` (contract §6
    "Explanations"). It holds the model its RunInference loaded (the process's model cache
    gives both one copy) and calls it through the handler's ``LoadedModel``."""

    def __init__(self, plan: ScoringPlan, run: ModelRun):
        assert run.explain is not None
        self.plan = plan
        self.explain = run.explain
        self.handler = run.handler

    def setup(self):
        self._model = self.handler.load_model()
        self._loaded = self.handler.loaded(self._model)

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
            hashes = row_hashes(_scored_rows(item.payload, ok), self.plan.hash_columns)
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


@dataclass(frozen=True, kw_only=True)
class _Shown:
    """One batch's attributions by feature, made once for its file, its drift statistics and
    its record."""
    names: np.ndarray        # the feature names
    by_feature: np.ndarray   # [explained rows, features]: the positions of one feature summed
    positions: np.ndarray    # [explained rows, k]: the features ``_explanation`` keeps
    values: np.ndarray       # their attributions


class WritePredictions(beam.DoFn):
    """One model's results → this attempt's files; one record per batch out: a
    :class:`BatchRecord` for the champion, a :class:`ChallengerBatchRecord` for a challenger (its
    :class:`ModelRun`'s ``rejects`` policy says which, and what becomes of its rejected rows).

    The work (row hashes, the predictions table, Parquet encoding, the put and its sha256) runs
    on one writer thread while this worker's main thread reads, validates and scores the next
    batches: that work is mostly single-threaded and releases the GIL, so it fills the core
    that scoring leaves idle (bench/README.md). At most ``IN_FLIGHT`` batches wait for the
    writer; records come out in order, the last ones at the end of the bundle.
    """

    IN_FLIGHT = 2

    def __init__(self, plan: ScoringPlan, run: ModelRun):
        self.plan = plan
        # What is written, not the handler: RunInference carries that one.
        self.name = run.name
        self.triple = run.triple
        self.folder = run.folder
        self.prediction_names = run.prediction_names
        self.quarantines = run.rejects == "quarantine"
        self.encoding = prediction_encoding(plan.id_columns)
        # Iceberg reads a file's partition from its partition column's min/max: without them
        # the file would land in the null partition.
        self.encoding["statistics"] += list(plan.sink.constants())
        self.explain = run.explain

    def setup(self):
        self.layout = self.plan.sink.layout(self.plan.output_url.value(), self.plan.attempt)
        self.constants = self.plan.sink.constants()
        self.arrow_schema = self.plan.sink.arrow_schema
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batchinfer-write")

    def start_bundle(self):
        self._pending: collections.deque = collections.deque()

    def process(self, result: PredictionResult) -> Iterator[Any]:
        self._pending.append(self._writer.submit(self._complete, result))
        while len(self._pending) > self.IN_FLIGHT:
            yield self._counted(self._pending.popleft().result())

    def finish_bundle(self) -> Iterator[Any]:
        while self._pending:
            yield in_global_window(self._counted(self._pending.popleft().result()))

    def _counted(self, out: tuple[int, Any]) -> tuple[int, Any]:
        """``out`` (a batch's record), counted for progress — here, on the thread Beam runs the
        step on, where its metrics count (pipeline/progress.py)."""
        index, record = out
        if isinstance(record, BatchRecord):
            progress.rows_written(index, record.rows_in, record.rows_quarantined,
                                  last=record.last)
            progress.batch_timings(record.rows_in, record.seconds, record.compute_ms)
        return out

    def teardown(self):
        writer = getattr(self, "_writer", None)
        if writer is not None:
            writer.shutdown(wait=True, cancel_futures=True)

    def _complete(self, result: PredictionResult) -> tuple[int, BatchRecord | ChallengerBatchRecord]:
        """One batch's files and its record, on the writer thread."""
        plan = self.plan
        t0 = time.perf_counter()
        item = cast(Prepared, result.example)
        inference = cast(Inference, result.inference)
        payload: Payload = item.payload
        index, number = item.key
        name = plan.shard_names[index]
        ok, outputs, failed = screen_outputs(inference)
        files = []
        hash_s = profile_s = 0.0
        profile: dict[str, ColumnStats] = {}
        explain_stats: dict[str, Any] = {}
        if ok.size:
            scored = _scored_rows(payload, ok)
            t1 = time.perf_counter()
            explained = cast("Attributions | None", inference.explained)
            if explained is not None and explained.hashes is not None:
                input_hash = explained.hashes   # the sample needed them first
            else:
                input_hash = row_hashes(scored, plan.hash_columns)
            t2 = time.perf_counter()
            hash_s = t2 - t1
            # by feature and top k once, for the file, the statistics and the record
            shown = self._shown(explained) if explained is not None else None
            if self.quarantines:   # the partition's model: its drift statistics
                profile = self._profile(scored, outputs, explained, shown)
                profile_s = time.perf_counter() - t2
            table = self._predictions(payload, scored, ok, input_hash, outputs, name,
                                      f"{plan.attempt}-{index:05d}-{number:05d}",
                                      inference.compute_ms, explained, shown)
            files.append(self._write(self.folder, index, number, table, self.encoding))
            explain_stats = self._explain_stats(explained, shown)
        if not self.quarantines:
            return (index, ChallengerBatchRecord(
                name=self.name, batch=number, rows_in=item.rows, rows_scored=int(ok.size),
                rows_rejected=len(failed), files=tuple(files),
                first_reason=failed[0][1] if failed else None,
                compute_ms=inference.compute_ms if item.rows else 0.0))
        quarantine = list(payload.quarantine)
        if failed:
            rows = np.array([r for r, _ in failed], dtype=np.int64)
            quarantine.append(build_quarantine(
                name, payload.source_rows[rows],
                [[Failure(None, "model", msg)] for _, msg in failed],
                payload.valid.take(pa.array(rows))))
        quarantined = 0
        first_reason = None
        by_check: dict[tuple[str | None, str], int] = {}
        if quarantine:
            table = pa.concat_tables(quarantine).sort_by(SOURCE_ROW.name)
            quarantined = table.num_rows
            first_reason = table.column(REASON.name)[0].as_py()
            counted = (table.group_by([FAILED_COLUMN.name, CHECK.name])
                       .aggregate([(SOURCE_ROW.name, "count")]))
            by_check = {(c, k): n for c, k, n in zip(counted.column(FAILED_COLUMN.name).to_pylist(),
                                                     counted.column(CHECK.name).to_pylist(),
                                                     counted.column(f"{SOURCE_ROW.name}_count").to_pylist())}
            files.append(self._write(QUARANTINE, index, number, table))
        seconds = dict(payload.seconds, infer=inference.compute_ms / 1000.0, hash=hash_s,
                       profile=profile_s, write=time.perf_counter() - t0 - hash_s - profile_s)
        if inference.explained is not None:
            seconds["explain"] = inference.explained.seconds
        model = ModelStats(rows=item.rows, raised=len(inference.failed),
                           error=inference.failed[0][1] if inference.failed else None,
                           oom_backoffs=inference.oom_backoffs, chunk_rows=inference.chunk_rows,
                           warmup_ms=inference.warmup_ms, tokens=inference.tokens,
                           padded_tokens=inference.padded_tokens, **explain_stats)
        return (index, BatchRecord(
            batch=number, rows_in=payload.rows_in, rows_scored=int(ok.size),
            rows_quarantined=quarantined, files=tuple(files), first_reason=first_reason,
            seconds=seconds, model=model, profile=profile, quarantine=by_check,
            compute_ms=inference.compute_ms if item.rows else None, preprocess=payload.preprocess,
            last=payload.last))

    def _write(self, kind: str, index: int, number: int, table: pa.Table,
               encoding: dict | None = None) -> FileRecord:
        relative = self.layout.part(kind, index, number)
        for name, value in self.constants.items():   # Iceberg's partition column (io/sinks.py)
            table = table.append_column(name, pa.array([value] * table.num_rows, pa.string()))
        data = parquet_bytes(table, **(encoding or {}), arrow_schema=self.arrow_schema)
        if faults.armed("mid_write"):
            write_file(self.layout.fs, self.layout.abs(relative), data[: len(data) // 2])
            faults.point("mid_write")
        digest = write_file(self.layout.fs, self.layout.abs(relative), data)
        faults.point("write")
        return FileRecord(relative, table.num_rows, digest)

    def _explain_stats(self, explained: "Attributions | None", shown: "_Shown | None") -> dict[str, Any]:
        """The batch's explanation figures for its ModelStats: rows explained, rows that missed
        completeness, |attribution| summed per feature."""
        if explained is None or shown is None or self.explain is None:
            return {}
        return {"explained": int(explained.rows.size), "incomplete": explained.incomplete,
                "max_gap": explained.max_gap,
                "abs_attribution": {name: float(v) for name, v in
                                    zip(shown.names, np.abs(shown.by_feature).sum(axis=0))}}

    def _shown(self, explained: "Attributions") -> "_Shown":
        """The batch's attributions by feature, and what ``_explanation`` keeps of them: the top
        ``k`` features by |attribution|, or every one."""
        plan = cast(ExplainPlan, self.explain)
        width = int(np.shape(explained.values)[1]) if explained.values.size else 0
        names = np.array(plan.names(width) if width else (), dtype=object)
        by_feature = grouped(explained.values, plan.groups, len(names))
        positions, values = top(by_feature, plan.top_k) if len(names) else (
            np.zeros((explained.rows.size, 0), np.int64), np.zeros((explained.rows.size, 0)))
        return _Shown(names=names, by_feature=by_feature, positions=positions, values=values)

    def _explanations(self, n: int, explained: "Attributions",
                      shown: "_Shown") -> tuple[pa.Array, pa.Array]:
        """``_explanation`` and ``_explanation_baseline`` for the ``n`` scored rows: the explained
        rows' top features (or every one), null for the others."""
        names, positions, values = shown.names, shown.positions, shown.values
        k = positions.shape[1]
        struct = pa.StructArray.from_arrays(
            [pa.array(names[positions.reshape(-1)] if k else [], pa.string()),
             pa.array(values.reshape(-1), pa.float64())],
            fields=[pa.field("feature", pa.string(), nullable=False),
                    pa.field("attribution", pa.float64(), nullable=False)])
        lengths = np.zeros(n, dtype=np.int32)
        lengths[explained.rows] = k
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        missing = np.ones(n, dtype=bool)
        missing[explained.rows] = False
        lists = pa.ListArray.from_arrays(pa.array(offsets), struct,
                                         type=pa.list_(struct.type), mask=pa.array(missing))
        baseline = np.full(n, explained.baseline_value, dtype=np.float64)
        return lists, pa.array(baseline, pa.float64(), mask=missing)

    def _predictions(self, payload: Payload, scored: pa.RecordBatch, ok: np.ndarray,
                     input_hash: pa.Array, outputs: dict[str, np.ndarray], shard_name: str,
                     inference_id: str, compute_ms: float,
                     explained: "Attributions | None" = None,
                     shown: "_Shown | None" = None) -> pa.Table:
        """``scored``: the valid rows the model scored (``ok`` indexes them in the batch). The
        id columns, the prediction columns, with explain the explanation columns, then the
        audit columns as rows/columns.py declares them, in its order."""
        n = int(ok.size)
        columns: dict[str, pa.Array] = {}
        for column in self.plan.id_columns:  # one type per column in every file of the partition
            columns[column] = plain_array(scored.column(column))
        for output, column in (self.prediction_names or {k: k for k in outputs}).items():
            columns[column] = prediction_array(outputs[output])
        if explained is not None and shown is not None:
            columns[EXPLANATION.name], columns[EXPLANATION_BASELINE.name] = self._explanations(
                n, explained, shown)
        audit = {SOURCE_SHARD.name: pa.repeat(shard_name, n).cast(pa.string()),
                 SOURCE_ROW.name: pa.array(payload.source_rows[ok], pa.int64()),
                 INPUT_HASH.name: input_hash,
                 **{TRIPLE[part].name: _constant_dictionary(value, n)
                    for part, value in self.triple.as_dict().items()},
                 INFERENCE_ID.name: pa.repeat(inference_id, n).cast(pa.string()),
                 COMPUTE_MS.name: pa.repeat(float(compute_ms), n).cast(pa.float64())}
        for declared in AUDIT:
            columns[declared.name] = audit[declared.name]
        if explained is None:
            return pa.table(columns)
        return pa.table(columns).replace_schema_metadata({EXPLAIN_METADATA: self._metadata(explained)})

    def _metadata(self, explained: "Attributions") -> str:
        """What the explanation columns mean, in each file's metadata: the method and its
        parameters as declared, where the feature names come from and what they are."""
        plan = cast(ExplainPlan, self.explain)
        width = int(np.shape(explained.values)[1]) if explained.values.size else 0
        return json.dumps({"declared": json.loads(plan.declared), "input": plan.input,
                           "output": plan.output, "features_from": plan.features_from,
                           "features": list(plan.names(width)) if width or plan.features else [],
                           "completeness_tolerance": plan.tolerance if plan.complete else None},
                          sort_keys=True)

    def _profile(self, scored: pa.RecordBatch, outputs: dict[str, np.ndarray],
                 explained: "Attributions | None" = None,
                 shown: "_Shown | None" = None) -> dict[str, ColumnStats]:
        """This batch's statistics of the scored rows' features and predictions: a few numpy
        reductions and one ``searchsorted`` per column, no per-row Python (rows/profile.py)."""
        plan = self.plan
        stats: dict[str, ColumnStats] = {}
        names = scored.schema.names
        for column in plan.profile_features:
            values = numeric_values(scored.column(column)) if column in names else None
            if values is not None:
                stats[column] = ColumnStats.of(values, plan.profile_cuts.get(column))
        for output, column in (self.prediction_names or {k: k for k in outputs}).items():
            values = numeric_values(outputs[output])
            if values is not None:
                stats[column] = ColumnStats.of(values, plan.profile_cuts.get(column))
        if explained is not None and shown is not None and explained.rows.size:
            # the drift of "why": each feature's attribution over the rows explained, as
            # _explanation holds it (0 where a row's top k leave the feature out)
            names, positions, kept = shown.names, shown.positions, shown.values
            dense = np.zeros((kept.shape[0], len(names)))
            np.put_along_axis(dense, positions, kept, axis=1)
            for j, feature in enumerate(names):
                column = attribution_column(str(feature))
                stats[column] = ColumnStats.of(dense[:, j], plan.profile_cuts.get(column))
        return stats


class FinishShard(beam.DoFn):
    """Fold a shard's record and its batches' records into one shard entry of the manifest;
    ``challengers``: the names of the challengers whose records it must find."""

    def __init__(self, plan: ScoringPlan, challengers: tuple[str, ...] = ()):
        self.plan = plan
        self.challengers = challengers

    def setup(self):
        self.layout = self.plan.sink.layout(self.plan.output_url.value(), self.plan.attempt)

    def process(self, element) -> Iterator[int]:
        index, records = element
        result = fold_shard(self.plan.shard_names[index], list(records), self.challengers)
        result = dataclasses.replace(result, record=dataclasses.replace(result.record,
                                                                        scored_by=self.plan.attempt))
        write_json(self.layout.fs, self.layout.shard_result(index), result.to_dict())
        progress.shard_finished(index)
        faults.point("shard_done")
        yield index


def prediction_array(values: np.ndarray) -> pa.Array:
    """A model output as an Arrow column: [N] or [N, 1] → scalars, [N, K, ...] → fixed-size lists."""
    values = np.asarray(values)
    if values.ndim == 2 and values.shape[1] == 1:
        values = values[:, 0]
    if values.ndim <= 1:
        return pa.array(np.ascontiguousarray(values))
    flat = pa.array(np.ascontiguousarray(values).reshape(-1))
    for size in reversed(values.shape[1:]):
        flat = pa.FixedSizeListArray.from_arrays(flat, size)
    return flat


def screen_outputs(inference: Inference) -> tuple[np.ndarray, dict[str, np.ndarray], list[tuple[int, str]]]:
    """(rows scored, their outputs, rows rejected with why): the rows the model raised on, and
    those whose outputs are not finite, are rejected; ascending row order."""
    ok = inference.ok_rows
    outputs = inference.outputs
    failed = list(inference.failed)
    if ok.size:
        finite = _finite_rows(outputs, ok.size)
        if not finite.all():
            bad_outputs = {k for k, v in outputs.items() if not _finite_rows({k: v}, ok.size).all()}
            failed.extend((int(r), f"non-finite model output in {', '.join(sorted(bad_outputs))}")
                          for r in ok[~finite])
            outputs = {k: v[finite] for k, v in outputs.items()}
            ok = ok[finite]
    failed.sort()
    return ok, outputs, failed


def _scored_rows(payload: Payload, ok: np.ndarray) -> pa.RecordBatch:
    """The valid rows the model scored (``ok`` indexes them in the batch)."""
    return payload.valid if ok.size == payload.valid.num_rows else payload.valid.take(pa.array(ok))


def _finite_rows(outputs: dict[str, np.ndarray], n: int) -> np.ndarray:
    ok = np.ones(n, dtype=bool)
    for value in outputs.values():
        value = np.asarray(value)
        if value.dtype.kind in "fc":
            ok &= np.isfinite(value.reshape(n, -1)).all(axis=1)
    return ok


def _constant_dictionary(value: str, n: int) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)), pa.array([value]))
