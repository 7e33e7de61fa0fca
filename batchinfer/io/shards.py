"""Listing shards with fsspec and reading them as Arrow RecordBatches.

A shard is read in one of two ways. Up to ``MAX_IN_MEMORY_BYTES`` it is fetched whole (one GET on
an object store), hashed, and parsed from memory. Larger shards are hashed in a streaming pass
and then read batch by batch from the file, so memory stays bounded by the batch size.
Anything that goes wrong while *parsing* bytes we hold makes the shard ``unreadable`` (recorded,
counted against ``max_bad_shards``); a failure to *fetch* bytes is a storage failure (exit 5).
"""
from __future__ import annotations

import hashlib
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import NoShardsError, StorageError
from .storage import full_url, url_to_fs

MAX_IN_MEMORY_BYTES = 256 << 20


@dataclass(frozen=True)
class Shard:
    index: int
    url: str      # as listed from input.path (what _source_shard records)


def list_shards(pattern: str) -> list[Shard]:
    """Every file matching ``pattern`` (glob allowed), sorted by URL.

    Raises:
        NoShardsError: nothing matches.
        StorageError: the store cannot be listed.
    """
    fs, path = url_to_fs(pattern)
    try:
        if any(ch in path for ch in "*?["):
            paths = fs.glob(path)
        elif fs.isdir(path):
            paths = fs.find(path)
        else:
            paths = [path] if fs.exists(path) else []
        paths = [p for p in paths if not fs.isdir(p)]
    except (OSError, ValueError) as exc:
        raise StorageError(f"cannot list {pattern}: {exc}") from None
    if not paths:
        raise NoShardsError(f"no shard matches input.path {pattern}")
    return [Shard(i, full_url(fs, p)) for i, p in enumerate(sorted(paths))]


class Unreadable(Exception):
    """The shard's bytes are not a readable Parquet file."""


class ShardReader:
    """An opened shard: its sha256, row count and Arrow schema; batches on demand.

    Args:
        url: the shard.
        hasher: where to compute the sha256 of a shard held in memory (an executor: hashlib
            releases the GIL, so the digest is computed while the caller parses and scores);
            None computes it here.
    """

    def __init__(self, url: str, hasher: Optional[Executor] = None):
        self.url = url
        fs, path = url_to_fs(url)
        try:
            size = fs.size(path)
            if size <= MAX_IN_MEMORY_BYTES:
                data = fs.cat_file(path)
                if hasher is None:
                    self._sha256: Any = hashlib.sha256(data).hexdigest()
                else:
                    self._sha256 = hasher.submit(lambda: hashlib.sha256(data).hexdigest())
                source: Any = pa.BufferReader(data)
                self._in_memory = True
            else:
                self._in_memory = False
                self._sha256 = _stream_sha256(fs, path)
                source = fs.open(path, "rb")
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot read shard {url}: {exc}") from None
        if size == 0:
            raise Unreadable("zero-byte file")
        try:
            self._file = pq.ParquetFile(source)
        except Exception as exc:  # pyarrow raises several types for bad bytes
            raise Unreadable(f"not a readable Parquet file: {_one_line(exc)}") from None
        self.num_rows = self._file.metadata.num_rows
        self.schema = self._file.schema_arrow

    @property
    def sha256(self) -> str:
        if isinstance(self._sha256, Future):
            self._sha256 = self._sha256.result()
        return self._sha256

    def batches(self, rows: int) -> Iterator[pa.RecordBatch]:
        """Yield RecordBatches of at most ``rows`` rows (raises Unreadable on corrupt data)."""
        try:
            for batch in self._file.iter_batches(batch_size=rows, use_threads=True):
                if batch.num_rows:
                    yield batch
        except Exception as exc:
            # Bytes in memory cannot fail to fetch: any error is in the data. When streaming,
            # a plain OSError from the file system is a storage failure; Arrow's are the data's.
            if not self._in_memory and isinstance(exc, OSError) and not isinstance(exc, pa.ArrowException):
                raise StorageError(f"cannot read shard {self.url}: {exc}") from None
            raise Unreadable(f"corrupt Parquet data: {_one_line(exc)}") from None


def _stream_sha256(fs, path) -> str:
    h = hashlib.sha256()
    with fs.open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__
