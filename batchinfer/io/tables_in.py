"""An input's shards, listed by its format (contract §3 ``input``): what every table input shares.

``input.format`` names a format in the registry (io/formats.py), whose ``inputs`` lists the
shards: ``files`` the files a path, folder or glob stands for (io/shards.py); a table format the
Parquet data files of its table at one version (Delta: io/delta_tables.py) or snapshot (Iceberg:
io/iceberg_tables.py), those of the partition that ``input.filter`` names. Those files *are* the
shards, as if a glob had listed them, so reading, hashing, quarantine, accounting, resume and
``--update`` (kept, new and removed by shard name and sha256) are the same as for files. The
listing says which version it read (:class:`~batchinfer.io.records.InputTable`), for the
manifest to pin.

Only what reading each file as plain Parquet gets right is read; the rest is refused before any
work, with one line (exit 2: the same on every retry): each format says what it refuses (a file
with deleted rows, columns its files name otherwise, a filter on what is not a partition). Every
table input refuses the same way a table, version or snapshot that does not exist — or whose data
files are gone: an older version's log entry (Delta) or snapshot (Iceberg) outlives the files a
``VACUUM`` or an engine's snapshot expiry removed, so a version that lists files is checked for
them (one metadata request a file, for a version other than the latest only: the latest one's
files are the table). A version the partition's manifest pinned that the table no longer has
(vacuumed, expired) is exit 3: the committed partition can no longer be read as it was scored.
Without the check, reading the gone files would fail after the run began (exit 5, "cannot read
shard").

A format's library is imported only when a table is read (exit 5 naming the extra when missing).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ..errors import Action, NoShardsError, Remedy, SpecError, StorageError, TableVersionGone, one_line
from . import formats
from .formats import Format
from .records import InputTable
from .shards import Listing, Shard, list_input
from .storage import local_path, url_to_fs


@dataclass(frozen=True)
class TableRead:
    """What a format's ``inputs`` is asked to list.

    Attributes:
        format: the format's entry.
        path: ``input.path``: files, a path, folder or glob; a table, its root URL, or its
            identifier (``namespace.table``) in a catalog.
        filter: the partition to read (column → value).
        version: the version (or snapshot id) to read; None: the latest.
        pinned: ``version`` is the one the partition's manifest names (not the job's).
        catalog: the catalog's pyiceberg properties (a catalog's tables).
        catalog_name: the catalog's name.
        shown: ``path`` as messages show it.
    """

    format: Format
    path: str
    filter: dict[str, str] = field(default_factory=dict)
    version: int | None = None
    pinned: bool = False
    catalog: dict[str, str] = field(default_factory=dict)
    catalog_name: str = "batchinfer"
    shown: str = ""


def list_table(fmt: str, table: str, *, filter: Mapping[str, str], version: int | None,
               pinned: bool = False, catalog: Mapping[str, str] | None = None,
               catalog_name: str = "batchinfer", shown: str | None = None) -> Listing:
    """The shards of input ``table`` of format ``fmt``: for a table, the data files of its
    partition ``filter`` at ``version`` (None: the latest).

    Args:
        fmt: a format's name (``delta``: ``table`` is the table's root URL; ``iceberg``: its
            identifier, ``namespace.table``, in the catalog ``catalog_name`` with properties
            ``catalog``).
        pinned: ``version`` is the one the partition's manifest names (not the job's).
        shown: ``table`` as messages show it.

    Raises:
        SpecError: a refusal (see the module), no such table, version or snapshot, or a format
            that cannot be read.
        TableVersionGone: a pinned version the table no longer has (exit 3).
        NoShardsError: the partition has no data file (not arrived yet).
        StorageError: the table's log or metadata cannot be read.
        RuntimeFailure: the library is not installed.
    """
    entry = formats.get(fmt)
    if entry.inputs is None:
        raise SpecError(f"input.format {fmt!r} is not a table format "
                        f"({', '.join(formats.table_inputs())})")
    read = TableRead(entry, table, dict(filter), version, pinned, dict(catalog or {}), catalog_name,
                     shown or table)
    return formats.load(entry, entry.inputs, "input.format")(read)


def list_files(read: TableRead) -> Listing:
    """``files``: what the path, folder or glob stands for (io/shards.py)."""
    return list_input(read.path)


def listed(read: TableRead, shards: list[str], version: int, *, absent: tuple[str, ...] = ()) -> Listing:
    """A table input's listing: ``shards`` (sorted URLs) at ``version``, which the manifest pins."""
    table = InputTable(format=read.format.name, table=read.path, version=version, filter=read.filter)
    return Listing([Shard(i, url) for i, url in enumerate(shards)], table=table, absent=absent)


def missing_version(read: TableRead, version: int, known: str, latest: int | None = None) -> Exception:
    """No ``version`` in the table: exit 3 for the one the manifest pinned (the partition was
    scored from it), else 2 (the job's ``input.version``)."""
    fmt, what, shown = read.format.name, read.format.versions, read.shown
    if read.pinned:
        newest = f"{what} ({latest}: only what changed since)" if latest is not None else what
        return TableVersionGone(
            f"the committed partition was scored from {what} {version} of {fmt} table {shown}, "
            f"which the table no longer has ({known})", path=shown, field="input.version", remedies=[
                Remedy(Action.UPDATE, f"to score the latest {newest}"),
                Remedy(Action.UNPIN, subject=str(latest if latest is not None else "N"))])
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


def files_gone(read: TableRead, version: int, files: list[str], latest: int) -> None:
    """Refuse an older ``version`` whose log entry or snapshot is still there but whose data
    files of the partition a vacuum or expiry removed: the table no longer has that version."""
    gone = gone_files(files)
    if gone:
        raise missing_version(read, version,
                              f"{len(gone)} of its {len(files)} data files of the partition are "
                              f"gone, vacuumed or expired: {gone[0]}", latest)


def no_files(read: TableRead, version: int) -> NoShardsError:
    where = " and ".join(f"{k} = {v!r}" for k, v in read.filter.items()) or "the whole table"
    return NoShardsError(f"no shard matches input.filter: {read.format.name} table {read.shown} "
                         f"has no data file where {where} at version {version}")


def plain(url: str) -> str:
    """A local file as a plain path (as a glob lists it); any other URL as it is."""
    return local_path(url) if url.startswith("file://") else url   # type: ignore[return-value]
