"""The files batchinfer reads back, checked at the edge, where they are read.

Every JSON file that batchinfer reads again — a manifest, the scratch records of a run, a
profile, ``_metrics.json`` — is validated by :func:`check` (strict pydantic validation, as the
job spec is) before any command uses it: a record of a partition (:mod:`batchinfer.io.records`)
against its one declaration there (pydantic validates the dataclass itself); a profile or a
metrics record, which rows/ and commands/ write as plain data, against the schemas below. So
that a malformed or hand-edited file is one line, ``<file>: <field>: <what is
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
get the defaults that :mod:`batchinfer.io.records` gives them. Pure: bytes in, records out.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import BatchInferError, Remedy
from .codec import CHECKED, Count, Finite, Name, NonNegative, adapter, check_range

T = TypeVar("T")


class _Checked(BaseModel):
    # As the records (io/codec.py CHECKED): strict, finite floats, unknown keys ignored.
    model_config = ConfigDict(**CHECKED, frozen=True)


# -- profiles (contract §6 "Drift") ----------------------------------------------------------------

class ColumnProfileModel(_Checked):
    """``rows.column_profiles.ColumnProfile.to_dict``: a column of a baseline or of a run's profile.

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
        check_range(self.count, self.min, self.max)
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


def check(kind: type[T], data: bytes | str, shown: str, error: type[BatchInferError],
          hint: str = "", remedies: Sequence[Remedy] = ()) -> T:
    """``data`` (a file's bytes) validated as ``kind``: a record (io/records.py, declared once
    there) or one of the schemas above.

    Args:
        shown: the file, as the message names it.
        error: the exception to raise (its exit code is the file kind's, see the module).
        hint: what the file is not, appended to the message after ": ".
        remedies: what to do about it (the error's ``remedies``).

    Raises:
        BatchInferError: of type ``error``: ``<shown>: <field>: <what is wrong>[: <hint>]``, its
            ``path`` ``shown`` and its ``field`` the first wrong one (dotted; None for bytes
            that are no JSON).
    """
    try:
        return adapter(kind).validate_json(data)
    except ValidationError as exc:
        loc = exc.errors(include_url=False)[0]["loc"]
        field = ".".join(str(part) for part in loc) or None
        raise error(f"{shown}: {describe(exc)}" + (f": {hint}" if hint else ""), path=shown,
                    field=field, remedies=remedies) from None


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
