"""The sink seam: how a partition is stored (``output.format``, contract §4).

Every format keeps batchinfer's own protocol — the writers put Parquet files under an attempt's
folders (:class:`~batchinfer.io.outputs.Layout`), the commit step writes ``_manifest.json`` last,
and every reader of ours follows the manifest — and a table format adds one step to the commit:
its :class:`Tables` put the partition's files into the tables in their own transactions, which
every reader of the table sees atomically (Spark, polars, DuckDB, Trino, …). A format is one
module with a :class:`Tables` class and one entry in :data:`FORMATS`.

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

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from ..errors import RuntimeFailure
from ..redaction import Deferred
from .outputs import Layout

if TYPE_CHECKING:
    from .records import FileRecord

# format → "module:Class" of its Tables; files has none (the manifest is its only commit).
FORMATS: dict[str, str | None] = {
    "files": None,
    "delta": "batchinfer.io.delta_tables:DeltaTables",
    "iceberg": "batchinfer.io.iceberg_tables:IcebergTables",
}
EXTRAS = {"delta": ("deltalake", "batchinfer[delta]"), "iceberg": ("pyiceberg", "batchinfer[iceberg]")}


def require(fmt: str, key: str, module: str | None = None) -> Any:
    """The library of ``fmt`` tables (or ``module`` of it), for ``key`` (``input.format`` or
    ``output.format``), or exit 5 saying what to install."""
    library, extra = EXTRAS[fmt]
    try:
        return importlib.import_module(module or library)
    except ImportError:
        raise RuntimeFailure(f"{key} {fmt} needs {library}, which is not installed: "
                             f"pip install '{extra}'") from None


class LostRace(Exception):
    """Another attempt committed this generation of the partition to the table first."""


@dataclass(frozen=True)
class Sink:
    """How an output partition is stored; plain, picklable data (no secret value: a catalog's
    properties travel as :class:`~batchinfer.redaction.Deferred`).

    Attributes:
        format: ``files``, ``delta`` or ``iceberg``.
        column: tables: the partition column (``output.partition_column``).
        value: tables: the partition's value (the job's ``ds``).
        table: iceberg: the predictions table's identifier (the others are named after it).
        catalog: iceberg: the catalog's name and pyiceberg properties.
    """

    format: str = "files"
    column: str = ""
    value: str = ""
    table: str = ""
    catalog: tuple[tuple[str, Deferred], ...] = ()

    @property
    def partition(self) -> str:
        """``<column>=<value>``, the partition's folder in each table ("" for files)."""
        return f"{self.column}={self.value}" if self.format != "files" else ""

    @property
    def is_table(self) -> bool:
        return self.format != "files"

    def constants(self) -> dict[str, str]:
        """Columns every data file carries with one value: Iceberg infers a file's partition
        from its column statistics, so its files hold the partition column; Delta keeps it in
        the log (and readers add it), so its files do not."""
        return {self.column: self.value} if self.format == "iceberg" else {}

    def layout(self, url: str, attempt: str) -> Layout:
        return Layout.for_url(url, attempt, self.partition)

    def to_dict(self) -> dict[str, Any]:
        """The sink as JSON, left in a table commit's scratch beside its pending manifest: what
        a reader that finds the commit unfinished needs to open the tables and finish it (no
        secret value: the catalog's properties as their ``${NAME}`` templates)."""
        return {"format": self.format, "column": self.column, "value": self.value,
                "table": self.table,
                "catalog": [[key, {"template": d.template, "names": list(d.names)}]
                            for key, d in self.catalog]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sink":
        """The sink :meth:`to_dict` wrote.

        Raises:
            KeyError, TypeError, ValueError: ``data`` is not such a record.
        """
        if data["format"] not in FORMATS:
            raise ValueError(f"unknown format {data['format']!r}")
        return cls(format=str(data["format"]), column=str(data["column"]), value=str(data["value"]),
                   table=str(data["table"]),
                   catalog=tuple((str(key), Deferred(str(d["template"]), tuple(map(str, d["names"]))))
                                 for key, d in data["catalog"]))

    def tables(self, url: str) -> "Tables | None":
        """The format's tables under ``url`` (``output.path``), or None for files.

        Raises:
            RuntimeFailure: the format's library is not installed (exit 5, naming the extra).
        """
        target = FORMATS[self.format]
        if target is None:
            return None
        require(self.format, "output.format")
        module_name, class_name = target.split(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        return cls(url, self)


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

