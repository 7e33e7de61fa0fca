"""The format registry: the one place that says what an ``output.format`` or ``input.format`` is
(contract §3, §4 "Tables").

A :class:`Format` owns its name, how messages name its tables, its
:class:`~batchinfer.io.sinks.Tables` (the partition's commit) and its input listing, both named as
``"module:attr"`` strings, the library they need and what installs it, and the facts that the
spec's checks, the writers and the readers go by (its tables in a catalog, the partition column
in its data files, what its versions are called). Checking a job spec, planning or parsing a
DAG reads the entries only: no table library, not even pyarrow, is imported until a run opens
a table (:func:`load`). ``files`` — Parquet files and our manifest, no table — is the default.

``register()`` adds a format everywhere at once, and so does an installed distribution that
names a :class:`Format` in the ``batchinfer.formats`` entry-point group
(:mod:`batchinfer.registry`)::

    [project.entry-points."batchinfer.formats"]
    ledger = "ledger_format:FORMAT"     # a batchinfer.io.formats.Format named "ledger"
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import RuntimeFailure, SpecError
from ..registry import Provenance, Registry


@dataclass(frozen=True, kw_only=True)
class Format:
    """A way of storing a partition (``output.format``) and of reading one (``input.format``).

    Attributes:
        name: the ``output.format`` / ``input.format`` value.
        title: how messages name its tables (``Delta``: "Delta table …"); the name by default.
        tables: ``"module:Class"`` of its :class:`~batchinfer.io.sinks.Tables`, built as
            ``Class(url, sink)``; None for a format with no table, whose only commit is the
            manifest (``files``). A format with tables is a *table format*: its ``output.path``
            is the root of the job's tables, each date a partition in them.
        inputs: ``"module:function"`` that lists an input's shards, called with a
            :class:`~batchinfer.io.tables_in.TableRead` and answering a
            :class:`~batchinfer.io.shards.Listing`; None: the format cannot be an
            ``input.format`` (exit 2 at the spec check).
        needs: the library its tables and inputs import (checked first: exit 5 naming
            ``install`` when it is missing).
        install: what to install when ``needs`` is missing.
        catalog: its tables are named in a catalog (``input.catalog``, ``output.catalog``, as
            pyiceberg's ``load_catalog`` takes it): ``input.path`` and ``output.table`` are
            identifiers (``namespace.table``), not paths.
        partition_in_files: its data files hold the partition column, as a constant (Iceberg
            infers a file's partition from its column statistics); otherwise the table keeps it
            (Delta: in its log).
        arrow_schema: its data files keep the Arrow schema in their metadata (Iceberg's do not:
            it has no dictionary type, and pyiceberg warns about every such column).
        versions: what a version of its tables is called in messages (``snapshot``).
    """

    name: str
    title: str = ""
    tables: str | None = None
    inputs: str | None = None
    needs: str = ""
    install: str = ""
    catalog: bool = False
    partition_in_files: bool = False
    arrow_schema: bool = True
    versions: str = "version"

    @property
    def is_table(self) -> bool:
        return self.tables is not None

    @property
    def shown(self) -> str:
        """How messages name its tables: ``Delta``, ``Iceberg``, ``files``."""
        return self.title or self.name


def register(format: Format, *, clobber: bool = False) -> None:
    """Make ``format`` available under ``format.name``.

    Raises:
        ValueError: another format has that name and ``clobber`` is False, or batchinfer or an
            installed distribution has it (their entries are never replaced).
    """
    _REGISTRY.register(format, clobber=clobber)


def provenance(name: str) -> Provenance | None:
    """Where format ``name`` came from: batchinfer, or the distribution that holds it (None: no
    such format)."""
    return _REGISTRY.provenance(name)


def entries() -> Mapping[str, Format]:
    """Every format by name (a read-only view), those of installed distributions included."""
    return _REGISTRY.entries()


def names() -> tuple[str, ...]:
    """The formats' names, batchinfer's first, in the order they were registered."""
    return _REGISTRY.names()


def find(name: str) -> Format | None:
    return _REGISTRY.find(name)


def get(name: str) -> Format:
    """The format called ``name``.

    Raises:
        SpecError: no format has that name (the message lists the known ones).
    """
    found = _REGISTRY.find(name)
    if found is None:
        raise SpecError(f"unknown format {name!r} (known: {', '.join(names())})")
    return found


def table_inputs() -> tuple[str, ...]:
    """The table formats an input can be read from (``delta, iceberg``)."""
    return tuple(f.name for f in entries().values() if f.is_table and f.inputs)


def catalog_formats() -> tuple[str, ...]:
    """The formats whose tables are named in a catalog (``iceberg``)."""
    return tuple(f.name for f in entries().values() if f.catalog)


def require(format: Format, key: str) -> None:
    """Exit 5 saying what to install when the library ``format`` needs is missing (``key``:
    ``input.format`` or ``output.format``, for the message)."""
    if not format.needs:
        return
    try:
        importlib.import_module(format.needs)
    except ImportError:
        raise _missing(format, key) from None


def load(format: Format, target: str, key: str) -> Any:
    """What ``target`` (``"module:attr"``, one of ``format``'s) names, its library checked first.

    Raises:
        RuntimeFailure: the library or another package is missing, or a plugin's module fails
            as it is imported or does not define the name (exit 5, one line).
    """
    require(format, key)
    module_name, _, attr = target.partition(":")
    where = provenance(format.name)
    plugin = where is not None and not where.builtin
    held = f" (distribution {where.distribution} {where.version or ''})".replace(" )", ")") \
        if where is not None and plugin and where.distribution else ""
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if format.needs and (exc.name or "").split(".")[0] == format.needs.split(".")[0]:
            raise _missing(format, key) from None   # a part of the library is missing
        raise RuntimeFailure(f"{key} {format.name}{held} needs a package that is not installed "
                             f"({exc.name}): {format.install or 'install the package that provides it'}") from None
    except Exception as exc:
        if not plugin:
            raise
        raise RuntimeFailure(f"{key} {format.name}{held}: its module {module_name} cannot be "
                             f"imported: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    found = getattr(module, attr, None)
    if found is None:
        raise RuntimeFailure(f"{key} {format.name}{held} names {target}, which {module_name} does "
                             f"not define: fix or reinstall what provides it")
    return found


def _missing(format: Format, key: str) -> RuntimeFailure:
    return RuntimeFailure(f"{key} {format.name} needs {format.needs}, which is not installed: "
                          f"{format.install}")


FILES = Format(name="files", inputs="batchinfer.io.tables_in:list_files")

# batchinfer's own formats; installed distributions add theirs (group batchinfer.formats).
BUILTIN: tuple[Format, ...] = (
    FILES,
    Format(name="delta", title="Delta", tables="batchinfer.io.delta_tables:DeltaTables",
           inputs="batchinfer.io.delta_tables:list_input", needs="deltalake",
           install="pip install 'batchinfer[delta]'"),
    Format(name="iceberg", title="Iceberg", tables="batchinfer.io.iceberg_tables:IcebergTables",
           inputs="batchinfer.io.iceberg_tables:list_input", needs="pyiceberg",
           install="pip install 'batchinfer[iceberg]'", catalog=True, partition_in_files=True,
           arrow_schema=False, versions="snapshot"),
)

_REGISTRY: Registry[Format] = Registry(kind="format", entry_type=Format, group="batchinfer.formats",
                                       builtin=BUILTIN)
