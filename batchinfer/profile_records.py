"""The profile records on disk (contract §6 "Drift"), each declared once: a column's mergeable
statistics as a shard's result carries them, a column of a profile, a column's drift, a baseline
profile (``batchinfer profile``) and a run's ``_profile.json``.

:mod:`batchinfer.rows.column_profiles` writes them (its ``to_dict``\\s are these records'),
:mod:`batchinfer.io.records` validates a shard result's column statistics by
:class:`ColumnStatsRecord`, and the readers of a profile check it against :class:`Profile` or
:class:`RunProfile` with :func:`batchinfer.io.readback.check`. In the core because rows/ (the
writer) and io/ (a shard result) both need them. Pure: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import model_validator

from .codec import Count, Finite, NonNegative, Record, check_range

PROFILE_VERSION: Literal[1] = 1
Kind = Literal["feature", "prediction"]


@dataclass(frozen=True, kw_only=True)
class ColumnStatsRecord(Record):
    """A column's mergeable statistics as a shard's result carries them
    (``rows.column_profiles.ColumnStats.to_dict``): min and max None when it has no values."""

    count: Count
    nulls: Count
    mean: Finite
    m2: NonNegative
    min: Finite | None = None
    max: Finite | None = None
    counts: list[Count] = field(default_factory=list)
    at_cuts: list[Count] = field(default_factory=list)
    at_min: Count = 0

    @model_validator(mode="after")
    def _consistent(self) -> "ColumnStatsRecord":
        check_range(self.count, self.min, self.max)
        if self.counts and sum(self.counts) != self.count:
            raise ValueError(f"counts sum to {sum(self.counts)}, not to count {self.count}")
        if self.at_cuts and len(self.at_cuts) + 1 != len(self.counts):
            raise ValueError(f"{len(self.at_cuts)} at_cuts for {len(self.counts)} bins (one per cut)")
        return self


@dataclass(frozen=True, kw_only=True)
class ColumnProfileRecord(Record):
    """A column of a baseline or of a run's profile (``rows.column_profiles.ColumnProfile.to_dict``).

    The histogram must fit its cuts: cuts finite and strictly increasing, one count per bin
    (``len(cuts) + 1``), counts summing to ``count`` (the finite values; ``nulls`` are kept out
    of the histogram). A column with no cuts has no counts: moments only. The statistics are
    None for a column without values (and ``m2`` in a profile written before it was kept)."""

    kind: Kind = "feature"
    count: Count
    nulls: Count
    mean: Finite | None = None
    std: NonNegative | None = None
    min: Finite | None = None
    max: Finite | None = None
    quantiles: dict[str, Finite | None] = field(default_factory=dict)
    cuts: list[Finite] = field(default_factory=list)
    counts: list[Count] = field(default_factory=list)
    m2: NonNegative | None = None
    at_cuts: list[Count] = field(default_factory=list)
    at_min: Count = 0

    @model_validator(mode="after")
    def _histogram_fits_its_cuts(self) -> "ColumnProfileRecord":
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


@dataclass(frozen=True, kw_only=True)
class Profile(Record):
    """A baseline profile as ``batchinfer profile`` writes it: what it was made from (its
    *about*: the job, date, partition, attempt, triple and rows) and its columns. A hand-made
    profile needs only ``profile_version`` and ``columns``."""

    profile_version: Literal[1]
    job: str = ""
    ds: str | None = None
    output: str = ""
    attempt: str = ""
    triple: dict[str, str] = field(default_factory=dict)
    rows: Count = 0
    columns: dict[str, ColumnProfileRecord]


@dataclass(frozen=True, kw_only=True)
class DriftRecord(Record):
    """A column's drift (``rows.column_profiles.ColumnDrift.to_dict``)."""

    column: str
    kind: Kind
    psi: Finite | None    # None: not computed (a column with no scored values)
    ks: Finite | None
    level: Literal["ok", "warn", "fail"]
    breached: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class LimitsRecord(Record):
    """The ``monitor`` limits a run's drift was judged by (statistic → limit; None: no limit)."""

    warn: dict[str, Finite | None] = field(default_factory=dict)
    fail: dict[str, Finite | None] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class BaselineAbout(Record):
    """The baseline a run was compared with, in its ``_profile.json``: its path as shown, what
    the baseline file says about itself (every key of it but ``columns``, as it has them:
    written beside ``path``, not read back) and its columns."""

    path: str = ""
    about: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, ColumnProfileRecord] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        return {"path": data["path"], **data["about"], "columns": data["columns"]}


@dataclass(frozen=True, kw_only=True)
class RunProfile(Record):
    """A run's ``_profile.json`` (and a stopped run's ``_drift/<attempt>.json``):
    ``app.run_record.profile_record``."""

    profile_version: Literal[1]
    job: str = ""
    ds: str | None = None
    quarantine: list[tuple[str | None, str, Count]] = field(default_factory=list)
    level: Literal["none", "ok", "warn", "fail"] = "none"
    baseline: BaselineAbout | None = None
    limits: LimitsRecord = LimitsRecord()
    drift: list[DriftRecord] = field(default_factory=list)
    columns: dict[str, ColumnProfileRecord] = field(default_factory=dict)
