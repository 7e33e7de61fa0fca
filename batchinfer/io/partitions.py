"""A committed partition as our readers see it (``inspect``, ``track``, ``report``, ``diff``,
``profile``): its manifest, where its records are, and each kind's rows read back through the
manifest, whatever the format (io/sinks.py) — a table's data files are the manifest's files.

A reader names a partition by its folder: ``output.path`` for files; for tables its records
folder ``<output.path>/_batchinfer/dt=<ds>`` or, the same, its folder in the predictions table
``<output.path>/dt=<ds>``.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from ..errors import StorageError
from .commit import finish_for_reader
from .manifest import read_manifest
from .outputs import RECORDS, Layout
from .records import FileRecord, Manifest
from .storage import join, url_to_fs


@dataclass(frozen=True)
class Committed:
    """A committed partition: ``url`` as the reader named it, its manifest and its layout (the
    data files' root, the records' folder, the table partition)."""

    url: str
    manifest: Manifest
    layout: Layout

    def of_kind(self, files: tuple[FileRecord, ...] | list[FileRecord], kind: str) -> list[FileRecord]:
        """The files of ``files`` that hold ``kind`` (predictions, quarantine, a challenger's
        folder)."""
        folder = self.layout.folder(kind) + "/"
        return [f for f in files if f.path.startswith(folder)]

    def read(self, files: tuple[FileRecord, ...] | list[FileRecord], kind: str,
             columns: list[str] | None = None) -> pa.Table | None:
        """The rows of ``files`` that hold ``kind``, concatenated in order (None: none)."""
        tables = []
        for f in self.of_kind(files, kind):
            try:
                with self.layout.fs.open(self.layout.abs(f.path), "rb") as handle:
                    tables.append(pq.read_table(handle, columns=columns))
            except (OSError, pa.ArrowException) as exc:
                raise StorageError(f"cannot read {self.url}/{f.path}: {exc}") from None
        return pa.concat_tables(tables, promote_options="permissive") if tables else None

    def record(self, name: str) -> str:
        """The path of one of its records (``_metrics.json``, ``report.html``…)."""
        return self.layout.record(name)


def open_partition(url: str, fs: AbstractFileSystem | None = None) -> Committed | None:
    """The committed partition ``url`` names (``fs``: the filesystem to read it with, ``url``
    then a path on it; default: the URL's), or None when nothing is committed there.

    A table partition whose run committed the tables but died before its manifest is finished
    first (contract §4 "Exactly once": the next run or reader finishes it), when ``url`` is
    a URL (``fs`` not given): the reader sees what the tables serve.

    Raises:
        ContractError: its manifest is malformed (io/readback.py).
        StorageError: it cannot be read, or it has such an unfinished commit that this reader
            cannot finish.
    """
    if fs is None:
        fs, path = url_to_fs(url)
        table = _table_partition(path, url.rstrip("/"))
        if table is not None:
            finish_for_reader(table[1], table[0], fs)
    else:
        path = url.rstrip("/")
    manifest = read_manifest(fs, path)
    records = path
    if manifest is None and "/" in path and "=" in path.rsplit("/", 1)[1]:
        head, last = path.rsplit("/", 1)   # <output.path>/dt=<ds>: the predictions table's folder
        records = join(head, RECORDS, last)
        manifest = read_manifest(fs, records)
        if manifest is None or manifest.table is None:
            return None
    if manifest is None:
        return None
    if manifest.table is None:
        return Committed(url, manifest, Layout(fs, path, manifest.attempt))
    (column, value), = manifest.table.partition.items()
    root = records.rsplit("/", 2)[0]
    return Committed(url, manifest, Layout(fs, root, manifest.attempt, f"{column}={value}", records))


def _table_partition(path: str, url: str) -> tuple[str, str] | None:
    """(records folder on the filesystem, ``output.path`` as a URL) of the table partition that
    ``path`` (``url`` on its filesystem) may name — its records folder
    ``<output.path>/_batchinfer/<column>=<value>`` or its folder ``<output.path>/<column>=<value>``
    — or None when it can name none (a files partition's folder is only ever read)."""
    parts, links = path.rsplit("/", 2), url.rsplit("/", 2)
    if len(parts) < 2 or "=" not in parts[-1] or len(links) < 2:
        return None
    if len(parts) == 3 and parts[1] == RECORDS:
        return path, links[0]
    head = path.rsplit("/", 1)[0]
    return join(head, RECORDS, parts[-1]), url.rsplit("/", 1)[0]
