"""A run's OpenLineage events (contract §6 "Lineage"): built from what the run already knows,
sent at the edge, never able to fail the run.

The builders are pure: :func:`start_event`, :func:`complete_event`, :func:`fail_event` and
:func:`abort_event` take a :class:`RunLineage` (the job, the run, its inputs: known before any
work) and, for COMPLETE, a :class:`Committed` (what the commit holds), and return the client's
``RunEvent``. Standard facets are the client's classes; batchinfer's own (the version triple, the
declared model options, the challengers, the drift verdict, the run's attempt, quarantine by
reason) are plain mappings with ``_producer`` and ``_schemaURL``, their JSON schema shipped beside
this module (``lineage_facets.json``). Dataset names follow OpenLineage's naming: a local path is
namespace ``file`` and its absolute path, ``s3://bucket/key`` is namespace ``s3://bucket`` and
name ``key`` (:func:`dataset_name`).

The edge is :class:`Emitter`: one ``OpenLineageClient`` with the transport of the job spec's
``lineage`` section or of the environment (``OPENLINEAGE_URL``, ``OPENLINEAGE_CONFIG``,
``OPENLINEAGE__TRANSPORT__…``, which the client reads itself). START goes out on a thread of
its own while the models load; a terminal event waits for it, then is sent with the section's
timeout. A send that fails is counted (``errors``: the run's ``lineage_errors`` metric) and
said once, in one warning line; nothing is retried for long, nothing is raised.

``openlineage-python`` (the ``lineage`` extra) is imported only when events are to be sent.
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence
from urllib.parse import urlsplit

from .. import __version__

if TYPE_CHECKING:
    from openlineage.client.event_v2 import RunEvent


class LineageSpec(Protocol):
    """The job spec's ``lineage`` section (``batchinfer.spec.LineageSpec``) as read here."""

    @property
    def transport(self) -> str: ...
    @property
    def url(self) -> str | None: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def api_key(self) -> str | None: ...
    @property
    def path(self) -> str | None: ...
    @property
    def namespace(self) -> str | None: ...
    @property
    def timeout_s(self) -> float: ...

log = logging.getLogger("batchinfer")

DEFAULT_NAMESPACE = "batchinfer"
# Where batchinfer's events say they come from, and where its own facets' schema is named. The
# schema ships in the package (lineage_facets.json, under this $id); `.invalid` says the name
# is not fetched from anywhere.
PRODUCER = f"https://batchinfer.invalid/batchinfer/{__version__}"
FACETS_SCHEMA = "https://batchinfer.invalid/spec/facets/1-0-0/BatchinferFacets.json"
# Set by the DAG's score task (airflow_dags/nightly_scoring.py): the task's run as Airflow's
# OpenLineage provider names it, `namespace/job/run id` — the names dbt's integration reads.
PARENT_ENV = "OPENLINEAGE_PARENT_ID"
ROOT_ENV = "OPENLINEAGE_ROOT_PARENT_ID"
# Environment variables with which the client configures a transport by itself.
_CLIENT_ENV = ("OPENLINEAGE_URL", "OPENLINEAGE_CONFIG", "OPENLINEAGE__TRANSPORT__TYPE")


@dataclass(frozen=True)
class RunRef:
    """A run other events name: its job's namespace and name, and its run id."""

    namespace: str
    name: str
    run_id: str

    @classmethod
    def parse(cls, text: str | None) -> "RunRef | None":
        """``namespace/job/run id`` (the provider's ``lineage_parent_id``); None when it is not
        that (then the events go without a parent rather than with a wrong one)."""
        parts = (text or "").strip().split("/")
        if len(parts) != 3 or not all(parts):
            return None
        try:
            uuid.UUID(parts[2])
        except ValueError:
            return None
        return cls(*parts)


@dataclass(frozen=True)
class DatasetRef:
    namespace: str
    name: str


@dataclass(frozen=True, kw_only=True)
class RunLineage:
    """What every event of one run says, known before any work.

    Attributes:
        run_id: a UUID for the attempt (:func:`run_id_of`), the same on START and on the end.
        fields: the input schema's columns, (name, type), from the pandera schema.
        inputs: the datasets the shards are read from (one per folder of shards, or the table).
        input_version: a table input's version (Delta) or snapshot id (Iceberg).
        challengers: each challenger's name, triple and declared options.
    """

    namespace: str
    job: str
    run_id: str
    attempt: str
    ds: str | None = None
    triple: Mapping[str, str] = field(default_factory=dict)
    backend: str = ""
    model_options: Mapping[str, str] = field(default_factory=dict)
    challengers: Sequence[tuple[str, Mapping[str, str], Mapping[str, str]]] = ()
    schema: str = ""
    fields: Sequence[tuple[str, str]] = ()
    inputs: Sequence[DatasetRef] = ()
    input_version: str | None = None
    parent: RunRef | None = None
    root: RunRef | None = None


@dataclass(frozen=True, kw_only=True)
class Output:
    """One dataset the commit wrote to: predictions, quarantine, or a challenger's."""

    kind: str                       # predictions | quarantine | challengers/<name>
    dataset: DatasetRef
    rows: int
    files: int | None = None
    size: int | None = None         # bytes of its files, when they could be listed
    version: str | None = None      # the table's version, or the attempt that committed the files


@dataclass(frozen=True, kw_only=True)
class Committed:
    """What COMPLETE says of the partition as committed.

    Attributes:
        action: ``score`` (this run committed it), ``update``, ``reuse`` (it was committed as this
            run would commit it: a no-op) or ``lost_race``.
        attempt: the attempt whose manifest it is.
        rows_in, rows_scored, rows_quarantined, shards, shards_unreadable: the manifest's totals.
        rows_by_input: rows in per input dataset (by name).
        input_digest: the digest of the shards' names and sha256 (what MLflow's dataset logs).
        quarantine: quarantined rows by (column, check); empty when not known (a reuse).
        drift: the drift verdict's level and each column's record (empty: no baseline).
        output_fields: the predictions' columns, (name, type), from a file the commit holds.
    """

    action: str
    attempt: str
    rows_in: int
    rows_scored: int
    rows_quarantined: int
    shards: int
    shards_unreadable: int = 0
    rows_by_input: Mapping[str, int] = field(default_factory=dict)
    input_digest: str | None = None
    quarantine: Sequence[tuple[str | None, str, int]] = ()
    drift_level: str = "none"
    drift: Sequence[Mapping[str, Any]] = ()
    challengers: Mapping[str, tuple[int, int]] = field(default_factory=dict)   # scored, rejected
    outputs: Sequence[Output] = ()
    output_fields: Sequence[tuple[str, str]] = ()


# -- names -----------------------------------------------------------------------------------------

def dataset_name(url: str) -> DatasetRef:
    """A file or folder's dataset as OpenLineage's naming spec names it: ``file`` and the
    absolute path for a local one, ``scheme://authority`` and the path within for the others
    (``s3://bucket/a/b`` → ``s3://bucket``, ``a/b``). Userinfo is never part of the name.

    >>> dataset_name("s3://user:pw@bucket/scores/dt=2026-01-15")
    DatasetRef(namespace='s3://bucket', name='scores/dt=2026-01-15')
    """
    if "://" not in url or url.startswith("file://"):
        path = url.removeprefix("file://")
        return DatasetRef("file", os.path.abspath(path) if path else "/")
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    name = parts.path.lstrip("/") if host else parts.path
    return DatasetRef(f"{parts.scheme}://{host}", name or "/")


def folder_of(url: str) -> str:
    """The folder a shard is in (its URL up to the last ``/``)."""
    return url.rsplit("/", 1)[0] if "/" in url.rstrip("/") else url


def run_id_of(namespace: str, job: str, attempt: str, started: datetime) -> str:
    """The run's id: a UUIDv7 of its start and its attempt (as the client's
    ``generate_static_uuid`` makes them, and Airflow's provider for its runs): the same for every
    event of the attempt, and ordered by start time in a lineage tool."""
    from openlineage.client.uuid import generate_static_uuid

    return str(generate_static_uuid(instant=started, data=f"{namespace}.{job}.{attempt}".encode()))


def namespace_of(spec: LineageSpec | None, environ: Mapping[str, str] = os.environ) -> str:
    return (spec.namespace if spec is not None and spec.namespace else None) or environ.get(
        "OPENLINEAGE_NAMESPACE") or DEFAULT_NAMESPACE


def configured(spec: LineageSpec | None, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a run sends events: the job spec says where, or the environment does (and
    ``OPENLINEAGE_DISABLED`` does not say true)."""
    if environ.get("OPENLINEAGE_DISABLED", "").strip().lower() == "true":
        return False
    return spec is not None or any(environ.get(name) for name in _CLIENT_ENV)


def client_config(spec: LineageSpec) -> dict[str, Any]:
    """The client's ``config`` for the job spec's ``lineage`` section. HTTP: the section's
    timeout and one retry at most (the client's default retries with back-off take ~10 s
    against a receiver that is down)."""
    transport: dict[str, Any]
    if spec.transport == "http":
        transport = {"type": "http", "url": spec.url, "endpoint": spec.endpoint,
                     "timeout": spec.timeout_s,
                     "retry": {"total": 1, "connect": 1, "read": 1, "backoff_factor": 0.1}}
        if spec.api_key:
            transport["auth"] = {"type": "api_key", "apiKey": spec.api_key}
    elif spec.transport == "file":
        transport = {"type": "file", "log_file_path": spec.path, "append": True}
    else:
        transport = {"type": "console"}
    return {"transport": transport}


# -- events --------------------------------------------------------------------------------------

def _custom(name: str, **fields: Any) -> dict[str, Any]:
    return {"_producer": PRODUCER, "_schemaURL": f"{FACETS_SCHEMA}#/$defs/{name}", **fields}


def _run_facets(lineage: RunLineage, **extra: Any) -> dict[str, Any]:
    from openlineage.client.facet_v2 import parent_run, processing_engine_run

    facets: dict[str, Any] = {
        "processing_engine": processing_engine_run.ProcessingEngineRunFacet(
            version=__version__, name="batchinfer", producer=PRODUCER),
        "batchinfer_run": _custom("BatchinferRunFacet", attempt=lineage.attempt, ds=lineage.ds,
                                  **{k: v for k, v in extra.items() if v is not None}),
    }
    if lineage.triple:
        facets["batchinfer_triple"] = _custom("BatchinferTripleRunFacet", **dict(lineage.triple))
    if lineage.backend:
        facets["batchinfer_model"] = _custom("BatchinferModelRunFacet", backend=lineage.backend,
                                             options=dict(lineage.model_options))
    if lineage.challengers:
        facets["batchinfer_challengers"] = _custom("BatchinferChallengersRunFacet", challengers=[
            {"name": name, "triple": dict(triple), "options": dict(options)}
            for name, triple, options in lineage.challengers])
    if lineage.parent is not None:
        parent, root = lineage.parent, lineage.root or lineage.parent
        facets["parent"] = parent_run.ParentRunFacet(
            run=parent_run.Run(runId=parent.run_id),
            job=parent_run.Job(namespace=parent.namespace, name=parent.name),
            root=parent_run.Root(run=parent_run.RootRun(runId=root.run_id),
                                 job=parent_run.RootJob(namespace=root.namespace, name=root.name)),
            producer=PRODUCER)
    return facets


def _job(lineage: RunLineage) -> Any:
    from openlineage.client.event_v2 import Job
    from openlineage.client.facet_v2 import job_type_job

    return Job(namespace=lineage.namespace, name=lineage.job, facets={
        "jobType": job_type_job.JobTypeJobFacet(processingType="BATCH", integration="BATCHINFER",
                                                jobType="JOB", producer=PRODUCER)})


def _schema(fields: Sequence[tuple[str, str]]) -> Any:
    from openlineage.client.facet_v2 import schema_dataset

    return schema_dataset.SchemaDatasetFacet(
        fields=[schema_dataset.SchemaDatasetFacetFields(name=name, type=kind) for name, kind in fields],
        producer=PRODUCER)


def _inputs(lineage: RunLineage, committed: Committed | None = None) -> list[Any]:
    from openlineage.client.event_v2 import InputDataset
    from openlineage.client.facet_v2 import (
        data_quality_assertions_dataset,
        data_quality_metrics_input_dataset,
        dataset_version_dataset,
    )

    datasets = []
    alone = len(lineage.inputs) == 1   # the partition's counts by reason belong to its one input
    for ref in lineage.inputs:
        facets: dict[str, Any] = {}
        input_facets: dict[str, Any] = {}
        if lineage.fields:
            facets["schema"] = _schema(lineage.fields)
        version = lineage.input_version or (committed.input_digest if committed else None)
        if version:
            facets["version"] = dataset_version_dataset.DatasetVersionDatasetFacet(
                datasetVersion=version, producer=PRODUCER)
        if committed is not None:
            rows = committed.rows_in if alone else committed.rows_by_input.get(ref.name)
            input_facets["dataQualityMetrics"] = (
                data_quality_metrics_input_dataset.DataQualityMetricsInputDatasetFacet(
                    rowCount=rows, columnMetrics={}, producer=PRODUCER))
            if alone:
                input_facets["batchinfer_quarantine"] = _custom(
                    "BatchinferQuarantineInputDatasetFacet", rowsIn=committed.rows_in,
                    rowsScored=committed.rows_scored, rowsQuarantined=committed.rows_quarantined,
                    shards=committed.shards, shardsUnreadable=committed.shards_unreadable,
                    byReason=[{"column": column, "check": check, "rows": n}
                              for column, check, n in committed.quarantine])
                if committed.quarantine:   # an input facet: what the rows read were found to be
                    input_facets["dataQualityAssertions"] = (
                        data_quality_assertions_dataset.DataQualityAssertionsDatasetFacet(
                            assertions=[data_quality_assertions_dataset.Assertion(
                                assertion=check, success=False, column=column)
                                for column, check, _ in committed.quarantine],
                            producer=PRODUCER))
        datasets.append(InputDataset(namespace=ref.namespace, name=ref.name, facets=facets,
                                     inputFacets=input_facets))
    return datasets


def _outputs(committed: Committed) -> list[Any]:
    from openlineage.client.event_v2 import OutputDataset
    from openlineage.client.facet_v2 import dataset_version_dataset, output_statistics_output_dataset

    datasets = []
    for out in committed.outputs:
        facets: dict[str, Any] = {}
        if out.kind == "predictions" and committed.output_fields:
            facets["schema"] = _schema(committed.output_fields)
        if out.version:
            facets["version"] = dataset_version_dataset.DatasetVersionDatasetFacet(
                datasetVersion=out.version, producer=PRODUCER)
        statistics = output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(
            rowCount=out.rows, size=out.size, fileCount=out.files, producer=PRODUCER)
        datasets.append(OutputDataset(namespace=out.dataset.namespace, name=out.dataset.name,
                                      facets=facets, outputFacets={"outputStatistics": statistics}))
    return datasets


def _event(kind: str, lineage: RunLineage, when: datetime, run_facets: dict[str, Any],
           inputs: list[Any] | None = None, outputs: list[Any] | None = None) -> "RunEvent":
    from openlineage.client.event_v2 import Run, RunEvent, RunState

    return RunEvent(eventType=getattr(RunState, kind), eventTime=when.isoformat(),
                    run=Run(runId=lineage.run_id, facets=run_facets), job=_job(lineage),
                    inputs=inputs or [], outputs=outputs or [], producer=PRODUCER)


def start_event(lineage: RunLineage, when: datetime) -> "RunEvent":
    """START: the job, the run (triple, declared model options, challengers, parent) and the
    datasets it reads, with their schema."""
    return _event("START", lineage, when, _run_facets(lineage), _inputs(lineage))


def complete_event(lineage: RunLineage, when: datetime, committed: Committed) -> "RunEvent":
    """COMPLETE: START's facets, and the partition as committed: rows in and quarantined by
    reason on the input, each output with its rows, files, size and version, the drift verdict."""
    facets = _run_facets(lineage, action=committed.action, committedBy=committed.attempt)
    if committed.drift_level != "none":
        facets["batchinfer_drift"] = _custom("BatchinferDriftRunFacet", level=committed.drift_level,
                                             columns=[dict(d) for d in committed.drift])
    if committed.challengers and "batchinfer_challengers" in facets:
        for entry in facets["batchinfer_challengers"]["challengers"]:
            scored, rejected = committed.challengers.get(entry["name"], (0, 0))
            entry.update(rowsScored=scored, rowsRejected=rejected)
    return _event("COMPLETE", lineage, when, facets, _inputs(lineage, committed), _outputs(committed))


def fail_event(lineage: RunLineage, when: datetime, message: str, exit_code: int,
               error: str) -> "RunEvent":
    """FAIL: the error's one line (already redacted by the caller), its class and exit code."""
    from openlineage.client.facet_v2 import error_message_run

    facets = _run_facets(lineage, exitCode=exit_code, error=error)
    facets["errorMessage"] = error_message_run.ErrorMessageRunFacet(
        message=message, programmingLanguage="python", producer=PRODUCER)
    return _event("FAIL", lineage, when, facets, _inputs(lineage))


def abort_event(lineage: RunLineage, when: datetime) -> "RunEvent":
    """ABORT: stopped by Ctrl-C (or the DAG's SIGTERM, passed on as Ctrl-C): nothing committed."""
    return _event("ABORT", lineage, when, _run_facets(lineage, exitCode=130), _inputs(lineage))


# -- the edge --------------------------------------------------------------------------------------

class Emitter:
    """Sends a run's events with the configured transport; counts what it could not send.

    ``send`` returns at once (the event goes out on a thread); ``wait`` waits up to the timeout
    for what is in flight. ``errors`` is the number of events not sent.
    """

    def __init__(self, client: Any, timeout_s: float, shown: str):
        self._client = client
        self.timeout_s = timeout_s
        self.shown = shown          # the transport, for the warning line
        self.errors = 0
        self._warned = False
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @classmethod
    def of(cls, spec: LineageSpec | None, display: Any = str) -> "Emitter | None":
        """The emitter of the job's ``lineage`` section or of the environment; None when
        neither configures one. ``display`` hides secrets in what is said (``Job.display``)."""
        if not configured(spec):
            return None
        timeout = spec.timeout_s if spec is not None else 2.0
        shown = display(f"{spec.transport} {spec.url or spec.path or ''}".strip()) if spec else "environment"
        try:
            from openlineage.client import OpenLineageClient

            client = OpenLineageClient(config=client_config(spec) if spec is not None else None)
            if client.transport.kind == "console":
                # The client prints on its logger at INFO; the CLI shows warnings only.
                logging.getLogger("openlineage.client.transport.console").setLevel(logging.INFO)
        except ImportError:   # every event is then counted as not sent
            emitter = cls(None, timeout, shown)
            emitter._warn("openlineage-python is not installed (pip install 'batchinfer[lineage]')")
            return emitter
        except Exception as exc:  # a bad transport configuration: the run goes on without events
            emitter = cls(None, timeout, shown)
            emitter._warn(f"{type(exc).__name__}: {exc}")
            return emitter
        return cls(client, timeout, shown)

    def send(self, event: "RunEvent") -> None:
        thread = threading.Thread(target=self._emit, args=(event,), daemon=True,
                                  name="batchinfer-lineage")
        self._threads.append(thread)
        thread.start()

    def wait(self) -> None:
        for thread in self._threads:
            thread.join(self.timeout_s + 1.0)
            if thread.is_alive():   # stuck past its timeout: counted, left behind (a daemon)
                self._failed(f"no answer within {self.timeout_s:g} s")
        self._threads.clear()

    def send_now(self, event: "RunEvent") -> None:
        """Send and wait (a terminal event: the process is about to end)."""
        self.send(event)
        self.wait()

    def _emit(self, event: "RunEvent") -> None:
        if self._client is None:
            self._failed(None)
            return
        try:
            self._client.emit(event)
        except Exception as exc:
            self._failed(f"{type(exc).__name__}: {exc}")

    def _failed(self, why: str | None) -> None:
        with self._lock:
            self.errors += 1
        if why is not None:
            self._warn(why)

    def _warn(self, why: str) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        from ..redaction import redact

        # One line for the run, whatever else fails after it: the run itself is not affected.
        log.warning("lineage: could not send an OpenLineage event to %s (%s); the run goes on "
                    "without it (metric lineage_errors)", self.shown, redact(" ".join(why.split()))[:300])
