"""Listing shards with fsspec and reading them as Arrow RecordBatches.

**Listing.** ``input.path`` is a file, a folder, or a glob. A folder — named directly, or matched
by the glob as Spark and Hive write them (``part.parquet/``) — stands for every file below it.
Names starting with ``_`` or ``.`` are Hadoop-style metadata (``_SUCCESS``, ``_committed_*``,
``.part-0.crc``, ``_temporary/``) and are not shards; they are never skipped silently: the
listing returns them as ``ignored`` and ``plan`` and ``run`` say so.

**Reading.** The sha256 recorded for a shard is of exactly the bytes its rows were parsed from.
Up to ``MAX_IN_MEMORY_BYTES`` a shard is fetched whole (one GET on an object store), hashed and
parsed from memory. A larger one is read through :class:`HashingFile`, which hashes the bytes as
Arrow reads them (one pass, memory bounded by the batch size); a file that changes while it is
read (its size, modification time, inode or ETag differ after the last batch, or the object
store refuses a read because the ETag changed) is ``unreadable`` with reason "changed while
being read". Only regular files are opened: a FIFO would block forever, a dangling symbolic link
has no bytes, and both are ``unreadable`` with a reason.

Anything that goes wrong while *parsing* bytes we hold makes the shard ``unreadable`` (recorded,
counted against ``max_bad_shards``); a failure to *fetch* bytes is a storage failure (exit 5).
"""
from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any, Iterator, NoReturn, Optional

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from ..errors import NoShardsError, StorageError, one_line
from .records import InputTable
from .storage import full_url, is_local, url_to_fs

MAX_IN_MEMORY_BYTES = 256 << 20
# Below these sizes a thread costs more than it saves (measured: bench/README.md "Many small
# shards"): a shard's digest is computed here rather than on the hasher's thread, and its
# columns are decoded on the calling thread rather than by Arrow's pool.
INLINE_HASH_BYTES = 256 << 10
THREADED_DECODE_BYTES = 4 << 20
# Names (of a file, or of a folder on its way down from a matched folder) that are metadata.
METADATA_PREFIXES = ("_", ".")
CHANGED = "changed while being read"


@dataclass(frozen=True)
class Shard:
    index: int
    url: str      # as listed from input.path (what _source_shard records)


@dataclass(frozen=True)
class Listing:
    """What ``input.path`` matched.

    Attributes:
        shards: the data files, sorted by URL, indexed from 0.
        ignored: URLs of metadata files that were matched or found but are not shards.
        table: for a table input (:mod:`batchinfer.io.tables_in`), the table and the version
            read; None for files.
        absent: the table's columns that its files do not hold (a Delta table's partition
            columns, which are in its log).
    """

    shards: list[Shard]
    ignored: list[str] = field(default_factory=list)
    table: "InputTable | None" = None
    absent: tuple[str, ...] = ()


def list_shards(pattern: str) -> list[Shard]:
    """The shards of :func:`list_input` (see there)."""
    return list_input(pattern).shards


def list_input(pattern: str) -> Listing:
    """Every data file that ``pattern`` (a file, a folder or a glob) stands for.

    Raises:
        NoShardsError: no data file matches.
        StorageError: the store cannot be listed.
    """
    fs, path = url_to_fs(pattern)
    try:
        if any(ch in path for ch in "*?["):
            matches = {p: info.get("type") for p, info in fs.glob(path, detail=True).items()}
            hidden_matches = True
        elif fs.isdir(path):
            matches, hidden_matches = {path: "directory"}, False
        else:
            matches, hidden_matches = ({path: "file"} if fs.exists(path) else {}), False
        files: set[str] = set()
        ignored: set[str] = set()
        for match, kind in matches.items():
            if kind == "directory":
                for found in fs.find(match):
                    relative = found[len(match):].strip("/").split("/")
                    (ignored if any(_is_metadata(p) for p in relative) else files).add(found)
            elif hidden_matches and _is_metadata(match.rstrip("/").rsplit("/", 1)[-1]):
                ignored.add(match)  # matched by a glob (a file named exactly is read as asked)
            else:
                files.add(match)
    except (OSError, ValueError) as exc:
        raise StorageError(f"cannot list {pattern}: {exc}") from None
    if not files:
        also = f" ({len(ignored)} metadata file(s) ignored)" if ignored else ""
        raise NoShardsError(f"no shard matches input.path {pattern}{also}")
    return Listing([Shard(i, full_url(fs, p)) for i, p in enumerate(sorted(files))],
                   [full_url(fs, p) for p in sorted(ignored)])


def footer_rows(url: str) -> int:
    """The rows a shard holds, as its Parquet footer says: read without its data (on an object
    store, the footer's ranged reads only), for a caller that needs every shard's size first.

    Raises:
        Unreadable: not a regular file, zero bytes, or not Parquet.
        StorageError: the bytes cannot be fetched.
    """
    fs, path = url_to_fs(url)
    try:
        if _regular_file_info(fs, path)["size"] == 0:
            raise Unreadable("zero-byte file")
        with fs.open(path, "rb") as fh:
            return pq.read_metadata(fh).num_rows
    except Unreadable:
        raise
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:   # the bytes: not Parquet
        raise Unreadable(f"not a readable Parquet file: {one_line(exc)}") from None
    except (OSError, ValueError) as exc:
        if _is_changed(exc):
            raise Unreadable(CHANGED) from None
        raise StorageError(f"cannot read shard {url}: {exc}") from None


def _is_metadata(name: str) -> bool:
    return name.startswith(METADATA_PREFIXES)


class Unreadable(Exception):
    """The shard's bytes are not a readable Parquet file (or not a file at all)."""


class ShardReader:
    """An opened shard: its sha256, row count and Arrow schema; batches on demand.

    Args:
        url: the shard.
        hasher: where to compute the sha256 of a shard held in memory (an executor: hashlib
            releases the GIL, so the digest is computed while the caller parses and scores);
            None, or a shard of at most ``INLINE_HASH_BYTES``, computes it here.
        pooled_decode: whether Arrow's thread pool decodes the columns of a shard larger than
            ``THREADED_DECODE_BYTES``. A caller that decodes one batch ahead on a thread of its
            own (the pipeline's ``decoded_ahead``) says no: the pool shortens a batch's decode
            by a quarter but adds a third to its CPU (bench/README.md, issue 35), on cores the
            model's calls already keep busy.

    Raises:
        Unreadable: not a regular file, zero bytes, or not Parquet.
        StorageError: the bytes cannot be fetched.
    """

    def __init__(self, url: str, hasher: Optional[Executor] = None, *, pooled_decode: bool = True):
        self.url = url
        self._fs, self._path = fs, path = url_to_fs(url)
        self._stream: HashingFile | None = None
        try:
            info = _regular_file_info(fs, path)
            size = info["size"]
            if size == 0:
                raise Unreadable("zero-byte file")
            self._threads = pooled_decode and size > THREADED_DECODE_BYTES
            if size <= MAX_IN_MEMORY_BYTES:
                data = fs.cat_file(path)
                if hasher is None or size <= INLINE_HASH_BYTES:
                    self._sha256: Any = hashlib.sha256(data).hexdigest()
                else:
                    self._sha256 = hasher.submit(lambda: hashlib.sha256(data).hexdigest())
                source: Any = pa.BufferReader(data)
            else:
                fs.invalidate_cache(path)  # a listing's cached info may predate the file
                info = _regular_file_info(fs, path)
                size = info["size"]
                self._identity = _identity(info)
                self._stream = source = HashingFile(fs.open(path, "rb"), size)
                self._sha256 = None
        except Unreadable:
            raise
        except (OSError, ValueError) as exc:
            if _is_changed(exc):
                raise Unreadable(CHANGED) from None
            raise StorageError(f"cannot read shard {url}: {exc}") from None
        try:
            self._file = pq.ParquetFile(source)
        except Exception as exc:  # pyarrow raises several types for bad bytes
            self._raise_fetch_error()
            raise Unreadable(f"not a readable Parquet file: {one_line(exc)}") from None
        self.num_rows = self._file.metadata.num_rows
        self.schema = self._file.schema_arrow

    @property
    def sha256(self) -> str | None:
        """The digest of the bytes the rows came from; for a streamed shard, known once every
        batch was read (None if it changed while being read)."""
        if isinstance(self._sha256, Future):
            self._sha256 = self._sha256.result()
        return self._sha256

    def batches(self, rows: int) -> Iterator[pa.RecordBatch]:
        """Yield RecordBatches of at most ``rows`` rows.

        Raises:
            Unreadable: corrupt data, or (streamed) the file changed while being read.
            StorageError: (streamed) the file system failed.
        """
        try:
            for batch in self._file.iter_batches(batch_size=rows, use_threads=self._threads):
                if batch.num_rows:
                    yield batch
            if self._stream is not None:
                self._finish_stream()
        except (Unreadable, StorageError):
            raise
        except Exception as exc:
            self._raise_read_error(exc)

    def take(self, rows: Any) -> pa.RecordBatch:
        """The rows at shard row indices ``rows`` (ascending, distinct), in that order, read
        from the row groups that hold them only (a sample of a large shard, streamed, holds one
        row group at a time, not the shard). The shard's digest is not computed: a reader that
        takes rows is not one whose digest is recorded (:meth:`close` it).

        Raises:
            Unreadable: corrupt data, or (streamed) the file changed while being read.
            StorageError: (streamed) the file system failed.
        """
        import numpy as np

        wanted = np.asarray(rows, dtype=np.int64)
        meta = self._file.metadata
        starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        groups = np.searchsorted(starts, wanted, side="right") - 1
        parts = []
        try:
            for group in np.unique(groups):
                table = self._file.read_row_group(int(group), use_threads=self._threads)
                parts.append(table.take(wanted[groups == group] - starts[group]))
        except (Unreadable, StorageError):
            raise
        except Exception as exc:
            self._raise_read_error(exc)
        if not parts:
            return pa.RecordBatch.from_pylist([], schema=self.schema)
        return pa.concat_tables(parts).combine_chunks().to_batches()[0]

    def close(self) -> None:
        """Let go of a streamed shard's file (a reader read to its end closed it already)."""
        if self._stream is not None:
            self._stream.close()

    def _raise_read_error(self, exc: BaseException) -> NoReturn:
        if _is_changed(exc):
            raise Unreadable(CHANGED) from None
        # Bytes in memory cannot fail to fetch: any error is in the data. When streaming,
        # an error of the file system (seen by HashingFile, whatever Arrow made of it) is a
        # storage failure; any other is the data's (Arrow raises OSError for both).
        self._raise_fetch_error()
        if self._stream is not None:  # the bytes were fetched: the record keeps their digest
            self._sha256 = self._digest_rest()
        raise Unreadable(f"corrupt Parquet data: {one_line(exc)}") from None

    def _raise_fetch_error(self) -> None:
        """Raise the storage failure behind a streamed read's error, if there was one."""
        error = self._stream.fetch_error if self._stream is not None else None
        if error is None:
            return
        if _is_changed(error):
            raise Unreadable(CHANGED) from None
        raise StorageError(f"cannot read shard {self.url}: {error}") from None

    def _digest_rest(self) -> str | None:
        stream = self._stream
        assert stream is not None
        try:
            return stream.finish()
        except (OSError, Unreadable):
            return None
        finally:
            stream.close()

    def _finish_stream(self) -> None:
        """Hash what Arrow did not read (magic bytes, unused pages), then make sure the file is
        still the one that was opened; otherwise its rows and its digest may disagree."""
        stream = self._stream
        assert stream is not None
        try:
            digest = stream.finish()
            self._fs.invalidate_cache(self._path)
            same = _identity(_regular_file_info(self._fs, self._path)) == self._identity
        except Unreadable:
            same = False
        except OSError as exc:
            if _is_changed(exc) or isinstance(exc, FileNotFoundError):
                same = False
            else:
                raise StorageError(f"cannot read shard {self.url}: {exc}") from None
        finally:
            stream.close()
        if not same:
            raise Unreadable(CHANGED)
        self._sha256 = digest


class HashingFile:
    """A read-only file that computes the sha256 of the underlying file from the reads made
    through it, so the digest is of exactly the bytes the reader got.

    Parquet is read out of order (the footer first, then column chunks), but sha256 needs the
    bytes in order: reads ahead of the hashed prefix are kept until the prefix reaches them
    (a row group at most, in practice; past ``AHEAD_LIMIT`` the gap is read and hashed at once).
    :meth:`finish` hashes the bytes nobody read. Thread-safe: Arrow may read from several threads.
    """

    AHEAD_LIMIT = 64 << 20

    def __init__(self, raw: Any, size: int):
        self._raw = raw
        self._size = size
        self._pos = 0
        self._sha = hashlib.sha256()
        self._hashed = 0                       # bytes [0, _hashed) are in the digest
        self._ahead: dict[int, bytes] = {}     # offset → bytes read beyond _hashed
        self._ahead_bytes = 0
        self._lock = threading.RLock()
        self.closed = False
        self.fetch_error: BaseException | None = None   # the file system's, if a read failed

    # -- the file protocol Arrow uses ---------------------------------------------------------
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def read(self, n: int = -1) -> bytes:
        with self._lock:
            start = self._pos
            if n is None or n < 0:
                n = max(self._size - start, 0)
            data = self._read_at(start, n)
            self._pos = start + len(data)
            self._observe(start, data)
            return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        memoryview(buffer)[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._raw.close()

    # -- hashing ------------------------------------------------------------------------------
    def finish(self) -> str:
        """Hash every byte not read yet, in order; return the hex digest of the whole file."""
        with self._lock:
            self._fill(self._size)
            return self._sha.hexdigest()

    def _read_at(self, start: int, n: int) -> bytes:
        try:
            self._raw.seek(start)
            return self._raw.read(n)
        except Exception as exc:
            self.fetch_error = exc
            raise

    def _observe(self, start: int, data: bytes) -> None:
        end = start + len(data)
        if end <= self._hashed or not data:
            return
        if start <= self._hashed:
            self._sha.update(memoryview(data)[self._hashed - start:])
            self._hashed = end
            self._drain()
            return
        if len(data) > len(self._ahead.get(start, b"")):
            self._ahead_bytes += len(data) - len(self._ahead.get(start, b""))
            self._ahead[start] = data
        if self._ahead_bytes > self.AHEAD_LIMIT:
            self._fill(min(self._ahead))

    def _drain(self) -> None:
        """Hash kept chunks that the hashed prefix has reached."""
        while self._ahead:
            start = min(self._ahead)
            if start > self._hashed:
                return
            data = self._ahead.pop(start)
            self._ahead_bytes -= len(data)
            if start + len(data) > self._hashed:
                self._sha.update(memoryview(data)[self._hashed - start:])
                self._hashed = start + len(data)

    def _fill(self, until: int) -> None:
        """Read and hash the bytes up to ``until`` (and whatever kept chunks then join)."""
        while self._hashed < until:
            nxt = min(self._ahead) if self._ahead else self._size
            if nxt > self._hashed:
                gap = self._read_at(self._hashed, min(nxt, until) - self._hashed)
                if not gap:  # shorter than its size said: it changed
                    raise Unreadable(CHANGED)
                self._sha.update(gap)
                self._hashed += len(gap)
            self._drain()


def _regular_file_info(fs: AbstractFileSystem, path: str) -> dict:
    """``{"size", ...identity fields}`` of a regular file; Unreadable for anything else."""
    if is_local(fs):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if os.path.islink(path):
                raise Unreadable("a symbolic link to a file that does not exist") from None
            raise
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(f"not a regular file ({_kind(st.st_mode)})")
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino,
                "dev": st.st_dev}
    info = fs.info(path)
    if info.get("type", "file") != "file":
        raise Unreadable(f"not a file ({info.get('type')})")
    return info


# Fields that change when an object is replaced, on the stores fsspec knows.
_IDENTITY = ("size", "mtime_ns", "ino", "dev", "ETag", "etag", "generation", "md5Hash",
             "VersionId", "LastModified", "last_modified", "mtime", "created")


def _identity(info: dict) -> tuple:
    return tuple(str(info.get(key)) for key in _IDENTITY)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a file"


def _is_changed(exc: BaseException) -> bool:
    # s3fs raises FileExpired when a read's If-Match on the ETag it opened with fails.
    return type(exc).__name__ == "FileExpired"


_END = object()


def decoded_ahead(batches: Iterator[pa.RecordBatch], pool: Executor
                  ) -> Iterator[tuple[pa.RecordBatch, float]]:
    """``batches``, each with the seconds it took to decode, the next one decoded on ``pool``
    (one thread) while the caller works on the one it was given.

    Decoding releases the GIL; so do the model's calls that the caller's batch goes on to. On
    local files at 8M rows this was within noise (bench/README, issue 35): both cores are busy
    scoring there. Where a shard streams from an object store, the next batch's bytes are
    fetched while this one is scored. One batch ahead, never more: memory stays one batch per
    shard being read. What the reader raises reaches the caller where the batch would have. The
    generator is advanced by one thread at a time (the pool's, or none), and a caller that stops
    early waits for the decode in flight, so nothing reads a shard after its reader is dropped.
    """
    def step() -> tuple[Any, float]:
        t0 = time.perf_counter()
        item = next(batches, _END)
        return item, time.perf_counter() - t0

    future = pool.submit(step)
    try:
        while True:
            item, seconds = future.result()
            if item is _END:
                return
            future = pool.submit(step)
            yield item, seconds
    finally:
        wait([future])
