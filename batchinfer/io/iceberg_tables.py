"""``format: iceberg``: a partition's commit to Apache Iceberg tables, and an Iceberg table read as
input (pyiceberg; the format's entry is in io/formats.py).

**The commit** (``output.format: iceberg``; a SQL catalog on sqlite in
``<output.path>/_catalog.db`` by default, any pyiceberg catalog by ``output.catalog``).

Each kind has its own table: the predictions table ``<output.table>``, ``<output.table>__quarantine``
and ``<output.table>__challenger_<name>``, located where io/outputs.py puts each kind's table
(predictions at ``output.path``, ``_quarantine/``, ``_challengers/<name>/``) and partitioned by
``identity(output.partition_column)``. A commit is one catalog commit per table, one snapshot
that removes the partition's files the attempt does not keep and adds the attempt's where the
writers put them (nothing is copied). Iceberg takes a file's partition from its column
statistics, so every data file holds the partition column as a constant (Sink.constants).

Exactly once: each snapshot's summary names the partition, its generation and the attempt
(``batchinfer.partition``, ``batchinfer.generation``, ``batchinfer.attempt``, with the triple and
the job); the partition's generation is that of the newest snapshot of the partition in the
table's current lineage. The catalog swaps the table's metadata only if nobody moved it since
it was read (the SQL catalog: ``UPDATE … WHERE metadata_location = <read>``); on a refused commit
this module reads the table again and decides: another attempt committed the generation
(LostRace), or another partition's commit moved the table (commit again on top of it: both
land). pyiceberg's own retry is off in our tables (``commit.retry.num-retries=0``): it would
rebase an append onto a concurrent append of the same partition, and both would land.

**The input** (``input.format: iceberg``, io/tables_in.py). ``input.path`` is the table's
identifier in ``input.catalog``; its data files of the partition ``input.filter`` names, at the
snapshot ``input.version`` (or the current one), are the shards. Refused before any work (exit
2): a selected file with delete files, a filter on a column that is not an identity partition of
every selected file's partition spec, a column renamed since the table was made (older files name
it as it was).

**Storage options.** A catalog's tables on S3 are read and written through pyiceberg's FileIO, at
the endpoint and region that fsspec's S3 would use unless the catalog's properties say otherwise
(without them it resolves every bucket at amazonaws.com).
"""
from __future__ import annotations

import hashlib
import os
import random
import re
import time
from typing import TYPE_CHECKING, Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.exceptions import (
    CommitFailedException,
    NoSuchNamespaceError,
    NoSuchTableError,
    TableAlreadyExistsError,
    ValidationError,
)
from pyiceberg.expressions import AlwaysTrue, And, BooleanExpression, EqualTo
from pyiceberg.io.pyarrow import parquet_file_to_data_file
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema, assign_fresh_schema_ids
from pyiceberg.table import Table, TableProperties, Transaction
from pyiceberg.table.snapshots import Snapshot, ancestors_of
from pyiceberg.transforms import IdentityTransform
from pyiceberg.typedef import Record
from pyiceberg.utils.concurrent import ExecutorFactory

from ..errors import ContractError, SpecError, StorageError, one_line
from .outputs import CHALLENGERS, PREDICTIONS, QUARANTINE, Layout
from .shards import Listing
from .sinks import LostRace, Sink
from .storage import is_local, join, local_path, protocol, s3_endpoint, s3_region
from .tables_in import TableRead, files_gone, listed, missing_version, no_files, plain

if TYPE_CHECKING:
    from pyiceberg.manifest import DataFile

    from .records import FileRecord

ATTEMPT_KEY, GENERATION_KEY, PARTITION_KEY = "batchinfer.attempt", "batchinfer.generation", "batchinfer.partition"
# Our tables let this module, not pyiceberg, decide what a refused commit means (module docstring).
OWN_RETRY = {TableProperties.COMMIT_NUM_RETRIES: "0"}
PATIENCE_S = 120.0   # how long a commit keeps going on top of other partitions' commits


class IcebergTables:
    """The Iceberg tables of one job's output (``url``: ``output.path``) for one partition."""

    def __init__(self, url: str, sink: Sink):
        self.url = url.rstrip("/")
        self.sink = sink
        self.name, self.properties = catalog_properties(sink, url)
        self._catalog: Catalog | None = None

    def identifier(self, kind: str) -> str:
        """``kind``'s table: the predictions table, ``__quarantine`` or ``__challenger_<name>``
        after it (a challenger's name may hold ``.`` and ``-``, which an identifier may not)."""
        if kind == PREDICTIONS:
            return self.sink.table
        if kind == QUARANTINE:
            return f"{self.sink.table}__quarantine"
        name = kind[len(CHALLENGERS) + 1:]
        safe = re.sub(r"[^A-Za-z0-9_]", "_", name)
        if safe != name:   # "v.4" and "v-4" are two challengers: two tables
            safe += "_" + hashlib.sha256(name.encode()).hexdigest()[:6]
        return f"{self.sink.table}__challenger_{safe}"

    def describe(self, kind: str) -> str:
        return self.identifier(kind)

    # -- the catalog ------------------------------------------------------------------------

    def _open_catalog(self, *, create: bool) -> Catalog | None:
        """The catalog (None: a sqlite catalog whose file does not exist yet and ``create`` is
        false: nothing is committed, and reading must not create it)."""
        if self._catalog is not None:
            return self._catalog
        database = _sqlite_file(self.properties)
        if database is not None and not os.path.exists(database):
            if not create:
                return None
            os.makedirs(os.path.dirname(os.path.abspath(database)), exist_ok=True)
        for attempt in range(3):
            try:
                self._catalog = load_catalog(self.name, **self.properties)
                return self._catalog
            except Exception as exc:   # two processes creating the catalog's tables at once
                if attempt == 2:
                    raise StorageError(f"cannot open the Iceberg catalog {self.name!r}: {_one_line(exc)}") from None
                time.sleep(0.1 + random.random() * 0.2)
        raise AssertionError("unreachable")

    def _load(self, identifier: str, *, create: bool = False) -> Table | None:
        catalog = self._open_catalog(create=create)
        if catalog is None:
            return None
        try:
            return catalog.load_table(identifier)
        except (NoSuchTableError, NoSuchNamespaceError):
            return None
        except Exception as exc:
            raise StorageError(f"cannot read the Iceberg table {identifier}: {_one_line(exc)}") from None

    # -- the partition's generation ---------------------------------------------------------

    def _snapshots(self, table: Table) -> list[Snapshot]:
        """The partition's snapshots in the table's current lineage, newest first."""
        return [s for s in ancestors_of(table.current_snapshot(), table.metadata)
                if s.summary is not None
                and s.summary.additional_properties.get(PARTITION_KEY) == self.sink.partition]

    def generation(self) -> tuple[int, str | None]:
        table = self._load(self.sink.table)
        if table is None:
            return 0, None
        newest = next(iter(self._snapshots(table)), None)
        if newest is None:
            return 0, None
        props = _props(newest)
        return int(props.get(GENERATION_KEY, 0)), props.get(ATTEMPT_KEY)

    def _settled(self, table: Table, generation: int, attempt: str) -> int | None:
        """The snapshot id when ``table`` holds ``generation`` by ``attempt`` already (a retry);
        None when it holds an earlier one.

        Raises:
            LostRace: it holds ``generation`` by another attempt, or a later generation.
        """
        snapshots = self._snapshots(table)
        if not snapshots or int(_props(snapshots[0]).get(GENERATION_KEY, 0)) < generation:
            return None
        found = next((s for s in snapshots if _props(s).get(GENERATION_KEY) == str(generation)), None)
        if found is None or found is not snapshots[0] or _props(found).get(ATTEMPT_KEY) != attempt:
            raise LostRace(f"generation {generation} of {self.sink.partition} in {table.name()}")
        return found.snapshot_id

    # -- the commit -------------------------------------------------------------------------

    def commit(self, layout: Layout, kind: str, files: Sequence["FileRecord"], *, generation: int,
               attempt: str, summary: dict[str, str]) -> int | None:
        identifier = self.identifier(kind)
        wanted = [_uri(layout, layout.abs(f.path)) for f in files]
        properties = {ATTEMPT_KEY: attempt, GENERATION_KEY: str(generation),
                      PARTITION_KEY: self.sink.partition, **summary}
        deadline = time.monotonic() + PATIENCE_S
        for tries in range(1_000):
            table = self._load(identifier, create=True)
            if table is not None:
                done = self._settled(table, generation, attempt)
                if done is not None:
                    return done
            elif not files:
                return None
            try:
                if table is None:
                    tx: Transaction = self._create(identifier, layout, kind, files[0])
                else:
                    if table.metadata.properties.get(TableProperties.COMMIT_NUM_RETRIES) != "0":
                        table = table.transaction().set_properties(OWN_RETRY).commit_transaction()
                    tx = table.transaction()
                    self._fit_schema(tx, layout, files)
                self._replace(tx, table, wanted, properties)
                committed = tx.commit_transaction()
            except (CommitFailedException, TableAlreadyExistsError):
                # The table moved (or was created) since it was read: read it again and decide.
                if time.monotonic() > deadline:
                    raise StorageError(f"cannot commit to the Iceberg table {identifier}: it kept "
                                       f"moving under concurrent commits for {PATIENCE_S:.0f} s") from None
                time.sleep(min(2.0, 0.02 * 2 ** min(tries, 7)) * (0.5 + random.random()))
                continue
            except (StorageError, ContractError):
                raise
            except Exception as exc:
                raise StorageError(f"cannot commit to the Iceberg table {identifier}: {_one_line(exc)}") from None
            snapshot = committed.current_snapshot()
            assert snapshot is not None
            return snapshot.snapshot_id
        raise StorageError(f"cannot commit to the Iceberg table {identifier}: too many concurrent commits")

    def _create(self, identifier: str, layout: Layout, kind: str, first: "FileRecord") -> Transaction:
        """A transaction that creates ``kind``'s table (and its namespace) from a data file's
        schema, partitioned by the partition column; its first snapshot is in the same commit."""
        catalog = self._open_catalog(create=True)
        assert catalog is not None
        namespace = Catalog.namespace_from(identifier)
        try:
            catalog.create_namespace_if_not_exists(namespace)
        except Exception:   # the SQL catalog's own race: another run created it meanwhile
            if not catalog.namespace_exists(namespace):
                raise
        schema = _table_schema(layout, first)
        column = schema.find_field(self.sink.column)
        spec = PartitionSpec(PartitionField(source_id=column.field_id, field_id=1000,
                                            transform=IdentityTransform(), name=self.sink.column))
        folder = layout.table(kind)
        location = _uri(layout, join(layout.root, folder) if folder else layout.root)
        return catalog.create_table_transaction(identifier, schema, location=location,
                                                partition_spec=spec, properties=OWN_RETRY)

    def _fit_schema(self, tx: Transaction, layout: Layout, files: Sequence["FileRecord"]) -> None:
        """Columns the attempt's files have and the table has not yet are added (a job that
        now explains, say); types widen as Iceberg allows (float → double), others fail."""
        if not files:
            return
        try:
            with tx.update_schema() as update:
                update.union_by_name(_arrow_schema(layout, files[0]))
        except (ValidationError, ValueError, TypeError) as exc:
            raise ContractError(f"the Iceberg table {tx.table_metadata.location} has a column this "
                                f"run writes with another type ({_one_line(exc)}): write to another "
                                f"output.path or table, or change the table first; nothing "
                                f"committed") from None

    def _replace(self, tx: Transaction, table: Table | None, wanted: list[str],
                 properties: dict[str, str]) -> None:
        """Stage the snapshot that makes ``wanted`` the partition: the partition's current
        files that are not wanted go, the wanted ones that are not there yet come (``--update``
        keeps files that are in the table already)."""
        if tx.table_metadata.name_mapping() is None:
            # Our files carry no field ids: readers match their columns by name.
            tx.set_properties({TableProperties.DEFAULT_NAME_MAPPING:
                               tx.table_metadata.schema().name_mapping.model_dump_json()})
        current: dict[str, DataFile] = {}
        if table is not None and table.current_snapshot() is not None:
            # (pydantic's mypy plugin sees the model's fields, not EqualTo's own __init__)
            mine = EqualTo(self.sink.column, self.sink.value)  # type: ignore[call-arg, arg-type]
            current = {task.file.file_path: task.file
                       for task in table.scan(row_filter=mine).plan_files()}
        keep = set(wanted)
        removes = [f for path, f in current.items() if path not in keep]
        adds = self._data_files(tx, [p for p in wanted if p not in current])
        update = tx.update_snapshot(snapshot_properties=properties)
        producer = update.overwrite() if removes else update.fast_append()
        with producer:
            for data_file in removes:
                producer.delete_data_file(data_file)
            for data_file in adds:
                producer.append_data_file(data_file)

    def _data_files(self, tx: Transaction, paths: list[str]) -> list["DataFile"]:
        """Each file as a table's data file (its footer read for row count and statistics),
        checked to be of the partition."""
        metadata, io = tx.table_metadata, tx._table.io
        executor = ExecutorFactory.get_or_create()
        found = list(executor.map(lambda path: parquet_file_to_data_file(io, metadata, path), paths))
        expected = Record(self.sink.value)
        for data_file in found:
            if data_file.partition != expected:
                raise StorageError(f"{data_file.file_path} is not of partition {self.sink.partition} "
                                   f"(its {self.sink.column} statistics say {data_file.partition})")
        return found


def _props(snapshot: Snapshot) -> dict[str, str]:
    return snapshot.summary.additional_properties if snapshot.summary is not None else {}


def _uri(layout: Layout, path: str) -> str:
    """A path of ``layout``'s store as Iceberg names files: a URI (``file:///…``, ``s3://…``)."""
    return f"file://{path}" if is_local(layout.fs) else layout.fs.unstrip_protocol(path)


def _arrow_schema(layout: Layout, first: "FileRecord") -> pa.Schema:
    """A data file's schema as a table's: dictionary columns as their values' type (a table's
    type is logical, the encoding is the file's business), every column optional."""
    try:
        with layout.fs.open(layout.abs(first.path), "rb") as f:
            schema = pq.read_schema(f)
    except (OSError, pa.ArrowException) as exc:
        raise StorageError(f"cannot read {layout.abs(first.path)}: {exc}") from None
    return pa.schema([pa.field(f.name, f.type.value_type if pa.types.is_dictionary(f.type) else f.type,
                               nullable=True) for f in schema])


def _table_schema(layout: Layout, first: "FileRecord") -> Schema:
    """The Iceberg schema of a new table, from a data file's (field ids assigned)."""
    return assign_fresh_schema_ids(Catalog._convert_schema_if_needed(_arrow_schema(layout, first)))


def catalog_properties(sink: Sink, url: str) -> tuple[str, dict[str, str]]:
    """The catalog's name and pyiceberg properties (``${NAME}`` values filled in); for tables on
    S3 the endpoint and region that fsspec's S3 would use, unless the properties set them."""
    properties = {key: value.value() for key, value in sink.catalog}
    name = properties.pop("name", "batchinfer")
    if protocol(url) in ("s3", "s3a"):
        properties = {**s3_options(), **properties}
    return name, properties


def s3_options() -> dict[str, str]:
    """pyiceberg's S3 FileIO properties (module docstring: "Storage options")."""
    found = {"s3.endpoint": s3_endpoint(), "s3.region": s3_region()}
    return {key: value for key, value in found.items() if value}


def _sqlite_file(properties: dict[str, Any]) -> str | None:
    """The database file of a sqlite SQL catalog (None for any other catalog)."""
    uri = str(properties.get("uri", ""))
    if not uri.startswith("sqlite:///"):
        return None
    return local_path(uri[len("sqlite:///"):].split("?", 1)[0])


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# -- the input -------------------------------------------------------------------------------------

def list_input(read: TableRead) -> Listing:
    """The table's data files of the partition at the snapshot asked for (io/tables_in.py).

    Raises:
        SpecError: the catalog cannot be opened, no such table or snapshot, or a refusal
            (module docstring).
        TableVersionGone: a pinned snapshot the table no longer has (exit 3).
        NoShardsError: the partition has no data file.
        StorageError: the table's metadata cannot be read.
    """
    table, shown = _input_table(read), read.shown
    current = table.current_snapshot()
    if read.version is None:
        snapshot = current
        if snapshot is None:
            raise no_files(read, 0)
    else:
        snapshot = table.snapshot_by_id(read.version)
        if snapshot is None:
            known = ", ".join(str(s.snapshot_id) for s in table.snapshots()[-3:]) or "none"
            raise missing_version(read, read.version, f"latest snapshots: {known}",
                                  current.snapshot_id if current is not None else None)
    _refuse_renames(table, shown)
    schema = table.schema()
    for column in read.filter:
        if column not in {f.name for f in schema.fields}:
            raise SpecError(f"input.filter {column}: not a column of Iceberg table {shown}")
    row_filter: BooleanExpression = AlwaysTrue()
    for column, value in read.filter.items():
        row_filter = And(row_filter, EqualTo(column, value))  # type: ignore[call-arg, arg-type]
    try:
        tasks = list(table.scan(row_filter=row_filter, snapshot_id=snapshot.snapshot_id).plan_files())
    except OSError as exc:
        raise StorageError(f"cannot read Iceberg table {shown}: {one_line(exc)}") from None
    except ValueError as exc:   # what pyiceberg cannot plan (equality deletes): the table's
        raise SpecError(f"input.path {shown}: cannot read the Iceberg table as plain Parquet "
                        f"files: {one_line(exc)}") from None
    _refuse_unreadable(read, table, tasks)
    shards = sorted(plain(t.file.file_path) for t in tasks)
    if not shards:
        raise no_files(read, snapshot.snapshot_id)
    if current is not None and snapshot.snapshot_id != current.snapshot_id:
        files_gone(read, snapshot.snapshot_id, shards, current.snapshot_id)
    return listed(read, shards, snapshot.snapshot_id)


def _input_table(read: TableRead) -> Table:
    """The input table, from its catalog (read through pyiceberg's FileIO at fsspec's S3
    endpoint, unless the catalog's properties say otherwise)."""
    try:
        catalog = load_catalog(read.catalog_name, **{**s3_options(), **read.catalog})
    except Exception as exc:  # pyiceberg raises many types for a catalog it cannot open
        raise SpecError(f"input.catalog {read.catalog_name}: cannot open the Iceberg catalog: "
                        f"{one_line(exc)}") from None
    try:
        return catalog.load_table(read.path)
    except (NoSuchTableError, NoSuchNamespaceError):
        raise SpecError(f"input.path {read.shown}: no such table in Iceberg catalog "
                        f"{read.catalog_name}") from None
    except OSError as exc:
        raise StorageError(f"cannot read Iceberg table {read.shown}: {one_line(exc)}") from None


def _refuse_unreadable(read: TableRead, table: Table, tasks: list[Any]) -> None:
    """Refuse a filter on what is not an identity partition of every selected file's spec, and
    files with delete files: plain Parquet reading would get either wrong."""
    schema, specs, shown = table.schema(), table.specs(), read.shown
    for column in read.filter:
        source_id = schema.find_field(column).field_id
        for task in tasks:
            spec = specs[task.file.spec_id]
            if not any(f.source_id == source_id and isinstance(f.transform, IdentityTransform)
                       for f in spec.fields):
                raise SpecError(f"input.filter {column}: Iceberg table {shown} is not partitioned by "
                                f"{column} (identity) in partition spec {spec.spec_id} of "
                                f"{plain(task.file.file_path)}; filter by identity partition only")
    deleting = [t for t in tasks if t.delete_files]
    if deleting:
        raise SpecError(f"input.path {shown}: {len(deleting)} of the selected files have delete "
                        f"files (rows deleted without rewriting the file, e.g. "
                        f"{plain(deleting[0].file.file_path)}), which plain Parquet reading would "
                        f"score; rewrite them (compaction) first")


def _refuse_renames(table: Table, shown: str) -> None:
    """A column renamed since: files written before name it as it was, and batchinfer reads
    columns by name (Iceberg's readers by field id)."""
    current = {f.field_id: f.name for f in table.schema().fields}
    for older in table.schemas().values():
        for f in older.fields:
            if f.field_id in current and current[f.field_id] != f.name:
                raise SpecError(f"input.path {shown}: Iceberg column {current[f.field_id]!r} was "
                                f"renamed from {f.name!r}: older files name it as it was; rewrite "
                                f"the table, or score it under its old name")
