"""``batchinfer profile JOB.yaml --ds D --out PROFILE``: the baseline profile of a committed
partition, which runs of the job then compare themselves with (``monitor.baseline``).

It profiles exactly the rows the committed run scored: their feature columns, read again from
the input shards (only here: a run never reads its input twice) and taken by ``_source_row`` —
only from a shard whose sha256 is still the manifest's —, and the prediction columns of the
partition's files, read through its manifest. Each column gets
exact moments and quantiles and the cuts of its histogram (:mod:`batchinfer.rows.column_profiles`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..app.resolve import list_partition_input, partition_of, resolve, shown_partition
from ..errors import ContractError, SpecError, StorageError
from ..io.outputs import PREDICTIONS, write_json
from ..io.partitions import Committed
from ..io.records import ShardRecord
from ..io.shards import ShardReader, Unreadable
from ..io.storage import url_to_fs
from ..profile_records import PROFILE_VERSION, ColumnProfileRecord, Profile
from ..rows.column_profiles import baseline_column, numeric_values
from ..rows.columns import EXPLANATION, attribution_column
from ..spec import Job

BATCH_ROWS = 65536   # rows per batch when an input shard is read again


@dataclass(frozen=True)
class ProfileWritten:
    path: str
    rows: int
    features: int
    predictions: int


def scored_input(url: str, shard: ShardRecord, features: list[str], shown: str) -> pa.Table:
    """The feature columns of an input shard, read again — only if its bytes are still those
    the committed run scored (the manifest's sha256): rows taken by ``_source_row`` from other
    bytes would describe rows nobody scored.

    Raises:
        ContractError: the shard changed, or cannot be read as Parquet any more (exit 3).
        StorageError: its bytes cannot be fetched.
    """
    try:
        reader = ShardReader(url)
        if reader.sha256 is not None:   # fetched whole: known now (streamed: once read)
            _same_bytes(shard, reader.sha256, shown)
        schema = pa.schema([reader.schema.field(f) for f in features if f in reader.schema.names])
        batches = [pa.RecordBatch.from_arrays([b.column(f) for f in schema.names], schema=schema)
                   for b in reader.batches(BATCH_ROWS)]
    except Unreadable as exc:
        raise ContractError(f"{shown} was scored from shard {shard.path}, which cannot be read any "
                            f"more ({exc}): {REDO}") from None
    _same_bytes(shard, reader.sha256, shown)
    return pa.Table.from_batches(batches, schema=schema)


REDO = "profile a partition whose input is unchanged, or score this one again (run --overwrite)"


def _same_bytes(shard: ShardRecord, sha256: str | None, shown: str) -> None:
    if sha256 != shard.sha256:
        raise ContractError(f"{shown} was scored from other bytes of shard {shard.path} (sha256 "
                            f"{_short(shard.sha256)} committed, {_short(sha256)} now): {REDO}")


def _short(digest: str | None) -> str:
    return digest[:12] + "…" if digest else "none"


def _scored_rows(table: pa.Table, rows: int, shard: str) -> pa.Array:
    """The committed rows' ``_source_row`` of a shard, each one a row of it."""
    index = pc.cast(table.column("_source_row"), pa.int64())
    if len(index) and (pc.min(index).as_py() < 0 or pc.max(index).as_py() >= rows):
        raise ContractError(f"the partition's rows of shard {shard} are not rows of its {rows}: the "
                            f"shard is not the one that was scored")
    return index


def attributions(explanations: list) -> dict[str, np.ndarray]:
    """Each feature's attribution over the rows explained (``_explanation`` not null), as the
    run profiles it: its value in the row's list, 0 where the row's top k leave it out."""
    rows = [entry for entry in explanations if entry is not None]
    features = sorted({e["feature"] for entry in rows for e in entry})
    out = {attribution_column(f): np.zeros(len(rows)) for f in features}
    for i, entry in enumerate(rows):
        for e in entry:
            out[attribution_column(e["feature"])][i] = e["attribution"]
    return out


def profile_partition(job: Job, out: str) -> ProfileWritten:
    """Write the baseline profile of the job's committed partition to ``out``.

    Raises:
        SpecError: the partition is not committed (exit 2).
        ContractError: an input shard is no longer what the partition scored: gone from
            input.path, other bytes than the manifest's sha256, or too few rows (exit 3).
        StorageError: a file of the partition or the profile cannot be read or written.
    """
    spec = job.spec
    shown = shown_partition(job)
    committed = partition_of(job)
    manifest = committed.committed()
    if manifest is None:
        raise SpecError(f"{shown} is not committed: score it first (batchinfer run), then profile it")
    # a table input as it was scored: the version the manifest pinned
    resolved = resolve(job, listing=list_partition_input(job, manifest, reading=True))
    partition = Committed(shown, manifest, committed.layout(manifest.attempt))
    urls = dict(zip(resolved.shard_names(), (s.url for s in resolved.shards)))
    ids = set(spec.output.id_columns)
    features = list(resolved.features)
    feature_parts: dict[str, list[np.ndarray]] = {f: [] for f in features}
    prediction_parts: dict[str, list[np.ndarray]] = {}
    rows = 0
    try:
        for shard in manifest.shards:
            table = partition.read(shard.files, PREDICTIONS)
            if table is None:
                continue
            rows += table.num_rows
            for name in table.column_names:
                if name.startswith("_") or name in ids:
                    continue
                values = numeric_values(table.column(name))
                if values is not None:
                    prediction_parts.setdefault(name, []).append(values)
            if EXPLANATION.name in table.column_names:   # the drift of "why"
                for name, values in attributions(table.column(EXPLANATION.name).to_pylist()).items():
                    prediction_parts.setdefault(name, []).append(values)
            url = urls.get(shard.path)
            if url is None:
                raise ContractError(f"{shown} was committed from shard {shard.path}, which input.path "
                                    f"no longer lists: profile a partition whose shards are still there")
            source = scored_input(url, shard, features, shown)
            taken = source.take(_scored_rows(table, source.num_rows, shard.path))
            for name in source.column_names:
                values = numeric_values(taken.column(name))
                if values is not None:
                    feature_parts[name].append(values)
    except (OSError, pa.ArrowException) as exc:
        raise StorageError(f"cannot read the partition {shown} or its input: {exc}") from None
    columns: dict[str, ColumnProfileRecord] = {}
    for name, parts in feature_parts.items():
        if parts:
            columns[name] = baseline_column("feature", np.concatenate(parts)).record()
    for name, parts in prediction_parts.items():
        columns[name] = baseline_column("prediction", np.concatenate(parts)).record()
    record = Profile(profile_version=PROFILE_VERSION, job=spec.name, ds=job.ds, output=shown,
                     attempt=manifest.attempt, triple=dict(manifest.triple), rows=rows,
                     columns=columns)
    out_fs, out_path = url_to_fs(out)
    write_json(out_fs, out_path, record.to_dict())
    return ProfileWritten(out, rows, sum(c.kind == "feature" for c in columns.values()),
                          sum(c.kind == "prediction" for c in columns.values()))
