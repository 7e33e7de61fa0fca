"""The sample an export is checked on: rows of a job's input, prepared exactly as a run prepares
them (``--sample JOB.yaml``), and the ONNX model and sample job that ``--to tensorrt`` and
``--quantize`` need.

The sample is **stratified by shard** and seeded (:func:`_job_sample`): every readable shard of
the partition gives rows in proportion to its row count (at least one each, where the sample is
large enough), chosen inside the shard by a seeded generator. A sample of the first rows of the
first shard vouched for that shard alone: an INT8 recipe passed the gate there (min cosine
0.9927) and fell to 0.9884 on the rest of the partition (issue 35)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import SpecError

SAMPLE_ROWS = 1024
SAMPLE_SEED = 0            # the default: the same partition gives the same sample
METHOD = "stratified"
# Below this many rows a shard's not-yet-drawn rows are listed and drawn from; above it rows are
# drawn by rejection (a list of every row index of a shard of 100M rows would be 800 MB).
DENSE_ROWS = 1 << 20


@dataclass(frozen=True)
class SampleSize:
    """What a sample is asked for: ``rows`` valid rows (fewer when the partition has fewer),
    drawn with ``seed``."""

    rows: int = SAMPLE_ROWS
    seed: int = SAMPLE_SEED


@dataclass(frozen=True)
class JobSample:
    """The prepared rows and where they came from (what ``<out>.quantization.json`` records)."""

    arrays: list[np.ndarray]
    rows: int               # valid rows drawn
    shards: int             # shards they came from
    partition_shards: int   # shards the partition lists (unreadable ones too)
    partition_rows: int     # rows of its readable shards
    seed: int
    job: str

    def where(self) -> str:
        """The sample in a line's words: ``2000 rows of job's input, from 2 of 2 shards``."""
        return f"{self.rows} rows of {self.job}'s input, from {self.shards} of {self.partition_shards} shards"

    def facts(self) -> dict[str, Any]:
        """What the quantization record says of it (the sample's digest beside it, by the caller)."""
        return {"sample": f"{self.where()}, drawn in proportion to each shard's rows (seed "
                          f"{self.seed}), prepared as a run prepares them",
                "sample_method": METHOD, "sample_rows": self.rows, "sample_seed": self.seed,
                "sample_shards": self.shards, "sample_partition_shards": self.partition_shards,
                "sample_partition_rows": self.partition_rows}


def _job_sample(job: Any, input_names: list[str], size: SampleSize = SampleSize()) -> JobSample:
    """Up to ``size.rows`` valid rows drawn from every readable shard of the job's input (each
    shard's share by :func:`allocate`, its rows by a generator seeded with ``size.seed`` and the
    shard's index), validated and preprocessed as a run would: each shard's drawn rows validated
    as a batch of that shard (a drawn row that fails is replaced by another draw from the same
    shard, while it has rows), then the job's preprocessing once over all of them, in an order
    shuffled by the same seed (so the first rows, which calibrate a static quantization, are
    from every shard too).

    Raises:
        SpecError: no valid row in any readable shard.
    """
    from ..app.resolve import list_job_input, resolve_inputs
    from ..io.shards import Unreadable, footer_rows

    schema, _, preprocessor = resolve_inputs(job)
    shards = list_job_input(job).shards
    counts: dict[int, int] = {}
    for shard in shards:
        try:
            counts[shard.index] = footer_rows(shard.url)
        except Unreadable:
            continue
    readable = [s for s in shards if s.index in counts]
    quotas = allocate([counts[s.index] for s in readable], size.rows, np.random.default_rng(size.seed))
    drawn = []
    for shard, quota in zip(readable, quotas):
        if quota:
            try:
                rows = _shard_rows(shard.url, int(quota), np.random.default_rng([size.seed, shard.index]),
                                   schema)
            except Unreadable:   # read since it was counted: skipped, as the count would have
                continue
            if rows is not None:
                drawn.append(rows)
    if not drawn:
        raise SpecError(f"no valid rows in {job.display(job.spec.input.path)} to sample")
    valid = _concat(drawn)
    valid = valid.take(np.random.default_rng(size.seed).permutation(valid.num_rows))
    features = preprocessor(valid.combine_chunks().to_batches()[0])
    if isinstance(features, Mapping):  # by the program's input names when they match
        names = input_names if set(input_names) <= set(features) else list(features)
        arrays = [np.asarray(features[n]) for n in names]
    else:
        arrays = [np.asarray(features)]
    return JobSample(arrays, valid.num_rows, len(drawn), len(shards), sum(counts.values()), size.seed,
                     job.spec.name)


def allocate(counts: Sequence[int], rows: int, rng: np.random.Generator) -> np.ndarray:
    """Rows to draw from each shard, of ``counts`` rows each: ``rows`` (at most their total),
    in proportion to the counts (largest remainders), and at least one from every shard that
    has rows, taken from the shards most over their exact share. Asked for fewer rows than
    there are such shards: one row from each of ``rows`` shards drawn by ``rng``, a shard's
    chance in proportion to its rows.

    Example:
        >>> allocate([100, 300, 0, 1], 8, np.random.default_rng(0)).tolist()
        [2, 5, 0, 1]
    """
    sizes = np.asarray(counts, dtype=np.int64)
    total = int(sizes.sum())
    rows = min(int(rows), total)
    quotas = np.zeros(len(sizes), dtype=np.int64)
    having = np.flatnonzero(sizes)
    if rows <= 0:
        return quotas
    if rows < len(having):
        quotas[rng.choice(having, size=rows, replace=False, p=sizes[having] / total)] = 1
        return quotas
    share = sizes * rows    # exact shares are share / total: integers, no float rounding
    quotas = share // total
    remainders = share % total
    quotas[np.argsort(-remainders, kind="stable")[:rows - int(quotas.sum())]] += 1
    for empty in having[quotas[having] == 0]:
        donors = np.flatnonzero(quotas > 1)   # some: rows >= shards with rows
        over = quotas[donors] * total - share[donors]
        quotas[donors[np.argmax(over)]] -= 1
        quotas[empty] += 1
    return quotas


def _shard_rows(url: str, quota: int, rng: np.random.Generator, schema: Any) -> Any:
    """Up to ``quota`` valid rows of shard ``url`` (a RecordBatch; None if it has none), drawn
    by ``rng`` and validated as a batch of the shard; rows that fail are replaced by further
    draws until ``quota`` are valid or the shard is drawn out."""
    import pyarrow as pa

    from ..io.shards import ShardReader
    from ..rows.validation import validate_batch

    reader = ShardReader(url)
    try:
        taken = np.empty(0, dtype=np.int64)
        kept: list[pa.RecordBatch] = []
        have, ask = 0, quota
        while have < quota and len(taken) < reader.num_rows:
            drawn = _draw(rng, reader.num_rows, taken, ask)
            taken = np.concatenate([taken, drawn])
            order = np.sort(drawn)
            result = validate_batch(reader.take(order), schema.schema, source_shard=url)
            ok = np.zeros(len(order), dtype=bool)
            ok[result.valid_rows] = True
            at = np.searchsorted(order, drawn)          # each drawn row's place in ``order``
            first = at[ok[at]][:quota - have]           # the valid ones, first drawn first
            if len(first):
                kept.append(result.valid.take(np.cumsum(ok)[first] - 1))
                have += len(first)
            valid_share = have / len(taken)
            # as many as the valid share so far says are needed; none valid yet: twice as many
            ask = int(np.ceil((quota - have) / valid_share)) if valid_share else 2 * ask
        return pa.Table.from_batches(kept).combine_chunks().to_batches()[0] if have else None
    finally:
        reader.close()


def _draw(rng: np.random.Generator, population: int, taken: np.ndarray, size: int) -> np.ndarray:
    """``size`` distinct row indices of ``[0, population)`` not in ``taken`` (all that are left,
    if fewer), in the order drawn."""
    left = population - len(taken)
    size = min(size, left)
    if size <= 0:
        return np.empty(0, dtype=np.int64)
    if population <= DENSE_ROWS or 4 * size >= left:
        pool = np.setdiff1d(np.arange(population, dtype=np.int64), taken, assume_unique=True)
        return rng.choice(pool, size=size, replace=False)
    seen = set(taken.tolist())   # sparse: most draws are rows not drawn yet
    out: list[int] = []
    while len(out) < size:
        for index in rng.integers(0, population, size=2 * (size - len(out))).tolist():
            if index not in seen:
                seen.add(index)
                out.append(index)
                if len(out) == size:
                    break
    return np.asarray(out, dtype=np.int64)


def _concat(batches: Sequence[Any]) -> Any:
    """The shards' valid rows as one table. Shards written apart may differ in a column's
    presence or width (int32 here, int64 there): Arrow's permissive promotion unifies them, as
    the run's validation let each pass; columns that cannot be unified are exit 2.

    Raises:
        SpecError: shards whose columns no type holds both of.
    """
    import pyarrow as pa

    tables = [pa.Table.from_batches([b]) for b in batches]
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise SpecError(f"the sampled shards' columns do not unify into one sample: {exc}") from None


def _check_onnx_input(model: Path, sample_job: Any, mode: str, why_sample: str) -> None:
    """An ONNX model file and a sample job, as ``export MODE`` needs them (exit 2 otherwise)."""
    if model.suffix.lower() != ".onnx":
        raise SpecError(f"export {mode} takes an ONNX model (.onnx), not {model.name}")
    if not model.is_file():
        raise SpecError(f"no model file {model}")
    if sample_job is None:
        raise SpecError(f"export {mode} needs --sample JOB.yaml: {why_sample}")
