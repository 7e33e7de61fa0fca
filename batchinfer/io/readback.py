"""Schemas of the files batchinfer reads back, checked at the edge, where they are read.

Every JSON file that batchinfer reads again — a manifest, the scratch records of a run, a
profile, ``_metrics.json`` — is validated here (strict pydantic models, as the job spec is)
before any typed record (:mod:`batchinfer.io.records`, :mod:`batchinfer.rows.profile`) is made
of it, so that a malformed or hand-edited file is one line, ``<file>: <field>: <what is
wrong>``, with the exit code of whoever can fix it, never a ``KeyError`` deep inside a command:

=========================  ==================  ===============================================
file                       error (exit code)   why
=========================  ==================  ===============================================
``_manifest.json``         ContractError (3)   the committed partition is not one batchinfer can
                                               vouch for (edited or damaged): like a partition
                                               of another triple, it takes ``--overwrite``; not
                                               5, which a scheduler retries to no end
``_tmp/<attempt>/…``       StorageError (5)    scratch that only a run writes: bad bytes there
                                               are the store's fault, and a rerun (a new
                                               attempt) does not read them
a profile (a baseline,     SpecError (2)       the user's file (named by the job, by ``stamp
``_profile.json``)                             --baseline``, or hand-edited)
``_metrics.json``          SpecError (2)       the user's to upload (``batchinfer track``)
=========================  ==================  ===============================================

Unknown keys are ignored (a newer batchinfer may add some); missing keys that older files lack
get the defaults that :mod:`batchinfer.io.records` gives them. Pure: bytes in, models out.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import BatchInferError

Count = Annotated[int, Field(ge=0)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Duration = NonNegative   # seconds or milliseconds
Name = Annotated[str, Field(min_length=1)]


class _Checked(BaseModel):
    # strict: a count is an integer (not 3.0, not true, not "3"); floats are finite unless a
    # field says otherwise. Unknown keys are ignored: the file may come from a newer batchinfer.
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


# -- the manifest (contract §4) and the scratch records of a run ---------------------------------

class FileModel(_Checked):
    path: Name
    rows: Count
    sha256: Name

    @field_validator("path")
    @classmethod
    def _inside_the_output(cls, path: str) -> str:
        # Readers open output.path/<path>: a path that leaves the output is not a partition's.
        parts = path.replace("\\", "/").split("/")
        if path.startswith(("/", "\\")) or ":" in parts[0] or ".." in parts or "" in parts:
            raise ValueError(f"{path!r} is not a path inside the output folder")
        return path


class ShardModel(_Checked):
    path: Name
    sha256: Name | None = None
    rows_in: Count | None = None
    rows_scored: Count
    rows_quarantined: Count
    status: Literal["scored", "empty", "quarantined", "unreadable"]
    reason: str | None = None
    files: list[FileModel] = Field(default_factory=list)
    scored_by: Name | None = None

    @model_validator(mode="after")
    def _accounted(self) -> "ShardModel":
        if self.rows_in is not None and self.rows_in != self.rows_scored + self.rows_quarantined:
            raise ValueError(f"rows_in {self.rows_in} is not rows_scored {self.rows_scored} + "
                             f"rows_quarantined {self.rows_quarantined}")
        return self


class TotalsModel(_Checked):
    shards: Count
    rows_in: Count
    rows_scored: Count
    rows_quarantined: Count
    shards_unreadable: Count


class ChallengerShardModel(_Checked):
    path: Name
    rows_scored: Count
    rows_rejected: Count
    reason: str | None = None
    compute_ms: Duration = 0.0
    files: list[FileModel] = Field(default_factory=list)


class ChallengerModel(_Checked):
    name: Name
    triple: dict[str, str]
    backend: str = ""
    device: str = ""
    model_options: dict[str, str] = Field(default_factory=dict)
    shards: list[ChallengerShardModel] = Field(default_factory=list)


class TableVersionModel(_Checked):
    kind: str
    table: str
    version: int


class TableCommitModel(_Checked):
    format: Literal["delta", "iceberg"]
    partition: dict[str, str]
    generation: Count
    tables: list[TableVersionModel] = Field(default_factory=list)


class InputTableModel(_Checked):
    format: Literal["delta", "iceberg"]
    table: Name
    version: Annotated[int, Field(ge=0)]
    filter: dict[str, str] = Field(default_factory=dict)


class PluginModel(_Checked):
    kind: Literal["backend", "runner"]
    name: Name
    distribution: str | None
    version: str | None


class ManifestModel(_Checked):
    manifest_version: Literal[1] = 1
    job: Name
    ds: str | None
    attempt: Name
    triple: dict[str, str]
    job_spec_sha256: str = ""
    runner: str = ""
    device: str = ""
    backend: str = ""
    model_options: dict[str, str] = Field(default_factory=dict)
    started_at: str = ""
    finished_at: str = ""
    mlflow_run_id: str | None = None
    totals: TotalsModel | None = None
    shards: list[ShardModel]
    challengers: list[ChallengerModel] = Field(default_factory=list)
    table: TableCommitModel | None = None
    input_table: InputTableModel | None = None
    plugins: list[PluginModel] = Field(default_factory=list)


class AttemptKeyModel(_Checked):
    job: Name
    ds: str | None
    job_spec_sha256: str
    triple: dict[str, str]
    model_options: dict[str, str] = Field(default_factory=dict)
    challengers: list[ChallengerModel] = Field(default_factory=list)


class ModelStatsModel(_Checked):
    rows: Count = 0
    raised: Count = 0
    error: str | None = None
    oom_backoffs: Count = 0
    chunk_rows: Count = 0
    warmup_ms: Finite = 0.0
    tokens: Count = 0
    padded_tokens: Count = 0
    explained: Count = 0
    incomplete: Count = 0
    abs_attribution: dict[str, NonNegative] = Field(default_factory=dict)
    max_gap: NonNegative = 0.0


class ColumnStatsModel(_Checked):
    """``rows.profile.ColumnStats.to_dict``: a column's mergeable statistics."""

    count: Count
    nulls: Count
    mean: Finite
    m2: NonNegative
    min: Finite | None = None
    max: Finite | None = None
    counts: list[Count] = Field(default_factory=list)
    at_cuts: list[Count] = Field(default_factory=list)
    at_min: Count = 0

    @model_validator(mode="after")
    def _consistent(self) -> "ColumnStatsModel":
        _check_range(self.count, self.min, self.max)
        if self.counts and sum(self.counts) != self.count:
            raise ValueError(f"counts sum to {sum(self.counts)}, not to count {self.count}")
        if self.at_cuts and len(self.at_cuts) + 1 != len(self.counts):
            raise ValueError(f"{len(self.at_cuts)} at_cuts for {len(self.counts)} bins (one per cut)")
        return self


class PreprocessStatsModel(_Checked):
    """``io.records.PreprocessStats``: what the preprocessing did with a shard's valid rows."""

    rows: Count = 0
    raised: dict[str, Count] = Field(default_factory=dict)
    first: dict[str, str] = Field(default_factory=dict)
    trace: str | None = None


class ShardResultModel(_Checked):
    record: ShardModel
    seconds: dict[str, Finite] = Field(default_factory=dict)
    model: ModelStatsModel = Field(default_factory=ModelStatsModel)
    profile: dict[str, ColumnStatsModel] = Field(default_factory=dict)
    quarantine: list[tuple[str | None, str, Count]] = Field(default_factory=list)
    batches: list[tuple[Count, Finite]] = Field(default_factory=list)
    challengers: dict[str, ChallengerShardModel] = Field(default_factory=dict)
    preprocess: PreprocessStatsModel = Field(default_factory=PreprocessStatsModel)


class OutcomeModel(_Checked):
    status: Literal["committed", "lost_race", "conflict", "refused"]
    manifest: ManifestModel | None = None
    code: Count = 0
    message: str | None = None
    results: list[ShardResultModel] = Field(default_factory=list)
    seconds: NonNegative = 0.0


# -- profiles (contract §6 "Drift") ----------------------------------------------------------------

def _check_range(count: int, low: float | None, high: float | None) -> None:
    if count and (low is None or high is None):
        raise ValueError(f"count is {count} but min or max is missing")
    if low is not None and high is not None and low > high:
        raise ValueError(f"min {low} is above max {high}")


class ColumnProfileModel(_Checked):
    """``rows.profile.ColumnProfile.to_dict``: a column of a baseline or of a run's profile.

    The histogram must fit its cuts: cuts finite and strictly increasing, one count per bin
    (``len(cuts) + 1``), counts summing to ``count`` (the finite values; ``nulls`` are kept out
    of the histogram). A column with no cuts has no counts: moments only."""

    kind: Literal["feature", "prediction"] = "feature"
    count: Count
    nulls: Count
    mean: Finite | None = None
    std: NonNegative | None = None
    min: Finite | None = None
    max: Finite | None = None
    m2: NonNegative | None = None
    quantiles: dict[str, Finite | None] = Field(default_factory=dict)
    cuts: list[Finite] = Field(default_factory=list)
    counts: list[Count] = Field(default_factory=list)
    at_cuts: list[Count] = Field(default_factory=list)
    at_min: Count = 0

    @model_validator(mode="after")
    def _histogram_fits_its_cuts(self) -> "ColumnProfileModel":
        _check_range(self.count, self.min, self.max)
        if any(b <= a for a, b in zip(self.cuts, self.cuts[1:])):
            raise ValueError("cuts are not strictly increasing")
        if len(self.counts) != (len(self.cuts) + 1 if self.cuts else 0):
            raise ValueError(f"{len(self.counts)} counts for {len(self.cuts)} cuts (a histogram "
                             f"has len(cuts) + 1 bins; no cuts, no counts)")
        if self.cuts and sum(self.counts) != self.count:
            raise ValueError(f"counts sum to {sum(self.counts)}, not to count {self.count} (the "
                             f"finite values)")
        if self.at_cuts and len(self.at_cuts) != len(self.cuts):
            raise ValueError(f"{len(self.at_cuts)} at_cuts for {len(self.cuts)} cuts")
        return self


class ProfileModel(_Checked):
    """A profile as ``batchinfer profile`` writes it (a baseline); other keys are its about."""

    profile_version: Literal[1]
    columns: dict[str, ColumnProfileModel]


class DriftModel(_Checked):
    column: str
    kind: Literal["feature", "prediction"]
    psi: Finite | None    # None: not computed (a column with no scored values)
    ks: Finite | None
    level: Literal["ok", "warn", "fail"]
    breached: list[str] = Field(default_factory=list)


class LimitsModel(_Checked):
    warn: dict[str, Finite | None] = Field(default_factory=dict)
    fail: dict[str, Finite | None] = Field(default_factory=dict)


class BaselineAboutModel(_Checked):
    path: str = ""
    ds: str | None = None
    columns: dict[str, ColumnProfileModel] = Field(default_factory=dict)


class RunProfileModel(_Checked):
    """A run's ``_profile.json`` (``commands.record.profile_record``)."""

    profile_version: Literal[1]
    job: str = ""
    ds: str | None = None
    quarantine: list[tuple[str | None, str, Count]] = Field(default_factory=list)
    level: Literal["none", "ok", "warn", "fail"] = "none"
    baseline: BaselineAboutModel | None = None
    limits: LimitsModel = Field(default_factory=LimitsModel)
    drift: list[DriftModel] = Field(default_factory=list)
    columns: dict[str, ColumnProfileModel] = Field(default_factory=dict)


# -- _metrics.json (contract §6 "Tracking record") --------------------------------------------------

Scalar = str | int | float | bool | None


class MetricsRecordModel(_Checked):
    mlflow_run_id: str | None = None
    uploaded: bool = False
    error: str | None = None
    tracking_uri: Name
    experiment: Name
    run_name: str | None = None
    params: dict[str, Scalar] = Field(default_factory=dict)
    # A metric may be NaN or infinite: MLflow takes them, and a run may have logged one.
    metrics: dict[str, Annotated[float, Field(allow_inf_nan=True)]] = Field(default_factory=dict)
    tags: dict[str, str] = Field(default_factory=dict)


M = TypeVar("M", bound=BaseModel)


def check(schema: type[M], data: bytes | str, shown: str, error: type[BatchInferError],
          hint: str = "") -> M:
    """``data`` (a file's bytes) validated as ``schema``.

    Args:
        shown: the file, as the message names it.
        error: the exception to raise (its exit code is the file kind's, see the module).
        hint: what to do, appended to the message after ": ".

    Raises:
        BatchInferError: of type ``error``: ``<shown>: <field>: <what is wrong>[: <hint>]``.
    """
    try:
        return schema.model_validate_json(data)
    except ValidationError as exc:
        raise error(f"{shown}: {describe(exc)}" + (f": {hint}" if hint else "")) from None


def describe(exc: ValidationError) -> str:
    """The first thing wrong, as ``field: what`` (``field`` dotted, list items by index)."""
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in err["loc"])
    kind, message = err["type"], err["msg"]
    if kind == "json_invalid":
        return f"not valid JSON ({message.removeprefix('Invalid JSON: ')})"
    if kind == "missing":
        message = "missing"
    elif kind == "value_error":  # our own checks: the message says it all
        message = message.removeprefix("Value error, ")
    else:
        got = err.get("input")
        if not isinstance(got, (dict, list)):
            message += f" (got {_shown(got)})"
    return f"{where}: {message}" if where else message


def _shown(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return repr(value)[:60]
