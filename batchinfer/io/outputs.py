"""The output layout of a partition (contract §4) and writing its files.

    <output.path>/_manifest.json                                   the commit
    <output.path>/predictions/<attempt>/part-SSSSS-BBBBB.parquet   shard S, batch B
    <output.path>/quarantine/<attempt>/part-SSSSS-BBBBB.parquet
    <output.path>/challengers/<name>/<attempt>/part-SSSSS-BBBBB.parquet   a challenger's predictions
    <output.path>/_tmp/<attempt>/shards/SSSSS.json                 per-shard results (scratch)

Files are serialised in memory, hashed, then written with one put: the sha256 recorded in the
manifest is of exactly the bytes written, and an object store sees one request per file.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from ..errors import StorageError
from .storage import join, url_to_fs

MANIFEST = "_manifest.json"
PREDICTIONS = "predictions"
QUARANTINE = "quarantine"
CHALLENGERS = "challengers"   # challengers/<name>/<attempt>/…: each challenger model's predictions
TMP = "_tmp"
METRICS = "_metrics.json"
PROFILE = "_profile.json"     # the run's column statistics and drift (monitoring), beside METRICS
REPORT = "report.html"        # the job report, beside METRICS
DRIFT = "_drift"              # <attempt>.json/.html of runs that drift stopped (not cleaned up)
# `<UTC time>-<8 hex>` (contract §6). Cleanup removes only folders named like this: output.path is
# the user's, and a folder of theirs that happens to sit in predictions/ is not ours to delete.
ATTEMPT = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{8}")  # fullmatch: `$` passes a final newline


@dataclass(frozen=True)
class Layout:
    """Paths of one attempt's files under an output root (fsspec path, no protocol)."""

    fs: AbstractFileSystem
    root: str
    attempt: str

    @classmethod
    def for_url(cls, url: str, attempt: str) -> "Layout":
        fs, root = url_to_fs(url)
        return cls(fs, root, attempt)

    @property
    def manifest(self) -> str:
        return join(self.root, MANIFEST)

    def part(self, kind: str, shard: int, batch: int) -> str:
        """Relative path of a data file (``kind``: predictions, quarantine, or a challenger's
        folder, :func:`challenger_folder`)."""
        return f"{kind}/{self.attempt}/part-{shard:05d}-{batch:05d}.parquet"

    def shard_result(self, shard: int) -> str:
        return join(self.root, TMP, self.attempt, "shards", f"{shard:05d}.json")

    @property
    def outcome(self) -> str:
        """Where the pipeline's commit step leaves what it did (io.commit.Attempt.record)."""
        return join(self.root, TMP, self.attempt, "outcome.json")

    def abs(self, relative: str) -> str:
        return join(self.root, relative)


def challenger_folder(name: str) -> str:
    """The folder (relative to ``output.path``) that holds challenger ``name``'s attempts; a
    ``kind`` for :meth:`Layout.part`."""
    return f"{CHALLENGERS}/{name}"


def parquet_bytes(table: pa.Table, *, dictionary: list[str] | None = None,
                  statistics: list[str] | None = None) -> bytes:
    """Serialise ``table`` as Parquet.

    Args:
        dictionary: columns to dictionary-encode (default: all). Trying a dictionary on
            high-cardinality columns (hashes, scores) only to give up costs more than writing.
        statistics: columns to keep min/max statistics for (default: all); statistics of
            long unique strings cost time and help no reader.
    """
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink,
                   use_dictionary=True if dictionary is None else dictionary,
                   write_statistics=True if statistics is None else statistics)
    return sink.getvalue().to_pybytes()


def write_file(fs: AbstractFileSystem, path: str, data: bytes) -> str:
    """Write ``data`` to ``path``; return its sha256."""
    try:
        parent = path.rsplit("/", 1)[0]
        fs.makedirs(parent, exist_ok=True)
        fs.pipe_file(path, data)
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc}") from None
    return hashlib.sha256(data).hexdigest()


def write_json(fs: AbstractFileSystem, path: str, obj: Any) -> None:
    write_file(fs, path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def read_json(fs: AbstractFileSystem, path: str) -> Any:
    return json.loads(fs.cat_file(path))
