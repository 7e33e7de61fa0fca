"""``format: delta``: a partition's commit to Delta Lake tables, and a Delta table read as input
(delta-rs, no JVM; the format's entry is in io/formats.py).

**The commit** (``output.format: delta``).

Each kind has its own table under ``output.path`` (io/outputs.py: predictions at the root,
``_quarantine/``, ``_challengers/<name>/``), partitioned by ``output.partition_column``. A
commit is one transaction per table that removes the partition's files and adds the attempt's,
where the writers put them (``partition_values`` carry the date; the files do not hold it).

Exactly once: every commit of the partition carries the application transaction
``batchinfer:<column>=<value>`` with the partition's generation as its version. delta-rs fails
a commit when a concurrent commit wrote the same application id, so of two runs committing one
generation at once one gets through (measured on delta-rs 1.6.6: without it two first commits
of an empty partition both land, and readers see both). A commit whose table holds the
generation already is a retry, answered from the log. ``commitInfo`` names the attempt, the
generation and the triple, for ``DESCRIBE HISTORY``.

**The input** (``input.format: delta``, io/tables_in.py). ``input.path`` is the table's root; its
data files of the partition ``input.filter`` names, at ``input.version`` (or the latest), are the
shards. Refused before any work (exit 2): a selected file with a deletion vector (some of its
rows are deleted), column mapping (the files' columns are not named as the table's), a filter on
a column the table is not partitioned by (a filter on a data column would select files, not
rows). The table's partition columns are in its log, not in its files, so they are not columns
of the shards (:attr:`~batchinfer.io.shards.Listing.absent`).

**Storage options.** On S3, delta-rs's object store gets conditional puts for the log (the store
itself makes two commits of one version impossible, no lock table needed) and the endpoint that
fsspec's S3 would use.
"""
from __future__ import annotations

import itertools
import json
import random
import time
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable, Schema
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import (
    AddAction,
    CommitProperties,
    RemoveAction,
    Transaction,
    create_table_with_add_actions,
)

from ..errors import ContractError, SpecError, StorageError, one_line
from .outputs import Layout
from .records import FileRecord
from .shards import Listing
from .sinks import LostRace, Sink
from .storage import join, protocol, s3_endpoint
from .tables_in import TableRead, files_gone, listed, missing_version, no_files, plain

ATTEMPT_KEY, GENERATION_KEY, PARTITION_KEY = "batchinfer.attempt", "batchinfer.generation", "batchinfer.partition"


PATIENCE_S = 120.0   # how long a commit keeps going on top of other partitions' commits


def storage_options(url: str) -> dict[str, str]:
    """delta-rs's object-store options for ``url`` (module docstring: "Storage options")."""
    if protocol(url) not in ("s3", "s3a"):
        return {}
    options = {"conditional_put": "etag"}
    endpoint = s3_endpoint()
    if endpoint:
        options["endpoint_url"] = endpoint
        if endpoint.startswith("http://"):
            options["allow_http"] = "true"
    return options


class _Refused(Exception):
    """A commit that another commit of the table got ahead of: decide again and retry."""


class DeltaTables:
    """The Delta tables of one job's output (``url``: ``output.path``) for one partition."""

    def __init__(self, url: str, sink: Sink):
        self.url = url.rstrip("/")
        self.sink = sink
        self.app = f"batchinfer:{sink.partition}"
        self.options = storage_options(url)

    def uri(self, layout: Layout, kind: str) -> str:
        folder = layout.table(kind)
        return join(self.url, folder) if folder else self.url

    def describe(self, kind: str) -> str:
        return self.sink.layout(self.url, "").table(kind)

    def _open(self, uri: str) -> DeltaTable | None:
        try:
            return DeltaTable(uri, storage_options=self.options)
        except TableNotFoundError:
            return None
        except (DeltaError, OSError) as exc:
            raise StorageError(f"cannot read the Delta table {uri}: {exc}") from None

    def generation(self) -> tuple[int, str | None]:
        table = self._open(self.url)
        if table is None:
            return 0, None
        generation = table.transaction_version(self.app) or 0
        found = self._commit_of(table, generation) if generation else None
        return generation, (found or {}).get(ATTEMPT_KEY)

    def _commit_of(self, table: DeltaTable, generation: int) -> dict[str, Any] | None:
        """The newest ``commitInfo`` of this partition's ``generation``, if the log still has it."""
        for entry in table.history():
            if (entry.get(PARTITION_KEY) == self.sink.partition
                    and str(entry.get(GENERATION_KEY)) == str(generation)):
                return entry
        return None

    def commit(self, layout: Layout, kind: str, files: Sequence[FileRecord], *, generation: int,
               attempt: str, summary: dict[str, str]) -> int | None:
        uri = self.uri(layout, kind)
        relative = [_within(f.path, layout.table(kind)) for f in files]
        sizes = _sizes(layout, files)
        value: dict[str, str | None] = {self.sink.column: self.sink.value}
        metadata = {ATTEMPT_KEY: attempt, GENERATION_KEY: str(generation),
                    PARTITION_KEY: self.sink.partition, **summary}
        deadline = time.monotonic() + PATIENCE_S
        for tries in itertools.count():
            table = self._open(uri)
            settled = self._settled(table, generation, attempt) if table is not None else None
            if settled is not None:
                return settled
            if table is None and not files:
                return None
            now = int(time.time() * 1000)
            adds = [AddAction(path, sizes[f.path], value, now, True, json.dumps({"numRecords": f.rows}))
                    for path, f in zip(relative, files)]
            try:
                if table is None:
                    self._create(uri, layout, files[0], adds, metadata, generation)
                else:
                    table = _fit_schema(uri, table, _table_schema(layout, files[0], self.sink.column)) \
                        if files else table
                    current = self._partition_files(table)
                    have, wanted = {path for path, _ in current}, set(relative)
                    removes = [RemoveAction(path, True, now, size, value)
                               for path, size in current if path not in wanted]
                    table.create_write_transaction(
                        [a for a in adds if a.path not in have] + removes, mode="append",
                        schema=table.schema(), partition_by=[self.sink.column],
                        commit_properties=CommitProperties(
                            custom_metadata=metadata,
                            app_transactions=[Transaction(self.app, generation)]))
            except (CommitFailedError, _Refused) as exc:
                # The table moved since it was read. This partition's generation taken: the
                # settled check above says by whom. Another partition's commit (which delta-rs
                # takes for a conflict when it removed files, as an --overwrite does): commit
                # again on top of it, so that both land.
                if time.monotonic() > deadline:
                    raise StorageError(f"cannot commit to the Delta table {uri}: it kept moving "
                                       f"under concurrent commits for {PATIENCE_S:.0f} s ({exc})") from None
                time.sleep(min(2.0, 0.02 * 2 ** min(tries, 7)) * (0.5 + random.random()))
                continue
            except (DeltaError, OSError) as exc:
                raise StorageError(f"cannot commit to the Delta table {uri}: {exc}") from None
            after = self._open(uri)
            found = self._commit_of(after, generation) if after is not None else None
            if found is None or found.get(ATTEMPT_KEY) != attempt:
                raise LostRace(f"generation {generation} of {self.sink.partition} in {uri}")
            return int(found["version"])
        raise AssertionError("unreachable")

    def _settled(self, table: DeltaTable, generation: int, attempt: str) -> int | None:
        """The version of this attempt's commit of ``generation`` if the table holds it (a
        retry: nothing to write), None if the table holds an older generation (commit it).

        Raises:
            LostRace: the table holds ``generation`` by another attempt, or a later one.
        """
        held = table.transaction_version(self.app) or 0
        if held < generation:
            return None
        found = self._commit_of(table, generation)
        if held > generation or (found and found.get(ATTEMPT_KEY) != attempt):
            raise LostRace(f"generation {generation} of {self.sink.partition} in {table.table_uri}")
        return int(found["version"]) if found else table.version()

    def _create(self, uri: str, layout: Layout, first: FileRecord, adds: list[AddAction],
                metadata: dict[str, str], generation: int) -> None:
        """Make the table with the partition's first files in its first commit.

        Raises:
            _Refused: another commit made the table meanwhile (commit into it).
        """
        schema = _table_schema(layout, first, self.sink.column)
        try:
            # No retry: delta-rs 1.6.6 retries a create that lost the race for version 0 as a
            # second CREATE TABLE at version 1, over the winner's files (measured: 8 of 10
            # forced races). Refused instead, this commit goes into the table made.
            create_table_with_add_actions(
                uri, Schema.from_arrow(schema), adds, mode="error",
                partition_by=[self.sink.column], storage_options=self.options,
                commit_properties=CommitProperties(
                    custom_metadata=metadata, max_commit_retries=0,
                    app_transactions=[Transaction(self.app, generation)]))
        except (DeltaError, OSError) as exc:
            if self._open(uri) is None:
                raise StorageError(f"cannot create the Delta table {uri}: {exc}") from None
            raise _Refused(str(exc)) from None

    def _partition_files(self, table: DeltaTable) -> list[tuple[str, int]]:
        """(path, size) of the partition's files in the table's current version."""
        actions = pa.table(table.get_add_actions(flatten=True))
        column = f"partition.{self.sink.column}"
        if actions.num_rows == 0 or column not in actions.column_names:
            return []
        return [(row["path"], int(row["size_bytes"])) for row in actions.to_pylist()
                if row[column] == self.sink.value]


def _within(path: str, prefix: str) -> str:
    """A data file's path relative to its table (the manifest's is relative to output.path)."""
    return path[len(prefix) + 1:] if prefix else path


def _sizes(layout: Layout, files: Sequence[FileRecord]) -> dict[str, int]:
    """Each file's size in bytes, by one listing per folder."""
    sizes: dict[str, int] = {}
    for folder in sorted({f.path.rsplit("/", 1)[0] for f in files}):
        try:
            for entry in layout.fs.ls(layout.abs(folder), detail=True):
                name = entry["name"].rstrip("/")
                sizes[name[len(layout.root):].lstrip("/")] = int(entry["size"])
        except OSError as exc:
            raise StorageError(f"cannot list {layout.abs(folder)}: {exc}") from None
    missing = [f.path for f in files if f.path not in sizes]
    if missing:
        raise StorageError(f"{len(missing)} file(s) of the partition are gone (e.g. {missing[0]}): "
                           f"nothing committed; run the job again")
    return sizes


def _fit_schema(uri: str, table: DeltaTable, ours: pa.Schema) -> DeltaTable:
    """The table, able to take files of ``ours``, as the Iceberg tables are: columns the run
    writes that the table lacks are added first (nullable: earlier rows read them as null; one
    metadata commit of its own); a column the run no longer writes reads as null in its rows; a
    column it writes with another type is refused (exit 3): one column, two types."""
    mine = {f.name: f for f in Schema.from_arrow(ours).fields}
    theirs = {f.name: f for f in table.schema().fields}
    changed = sorted(n for n in theirs if n in mine and str(mine[n].type) != str(theirs[n].type))
    if changed:
        raise ContractError(f"the Delta table {uri} has a column this run writes with another "
                            f"type ({changed[0]}: {theirs[changed[0]].type} in the table): write to "
                            f"another output.path, or change the table first; nothing committed")
    added = [mine[n] for n in mine if n not in theirs]
    if added:
        table.alter.add_columns(added)
        table = DeltaTable(uri, storage_options=storage_options(uri))
    return table


def _table_schema(layout: Layout, first: FileRecord, column: str) -> pa.Schema:
    """The table's schema: a data file's, dictionary columns as their values' type (a table's
    type is logical, the encoding is the file's business), and the partition column."""
    with layout.fs.open(layout.abs(first.path), "rb") as f:
        schema = pq.read_schema(f)
    fields = [pa.field(f.name, f.type.value_type if pa.types.is_dictionary(f.type) else f.type,
                       nullable=True) for f in schema]
    return pa.schema([*fields, pa.field(column, pa.string())])


# -- the input -------------------------------------------------------------------------------------

def list_input(read: TableRead) -> Listing:
    """The table's data files of the partition at the version asked for (io/tables_in.py).

    Raises:
        SpecError: no Delta table there, no such version, or a refusal (module docstring).
        TableVersionGone: a pinned version the table no longer has (exit 3).
        NoShardsError: the partition has no data file.
        StorageError: the log cannot be read.
    """
    root, shown, version = read.path, read.shown, read.version
    try:
        table = DeltaTable(root, storage_options=storage_options(root))
    except TableNotFoundError:
        raise SpecError(f"input.path {shown} is not a Delta table (no _delta_log there)") from None
    except (OSError, DeltaError) as exc:
        raise StorageError(f"cannot read Delta table {shown}: {one_line(exc)}") from None
    latest = table.version()
    if version is not None and version != latest:
        if not 0 <= version <= latest:
            raise missing_version(read, version, f"its versions are 0 to {latest}", latest)
        try:
            table = DeltaTable(root, version=version, storage_options=storage_options(root))
        except (OSError, DeltaError) as exc:  # its log entry is gone
            raise missing_version(read, version, one_line(exc), latest) from None
    at = table.version()
    partitioned = _readable_partitions(table, read)
    try:
        files = table.file_uris(file_pruning_predicate=[(k, "=", v) for k, v in read.filter.items()]
                                or None)
        deleted = _with_deletion_vectors(table)
    except (OSError, DeltaError) as exc:
        raise StorageError(f"cannot read Delta table {shown}: {one_line(exc)}") from None
    shards = sorted(plain(f) for f in files)
    marked = [f for f in shards if f in deleted]
    if marked:
        raise SpecError(f"input.path {shown}: {len(marked)} of the selected files have deletion "
                        f"vectors (rows deleted without rewriting the file, e.g. {marked[0]}), "
                        f"which plain Parquet reading would score; rewrite them (OPTIMIZE / purge) "
                        f"or disable deletion vectors")
    if not shards:
        raise no_files(read, at)
    if at != latest:
        files_gone(read, at, shards, latest)
    return listed(read, shards, at, absent=tuple(partitioned))


def _readable_partitions(table: DeltaTable, read: TableRead) -> list[str]:
    """The table's partition columns, once its files are known to name its columns and the
    filter to name only partition columns (exit 2 otherwise)."""
    metadata = table.metadata()
    mapping = metadata.configuration.get("delta.columnMapping.mode", "none")
    if mapping != "none":
        raise SpecError(f"input.path {read.shown}: the Delta table uses column mapping ({mapping}): "
                        f"its files do not name its columns, which batchinfer reads by name; "
                        f"write the input without column mapping")
    partitioned = list(metadata.partition_columns)
    wrong = [k for k in read.filter if k not in partitioned]
    if wrong:
        raise SpecError(f"input.filter {', '.join(wrong)}: not a partition column of Delta table "
                        f"{read.shown} (its partition columns: {', '.join(partitioned) or 'none'}); "
                        f"filter by partition only")
    return partitioned


def _with_deletion_vectors(table: DeltaTable) -> set[str]:
    """The files of ``table`` that have a deletion vector (only a table whose protocol has the
    feature can hold one)."""
    if "deletionVectors" not in (table.protocol().reader_features or []):
        return set()
    found: set[str] = set()
    for batch in table.deletion_vectors():
        found.update(plain(str(p)) for p in batch.column("filepath").to_pylist())
    return found
