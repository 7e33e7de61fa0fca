"""Resolving a job: everything it names looked up, the triple computed and checked (contract §1).

Used by ``plan``, ``run``, ``stamp`` and ``export``; nothing here writes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..backends import declared_options, implied_options
from ..errors import ContractError, SpecError, TableVersionGone
from ..io import formats
from ..io.commit import PartitionCommit
from ..io.outputs import RECORDS
from ..io.records import InputTable, Manifest
from ..io.shards import Listing, Shard
from ..io.sinks import FILES, Sink
from ..io.storage import join, local_path
from ..redaction import Deferred
from ..spec import ChallengerSpec, Job, ModelFields
from ..triple.contract import Triple, check_contract, check_declared_code, check_explain, model_digest, refuse_pickle
from ..triple.models import ResolvedModel, resolve_model
from ..triple.preprocess import Preprocessor, load_preprocessor
from ..triple.schemas import SchemaVersion, next_version, parse_ref, resolve_schema
from .explain_plan import check_background

log = logging.getLogger("batchinfer")


@dataclass(frozen=True)
class ResolvedChallenger:
    """A challenger model, found and checked: it scores the champion's prepared batches, so its
    triple shares the job's schema version and preprocess hash; its model version and digest
    are its own."""

    spec: ChallengerSpec
    model: ResolvedModel
    triple: Triple

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class Resolved:
    """A job with everything it names looked up and the triple computed."""

    job: Job
    schema: SchemaVersion
    preprocessor: Preprocessor
    features: tuple[str, ...]
    model: ResolvedModel
    triple: Triple
    shards: list[Shard] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)   # metadata files input.path matched
    challengers: tuple[ResolvedChallenger, ...] = ()
    table: InputTable | None = None   # a table input: the table and version its shards are of

    def shard_names(self) -> tuple[str, ...]:
        """What ``_source_shard`` records for each shard (``${NAME}`` values put back)."""
        return tuple(self.job.display(s.url) for s in self.shards)

    def input_table(self) -> InputTable | None:
        """What the manifest says was read, for a table input (``${NAME}`` values put back)."""
        return self.table and InputTable(format=self.table.format,
                                         table=self.job.display(self.table.table),
                                         version=self.table.version, filter=self.table.filter)


def pinned_version(job: Job, committed: Manifest | None, *, update: bool = False) -> int | None:
    """The table version a run of the partition reads when ``input.version`` is not set: the
    one its manifest names (a rerun reads what the commit read, and is a no-op), unless the
    partition is updated (``--update``: the latest) or was scored from another table or from
    files (contract §3 ``input``). None: the latest."""
    spec = job.spec.input
    held = committed.input_table if committed is not None else None
    if not formats.get(spec.format).is_table or spec.version is not None or update or held is None:
        return None
    if (held.format, held.table, held.filter) != (spec.format, job.display(spec.path), spec.filter):
        return None
    return held.version


def list_partition_input(job: Job, committed: Manifest | None, *, update: bool = False,
                         reading: bool = False) -> Listing:
    """The shards a run of the partition reads (:func:`pinned_version`, then
    :func:`list_job_input`). When the version the manifest pinned is gone from the table
    (vacuumed, expired), a run that does not read the shards (``reading`` False: a plain rerun
    decides reuse, or exit 3, by the shards' names) gets the manifest's shards, so the no-op of
    a committed partition stays one (a backfill over old dates); one that reads them exits 3.
    The first gets one warning line saying so (``plan`` shows what a run would do, and this is
    what ``--overwrite`` and ``profile`` would meet), before any shard is read.

    Raises:
        TableVersionGone: the pinned version is gone and ``reading`` (exit 3, before any work).
    """
    pinned = pinned_version(job, committed, update=update)
    try:
        return list_job_input(job, pinned=pinned)
    except TableVersionGone as exc:
        if reading or committed is None:
            raise
        log.warning("the committed partition stays as it is (a run reuses it), but --overwrite "
                    "and profile cannot read it again: %s", exc)   # the CLI words its remedies
        return Listing([Shard(i, s.path) for i, s in enumerate(committed.shards)],
                       table=committed.input_table)


def partition_listing(job: Job, partition: PartitionCommit, *, update: bool = False,
                      reading: bool = False) -> Listing | None:
    """For a table input, the shards a run of ``partition`` reads (:func:`list_partition_input`
    on its committed manifest); None for files (:func:`resolve` lists them)."""
    if not formats.get(job.spec.input.format).is_table:
        return None
    return list_partition_input(job, partition.committed(), update=update, reading=reading)


def list_job_input(job: Job, *, pinned: int | None = None) -> Listing:
    """The job's shards, as ``input.format`` lists them (:mod:`batchinfer.io.tables_in`): the
    files ``input.path`` stands for, or a table's data files at ``input.version``, else at
    ``pinned`` (:func:`pinned_version`), else at its latest version. Every command that reads
    the input lists it here."""
    from ..io.tables_in import list_table

    spec = job.spec.input

    version = spec.version if spec.version is not None else pinned
    return list_table(spec.format, spec.path, filter=spec.filter, version=version,
                      pinned=spec.version is None and pinned is not None,
                      catalog=spec.catalog_properties(),
                      catalog_name=spec.catalog.name if spec.catalog else "batchinfer",
                      shown=job.display(spec.path))


def sink_of(job: Job) -> Sink:
    """How the job's output partition is stored (``output.format``, io/sinks.py).

    Raises:
        SpecError: a table format without a date (its tables are partitioned by it), or a
            catalog's tables (Iceberg's) on an object store without ``output.catalog``.
    """
    output = job.spec.output
    if not output.is_table:
        return FILES
    if job.ds is None:
        raise SpecError(f"output.format {output.format} partitions its tables by "
                        f"{output.partition_column}: run with --ds YYYY-MM-DD")
    catalog: tuple[tuple[str, Deferred], ...] = ()
    if formats.get(output.format).catalog:
        catalog = tuple((k, Deferred.of(v, job.secrets)) for k, v in _catalog(job).items())
    return Sink(format=output.format, column=output.partition_column, value=job.ds,
                table=output.table or f"batchinfer.{job.spec.name.replace('-', '_').replace('.', '_')}",
                catalog=catalog)


def _catalog(job: Job) -> dict[str, str]:
    """The catalog's pyiceberg properties (name under ``name``): ``output.catalog``, or a sqlite
    catalog in ``<output.path>/_catalog.db`` for a local ``output.path``."""
    output = job.spec.output
    spec = output.catalog
    if spec is None:
        local = local_path(output.path)
        if local is None:
            raise SpecError(f"output.format {output.format} on {job.display(output.path)} needs "
                            f"output.catalog (a sqlite catalog is the default only for a local "
                            f"output.path)")
        return {"name": "batchinfer", "type": "sql", "uri": f"sqlite:///{join(local, '_catalog.db')}",
                "warehouse": output.path}
    props = {"name": spec.name, **spec.properties}
    for key in ("uri", "type", "warehouse"):
        value = getattr(spec, key)
        if value is not None:
            props[key] = value
    props.setdefault("warehouse", output.path)
    return props


def partition_of(job: Job) -> PartitionCommit:
    """The job's output partition (``output.path`` and how it is stored)."""
    return PartitionCommit(job.spec.output.path, sink_of(job))


def shown_partition(job: Job) -> str:
    """The partition as messages name it: ``output.path`` (and the table partition)."""
    sink = sink_of(job)
    shown = job.display(job.spec.output.path)
    return f"{shown} ({output_format(job)} partition {sink.partition})" if sink.is_table else shown


def output_format(job: Job) -> str:
    """How messages name the output's tables: ``Delta``, ``Iceberg``, ``files``."""
    return formats.get(job.spec.output.format).shown


def records_url(job: Job) -> str:
    """Where the partition's manifest and records are: ``output.path`` for files,
    ``<output.path>/_batchinfer/<column>=<ds>`` for tables (io/outputs.py)."""
    sink = sink_of(job)
    return join(job.spec.output.path, RECORDS, sink.partition) if sink.is_table else job.spec.output.path


def resolve_inputs(job: Job) -> tuple[SchemaVersion, tuple[str, ...], Preprocessor]:
    """The job's schema version, the model's feature columns and the preprocessing step."""
    spec = job.spec
    schema = resolve_schema(spec.schemas.root, spec.schema_)
    missing_ids = [c for c in spec.output.id_columns if c not in schema.columns]
    if missing_ids:
        raise SpecError(f"output.id_columns {missing_ids} are not columns of schema {schema.ref}")
    features = schema.features_for(spec.output.id_columns)
    return schema, features, load_preprocessor(spec.preprocess, job.folder, features)


def resolve(job: Job, *, list_input_files: bool = True, check: bool = True,
            listing: Listing | None = None) -> Resolved:
    """Look up schema, preprocessing, model and shards; compute the triple; check the contract.

    Args:
        listing: the shards, listed already (:func:`list_partition_input`); by default
            :func:`list_job_input`'s.

    Raises:
        UsageError: the schema, preprocessing, model or shards cannot be found (exit 2).
        ContractError: the triple does not match the model's declaration (exit 3).
    """
    spec = job.spec
    schema, features, preprocessor = resolve_inputs(job)
    model, triple = _resolve_model(job, spec.model, schema, preprocessor, check)
    challengers = []
    for challenger in spec.model.challengers:
        try:
            found, its_triple = _resolve_model(job, challenger, schema, preprocessor, check)
        except ContractError as exc:  # which model: the champion's message would look the same
            raise exc.within(f"challenger {challenger.name}") from None
        challengers.append(ResolvedChallenger(challenger, found, its_triple))
    if listing is None and list_input_files:
        listing = list_job_input(job)
    if listing is not None:
        check_table_columns(job, schema, listing)
    return Resolved(job, schema, preprocessor, features, model, triple,
                    listing.shards if listing else [], listing.ignored if listing else [],
                    tuple(challengers), listing.table if listing else None)


def check_table_columns(job: Job, schema: SchemaVersion, listing: Listing) -> None:
    """A table's columns that its files do not hold (a Delta table's partition columns are in
    its log): a schema that needs one would quarantine every row (exit 2 before any work
    instead)."""
    needed = [c for c in listing.absent if c in schema.columns]
    if needed:
        raise SpecError(f"schema {schema.ref} has {', '.join(needed)}, a partition column of "
                        f"{formats.get(job.spec.input.format).shown} table "
                        f"{job.display(job.spec.input.path)}: its value is in the "
                        f"table's log, not in its data files, which batchinfer reads; leave it "
                        f"out of the schema (and of output.id_columns)")


def _resolve_model(job: Job, model_spec: ModelFields, schema: SchemaVersion,
                   preprocessor: Preprocessor, check: bool) -> tuple[ResolvedModel, Triple]:
    """Find one model (the champion or a challenger), compute its triple and check it against
    its declaration — and the declaration's record of the code behind the triple's names (the
    schema's source, the preprocessing's packages): a warning, or exit 3."""
    refuse_pickle(model_spec.uri, bool(model_spec.options.get("allow_pickle", False)))
    model = resolve_model(model_spec.uri, model_spec.backend, job.spec.tracking.uri)
    digest = model.digest or model_digest(model.path)   # a fetched model was hashed in the cache
    declared = model.declaration
    declared_version = (declared.model_version if declared else None) or model_spec.version or ""
    triple = Triple(declared_version, digest, schema.ref, preprocessor.hash)
    if check:
        shown = job.display(model_spec.uri)
        check_contract(shown, model.declaration, triple, model_spec.version,
                       declared_options(model_spec.backend, model_spec.options),
                       implied_options(model_spec.backend))
        explain = job.spec.explain
        check_explain(shown, model.declaration or {}, explain.declared() if explain else None)
        check_background(shown, model.declaration or {}, explain)
        following = next_version(job.spec.schemas.root, parse_ref(schema.ref)[0])
        for line in check_declared_code(shown, model.declaration or {}, schema.ref,
                                        schema.source.sha256, following,
                                        " ".join(preprocessor.packages)):
            log.warning("%s", line)
    return model, triple
