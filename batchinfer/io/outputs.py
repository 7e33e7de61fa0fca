"""The output layout of a partition (contract §4) and writing its files.

``output.format: files`` (the default), ``output.path`` the partition's folder:

    <output.path>/_manifest.json                                   the commit
    <output.path>/predictions/<attempt>/part-SSSSS-BBBBB.parquet   shard S, batch B
    <output.path>/quarantine/<attempt>/part-SSSSS-BBBBB.parquet
    <output.path>/challengers/<name>/<attempt>/part-SSSSS-BBBBB.parquet   a challenger's predictions
    <output.path>/_tmp/<attempt>/shards/SSSSS.json                 per-shard results (scratch)
    <output.path>/_tmp/<attempt>/challengers/<name>/SSSSS.json     a challenger's part of each

``output.format: delta`` or ``iceberg``, ``output.path`` the root of the job's tables, the same
for every date; the partition is ``dt=<ds>`` (``output.partition_column``) in each table:

    <output.path>/                                       the predictions table (its log or metadata)
    <output.path>/dt=<ds>/<attempt>/part-SSSSS-BBBBB.parquet
    <output.path>/_quarantine/                           the quarantine table
    <output.path>/_quarantine/dt=<ds>/<attempt>/part-…
    <output.path>/_challengers/<name>/                   each challenger's table
    <output.path>/_challengers/<name>/dt=<ds>/<attempt>/part-…
    <output.path>/_batchinfer/dt=<ds>/_manifest.json     the partition's audit record (and _tmp/,
                                                         _metrics.json, report.html, …)

A table's data files are the files batchinfer wrote, where it wrote them: its commit adds them to
the table, nothing is copied. Their paths in the manifest are relative to ``output.path``.

Files are serialised in memory, hashed, then written with one put: the sha256 recorded in the
manifest is of exactly the bytes written, and an object store sees one request per file.
"""
from __future__ import annotations

import functools
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
RECORDS = "_batchinfer"       # tables: <output.path>/_batchinfer/<column>=<value>/ holds the records
TABLE_FOLDERS = {QUARANTINE: "_quarantine", CHALLENGERS: "_challengers"}   # tables: a kind's table
METRICS = "_metrics.json"
PROFILE = "_profile.json"     # the run's column statistics and drift (monitoring), beside METRICS
REPORT = "report.html"        # the job report, beside METRICS
HISTORY = "history.html"      # `batchinfer history`'s page by default: in its last date's records
DRIFT = "_drift"              # <attempt>.json/.html of runs that drift stopped (not cleaned up)
# `<UTC time>-<8 hex>` (contract §6). Cleanup removes only folders named like this: output.path is
# the user's, and a folder of theirs that happens to sit in predictions/ is not ours to delete.
ATTEMPT = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{8}")  # fullmatch: `$` passes a final newline


@dataclass(frozen=True)
class Layout:
    """Paths of one attempt's files under an output root (fsspec paths, no protocol).

    Attributes:
        root: where the data files are (``output.path``); their paths are relative to it.
        attempt: the attempt id.
        partition: tables: ``<column>=<value>``, the folder of the partition in each table;
            empty for files.
        records: where the manifest, the scratch and the run's records are: ``root`` for
            files, ``<root>/_batchinfer/<partition>`` for tables.
    """

    fs: AbstractFileSystem
    root: str
    attempt: str
    partition: str = ""
    records: str = ""

    def __post_init__(self) -> None:
        if not self.records:
            object.__setattr__(self, "records", join(self.root, RECORDS, self.partition)
                               if self.partition else self.root)

    @classmethod
    def for_url(cls, url: str, attempt: str, partition: str = "") -> "Layout":
        fs, root = url_to_fs(url)
        return cls(fs, root, attempt, partition)

    @property
    def manifest(self) -> str:
        return join(self.records, MANIFEST)

    def folder(self, kind: str) -> str:
        """The folder (relative) that holds ``kind``'s attempts (``kind``: predictions,
        quarantine, or a challenger's :func:`challenger_folder`): the kind itself for files; the
        partition's folder in the kind's table for tables."""
        if not self.partition:
            return kind
        if kind == PREDICTIONS:
            return self.partition
        top, _, name = kind.partition("/")
        return "/".join(p for p in (TABLE_FOLDERS[top], name, self.partition) if p)

    def table(self, kind: str) -> str:
        """Tables: the folder (relative) of ``kind``'s table (empty: ``root``, predictions')."""
        return self.folder(kind).rsplit("/", 1)[0] if "/" in self.folder(kind) else ""

    def part(self, kind: str, shard: int, batch: int) -> str:
        """Relative path of a data file (``kind``: predictions, quarantine, or a challenger's
        folder, :func:`challenger_folder`)."""
        return f"{self.folder(kind)}/{self.attempt}/part-{shard:05d}-{batch:05d}.parquet"

    def scratch(self, attempt: str | None = None) -> str:
        """An attempt's scratch folder (this one's by default), or with ``attempt=""`` the
        folder of every attempt's scratch."""
        chosen = self.attempt if attempt is None else attempt
        return join(self.records, TMP, chosen) if chosen else join(self.records, TMP)

    def shard_result(self, shard: int) -> str:
        return join(self.scratch(), "shards", f"{shard:05d}.json")

    def challenger_result(self, name: str, shard: int) -> str:
        """Challenger ``name``'s part of a shard's result (its writer's, written beside the
        champion's :meth:`shard_result` the moment its own files are written)."""
        return join(self.scratch(), CHALLENGERS, name, f"{shard:05d}.json")

    @property
    def pending(self) -> str:
        """Tables: the manifest an attempt leaves in its scratch before its first table commit
        (io.commit.Attempt.publish finishes a commit from it)."""
        return join(self.scratch(), MANIFEST)

    @property
    def sink(self) -> str:
        """Tables: beside :attr:`pending`, how the partition is stored (io.sinks.Sink), for a
        reader that finds the commit unfinished."""
        return join(self.scratch(), "sink.json")

    @property
    def outcome(self) -> str:
        """Where the pipeline's commit step leaves what it did (io.commit.Attempt.record)."""
        return join(self.scratch(), "outcome.json")

    def abs(self, relative: str) -> str:
        """A data file's path (``relative`` as the manifest names it)."""
        return join(self.root, relative)

    def record(self, name: str) -> str:
        """The path of one of the partition's records (``_metrics.json``, ``report.html``, …)."""
        return join(self.records, name)


def challenger_folder(name: str) -> str:
    """The folder (relative to ``output.path``) that holds challenger ``name``'s attempts; a
    ``kind`` for :meth:`Layout.part`."""
    return f"{CHALLENGERS}/{name}"


def parquet_bytes(table: pa.Table, *, dictionary: list[str] | None = None,
                  statistics: list[str] | None = None, uncompressed: list[str] | None = None,
                  arrow_schema: bool = True) -> bytes:
    """Serialise ``table`` as Parquet.

    Args:
        dictionary: columns to dictionary-encode (default: all). Trying a dictionary on
            high-cardinality columns (hashes, scores) only to give up costs more than writing.
        statistics: columns to keep min/max statistics for (default: all); statistics of
            long unique strings cost time and help no reader.
        uncompressed: columns written without compression (the others: Snappy, Parquet's
            default); random digits gain little from it at a high price.
        arrow_schema: keep the Arrow schema in the file's metadata (pyarrow then reads the
            triple's columns as dictionaries). Iceberg's files leave it out: Iceberg has no
            dictionary type, and its readers warned once per file for each such column.
    """
    sink = pa.BufferOutputStream()
    compression: str | dict[str, str] = "snappy"
    if uncompressed:
        compression = _compression(table.schema, tuple(uncompressed))
    pq.write_table(table, sink,
                   use_dictionary=True if dictionary is None else dictionary,
                   write_statistics=True if statistics is None else statistics,
                   compression=compression, store_schema=arrow_schema)
    return sink.getvalue().to_pybytes()


@functools.lru_cache(maxsize=64)
def _compression(schema: pa.Schema, uncompressed: tuple[str, ...]) -> dict[str, str]:
    """Each Parquet leaf column of ``schema`` → its codec: none under the top-level columns
    ``uncompressed``, Snappy elsewhere. pyarrow takes a codec per leaf path (``vec.list.element``
    for a list column) and leaves a leaf it is not given uncompressed, so every leaf is named; the
    paths are Parquet's own, read from an empty file of the schema (once per schema)."""
    sink = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), sink)
    paths = pq.read_metadata(pa.BufferReader(sink.getvalue())).schema
    return {paths.column(i).path: "none" if paths.column(i).path.split(".")[0] in uncompressed
            else "snappy" for i in range(len(paths))}


def write_file(fs: AbstractFileSystem, path: str, data: bytes) -> str:
    """Write ``data`` to ``path``; return its sha256."""
    put_file(fs, path, data)
    return hashlib.sha256(data).hexdigest()


def put_file(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` (one put on an object store)."""
    try:
        parent = path.rsplit("/", 1)[0]
        fs.makedirs(parent, exist_ok=True)
        fs.pipe_file(path, data)
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc}") from None


def write_json(fs: AbstractFileSystem, path: str, obj: Any) -> None:
    write_file(fs, path, json_bytes(obj))


def write_scratch_json(fs: AbstractFileSystem, path: str, obj: Any) -> None:
    """``obj`` as compact JSON (sorted keys, no spaces): a record only batchinfer reads, written
    once per shard — Python's C encoder runs only without an indent (about 0.1 ms a shard
    result, bench/README.md "Many small shards")."""
    put_file(fs, path, json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


_JSON = json.JSONEncoder(indent=1, sort_keys=True)
_PIECES = 1 << 14   # encoded pieces joined at a time


def json_bytes(obj: Any) -> bytes:
    """``obj`` as the JSON text batchinfer writes (sorted keys, indented by one, a newline at the
    end), as bytes. Encoded piece by piece: ``json.dumps`` with an indent first holds every piece
    (a few characters each) in one list, which for a manifest or a commit record of 20,000
    shards was several hundred MB at once (bench/README.md "Many small shards")."""
    blocks: list[bytes] = []
    pieces: list[str] = []
    for piece in _JSON.iterencode(obj):
        pieces.append(piece)
        if len(pieces) >= _PIECES:
            blocks.append("".join(pieces).encode())
            pieces.clear()
    pieces.append("\n")
    blocks.append("".join(pieces).encode())
    return b"".join(blocks)


def read_json(fs: AbstractFileSystem, path: str) -> Any:
    return json.loads(fs.cat_file(path))
