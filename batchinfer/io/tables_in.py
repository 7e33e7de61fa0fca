"""A partition's shards read from a Delta Lake or Apache Iceberg table (contract §3 ``input``).

A table input stands for the table's Parquet data files at one version (Delta) or snapshot
(Iceberg), those of the partition that ``input.filter`` names: those files *are* the shards, as
if a glob had listed them, so reading, hashing, quarantine, accounting, resume and ``--update``
(kept, new and removed by shard name and sha256) are the same as for files. The listing says
which version it read (:class:`~batchinfer.io.records.InputTable`), for the manifest to pin.

Only what reading each file as plain Parquet gets right is read; the rest is refused before any
work, with one line (exit 2: the same on every retry):

* Delta: a selected file with a deletion vector (some of its rows are deleted), column mapping
  (the files' columns are not named as the table's), a filter on a column the table is not
  partitioned by (a filter on a data column would select files, not rows);
* Iceberg: a selected file with delete files, a filter on a column that is not an identity
  partition of every selected file's partition spec, a column renamed since the table was made
  (older files name it as it was);
* a table, version or snapshot that does not exist — or whose data files are gone: an older
  version's log entry (Delta) or snapshot (Iceberg) outlives the files a ``VACUUM`` or an
  engine's snapshot expiry removed, so a version that lists files is checked for them (one
  metadata request a file, for a version other than the latest only: the latest one's files
  are the table). A version the partition's manifest pinned that the table no longer has
  (vacuumed, expired) is exit 3: the committed partition can no longer be read as it was
  scored. Without the check, reading the gone files would fail after the run began (exit 5,
  "cannot read shard").

A Delta table's partition columns are in its log, not in its files, so they are not columns of
the shards (:attr:`~batchinfer.io.shards.Listing.absent`). ``deltalake`` and ``pyiceberg`` are
imported here only, when a table is read (exit 5 naming the extra when missing).
"""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import NoShardsError, SpecError, StorageError, TableVersionGone, one_line
from . import sinks
from .records import InputTable
from .shards import Listing, Shard
from .storage import delta_options, iceberg_s3_options, local_path, url_to_fs


def require(fmt: str, module: str | None = None) -> Any:
    """The library that reads ``fmt`` tables, or exit 5 saying what to install (io/sinks.py)."""
    return sinks.require(fmt, "input.format", module)


def list_table(fmt: str, table: str, *, filter: Mapping[str, str], version: int | None,
               pinned: bool = False, catalog: Mapping[str, str] | None = None,
               catalog_name: str = "batchinfer", shown: str | None = None) -> Listing:
    """The data files of ``table``'s partition ``filter`` at ``version`` (None: the latest).

    Args:
        fmt: ``delta`` (``table`` is the table's root URL) or ``iceberg`` (``table`` is its
            identifier, ``namespace.table``, in the catalog ``catalog_name`` with properties
            ``catalog``).
        pinned: ``version`` is the one the partition's manifest names (not the job's).
        shown: ``table`` as messages show it.

    Raises:
        SpecError: a refusal (see the module), no such table, version or snapshot.
        TableVersionGone: a pinned version the table no longer has (exit 3).
        NoShardsError: the partition has no data file (not arrived yet).
        StorageError: the table's log or metadata cannot be read.
        RuntimeFailure: the library is not installed.
    """
    shown = shown or table
    if fmt == "delta":
        return _delta(table, dict(filter), version, pinned, shown)
    if fmt == "iceberg":
        return _iceberg(table, dict(filter), version, pinned, dict(catalog or {}), catalog_name, shown)
    raise SpecError(f"input.format {fmt!r} is not a table format (delta, iceberg)")


def _missing_version(fmt: str, shown: str, version: int, pinned: bool, known: str,
                     latest: int | None = None) -> Exception:
    what = "version" if fmt == "delta" else "snapshot"
    if pinned:
        newest = f"{what} ({latest}: only what changed since)" if latest is not None else what
        return TableVersionGone(
            f"the committed partition was scored from {what} {version} of {fmt} table {shown}, "
            f"which the table no longer has ({known}): run with --update to score the latest "
            f"{newest}, or drop the pin with --overwrite --set input.version="
            f"{latest if latest is not None else 'N'}")
    return SpecError(f"input.version {version}: {fmt} table {shown} has no such {what} ({known})")


def gone_files(urls: list[str]) -> list[str]:
    """Those of ``urls`` that no longer exist (one metadata request each).

    Raises:
        StorageError: the store cannot say (permissions, network).
    """
    gone = []
    for url in urls:
        try:
            fs, path = url_to_fs(url)
            if not fs.exists(path):
                gone.append(url)
        except OSError as exc:
            raise StorageError(f"cannot read table data file {url}: {one_line(exc)}") from None
    return gone


def _files_gone(fmt: str, shown: str, version: int, pinned: bool, files: list[str],
                latest: int) -> None:
    """Refuse an older ``version`` whose log entry or snapshot is still there but whose data
    files of the partition a vacuum or expiry removed: the table no longer has that version."""
    gone = gone_files(files)
    if gone:
        raise _missing_version(fmt, shown, version, pinned,
                               f"{len(gone)} of its {len(files)} data files of the partition are "
                               f"gone, vacuumed or expired: {gone[0]}", latest)


def _no_files(fmt: str, shown: str, filter: dict[str, str], version: int) -> NoShardsError:
    where = " and ".join(f"{k} = {v!r}" for k, v in filter.items()) or "the whole table"
    return NoShardsError(f"no shard matches input.filter: {fmt} table {shown} has no data file "
                         f"where {where} at version {version}")


# -- Delta Lake -----------------------------------------------------------------------------------

def _delta(root: str, filter: dict[str, str], version: int | None, pinned: bool,
           shown: str) -> Listing:
    deltalake = require("delta")
    try:
        table = deltalake.DeltaTable(root, storage_options=delta_options(root))
    except deltalake.exceptions.TableNotFoundError:
        raise SpecError(f"input.path {shown} is not a Delta table (no _delta_log there)") from None
    except (OSError, deltalake.exceptions.DeltaError) as exc:
        raise StorageError(f"cannot read Delta table {shown}: {one_line(exc)}") from None
    latest = table.version()
    if version is not None and version != latest:
        if not 0 <= version <= latest:
            raise _missing_version("delta", shown, version, pinned, f"its versions are 0 to {latest}",
                                   latest)
        try:
            table = deltalake.DeltaTable(root, version=version, storage_options=delta_options(root))
        except (OSError, deltalake.exceptions.DeltaError) as exc:  # its log entry is gone
            raise _missing_version("delta", shown, version, pinned, one_line(exc), latest) from None
    read = table.version()
    metadata = table.metadata()
    mapping = metadata.configuration.get("delta.columnMapping.mode", "none")
    if mapping != "none":
        raise SpecError(f"input.path {shown}: the Delta table uses column mapping ({mapping}): "
                        f"its files do not name its columns, which batchinfer reads by name; "
                        f"write the input without column mapping")
    partitioned = list(metadata.partition_columns)
    wrong = [k for k in filter if k not in partitioned]
    if wrong:
        raise SpecError(f"input.filter {', '.join(wrong)}: not a partition column of Delta table "
                        f"{shown} (its partition columns: {', '.join(partitioned) or 'none'}); "
                        f"filter by partition only")
    try:
        files = table.file_uris(file_pruning_predicate=[(k, "=", v) for k, v in filter.items()]
                                or None)
        deleted = _with_deletion_vectors(table)
    except (OSError, deltalake.exceptions.DeltaError) as exc:
        raise StorageError(f"cannot read Delta table {shown}: {one_line(exc)}") from None
    shards = sorted(_plain(f) for f in files)
    marked = [f for f in shards if f in deleted]
    if marked:
        raise SpecError(f"input.path {shown}: {len(marked)} of the selected files have deletion "
                        f"vectors (rows deleted without rewriting the file, e.g. {marked[0]}), "
                        f"which plain Parquet reading would score; rewrite them (OPTIMIZE / purge) "
                        f"or disable deletion vectors")
    if not shards:
        raise _no_files("delta", shown, filter, read)
    if read != latest:
        _files_gone("delta", shown, read, pinned, shards, latest)
    return Listing([Shard(i, url) for i, url in enumerate(shards)],
                   table=InputTable(format="delta", table=root, version=read, filter=filter),
                   absent=tuple(partitioned))


def _with_deletion_vectors(table: Any) -> set[str]:
    """The files of ``table`` that have a deletion vector (only a table whose protocol has the
    feature can hold one)."""
    if "deletionVectors" not in (table.protocol().reader_features or []):
        return set()
    found: set[str] = set()
    for batch in table.deletion_vectors():
        found.update(_plain(str(p)) for p in batch.column("filepath").to_pylist())
    return found


def _plain(url: str) -> str:
    """A local file as a plain path (as a glob lists it); any other URL as it is."""
    return local_path(url) if url.startswith("file://") else url   # type: ignore[return-value]


# -- Apache Iceberg -------------------------------------------------------------------------------

def _iceberg(identifier: str, filter: dict[str, str], version: int | None, pinned: bool,
             properties: dict[str, str], catalog_name: str, shown: str) -> Listing:
    catalog_module = require("iceberg", "pyiceberg.catalog")
    exceptions = require("iceberg", "pyiceberg.exceptions")
    expressions = require("iceberg", "pyiceberg.expressions")
    transforms = require("iceberg", "pyiceberg.transforms")
    try:
        # A table on S3 reads its files through pyiceberg's FileIO, at fsspec's endpoint unless
        # the catalog's properties say otherwise.
        catalog = catalog_module.load_catalog(catalog_name, **{**iceberg_s3_options(), **properties})
    except Exception as exc:  # pyiceberg raises many types for a catalog it cannot open
        raise SpecError(f"input.catalog {catalog_name}: cannot open the Iceberg catalog: "
                        f"{one_line(exc)}") from None
    try:
        table = catalog.load_table(identifier)
    except (exceptions.NoSuchTableError, exceptions.NoSuchNamespaceError):
        raise SpecError(f"input.path {shown}: no such table in Iceberg catalog {catalog_name}") from None
    except OSError as exc:
        raise StorageError(f"cannot read Iceberg table {shown}: {one_line(exc)}") from None
    current = table.current_snapshot()
    if version is None:
        snapshot = current
        if snapshot is None:
            raise _no_files("iceberg", shown, filter, 0)
    else:
        snapshot = table.snapshot_by_id(version)
        if snapshot is None:
            known = ", ".join(str(s.snapshot_id) for s in table.snapshots()[-3:]) or "none"
            raise _missing_version("iceberg", shown, version, pinned, f"latest snapshots: {known}",
                                   current.snapshot_id if current is not None else None)
    _refuse_renames(table, shown)
    schema = table.schema()
    for column in filter:
        if not _has(schema, column):
            raise SpecError(f"input.filter {column}: not a column of Iceberg table {shown}")
    row_filter = expressions.AlwaysTrue()
    for column, value in filter.items():
        row_filter = expressions.And(row_filter, expressions.EqualTo(column, value))
    try:
        tasks = list(table.scan(row_filter=row_filter, snapshot_id=snapshot.snapshot_id).plan_files())
    except OSError as exc:
        raise StorageError(f"cannot read Iceberg table {shown}: {one_line(exc)}") from None
    except ValueError as exc:   # what pyiceberg cannot plan (equality deletes): the table's
        raise SpecError(f"input.path {shown}: cannot read the Iceberg table as plain Parquet "
                        f"files: {one_line(exc)}") from None
    specs = table.specs()
    for column in filter:
        source_id = schema.find_field(column).field_id
        for task in tasks:
            spec = specs[task.file.spec_id]
            if not any(f.source_id == source_id and isinstance(f.transform, transforms.IdentityTransform)
                       for f in spec.fields):
                raise SpecError(f"input.filter {column}: Iceberg table {shown} is not partitioned by "
                                f"{column} (identity) in partition spec {spec.spec_id} of "
                                f"{_plain(task.file.file_path)}; filter by identity partition only")
    deleting = [t for t in tasks if t.delete_files]
    if deleting:
        raise SpecError(f"input.path {shown}: {len(deleting)} of the selected files have delete "
                        f"files (rows deleted without rewriting the file, e.g. "
                        f"{_plain(deleting[0].file.file_path)}), which plain Parquet reading would "
                        f"score; rewrite them (compaction) first")
    shards = sorted(_plain(t.file.file_path) for t in tasks)
    if not shards:
        raise _no_files("iceberg", shown, filter, snapshot.snapshot_id)
    if current is not None and snapshot.snapshot_id != current.snapshot_id:
        _files_gone("iceberg", shown, snapshot.snapshot_id, pinned, shards, current.snapshot_id)
    return Listing([Shard(i, url) for i, url in enumerate(shards)],
                   table=InputTable(format="iceberg", table=identifier,
                                    version=snapshot.snapshot_id, filter=filter))


def _has(schema: Any, column: str) -> bool:
    return column in {f.name for f in schema.fields}


def _refuse_renames(table: Any, shown: str) -> None:
    """A column renamed since: files written before name it as it was, and batchinfer reads
    columns by name (Iceberg's readers by field id)."""
    current = {f.field_id: f.name for f in table.schema().fields}
    for older in table.schemas().values():
        for f in older.fields:
            if f.field_id in current and current[f.field_id] != f.name:
                raise SpecError(f"input.path {shown}: Iceberg column {current[f.field_id]!r} was "
                                f"renamed from {f.name!r}: older files name it as it was; rewrite "
                                f"the table, or score it under its old name")
