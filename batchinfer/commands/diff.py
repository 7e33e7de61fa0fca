"""``batchinfer diff``: compare two committed outputs of the same partition (SPEC §2).

Both sides are read through their manifests only (files a manifest does not list are not part
of a partition). Rows are matched by ``(_source_shard, _source_row)``, one shard at a time, so
memory is bounded by the largest shard, not the partition. Compared: the triple, the inputs
(each shard's sha256), which rows were scored or quarantined on each side, ``_input_hash``, and
every other column the two prediction tables share — bit for bit, with the largest absolute
difference for numbers. ``_inference_id`` and ``_compute_ms`` describe an execution and are
not compared (SPEC §5.4); the triple columns are compared once, from the manifests.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import SpecError, StorageError
from ..io.manifest import read_manifest
from ..io.records import FileRecord, Manifest, ShardRecord
from ..io.storage import join, url_to_fs

EXEMPT = {"_source_shard", "_source_row", "_inference_id", "_compute_ms", "_model_version",
          "_model_digest", "_schema_version", "_preprocess_hash"}


def diff_outputs(url_a: str, url_b: str) -> dict[str, Any]:
    """A report (plain data, JSON-ready) of how output B differs from output A.

    Raises:
        SpecError: either side holds no committed partition.
        StorageError: a listed file cannot be read.
    """
    sides = [_Side(url) for url in (url_a, url_b)]
    a, b = sides
    triple = {part: {"a": a.manifest.triple.get(part), "b": b.manifest.triple.get(part)}
              for part in sorted(set(a.manifest.triple) | set(b.manifest.triple))
              if a.manifest.triple.get(part) != b.manifest.triple.get(part)}
    shards_a, shards_b = a.shards(), b.shards()
    rows = dict.fromkeys(["scored_both", "scored_only_a", "scored_only_b", "quarantined_both",
                          "input_hash_differs"], 0)
    columns: dict[str, dict[str, Any]] = {}
    for name in sorted(set(shards_a) & set(shards_b)):
        _compare_shard(a, b, shards_a[name], shards_b[name], rows, columns)
    changed = sorted(n for n in set(shards_a) & set(shards_b)
                     if shards_a[n].sha256 != shards_b[n].sha256)
    identical = (not triple and not changed and shards_a.keys() == shards_b.keys()
                 and rows["scored_only_a"] == rows["scored_only_b"] == 0
                 and rows["input_hash_differs"] == 0
                 and all(c["differ"] == 0 for c in columns.values()))
    return {
        "a": {"output": url_a, **_about(a.manifest)}, "b": {"output": url_b, **_about(b.manifest)},
        "same_partition": (a.manifest.job, a.manifest.ds) == (b.manifest.job, b.manifest.ds),
        "triple_differs": triple,
        "shards": {"both": len(set(shards_a) & set(shards_b)),
                   "only_a": sorted(set(shards_a) - set(shards_b)),
                   "only_b": sorted(set(shards_b) - set(shards_a)),
                   "input_changed": changed},
        "rows": rows,
        "columns": columns,
        "identical": identical,
    }


def _about(manifest: Manifest) -> dict:
    return {"job": manifest.job, "ds": manifest.ds, "attempt": manifest.attempt,
            "totals": manifest.totals.to_dict()}


class _Side:
    def __init__(self, url: str):
        self.url = url
        self.fs, self.root = url_to_fs(url)
        manifest = read_manifest(self.fs, self.root)
        if manifest is None:
            raise SpecError(f"{url} holds no committed partition (no _manifest.json)")
        self.manifest = manifest

    def shards(self) -> dict[str, ShardRecord]:
        return {s.path: s for s in self.manifest.shards}

    def read(self, files: tuple[FileRecord, ...], kind: str,
             columns: list[str] | None) -> pa.Table | None:
        """The shard's files of one kind (predictions | quarantine), concatenated."""
        tables = []
        for f in files:
            if not f.path.startswith(f"{kind}/"):
                continue
            path = join(self.root, f.path)
            try:
                with self.fs.open(path, "rb") as handle:
                    tables.append(pq.read_table(handle, columns=columns))
            except (OSError, pa.ArrowException) as exc:
                raise StorageError(f"cannot read {self.url}/{f.path}: {exc}") from None
        return pa.concat_tables(tables) if tables else None


def _rows(table: pa.Table | None) -> np.ndarray:
    if table is None:
        return np.zeros(0, np.int64)
    return table.column("_source_row").to_numpy()


def _compare_shard(a: _Side, b: _Side, shard_a: ShardRecord, shard_b: ShardRecord, rows: dict,
                   columns: dict) -> None:
    pred_a = a.read(shard_a.files, "predictions", None)
    pred_b = b.read(shard_b.files, "predictions", None)
    quar_a = _rows(a.read(shard_a.files, "quarantine", ["_source_row"]))
    quar_b = _rows(b.read(shard_b.files, "quarantine", ["_source_row"]))
    rows_a, rows_b = _rows(pred_a), _rows(pred_b)
    common, ia, ib = np.intersect1d(rows_a, rows_b, assume_unique=True, return_indices=True)
    rows["scored_both"] += int(common.size)
    rows["scored_only_a"] += int(rows_a.size - common.size)
    rows["scored_only_b"] += int(rows_b.size - common.size)
    rows["quarantined_both"] += int(np.intersect1d(quar_a, quar_b, assume_unique=True).size)
    if not common.size or pred_a is None or pred_b is None:
        return
    names = [n for n in pred_a.column_names if n in pred_b.column_names and n not in EXEMPT]
    for name in names:
        col_a = pred_a.column(name).take(pa.array(ia))
        col_b = pred_b.column(name).take(pa.array(ib))
        differ, max_abs = _column_difference(col_a, col_b)
        if name == "_input_hash":
            rows["input_hash_differs"] += differ
            continue
        entry = columns.setdefault(name, {"differ": 0, "max_abs_diff": None})
        entry["differ"] += differ
        if max_abs is not None:
            entry["max_abs_diff"] = max(entry["max_abs_diff"] or 0.0, max_abs)


def _column_difference(col_a: pa.ChunkedArray, col_b: pa.ChunkedArray) -> tuple[int, float | None]:
    """(rows that are not identical, largest |a - b| for numeric columns or None)."""
    if col_a.type != col_b.type:
        return len(col_a), None
    rows, width = len(col_a), 1
    values_a, values_b = col_a.combine_chunks(), col_b.combine_chunks()
    while pa.types.is_fixed_size_list(values_a.type):  # model outputs of shape [N, K, ...]
        width *= values_a.type.list_size
        values_a, values_b = values_a.flatten(), values_b.flatten()
    if pa.types.is_integer(values_a.type) or pa.types.is_floating(values_a.type):
        x = values_a.to_numpy(zero_copy_only=False).reshape(rows, width)
        y = values_b.to_numpy(zero_copy_only=False).reshape(rows, width)
        same = (x == y) | (np.isnan(x) & np.isnan(y)) if x.dtype.kind == "f" else x == y
        gap = np.abs(x.astype(np.float64) - y.astype(np.float64))
        return int((~same.all(axis=1)).sum()), float(np.nanmax(gap)) if gap.size else 0.0
    equal = pc.fill_null(pc.equal(values_a, values_b), False)
    same = pc.or_(equal, pc.and_(pc.is_null(values_a), pc.is_null(values_b)))
    return int((~same.to_numpy(zero_copy_only=False).reshape(rows, width).all(axis=1)).sum()), None
