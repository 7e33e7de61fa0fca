"""The sink seam: how a partition is stored (``output.format``, contract §4).

Every format keeps batchinfer's own protocol — the writers put Parquet files under an attempt's
folders (:class:`~batchinfer.io.outputs.Layout`), the commit step writes ``_manifest.json`` last,
and every reader of ours follows the manifest — and a table format adds one step to the commit:
its :class:`Tables` put the partition's files into the tables in their own transactions, which
every reader of the table sees atomically (Spark, polars, DuckDB, Trino, …). What a format is,
and which :class:`Tables` it has, is its entry in the format registry (io/formats.py).

    sink = Sink(format="delta", column="dt", value="2026-01-31")
    layout = sink.layout(url, attempt)             # where the writers put files
    tables = sink.tables(url)                      # None for files
    tables.generation()                            # (generation, attempt) committed now
    tables.commit(layout, kind, files, generation=g, attempt=a, summary=s)   # → the version

The commit order (io/commit.py): the pending manifest in the attempt's scratch, the predictions
table (the arbiter: of two commits of one generation the table takes one), the other tables, then
``_manifest.json`` naming their versions. A run that dies between the table commit and the
manifest is finished by the next run from the pending manifest, never written again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

from ..codec import Record
from ..redaction import Deferred
from . import formats
from .outputs import Layout

if TYPE_CHECKING:
    from .records import FileRecord


class LostRace(Exception):
    """Another attempt committed this generation of the partition to the table first."""


@dataclass(frozen=True)
class Sink(Record):
    """How an output partition is stored; plain, picklable data (no secret value: a catalog's
    properties travel as :class:`~batchinfer.redaction.Deferred`, as their ``${NAME}``
    templates). Left as JSON (its ``to_dict``) in a table commit's scratch beside its pending
    manifest (``sink.json``): what a reader that finds the commit unfinished needs to open the
    tables and finish it.

    Attributes:
        format: a name in the format registry (io/formats.py).
        column: tables: the partition column (``output.partition_column``).
        value: tables: the partition's value (the job's ``ds``).
        table: a catalog's tables: the predictions table's identifier (the others are named
            after it).
        catalog: a catalog's tables: the catalog's name and pyiceberg properties.
    """

    format: str = formats.FILES.name
    column: str = ""
    value: str = ""
    table: str = ""
    catalog: tuple[tuple[str, Deferred], ...] = ()

    @property
    def entry(self) -> formats.Format:
        """The format's registry entry."""
        return formats.get(self.format)

    @property
    def partition(self) -> str:
        """``<column>=<value>``, the partition's folder in each table ("" for files)."""
        return f"{self.column}={self.value}" if self.is_table else ""

    @property
    def is_table(self) -> bool:
        return self.entry.is_table

    def constants(self) -> dict[str, str]:
        """Columns every data file carries with one value: Iceberg infers a file's partition
        from its column statistics, so its files hold the partition column; Delta keeps it in
        the log (and readers add it), so its files do not (``Format.partition_in_files``)."""
        return {self.column: self.value} if self.entry.partition_in_files else {}

    @property
    def arrow_schema(self) -> bool:
        """Its data files keep the Arrow schema in their metadata (``Format.arrow_schema``)."""
        return self.entry.arrow_schema

    def layout(self, url: str, attempt: str) -> Layout:
        return Layout.for_url(url, attempt, self.partition)

    def tables(self, url: str) -> "Tables | None":
        """The format's tables under ``url`` (``output.path``), or None for files.

        Raises:
            RuntimeFailure: the format's library is not installed (exit 5, naming the extra),
                or a plugin's module cannot be loaded.
        """
        entry = self.entry
        if entry.tables is None:
            return None
        return formats.load(entry, entry.tables, "output.format")(url, self)


FILES = Sink()


class Tables(Protocol):
    """A table format's side of one partition's commit."""

    def generation(self) -> tuple[int, str | None]:
        """The partition's generation in the predictions table now (0: never committed) and
        the attempt that committed it."""
        ...

    def commit(self, layout: Layout, kind: str, files: Sequence["FileRecord"], *, generation: int,
               attempt: str, summary: dict[str, str]) -> int | None:
        """Make ``files`` the partition in ``kind``'s table, as ``generation``: one transaction
        that removes the partition's other files and adds these (nothing is copied). Idempotent:
        a table that holds ``generation`` already answers its version without writing. Returns
        the table's version (None: no table and nothing to add, so none was made).

        Raises:
            LostRace: another attempt committed ``generation`` (or a later one) first.
            StorageError: the table cannot be read or written.
        """
        ...

    def describe(self, kind: str) -> str:
        """How the manifest names ``kind``'s table: Delta, its folder relative to
        ``output.path`` ("" for the predictions table); Iceberg, its identifier. Never a URL:
        one may hold a secret's value, and the manifest holds none (contract §3)."""
        ...

