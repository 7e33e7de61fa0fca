"""A run's lineage (contract §6 "Lineage"): what :func:`batchinfer.commands.run.run_job` tells
:mod:`batchinfer.io.lineage` as its phases pass, and the few reads the COMPLETE event needs of
the committed partition (its files' sizes, one file's schema), which may fail without a word.

:class:`RunLineageLog` holds one run's events: :meth:`~RunLineageLog.resolved` once the job is
resolved, :meth:`~RunLineageLog.start` when work starts, then one of
:meth:`~RunLineageLog.complete`, :meth:`~RunLineageLog.fail`, :meth:`~RunLineageLog.abort`.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..io import formats
from ..io import lineage as ol
from ..io.records import Manifest
from ..io.storage import join, url_to_fs
from .run_record import input_dataset

if TYPE_CHECKING:
    from ..clock import Clock
    from ..spec import Job
    from .resolve import Resolved

log = logging.getLogger("batchinfer")


def lineage_of(job: "Job", attempt: str, started: datetime,
               environ: Mapping[str, str] = os.environ) -> ol.RunLineage:
    """What every event of the run says before the job is resolved: its job, run id, parent."""
    namespace = ol.namespace_of(job.spec.lineage, environ)
    return ol.RunLineage(namespace=namespace, job=job.spec.name,
                         run_id=ol.run_id_of(namespace, job.spec.name, attempt, started),
                         attempt=attempt, ds=job.ds,
                         parent=ol.RunRef.parse(environ.get(ol.PARENT_ENV)),
                         root=ol.RunRef.parse(environ.get(ol.ROOT_ENV)))


def with_resolved(lineage: ol.RunLineage, resolved: "Resolved", model_options: Mapping[str, str],
                  challengers: Sequence[tuple[str, Mapping[str, str], Mapping[str, str]]]) -> ol.RunLineage:
    """The run's lineage once resolved: the triple, the model, the input datasets and schema."""
    job = resolved.job
    table = resolved.input_table()
    if table is not None:
        inputs = [_table_ref(job, table.table, input_side=True)]
    else:
        folders = dict.fromkeys(ol.folder_of(name) for name in resolved.shard_names())
        inputs = [ol.dataset_name(folder) for folder in folders]
    return replace(lineage, triple=resolved.triple.as_dict(), backend=job.spec.model.backend,
                   model_options=dict(model_options), challengers=tuple(challengers),
                   schema=resolved.schema.ref, fields=schema_fields(resolved.schema.schema),
                   inputs=inputs, input_version=str(table.version) if table is not None else None)


def schema_fields(compiled: Any) -> tuple[tuple[str, str], ...]:
    """The pandera schema's columns and their types (as pandera names them)."""
    columns = getattr(getattr(compiled, "schema", None), "columns", None) or {}
    return tuple((str(name), str(getattr(column, "dtype", "") or "")) for name, column in columns.items())


def _table_ref(job: "Job", table: str, *, input_side: bool) -> ol.DatasetRef:
    """A table's dataset: an Iceberg identifier in its catalog, or a Delta table's folder."""
    spec = job.spec.input if input_side else job.spec.output
    if formats.get(spec.format).catalog:
        catalog = spec.catalog.name if spec.catalog is not None else "batchinfer"
        return ol.DatasetRef(f"iceberg://{catalog}", table)
    return ol.dataset_name(table)


def committed_of(job: "Job", manifest: Manifest, action: str, *,
                 quarantine: Sequence[tuple[str | None, str, int]] = (),
                 drift_level: str = "none", drift: Sequence[Mapping[str, Any]] = ()) -> ol.Committed:
    """What COMPLETE says of ``manifest``'s partition (its outputs' sizes and the predictions'
    schema read from the store, left out when they cannot be)."""
    totals = manifest.totals
    by_input: dict[str, int] = {}
    for shard in manifest.shards:
        name = ol.dataset_name(ol.folder_of(shard.path)).name
        by_input[name] = by_input.get(name, 0) + (shard.rows_in or 0)
    sizes, fields = _read_outputs(job, manifest)
    return ol.Committed(
        action=action, attempt=manifest.attempt, rows_in=totals.rows_in,
        rows_scored=totals.rows_scored, rows_quarantined=totals.rows_quarantined,
        shards=totals.shards, shards_unreadable=totals.shards_unreadable, rows_by_input=by_input,
        input_digest=input_dataset(manifest)["digest"], quarantine=tuple(quarantine),
        drift_level=drift_level, drift=tuple(drift),
        challengers={c.name: (c.rows_scored, c.rows_rejected) for c in manifest.challengers},
        outputs=outputs_of(job, manifest, sizes), output_fields=fields)


def _kind_of(path: str, table: bool) -> str:
    """The output a data file belongs to, by its path relative to ``output.path``: files'
    ``predictions/<attempt>/…``; tables' ``dt=…/<attempt>/…``, ``_quarantine/…``, ``_challengers/<name>/…``."""
    head = path.split("/")
    if table:
        if head[0] == "_quarantine":
            return "quarantine"
        if head[0] == "_challengers" and len(head) > 1:
            return f"challengers/{head[1]}"
        return "predictions"
    return "/".join(head[:2]) if head[0] == "challengers" else head[0]


def _files(manifest: Manifest) -> list[Any]:
    return [f for s in manifest.shards for f in s.files] + [
        f for c in manifest.challengers for s in c.shards for f in s.files]


def outputs_of(job: "Job", manifest: Manifest, sizes: Mapping[str, int] | None = None) -> list[ol.Output]:
    """Each dataset the commit wrote to, with its rows, files and version: for files the kind's
    folder (``<output.path>/predictions``) at the attempt that committed it; for tables each
    table at the version the commit made."""
    root = job.display(job.spec.output.path)
    table = manifest.table
    counts: dict[str, list[int]] = {}
    for f in _files(manifest):
        entry = counts.setdefault(_kind_of(f.path, table is not None), [0, 0])
        entry[0] += f.rows
        entry[1] += 1
    size = (lambda kind: sizes.get(kind)) if sizes else (lambda kind: None)
    if table is None:
        return [ol.Output(kind=kind, dataset=ol.dataset_name(join(root, kind)), rows=rows, files=n,
                          size=size(kind), version=manifest.attempt)
                for kind, (rows, n) in counts.items()]
    outputs = []
    for t in table.tables:
        ref = (_table_ref(job, t.table, input_side=False) if formats.get(table.format).catalog
               else ol.dataset_name(join(root, t.table) if t.table else root))
        rows, n = counts.get(t.kind, [0, 0])
        outputs.append(ol.Output(kind=t.kind, dataset=ref, rows=rows, files=n, size=size(t.kind),
                                 version=str(t.version)))
    return outputs


def _read_outputs(job: "Job", manifest: Manifest) -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """The bytes of each output's files (one listing per folder of files) and the predictions'
    columns (one file's footer); empty where the store does not answer."""
    sizes: dict[str, int] = {}
    fields: tuple[tuple[str, str], ...] = ()
    table = manifest.table is not None
    files = _files(manifest)
    try:
        fs, root = url_to_fs(job.spec.output.path)
        listed: dict[str, int] = {}
        for folder in dict.fromkeys(f.path.rsplit("/", 1)[0] for f in files if "/" in f.path):
            for info in fs.ls(join(root, folder), detail=True):
                listed[str(info["name"]).rstrip("/")] = int(info.get("size") or 0)
        for f in files:
            kind = _kind_of(f.path, table)
            sizes[kind] = sizes.get(kind, 0) + listed.get(join(root, f.path).rstrip("/"), 0)
        first = next((f for f in files if _kind_of(f.path, table) == "predictions"), None)
        if first is not None:
            import pyarrow.parquet as pq

            with fs.open(join(root, first.path), "rb") as handle:
                schema = pq.read_schema(handle)
            # A dictionary-encoded column (the triple's) is of its values' type to a reader.
            fields = tuple((name, str(getattr(kind, "value_type", kind)))
                           for name, kind in zip(schema.names, schema.types))
    except Exception as exc:   # the statistics are extra: the event goes without them
        log.debug("lineage: could not read the outputs' sizes or schema: %s", exc)
    return sizes, fields


class RunLineageLog:
    """One run's events, in order: START once, then at most one of COMPLETE, FAIL, ABORT.

    A run that stops before work (refused while resolving or deciding) sends FAIL alone; a
    dry run sends nothing (it is not made). ``errors`` is the events that could not be sent.
    """

    def __init__(self, emitter: ol.Emitter, lineage: ol.RunLineage, clock: "Clock"):
        self._emitter = emitter
        self.lineage = lineage
        self._clock = clock
        self._started = False
        self._ended = False

    @classmethod
    def of(cls, job: "Job", attempt: str, started: datetime, clock: "Clock") -> "RunLineageLog | None":
        emitter = ol.Emitter.of(job.spec.lineage, job.display)
        if emitter is None:
            return None
        try:
            lineage = lineage_of(job, attempt, started)
        except ImportError:   # no client: the run id cannot be made, nor an event sent
            lineage = ol.RunLineage(namespace="", job=job.spec.name, run_id="", attempt=attempt)
        return cls(emitter, lineage, clock)

    @property
    def errors(self) -> int:
        return self._emitter.errors

    def resolved(self, resolved: "Resolved", model_options: Mapping[str, str],
                 challengers: Sequence[tuple[str, Mapping[str, str], Mapping[str, str]]]) -> None:
        self.lineage = self._safely(with_resolved, self.lineage, resolved, model_options,
                                    challengers) or self.lineage

    def start(self) -> None:
        """START, sent while the run goes on (the models load meanwhile)."""
        if self._started:
            return
        self._started = True
        self._send(ol.start_event, self.lineage, self._clock(), wait=False)

    def complete(self, job: "Job", manifest: Manifest, action: str, **read: Any) -> None:
        """COMPLETE with the committed partition (after START, sent first if it was not)."""
        self.start()
        committed = self._safely(committed_of, job, manifest, action, **read)
        if committed is not None:
            self._end(ol.complete_event, self.lineage, self._clock(), committed)

    def fail(self, message: str, exit_code: int, error: str) -> None:
        self._end(ol.fail_event, self.lineage, self._clock(), message, exit_code, error)

    def abort(self) -> None:
        self._end(ol.abort_event, self.lineage, self._clock())

    def _end(self, build: Any, *args: Any) -> None:
        if self._ended:
            return
        self._ended = True
        self._send(build, *args, wait=True)

    def _send(self, build: Any, *args: Any, wait: bool) -> None:
        if wait:   # a terminal event goes after START, never beside it
            self._emitter.wait()
        event = self._safely(build, *args)
        if event is None:
            self._emitter.errors += 1
        else:
            self._emitter.send(event)
        if wait:
            self._emitter.wait()

    def _safely(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        """``function``'s result, or None (counted, said once) if it raised: a bug in building an
        event must not fail the run either."""
        try:
            return function(*args, **kwargs)
        except Exception as exc:
            self._emitter._warn(f"{type(exc).__name__}: {exc}")
            return None
