"""The job spec: YAML → --set overrides → typed model → templating → a resolved Job.

Order matters and is part of the contract (contract §3):

1. the YAML file is parsed into plain data;
2. ``--set a.b=value`` overrides are applied to that data (values parsed as YAML);
3. ``job_spec_sha256`` is taken over the result (canonical JSON), before any templating, so it
   names the job, not the partition, and never covers an environment value;
4. the data is validated (unknown, missing and bad keys are errors that name the key). Types
   are strict: YAML's ``true``, ``2.0`` or ``"8192"`` is not an integer, and a key given twice
   is an error, not "the last one wins";
5. ``{ds}`` and ``${NAME}`` are substituted and relative paths resolved against the job file's
   folder. Values that came from ``${NAME}`` and are secrets (by name, or listed under
   ``secrets``) are remembered so that every string batchinfer prints, logs or writes can be
   shown with ``${NAME}`` in their place (:meth:`Job.display`, :mod:`batchinfer.redaction`);
   other values are shown as they are;
6. what no single key can say wrong is checked last: output column names that collide
   (:mod:`batchinfer.rows.columns`), an output inside the input's reach (:mod:`batchinfer.io.reach`).
"""
from __future__ import annotations

import calendar
import difflib
import hashlib
import json
import os
import re
import typing
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Sequence

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from . import backends, redaction, runners
from .errors import SpecError
from .io import formats
from .io.reach import ANY_DATE, reach_conflict
from .rows.columns import check_output_columns

DATE_FORMAT = re.compile(r"\d{4}-\d{2}-\d{2}")  # a partition date, YYYY-MM-DD (fullmatch)
ENV_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_ENV = re.compile(r"\$\{(%s)\}" % ENV_NAME)
# A date that stands for "some partition" where the spec is checked without --ds.
SAMPLE_DATE = "2000-01-01"


class _Strict(BaseModel):
    # strict: no coercion. Lax pydantic reads `rows: true` as 1 and `rows: "8192"` as 8192;
    # in a job spec those are mistakes to report, not values to guess.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, strict=True)


def _known_format(value: Any) -> Any:
    """A name in the format registry (io/formats.py), refused as pydantic refuses a Literal."""
    if isinstance(value, str) and formats.find(value) is not None:
        return value
    known = [repr(name) for name in formats.names()]
    expected = " or ".join([", ".join(known[:-1]), known[-1]] if len(known) > 1 else known)
    raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})


# How a partition is stored (contract §4): Parquet files and our manifest, or a table whose own
# commit every reader sees atomically (the manifest stays the audit record). What each format
# is, and what it takes, is its entry in io/formats.py.
TableFormat = Annotated[str, BeforeValidator(_known_format)]
PARTITION_COLUMN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
TABLE_IDENTIFIER = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)+")


class CatalogSpec(_Strict):
    """An Iceberg catalog, as pyiceberg's ``load_catalog(name, **properties)`` takes it: ``uri``
    a SQLAlchemy URL (``sqlite:///…``, ``postgresql://…``: the SQL catalog) or ``http(s)://…`` (a
    REST catalog); ``type`` (``sql``, ``rest``, ``glue``) when the URL does not say; any other
    pyiceberg property in ``properties`` (``${NAME}`` for its secrets)."""

    name: str = Field(default="batchinfer", pattern=r"^[A-Za-z0-9_.-]+$")
    uri: str | None = None
    type: Literal["sql", "rest", "glue"] | None = None
    warehouse: str | None = None
    properties: dict[str, str] = Field(default_factory=dict)


class InputSpec(_Strict):
    path: str = Field(min_length=1)
    # files: path is a file, a folder or a glob of Parquet shards. delta: path is the table's
    # root. iceberg (a catalog's tables): path is the table's identifier (namespace.table) in
    # `catalog`.
    format: TableFormat = formats.FILES.name
    # A table's rows to score: partition column → value (`{ds}` templated), equality only.
    filter: dict[str, str] = Field(default_factory=dict)
    # The table version (Delta) or snapshot id (Iceberg) to read; None: the latest, pinned by the
    # partition's manifest once committed (a rerun reads what the commit read).
    version: int | None = Field(default=None, ge=0)
    catalog: CatalogSpec | None = None

    @model_validator(mode="after")
    def _table_keys(self) -> "InputSpec":
        stored = formats.get(self.format)
        if stored.inputs is None:
            raise ValueError(f"input.format {self.format} cannot be read: the format has no input "
                             f"side (input formats: {', '.join(_input_formats())})")
        if not stored.is_table:
            given = [k for k in ("filter", "version", "catalog") if getattr(self, k)
                     not in (None, {})]
            if given:
                raise ValueError(f"input.{given[0]} is for a table input: set input.format "
                                 f"({', '.join(formats.table_inputs())}), or leave input.{given[0]} out")
        elif not stored.catalog and self.catalog is not None:
            raise ValueError(f"input.catalog is for input.format {', '.join(formats.catalog_formats())} "
                             f"({_a(stored.shown)} table is its folder: input.path)")
        elif stored.catalog:
            if self.catalog is None:
                raise ValueError(f"input.format {self.format} needs input.catalog (its uri, or type "
                                 f"and properties)")
            if not TABLE_IDENTIFIER.fullmatch(self.path):
                raise ValueError(f"input.path {self.path!r} is not {_a(stored.shown)} table "
                                 f"identifier (namespace.table)")
        for column in self.filter:
            if not PARTITION_COLUMN.fullmatch(column):
                raise ValueError(f"input.filter {column!r} is not a column name (letters, "
                                 f"digits, '_')")
        return self

    def catalog_properties(self) -> dict[str, str]:
        """``input.catalog`` as pyiceberg's ``load_catalog`` takes its properties."""
        if self.catalog is None:
            return {}
        named = {"uri": self.catalog.uri, "type": self.catalog.type,
                 "warehouse": self.catalog.warehouse}
        return {**{k: v for k, v in named.items() if v is not None}, **self.catalog.properties}


def _input_formats() -> list[str]:
    return [name for name, entry in formats.entries().items() if entry.inputs]


def _a(title: str) -> str:
    """``a Delta``, ``an Iceberg``: a format's title with its article, for messages."""
    return f"{'an' if title[:1].lower() in 'aeiou' else 'a'} {title}"


class SchemasSpec(_Strict):
    root: str = "schemas"


class ModelFields(_Strict):
    """What names a model and how it runs: the champion's keys, and each challenger's."""

    uri: str = Field(min_length=1)
    backend: str = "onnxruntime"       # a name in batchinfer.backends
    device: Literal["auto", "cpu", "cuda"] = "auto"
    version: str | None = None
    # Backend-specific settings (e.g. ONNX Runtime threads); the backend's registry entry says
    # which keys and types it takes.
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_backend_and_options(self) -> "ModelFields":
        try:
            backends.check_options(self.backend, self.options)
        except SpecError as exc:
            raise ValueError(exc.message) from None
        return self


# A challenger's name is a folder under output.path (challengers/<name>/): one safe path segment.
# fullmatch, never match with `$`: `$` also matches before a final newline ("c\n" passed).
CHALLENGER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


class ChallengerSpec(ModelFields):
    """A model scored beside the champion on the same prepared batches (contract §6 "Challengers").

    ``name`` defaults to the model file's stem (``models/credit_v4.onnx`` → ``credit_v4``; a
    registry URI ``models:/credit/4`` → ``credit-4``). ``predictions`` maps its model's outputs
    to the champion's prediction columns (``{sigmoid: probability}``), for a model whose outputs
    are named otherwise; by default its outputs are read as the champion's are."""

    name: str = ""
    predictions: dict[str, str] | None = None

    @model_validator(mode="after")
    def _safe_name(self) -> "ChallengerSpec":
        name = self.name or default_challenger_name(self.uri)
        if not CHALLENGER_NAME.fullmatch(name):
            what = f"name {self.name!r}" if self.name else f"name {name!r} (from its uri)"
            raise ValueError(f"model.challengers: {what} is not a safe folder name (letters, "
                             f"digits, '_', '.', '-'; starting with a letter or digit): set name")
        object.__setattr__(self, "name", name)  # frozen: filled in once, here
        return self


def default_challenger_name(uri: str) -> str:
    """The name a challenger gets without ``name``: its file's stem, or ``<name>-<version>`` of
    a registry URI."""
    registry = re.fullmatch(r"models:/([^/]+)/([^/]+)", uri)
    if registry:
        return f"{registry[1]}-{registry[2]}"
    last = uri.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    return last.rsplit(".", 1)[0] if "." in last.lstrip(".") else last


class ModelSpec(ModelFields):
    challengers: list[ChallengerSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_challengers(self) -> "ModelSpec":
        seen: set[str] = set()
        for challenger in self.challengers:
            if challenger.name in seen:
                raise ValueError(f"model.challengers: two challengers are named "
                                 f"{challenger.name!r}: give each a distinct name")
            seen.add(challenger.name)
        return self


class OutputSpec(_Strict):
    # files: the partition's folder (usually with {ds}). delta / iceberg: the root of the job's
    # tables, the same for every date (the partition is `<partition_column>=<ds>` inside them).
    path: str = Field(min_length=1)
    id_columns: list[str] = Field(default_factory=list)
    predictions: dict[str, str] | None = None
    format: TableFormat = formats.FILES.name
    partition_column: str = "dt"
    # A catalog's tables (iceberg): the predictions table's identifier (default
    # `batchinfer.<job name>`) and its catalog (default: a sqlite catalog in
    # `<path>/_catalog.db`, for a local path).
    table: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)+$")
    catalog: CatalogSpec | None = None

    @model_validator(mode="after")
    def _partition_column(self) -> "OutputSpec":
        if not PARTITION_COLUMN.fullmatch(self.partition_column):
            raise ValueError(f"output.partition_column {self.partition_column!r} is not a column "
                             f"name (letters, digits, '_')")
        if not formats.get(self.format).catalog and (self.table or self.catalog):
            raise ValueError(f"output.table and output.catalog are for output.format "
                             f"{', '.join(formats.catalog_formats())}")
        return self

    @property
    def is_table(self) -> bool:
        """A table format's: ``path`` is the root of the job's tables, each date a partition."""
        return formats.get(self.format).is_table

    @property
    def table_partition(self) -> str | None:
        """The partition column, which a table format's tables hold (None for files)."""
        return self.partition_column if self.is_table else None


class QuarantineSpec(_Strict):
    max_bad_fraction: float = Field(default=0.01, ge=0.0, le=1.0)
    max_bad_shards: int = Field(default=0, ge=0)

    def breach(self, rows_in: int, rows_bad: int, unreadable_shards: int) -> str | None:
        """Why a partition with these counts must not commit (exit 4), or None (contract §5.1)."""
        fraction = rows_bad / rows_in if rows_in else 0.0
        if fraction <= self.max_bad_fraction and unreadable_shards <= self.max_bad_shards:
            return None
        return (f"{rows_bad} of {rows_in} rows quarantined ({fraction:.2%}, max "
                f"{self.max_bad_fraction:.2%}) and {unreadable_shards} unreadable shards (max "
                f"{self.max_bad_shards})")


class DriftLimits(_Strict):
    """Limits on a column's drift against the baseline; a statistic left out is not checked."""

    psi: float | None = Field(default=None, ge=0.0)
    ks: float | None = Field(default=None, ge=0.0, le=1.0)

    def as_dict(self) -> dict[str, float | None]:
        return {"psi": self.psi, "ks": self.ks}


class MonitorSpec(_Strict):
    """Drift against a baseline profile (``batchinfer profile``): above ``warn`` a warning and
    an MLflow tag; above ``fail`` exit 4, nothing committed. Without ``baseline``, the one the
    model's declaration names (``stamp --baseline``): a new model version brings its own."""

    baseline: str | None = Field(default=None, min_length=1)
    warn: DriftLimits = Field(default_factory=lambda: DriftLimits(psi=0.1))
    fail: DriftLimits = Field(default_factory=lambda: DriftLimits(psi=0.25))


class BatchSpec(_Strict):
    """``rows``: rows per batch (the unit of reading, validation, scoring, files and crash
    safety). ``tokens``: size each model call by padded tokens instead, longest rows first
    within the batch, which is the bounded window rows are sorted in (handlers/tokens.py).
    ``lengths_from``: the model input that marks a row's real tokens. ``sequence_inputs``: the
    inputs cut to each call's longest row (default: told from the model's declared shapes)."""

    rows: int = Field(default=65536, gt=0, le=16_777_216)
    tokens: int | None = Field(default=None, gt=0)
    lengths_from: str = Field(default="attention_mask", min_length=1)
    sequence_inputs: list[str] | None = None


EXPLAIN_METHODS = ("integrated_gradients", "gradient_x_input", "permutation")
# What each method needs of a backend (contract §6 "Explanations"): gradients, or only calls.
GRADIENT_METHODS = ("integrated_gradients", "gradient_x_input")
# Methods whose attributions sum to f(x) - f(baseline): checked row by row (completeness).
COMPLETE_METHODS = ("integrated_gradients", "permutation")


class ExplainSpec(_Strict):
    """Per-row feature attributions computed in the run (contract §6 "Explanations").

    ``method``: ``integrated_gradients`` (Captum's, torch backend), ``gradient_x_input`` (torch
    backend) or ``permutation`` (Shapley values by sampled feature orderings, any backend: it
    only calls the model). ``output``: the model output explained (one value per row; default:
    the model's only output). ``baseline``: ``zeros`` or one value per model-input position.
    ``steps`` (integrated gradients), ``samples`` and ``seed`` (permutation): defaults 50, 8,
    0; given for another method they are an error. ``top_k``: features kept per row, largest
    |attribution| first, or ``all`` (the whole vector, in input order). ``fraction``: the share
    of rows explained, chosen by ``_input_hash``. ``tolerance`` and ``max_incomplete_fraction``:
    the completeness check and its threshold (exit 4 above it).

    Every number here is finite and in its range: YAML reads ``.nan`` and ``.inf`` as floats,
    and a NaN baseline or tolerance would not fail anything until the whole partition was
    scored (``abs(nan) > tol`` is false: every row "complete"), so they are refused with the
    spec, naming the key, before any work."""

    method: Literal["integrated_gradients", "gradient_x_input", "permutation"]
    output: str | None = Field(default=None, min_length=1)
    baseline: Literal["zeros"] | list[float] = "zeros"   # finite: _params_of_its_method
    background: str | None = Field(default=None, min_length=1)
    steps: int | None = Field(default=None, gt=0, le=10_000)
    samples: int | None = Field(default=None, gt=0, le=10_000)
    # A seed numpy takes and every reader of the declaration's JSON reads as one integer.
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    top_k: int | Literal["all"] = Field(default=5)
    fraction: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    tolerance: float = Field(default=0.01, ge=0.0, allow_inf_nan=False)
    max_incomplete_fraction: float = Field(default=0.01, ge=0.0, le=1.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _params_of_its_method(self) -> "ExplainSpec":
        if self.background is not None and self.baseline != "zeros":
            raise ValueError("explain: give baseline or background, not both (the baseline is "
                             "the background's mean model input)")
        if isinstance(self.top_k, int) and self.top_k <= 0:
            raise ValueError("explain.top_k: give a positive number of features, or all")
        if self.baseline != "zeros":
            _check_baseline(self.baseline)
        for key, method in (("steps", "integrated_gradients"), ("samples", "permutation"),
                            ("seed", "permutation")):
            if getattr(self, key) is not None and self.method != method:
                raise ValueError(f"explain.{key} is a parameter of {method}, not of "
                                 f"{self.method}: leave it out")
        if self.method == "integrated_gradients" and self.steps is None:
            object.__setattr__(self, "steps", 50)   # frozen: filled in once, here
        if self.method == "permutation":
            object.__setattr__(self, "samples", 8 if self.samples is None else self.samples)
            object.__setattr__(self, "seed", 0 if self.seed is None else self.seed)
        return self

    def declared(self) -> str:
        """What the model's declaration records (``explain``): every parameter that changes what
        is written, as canonical JSON; the thresholds are the run's, not the model's. A
        background is declared as ``"baseline": "background"``, its bytes by their sha256
        beside it (``explain_background_sha256``), not by a path that moves with the project."""
        values = self.model_dump(exclude={"tolerance", "max_incomplete_fraction", "background"},
                                 exclude_none=True)
        if self.background is not None:
            values["baseline"] = "background"
        return json.dumps(values, sort_keys=True, separators=(",", ":"))


def _check_baseline(values: list[float]) -> None:
    """``explain.baseline`` is one finite number per model-input position: a NaN or an infinite
    one makes ``f(baseline)`` and every completeness gap non-finite."""
    if not values:
        raise ValueError("explain.baseline is empty: give one number per model-input position, "
                         "or zeros")
    for i, value in enumerate(values):
        if not abs(value) < float("inf"):   # false for NaN too
            raise ValueError(f"explain.baseline[{i}] is {value}: give finite numbers, one per "
                             f"model-input position, or zeros")


class TrackingSpec(_Strict):
    uri: str = "sqlite:///mlflow.db"
    experiment: str | None = None  # default: the job's name


class LineageSpec(_Strict):
    """Where a run's OpenLineage events go (``batchinfer.io.lineage``; contract §6 "Lineage").
    ``transport``: ``http`` (``url``, ``endpoint``, ``api_key`` as ``${NAME}``), ``file`` (one
    event per line appended to ``path``, relative to the job file) or ``console`` (stderr).
    ``namespace``: the job's (default ``$OPENLINEAGE_NAMESPACE``, else ``batchinfer``).
    ``timeout_s``: the most a send may take; a send that fails never fails the run."""

    transport: Literal["http", "file", "console"]
    url: str | None = Field(default=None, min_length=1)
    endpoint: str = "api/v1/lineage"
    api_key: str | None = Field(default=None, min_length=1)
    path: str | None = Field(default=None, min_length=1)
    namespace: str | None = Field(default=None, min_length=1)
    timeout_s: float = Field(default=2.0, gt=0, le=60, allow_inf_nan=False)

    @model_validator(mode="after")
    def _keys_of_its_transport(self) -> "LineageSpec":
        needs = {"http": "url", "file": "path"}.get(self.transport)
        if needs and getattr(self, needs) is None:
            raise ValueError(f"lineage.transport {self.transport} needs lineage.{needs}")
        for key, transport in (("url", "http"), ("api_key", "http"), ("path", "file")):
            if getattr(self, key) is not None and self.transport != transport:
                raise ValueError(f"lineage.{key} is for lineage.transport {transport}: leave it out")
        return self


def _known_runner(name: Any) -> Any:
    """``name`` if a runner has it (:mod:`batchinfer.runners`); refused as pydantic refuses a
    value outside a ``Literal``, naming the known runners."""
    known = runners.names()
    if name not in known:
        quoted = [repr(n) for n in known]
        expected = " or ".join(filter(None, [", ".join(quoted[:-1]), quoted[-1]]))
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
    return name


class RunnerSpec(_Strict):
    name: Annotated[str, BeforeValidator(_known_runner)] = "direct"
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _remote_runner_has_its_address(self) -> "RunnerSpec":
        # Without these Beam starts an embedded Flink or a Docker job server, or fails once the
        # work has begun (docs/runners.md).
        missing = [k for k in runners.get(self.name).required if not self.options.get(k)]
        if missing:
            raise ValueError(f"runner {self.name} needs {', '.join(f'runner.options.{k}' for k in missing)}")
        return self


class JobSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=200)
    input: InputSpec
    schema_: str = Field(alias="schema", pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*@[0-9]+$")
    schemas: SchemasSpec = Field(default_factory=SchemasSpec)
    preprocess: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$")
    model: ModelSpec
    output: OutputSpec
    quarantine: QuarantineSpec = Field(default_factory=QuarantineSpec)
    batch: BatchSpec = Field(default_factory=BatchSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    runner: RunnerSpec = Field(default_factory=RunnerSpec)
    monitor: MonitorSpec | None = None
    explain: ExplainSpec | None = None
    lineage: LineageSpec | None = None   # None: events only where the environment configures them
    # Variables whose ${NAME} values are secrets whatever they are called (besides the names
    # redaction.SECRET_WORDS marks): never shown, logged or written.
    secrets: list[Annotated[str, Field(pattern=f"^{ENV_NAME}$")]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _explain_fits_the_job(self) -> "JobSpec":
        if self.explain is None:
            return self
        if self.batch.tokens is not None:
            raise ValueError("explain: attributions per token are not supported: leave explain "
                             "out of a job with batch.tokens")
        if self.explain.method in GRADIENT_METHODS:
            others = [m.backend for m in (self.model, *self.model.challengers) if m.backend != "torch"]
            if others:
                raise ValueError(f"explain.method {self.explain.method} needs the model's "
                                 f"gradients, which only the torch backend gives (this job has "
                                 f"{', '.join(sorted(set(others)))}): use method permutation")
        return self


@dataclass(frozen=True)
class Job:
    """A validated, templated job spec with every path resolved.

    Attributes:
        spec: the typed spec, after templating and path resolution.
        path: the job file.
        ds: the partition date, or None.
        spec_sha256: sha256 of the spec after --set, before templating.
        work_sha256: the same without its ``runner`` (and ``lineage``) section: of what the job
            scores, not of where (every runner commits the same partition, docs/runners.md), so a rerun on
            another cluster — a new scheduler address — resumes what the lost one finished
            (the attempt key, contract §5.3 "Resume").
        secrets: the secret environment values substituted for ``${NAME}``, by name (what
            :meth:`display` hides).
        templated: every environment value substituted for ``${NAME}``, by name.
    """

    spec: JobSpec
    path: Path
    ds: str | None
    spec_sha256: str
    secrets: Mapping[str, str] = field(default_factory=dict)
    templated: Mapping[str, str] = field(default_factory=dict)
    work_sha256: str = ""

    @property
    def folder(self) -> Path:
        return self.path.parent

    def display(self, text: str) -> str:
        """Return ``text`` with every secret ``${NAME}`` value put back as ``${NAME}`` and the
        credentials in its URLs hidden (:func:`batchinfer.redaction.mask`)."""
        return redaction.mask(text, self.secrets)


def load_job(path: str | os.PathLike, *, ds: str | None = None,
             overrides: Sequence[str] = (), environ: Mapping[str, str] | None = None,
             require_ds: bool = True) -> Job:
    """Load, override, validate, template and resolve a job file.

    Args:
        path: the job YAML file.
        ds: the partition date (YYYY-MM-DD) for ``{ds}``.
        overrides: ``key.path=value`` strings; values are parsed as YAML.
        environ: the environment for ``${NAME}`` (default: ``os.environ``).
        require_ds: False for commands that never read the partition (``stamp``): ``{ds}`` is
            then left as is when no date is given.

    Raises:
        SpecError: anything wrong with the file, an override, ``ds`` or the environment.
    """
    job_path = Path(path).resolve()
    data = read_mapping(job_path, "a job spec")
    for item in overrides:
        apply_override(data, item)
    spec_sha256 = hashlib.sha256(canonical_json(data).encode()).hexdigest()
    # Nor where its lineage events go: a new receiver does not make another partition.
    work = {k: v for k, v in data.items() if k not in ("runner", "lineage")}
    work_sha256 = hashlib.sha256(canonical_json(work).encode()).hexdigest()
    # validate before templating: errors name keys, not values
    listed = parse_spec(data, source=job_path.name).secrets
    if ds is not None:
        check_date(ds, "--ds")
    env = os.environ if environ is None else environ
    values: dict[str, str] = {}
    templated = _template(data, ds=ds, env=env, secrets=values, where="", require_ds=require_ds)
    secrets = {name: value for name, value in values.items() if redaction.is_secret_name(name, listed)}
    redaction.register(secrets)  # before anything can quote a value (errors below included)
    spec = parse_spec(templated, source=job_path.name)
    spec = _resolve_paths(spec, job_path.parent)
    _check_paths(data, spec, job_path.parent, ds, env)
    return Job(spec=spec, path=job_path, ds=ds, spec_sha256=spec_sha256, secrets=secrets,
               templated=values, work_sha256=work_sha256)


def read_mapping(path: Path, what: str, *, allow_empty: bool = False) -> dict:
    """The YAML mapping in ``path``, read as strictly as a job spec (``what`` says what the file
    holds, for the error): safe YAML only (a tag such as ``!!python/object`` is an error), a key
    given twice is an error, and so is a value YAML cannot construct (``2026-02-30``). With
    ``allow_empty``, a file of comments only is an empty mapping.

    Raises:
        SpecError: naming the file (and the line where YAML knows it).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where else ""
        raise SpecError(f"{path.name}: not valid YAML{at}: {getattr(exc, 'problem', exc)}") from None
    except ValueError as exc:  # a constructor's own check: !!int abc
        raise SpecError(f"{path.name}: not valid YAML: {exc}") from None
    if data is None and allow_empty:
        return {}
    if not isinstance(data, dict):
        raise SpecError(f"{path.name}: {what} must be a YAML mapping of keys")
    return data


def check_date(value: str, what: str) -> date:
    """``value`` as a date; SpecError unless it is a real calendar date written YYYY-MM-DD."""
    if not DATE_FORMAT.fullmatch(value):
        raise SpecError(f"{what} {value!r} is not a date: use YYYY-MM-DD (e.g. 2026-01-31)")
    year, month, day = (int(part) for part in value.split("-"))
    if not 1 <= month <= 12:
        raise SpecError(f"{what} {value!r} is not a date: there is no month {month} (01-12)")
    days = calendar.monthrange(year, month)[1]
    if not 1 <= day <= days:
        raise SpecError(f"{what} {value!r} is not a date: {value} is not a day of "
                        f"{calendar.month_name[month]} {year} (it has {days} days)")
    return date(year, month, day)


def _check_paths(data: dict, spec: "JobSpec", folder: Path, ds: str | None,
                 env: Mapping[str, str]) -> None:
    """The rules about input and output paths that concern every date, not just this one."""
    raw_input, raw_output = data["input"]["path"], data["output"]["path"]
    if spec.output.is_table and "{ds}" in raw_output:
        raise SpecError(f"output.path of output.format {spec.output.format} is the root of the "
                        f"job's tables, the same for every date: leave {{ds}} out (each date is "
                        f"the partition {spec.output.partition_column}=<ds> in them)")
    if any(ch in spec.output.path for ch in "*?["):
        raise SpecError(f"output.path {redaction.redact(spec.output.path)!r} contains a glob "
                        f"character (* ? [): an output is one folder")
    # Compare the input as it reads *any* date with the output of one date: a run must not be
    # able to read its own (or another date's) predictions as shards, nor write into its input.
    if formats.get(spec.input.format).catalog:   # an identifier: the catalog says where its files are
        return
    secrets: dict[str, str] = {}
    any_input = resolve_path(_template(raw_input, ds=ANY_DATE, env=env, secrets=secrets,
                                       where="input.path"), folder)
    one_output = spec.output.path if ds is not None or "{ds}" not in raw_output else resolve_path(
        _template(raw_output, ds=SAMPLE_DATE, env=env, secrets=secrets, where="output.path"),
        folder)
    conflict = reach_conflict(any_input, one_output)
    if conflict:
        raise SpecError(f"output.path {redaction.redact(spec.output.path)} {conflict}: write "
                        f"outputs outside the input's folders")


def parse_spec(data: Any, *, source: str = "job spec") -> JobSpec:
    """Validate plain data as a :class:`JobSpec`; raise one-line :class:`SpecError` otherwise."""
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"{source}: {_describe(exc)}") from None
    try:
        check_output_columns(spec.output.id_columns, spec.output.predictions or {},
                             partition=spec.output.table_partition)
    except SpecError as exc:
        raise SpecError(f"{source}: {exc.message}") from None
    return spec


def apply_override(data: dict, item: str) -> None:
    """Apply one ``a.b.c=value`` override to ``data`` in place (value parsed as YAML)."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise SpecError(f"--set {item!r}: use --set key.path=value, e.g. --set batch.rows=8192")
    try:
        value = yaml.load(raw, Loader=_UniqueKeyLoader) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise SpecError(f"--set {key}: value {raw!r} is not valid YAML: "
                        f"{getattr(exc, 'problem', None) or exc}") from None
    node = data
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise SpecError(f"--set {key}: {'.'.join(parts[:depth + 1])} is not a mapping")
        node = child
    node[parts[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error (PyYAML
    keeps the last one silently: `batch: {rows: 100}` and, further down, `batch: {rows: 5}`)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_timestamp(self, node):
        try:
            return super().construct_yaml_timestamp(node)
        except ValueError as exc:  # an unquoted 2026-02-30 has YAML's form of a date, not a date
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value!r} is not a date ({exc})", node.start_mark) from None


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:timestamp", _UniqueKeyLoader.construct_yaml_timestamp)


def canonical_json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _template(value: Any, *, ds: str | None, env: Mapping[str, str], secrets: dict, where: str,
              require_ds: bool = True) -> Any:
    if isinstance(value, dict):
        return {k: _template(v, ds=ds, env=env, secrets=secrets, where=f"{where}{k}.",
                             require_ds=require_ds) for k, v in value.items()}
    if isinstance(value, list):
        return [_template(v, ds=ds, env=env, secrets=secrets, where=where, require_ds=require_ds)
                for v in value]
    if not isinstance(value, str):
        return value
    key = where.rstrip(".") or "value"
    if "{ds}" in value and (ds is not None or require_ds):
        if ds is None:
            raise SpecError(f"{key} uses {{ds}}: pass --ds YYYY-MM-DD")
        value = value.replace("{ds}", ds)

    def substitute(match: re.Match) -> str:
        name = match.group(1)
        if name not in env:
            raise SpecError(f"{key} uses ${{{name}}}, which is not set in the environment")
        secrets[name] = env[name]
        return env[name]

    return _ENV.sub(substitute, value)


def has_scheme(uri: str) -> bool:
    """True for ``s3://…``, ``models:/…``, ``sqlite:///…``; False for plain paths."""
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", uri)) and not re.match(r"^[A-Za-z]:[\\/]", uri)


def resolve_path(value: str, folder: Path) -> str:
    """Resolve a plain relative path against ``folder``; leave URLs and absolute paths alone."""
    if has_scheme(value) or os.path.isabs(value):
        return value
    return str((folder / value).resolve())


def _resolve_tracking_uri(uri: str, folder: Path) -> str:
    # sqlite:///rel.db is relative to the working directory in SQLAlchemy; we make it relative
    # to the job file like every other path, so the store does not depend on where you stand.
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str((folder / uri[len("sqlite:///"):]).resolve())
    if uri.startswith("file:") and not uri.startswith(("file:/", "file:~")):   # file:mlruns
        return "file://" + str((folder / uri[len("file:"):]).resolve())
    if not has_scheme(uri):
        return resolve_path(uri, folder)
    return uri


def _resolve_paths(spec: JobSpec, folder: Path) -> JobSpec:
    monitor = spec.monitor and spec.monitor.model_copy(
        update={"baseline": spec.monitor.baseline and resolve_path(spec.monitor.baseline, folder)})
    explain = spec.explain and spec.explain.model_copy(
        update={"background": spec.explain.background and resolve_path(spec.explain.background, folder)})
    lineage = spec.lineage and spec.lineage.model_copy(
        update={"path": spec.lineage.path and resolve_path(spec.lineage.path, folder)})
    return spec.model_copy(update={
        "lineage": lineage,
        "monitor": monitor,
        "explain": explain,
        "input": _resolve_input(spec.input, folder),
        "schemas": spec.schemas.model_copy(update={"root": resolve_path(spec.schemas.root, folder)}),
        "model": spec.model.model_copy(update={
            "uri": resolve_path(spec.model.uri, folder),
            "challengers": [c.model_copy(update={"uri": resolve_path(c.uri, folder)})
                            for c in spec.model.challengers]}),
        "output": spec.output.model_copy(update={"path": resolve_path(spec.output.path, folder)}),
        "tracking": spec.tracking.model_copy(update={
            "uri": _resolve_tracking_uri(spec.tracking.uri, folder),
            "experiment": spec.tracking.experiment or spec.name}),
    })


def _resolve_input(spec: InputSpec, folder: Path) -> InputSpec:
    """A catalog's table (Iceberg's) is named by an identifier, not a path; its catalog's sqlite
    file and local warehouse are relative to the job file like every other path."""
    if not formats.get(spec.format).catalog:
        return spec.model_copy(update={"path": resolve_path(spec.path, folder)})
    catalog = spec.catalog
    assert catalog is not None   # the spec's check
    return spec.model_copy(update={"catalog": catalog.model_copy(update={
        "uri": catalog.uri and _resolve_tracking_uri(catalog.uri, folder),
        "warehouse": catalog.warehouse and resolve_path(catalog.warehouse, folder)})})


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join("schema" if p == "schema_" else str(p) for p in err["loc"])
        kind = err["type"]
        if kind == "extra_forbidden":
            parts.append(f"unknown key '{loc}'{_did_you_mean(err['loc'])}")
        elif kind == "missing":
            parts.append(f"missing required key '{loc}'")
        elif kind == "value_error":  # our own validators: the message says it all
            parts.append(err["msg"].removeprefix("Value error, "))
        else:
            got = err.get("input")
            shown = "" if isinstance(got, (dict, list)) else f" (got {str(got)[:80]!r})"
            parts.append(f"{loc}: {err['msg']}{shown}")
    return "; ".join(parts)


def _did_you_mean(loc: tuple) -> str:
    """`` (did you mean 'max_bad_fraction'?)`` for an unknown key at ``loc``, from the keys of
    the mapping it is in (its model's fields); the mapping's keys when none is close."""
    keys = _keys_at(JobSpec, loc[:-1])
    if not keys:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f" (known keys{' of ' + '.'.join(map(str, loc[:-1])) if loc[:-1] else ''}: {', '.join(keys)})"


def _keys_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys (aliases where a field has one) of the model that ``loc`` leads to from
    ``model``; list indexes in ``loc`` stand for the list's items. Empty when ``loc`` leads to
    something other than a model (a plain mapping such as ``runner.options``)."""
    for part in loc:
        if isinstance(part, int):
            continue
        fields = {f.alias or name: f for name, f in model.model_fields.items()}
        field = fields.get(str(part))
        inner = _model_in(field.annotation) if field is not None else None
        if inner is None:
            return []
        model = inner
    return [f.alias or name for name, f in model.model_fields.items()]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model an annotation holds: ``MonitorSpec | None`` and ``list[ChallengerSpec]`` too."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
