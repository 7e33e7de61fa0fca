"""``batchinfer profile JOB.yaml --ds D --out PROFILE``: the baseline profile of a committed
partition, which runs of the job then compare themselves with (``monitor.baseline``).

It profiles exactly the rows the committed run scored: their feature columns, read again from
the input shards (only here: a run never reads its input twice) and taken by ``_source_row``,
and the prediction columns of the partition's files, read through its manifest. Each column gets
exact moments and quantiles and the cuts of its histogram (:mod:`batchinfer.rows.profile`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import SpecError, StorageError
from ..io.commit import PartitionCommit
from ..io.outputs import write_json
from ..io.storage import join, url_to_fs
from ..rows.profile import PROFILE_VERSION, baseline_column, numeric_values
from ..spec import Job
from .resolve import resolve


@dataclass(frozen=True)
class ProfileWritten:
    path: str
    rows: int
    features: int
    predictions: int


def profile_partition(job: Job, out: str) -> ProfileWritten:
    """Write the baseline profile of the job's committed partition to ``out``.

    Raises:
        SpecError: the partition is not committed (exit 2).
        StorageError: a file of the partition or the profile cannot be read or written.
    """
    spec = job.spec
    resolved = resolve(job)
    shown = job.display(spec.output.path)
    manifest = PartitionCommit(spec.output.path).committed()
    if manifest is None:
        raise SpecError(f"{shown} is not committed: score it first (batchinfer run), then profile it")
    fs, root = url_to_fs(spec.output.path)
    urls = dict(zip(resolved.shard_names(), (s.url for s in resolved.shards)))
    ids = set(spec.output.id_columns)
    features = list(resolved.features)
    feature_parts: dict[str, list[np.ndarray]] = {f: [] for f in features}
    prediction_parts: dict[str, list[np.ndarray]] = {}
    rows = 0
    try:
        for shard in manifest.shards:
            files = [f for f in shard.files if f.path.startswith("predictions/")]
            if not files:
                continue
            table = pa.concat_tables([pq.read_table(fs.open(join(root, f.path), "rb")) for f in files])
            rows += table.num_rows
            for name in table.column_names:
                if name.startswith("_") or name in ids:
                    continue
                values = numeric_values(table.column(name))
                if values is not None:
                    prediction_parts.setdefault(name, []).append(values)
            url = urls.get(shard.path)
            if url is None:
                raise SpecError(f"{shown} was committed from shard {shard.path}, which input.path no "
                                f"longer lists: profile a partition whose shards are still there")
            shard_fs, shard_path = url_to_fs(url)
            with shard_fs.open(shard_path, "rb") as handle:
                names = pq.read_schema(handle).names
                handle.seek(0)
                wanted = [f for f in features if f in names]
                source = pq.read_table(handle, columns=wanted)
            taken = source.take(pc.cast(table.column("_source_row"), pa.int64()))
            for name in wanted:
                values = numeric_values(taken.column(name))
                if values is not None:
                    feature_parts[name].append(values)
    except OSError as exc:
        raise StorageError(f"cannot read the partition {shown} or its input: {exc}") from None
    columns = {}
    for name, parts in feature_parts.items():
        if parts:
            columns[name] = baseline_column("feature", np.concatenate(parts)).to_dict()
    for name, parts in prediction_parts.items():
        columns[name] = baseline_column("prediction", np.concatenate(parts)).to_dict()
    record = {"profile_version": PROFILE_VERSION, "job": spec.name, "ds": job.ds,
              "output": shown, "attempt": manifest.attempt, "triple": manifest.triple,
              "rows": rows, "columns": columns}
    out_fs, out_path = url_to_fs(out)
    write_json(out_fs, out_path, record)
    return ProfileWritten(out, rows, sum(c["kind"] == "feature" for c in columns.values()),
                          sum(c["kind"] == "prediction" for c in columns.values()))
