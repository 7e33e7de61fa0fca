"""The Beam pipeline that scores one partition (docs/architecture.md, "One run, file by file").

    Create(shards) → Reshuffle → ReadShard ──batches──→ Prepare → RunInference → WriteBatch ─┐
                                   │                        └─→ RunInference[c] → WriteChallenger[c] ─┤
                                   └────shard info───────────────────────────────────────────────────┴→
                                      GroupByKey(shard) → FinishShard (per-shard JSON in _tmp)
                                      → GroupByKey(one key) → CommitPartition (pipeline/commit.py)

Each challenger ``c`` (``model.challengers``) gets the same prepared batches as the champion —
one read, one validation, one preprocessing — and its own RunInference and writer, whose files
go to ``challengers/<c>/<attempt>/`` and whose records meet the champion's at FinishShard, so
they are committed (or not) with the partition.

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
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence, Tuple, cast

import numpy as np
import pyarrow as pa

from .. import faults
from ..beam_compat import PredictionResult, RunInference, beam, in_global_window
from ..handlers.base import BatchModelHandler, Inference, Prepared
from ..io.outputs import PREDICTIONS, QUARANTINE, Layout, challenger_folder, parquet_bytes, write_file, write_json
from ..io.records import FileRecord, ModelStats, PreprocessStats
from ..io.shards import ShardReader, Unreadable
from ..rows.arrow_types import plain_array
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

# Prediction files: dictionary-encode only the columns that repeat one value per batch, keep
# statistics only where readers prune by them (measured: 36 → 13 ms CPU per 65,536-row file).
PREDICTION_ENCODING = {
    "dictionary": ["_source_shard", "_model_version", "_model_digest", "_schema_version",
                   "_preprocess_hash", "_inference_id"],
    "statistics": ["_source_row"],
}


@dataclass(frozen=True)
class ChallengerPlan:
    """A challenger as its writer needs it: its name (its folder), the triple its rows carry
    and its outputs → the champion's prediction columns (None: as the champion's map)."""

    name: str
    triple: Triple
    prediction_names: dict[str, str] | None = None


@dataclass(frozen=True)
class ScoringPlan:
    """Everything the pipeline's workers need; plain, picklable data.

    Attributes:
        shard_urls: shard URLs to read, by shard index.
        shard_names: what ``_source_shard`` records for each (``${NAME}`` values put back).
        output_url: ``output.path``.
        attempt: this run's attempt id.
        batch_rows: rows per RecordBatch.
        schema: the loaded schema version (its source travels, not the module).
        preprocessor: the preprocessing step.
        triple: written on every prediction row.
        id_columns: copied from input to predictions.
        prediction_names: model output name → column name (None: every output, same name).
        hash_columns: the columns ``_input_hash`` covers.
    """

    shard_urls: tuple[str, ...]
    shard_names: tuple[str, ...]
    output_url: str
    attempt: str
    batch_rows: int
    schema: SchemaVersion
    preprocessor: Preprocessor
    triple: Triple
    id_columns: tuple[str, ...]
    prediction_names: dict[str, str] | None = None
    hash_columns: tuple[str, ...] = field(default=())
    # Drift monitoring (rows/profile.py): the feature columns profiled, and the baseline's
    # histogram cuts by column (features and prediction columns); a column without cuts gets
    # moments only.
    profile_features: tuple[str, ...] = field(default=())
    profile_cuts: dict[str, tuple[float, ...]] = field(default_factory=dict)
    challengers: tuple[ChallengerPlan, ...] = ()


@dataclass
class Chunk:
    """One RecordBatch of a shard, as read."""

    shard: int
    number: int
    first_row: int
    batch: pa.RecordBatch
    read_s: float

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


def build(pipeline: beam.Pipeline, plan: ScoringPlan, commit: CommitPlan, *, handler: BatchModelHandler,
          challenger_handlers: Sequence[BatchModelHandler] = ()):
    """Add the scoring transforms and the commit step to ``pipeline``; returns the commit step's
    output (one status string). ``challenger_handlers`` go with ``plan.challengers``, in order."""
    shards = (pipeline
              | "Shards" >> beam.Create(list(enumerate(plan.shard_urls)))
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
    written = (prepared
               | "RunInference" >> RunInference(handler)
               .with_output_types(PredictionResult)
               | "WriteBatch" >> beam.ParDo(WriteBatch(plan)).with_output_types(Tuple[int, Any]))
    challengers = [
        prepared
        | f"RunInference[{c.name}]" >> RunInference(h).with_output_types(PredictionResult)
        | f"WriteChallenger[{c.name}]" >> beam.ParDo(WriteChallenger(plan, c))
        .with_output_types(Tuple[int, Any])
        for c, h in zip(plan.challengers, challenger_handlers, strict=True)]
    finished = ((infos, written, *challengers)
                | "Merge" >> beam.Flatten().with_output_types(Tuple[int, Any])
                | "ByShard" >> beam.GroupByKey().with_output_types(Tuple[int, Iterable[Any]])
                | "FinishShard" >> beam.ParDo(FinishShard(plan)).with_output_types(int))
    return add_commit(finished, commit)


def _is_chunk(element: Any) -> bool:
    return isinstance(element, Chunk)


def _is_shard_info(element: Any) -> bool:
    return not isinstance(element, Chunk)


class ReadShard(beam.DoFn):
    """(shard index, url) → :class:`Chunk` RecordBatches, then one ``(shard index, ShardInfo)``.

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
        index, url = element
        t0 = time.perf_counter()
        try:
            reader = ShardReader(url, hasher=self._hasher)
        except Unreadable as exc:
            progress.shard_finished(index)
            yield index, ShardInfo(None, None, str(exc))
            return
        faults.point("read")
        progress.shard_opened(index, reader.num_rows or 0)
        opened_s = time.perf_counter() - t0
        first_row = 0
        try:
            batches = enumerate(reader.batches(self.plan.batch_rows))
            while True:
                t0 = time.perf_counter()  # decoding only: downstream work runs inside `yield`
                item = next(batches, None)
                if item is None:
                    break
                number, batch = item
                yield Chunk(index, number, first_row, batch, time.perf_counter() - t0)
                first_row += batch.num_rows
        except Unreadable as exc:
            # Batches already sent on are dropped by FinishShard: the shard counts as unreadable.
            progress.shard_finished(index)
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
                                       prepared.stats))


class _Writer(beam.DoFn):
    """Model results → this attempt's files; one record per batch out (see :class:`WriteBatch`
    and :class:`WriteChallenger`).

    The work (row hashes, the predictions table, Parquet encoding, the put and its sha256) runs
    on one writer thread while this worker's main thread reads, validates and scores the next
    batches: that work is mostly single-threaded and releases the GIL, so it fills the core
    that scoring leaves idle (bench/README.md). At most ``IN_FLIGHT`` batches wait for the
    writer; records come out in order, the last ones at the end of the bundle.
    """

    IN_FLIGHT = 2

    def __init__(self, plan: ScoringPlan):
        self.plan = plan

    def setup(self):
        self.layout = Layout.for_url(self.plan.output_url, self.plan.attempt)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batchinfer-write")

    def start_bundle(self):
        self._pending: collections.deque = collections.deque()

    def process(self, result: PredictionResult) -> Iterator[Any]:
        self._pending.append(self._writer.submit(self._complete, result))
        while len(self._pending) > self.IN_FLIGHT:
            yield self._pending.popleft().result()

    def finish_bundle(self) -> Iterator[Any]:
        while self._pending:
            yield in_global_window(self._pending.popleft().result())

    def teardown(self):
        writer = getattr(self, "_writer", None)
        if writer is not None:
            writer.shutdown(wait=True, cancel_futures=True)

    def _complete(self, result: PredictionResult) -> tuple[int, Any]:
        """One batch's files and its record, on the writer thread."""
        raise NotImplementedError

    def _write(self, kind: str, index: int, number: int, table: pa.Table,
               encoding: dict | None = None) -> FileRecord:
        relative = self.layout.part(kind, index, number)
        if encoding is not None:
            encoding = {"dictionary": encoding["dictionary"],
                        "statistics": [*self.plan.id_columns, *encoding["statistics"]]}
        data = parquet_bytes(table, **(encoding or {}))
        if faults.armed("mid_write"):
            write_file(self.layout.fs, self.layout.abs(relative), data[: len(data) // 2])
            faults.point("mid_write")
        digest = write_file(self.layout.fs, self.layout.abs(relative), data)
        faults.point("write")
        return FileRecord(relative, table.num_rows, digest)

    def _predictions(self, payload: Payload, scored: pa.RecordBatch, ok: np.ndarray,
                     input_hash: pa.Array, outputs: dict[str, np.ndarray], shard_name: str,
                     inference_id: str, compute_ms: float, triple: Triple,
                     names: dict[str, str] | None = None) -> pa.Table:
        """``scored``: the valid rows the model scored (``ok`` indexes them in the batch);
        ``names``: output → column where this model's outputs are mapped otherwise."""
        plan = self.plan
        n = int(ok.size)
        columns: dict[str, pa.Array] = {}
        for column in plan.id_columns:  # one type per column in every file of the partition
            columns[column] = plain_array(scored.column(column))
        mapping = names or plan.prediction_names or {k: k for k in outputs}
        for output, column in mapping.items():
            columns[column] = prediction_array(outputs[output])
        columns["_source_shard"] = pa.repeat(shard_name, n).cast(pa.string())
        columns["_source_row"] = pa.array(payload.source_rows[ok], pa.int64())
        columns["_input_hash"] = input_hash
        for part, value in triple.as_dict().items():
            columns[f"_{part}"] = _constant_dictionary(value, n)
        columns["_inference_id"] = pa.repeat(inference_id, n).cast(pa.string())
        columns["_compute_ms"] = pa.repeat(float(compute_ms), n).cast(pa.float64())
        return pa.table(columns)


class WriteBatch(_Writer):
    """The champion's results → prediction and quarantine files of this attempt; one
    :class:`BatchRecord` out per batch."""

    def _complete(self, result: PredictionResult) -> tuple[int, BatchRecord]:
        plan = self.plan
        t0 = time.perf_counter()
        item = cast(Prepared, result.example)
        inference = cast(Inference, result.inference)
        payload: Payload = item.payload
        index, number = item.key
        name = plan.shard_names[index]
        quarantine = list(payload.quarantine)

        ok, outputs, failed = screen_outputs(inference)
        if failed:
            rows = np.array([r for r, _ in failed], dtype=np.int64)
            quarantine.append(build_quarantine(
                name, payload.source_rows[rows],
                [[Failure(None, "model", msg)] for _, msg in failed],
                payload.valid.take(pa.array(rows))))

        files = []
        inference_id = f"{plan.attempt}-{index:05d}-{number:05d}"
        hash_s = profile_s = 0.0
        profile: dict[str, ColumnStats] = {}
        if ok.size:
            scored = _scored_rows(payload, ok)
            t1 = time.perf_counter()
            input_hash = row_hashes(scored, plan.hash_columns)
            t2 = time.perf_counter()
            hash_s = t2 - t1
            profile = self._profile(scored, outputs)
            profile_s = time.perf_counter() - t2
            table = self._predictions(payload, scored, ok, input_hash, outputs, name, inference_id,
                                      inference.compute_ms, plan.triple)
            files.append(self._write(PREDICTIONS, index, number, table, PREDICTION_ENCODING))
        quarantined = 0
        first_reason = None
        by_check: dict[tuple[str | None, str], int] = {}
        if quarantine:
            table = pa.concat_tables(quarantine).sort_by("_source_row")
            quarantined = table.num_rows
            first_reason = table.column("_reason")[0].as_py()
            counted = table.group_by(["_column", "_check"]).aggregate([("_source_row", "count")])
            by_check = {(c, k): n for c, k, n in zip(counted.column("_column").to_pylist(),
                                                     counted.column("_check").to_pylist(),
                                                     counted.column("_source_row_count").to_pylist())}
            files.append(self._write(QUARANTINE, index, number, table))
        seconds = dict(payload.seconds, infer=inference.compute_ms / 1000.0, hash=hash_s,
                       profile=profile_s, write=time.perf_counter() - t0 - hash_s - profile_s)
        progress.rows_written(index, payload.rows_in, quarantined)
        model = ModelStats(item.rows, len(inference.failed),
                           inference.failed[0][1] if inference.failed else None,
                           inference.oom_backoffs, inference.chunk_rows, inference.warmup_ms,
                           inference.tokens, inference.padded_tokens)
        return (index, BatchRecord(number, payload.rows_in, int(ok.size), quarantined,
                                   tuple(files), first_reason, seconds, model, profile, by_check,
                                   inference.compute_ms if item.rows else None,
                                   payload.preprocess))

    def _profile(self, scored: pa.RecordBatch, outputs: dict[str, np.ndarray]) -> dict[str, ColumnStats]:
        """This batch's statistics of the scored rows' features and predictions: a few numpy
        reductions and one ``searchsorted`` per column, no per-row Python (rows/profile.py)."""
        plan = self.plan
        stats: dict[str, ColumnStats] = {}
        names = scored.schema.names
        for column in plan.profile_features:
            values = numeric_values(scored.column(column)) if column in names else None
            if values is not None:
                stats[column] = ColumnStats.of(values, plan.profile_cuts.get(column))
        mapping = plan.prediction_names or {k: k for k in outputs}
        for output, column in mapping.items():
            values = numeric_values(outputs[output])
            if values is not None:
                stats[column] = ColumnStats.of(values, plan.profile_cuts.get(column))
        return stats


class WriteChallenger(_Writer):
    """A challenger's results → its prediction files, with the champion's columns and its own
    triple; one :class:`ChallengerBatchRecord` out per batch.

    Rows the challenger rejects are counted, not quarantined: the input row is the champion's
    business, and a challenger must never change what the partition commits.
    """

    def __init__(self, plan: ScoringPlan, challenger: ChallengerPlan):
        super().__init__(plan)
        self.challenger = challenger
        self.folder = challenger_folder(challenger.name)

    def _complete(self, result: PredictionResult) -> tuple[int, ChallengerBatchRecord]:
        plan = self.plan
        item = cast(Prepared, result.example)
        inference = cast(Inference, result.inference)
        payload: Payload = item.payload
        index, number = item.key
        ok, outputs, failed = screen_outputs(inference)
        files = []
        if ok.size:
            scored = _scored_rows(payload, ok)
            table = self._predictions(payload, scored, ok, row_hashes(scored, plan.hash_columns),
                                      outputs, plan.shard_names[index],
                                      f"{plan.attempt}-{index:05d}-{number:05d}",
                                      inference.compute_ms, self.challenger.triple,
                                      self.challenger.prediction_names)
            files.append(self._write(self.folder, index, number, table, PREDICTION_ENCODING))
        return (index, ChallengerBatchRecord(
            self.challenger.name, number, item.rows, int(ok.size), len(failed), tuple(files),
            failed[0][1] if failed else None, inference.compute_ms if item.rows else 0.0))


class FinishShard(beam.DoFn):
    """Fold a shard's record and its batches' records into one shard entry of the manifest."""

    def __init__(self, plan: ScoringPlan):
        self.plan = plan

    def setup(self):
        self.layout = Layout.for_url(self.plan.output_url, self.plan.attempt)

    def process(self, element) -> Iterator[int]:
        index, records = element
        result = fold_shard(self.plan.shard_names[index], list(records),
                            [c.name for c in self.plan.challengers])
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
