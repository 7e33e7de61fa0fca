"""What the pipeline's stages say about a shard, and folding it into the shard's result (pure).

``ReadShard`` sends one :class:`ShardInfo` per shard on its last batch, the champion's writer
makes one :class:`BatchRecord` per batch, each challenger's writer one
:class:`ChallengerBatchRecord` per batch. Each writer keeps its records of a shard until it has
written the shard's last batch, then folds them — :func:`fold_shard` into the
:class:`~batchinfer.io.records.ShardResult`, :func:`fold_challenger` into a challenger's
:class:`~batchinfer.io.records.ChallengerShard` — and writes the result to scratch at once
(pipeline/transforms.py); the commit joins them (``ShardResult.joined``). Records never leave
the worker that made them; the wide ones are keyword-only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

from ..io.records import ChallengerShard, FileRecord, ModelStats, PreprocessStats, ShardRecord, ShardResult, ShardStatus
from ..rows.column_profiles import ColumnStats, merge_columns


@dataclass(frozen=True)
class ShardInfo:
    """A shard as read: its digest, its footer's row count, or why it could not be read."""

    sha256: str | None
    rows_in: int | None
    unreadable: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class BatchRecord:
    """One batch as written: rows in, scored and quarantined, and the files that hold them."""

    batch: int
    rows_in: int
    rows_scored: int
    rows_quarantined: int
    files: tuple[FileRecord, ...] = ()
    first_reason: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    model: ModelStats = ModelStats()
    profile: dict[str, ColumnStats] = field(default_factory=dict)   # scored rows' columns
    quarantine: dict[tuple[str | None, str], int] = field(default_factory=dict)  # (column, check)
    compute_ms: float | None = None   # model time; None when no row reached the model
    preprocess: PreprocessStats = PreprocessStats()
    last: bool = False                # its shard's last batch (live progress counts the shard)


@dataclass(frozen=True, kw_only=True)
class ChallengerBatchRecord:
    """One batch as a challenger scored it: the prepared rows it was given, those it scored (in
    ``files``) and those it rejected (raised on, or non-finite output)."""

    name: str
    batch: int
    rows_in: int
    rows_scored: int
    rows_rejected: int
    files: tuple[FileRecord, ...] = ()
    first_reason: str | None = None
    compute_ms: float = 0.0


Record = Union[ShardInfo, BatchRecord, ChallengerBatchRecord]


def fold_shard(name: str, records: Sequence[Record], challengers: Sequence[str] = ()) -> ShardResult:
    """One shard's result from its info record(s), batch records and, for each challenger named
    in ``challengers``, its batch records.

    Raises:
        RuntimeError: the batches do not account for every row, or a challenger was not given
            every batch the champion was (a bug, never bad data).
    """
    infos = [r for r in records if isinstance(r, ShardInfo)]
    batches = sorted((r for r in records if isinstance(r, BatchRecord)), key=lambda r: r.batch)
    sha256 = next((i.sha256 for i in infos if i.sha256), None)
    unreadable = next((i.unreadable for i in infos if i.unreadable), None)
    if unreadable:
        # Batches already sent on are dropped: the shard counts as unreadable, and its files are
        # not listed (the cleanup after the commit removes them).
        return ShardResult(record=ShardRecord(path=name, sha256=sha256, rows_in=None, rows_scored=0,
                                              rows_quarantined=0, status="unreadable",
                                              reason=unreadable))
    if not infos:
        raise RuntimeError(f"shard {name} has batch records but no shard record")
    rows_in = infos[0].rows_in or 0
    scored = sum(b.rows_scored for b in batches)
    quarantined = sum(b.rows_quarantined for b in batches)
    seen = sum(b.rows_in for b in batches)
    if seen != rows_in or scored + quarantined != rows_in:
        raise RuntimeError(f"accounting failed for shard {name}: {rows_in} rows in the footer, "
                           f"{seen} read, {scored} scored + {quarantined} quarantined")
    status: ShardStatus
    reason: str | None = None
    if rows_in == 0:
        status = "empty"
    elif scored == 0:
        status = "quarantined"
        reason = next((b.first_reason for b in batches if b.first_reason), None)
    else:
        status = "scored"
    seconds: dict[str, float] = {}
    parts: list[ShardInfo | BatchRecord] = [*infos, *batches]
    for part in parts:
        for stage, value in part.seconds.items():
            seconds[stage] = seconds.get(stage, 0.0) + value
    model = sum((b.model for b in batches), ModelStats())
    record = ShardRecord(path=name, sha256=sha256, rows_in=rows_in, rows_scored=scored,
                         rows_quarantined=quarantined, status=status, reason=reason,
                         files=tuple(f for b in batches for f in b.files))
    profile: dict[str, ColumnStats] = {}
    by_check: dict[tuple[str | None, str], int] = {}
    for b in batches:
        profile = merge_columns(profile, b.profile)
        for key, n in b.quarantine.items():
            by_check[key] = by_check.get(key, 0) + n
    return ShardResult(
        record=record, seconds=seconds, model=model,
        profile={k: v.to_dict() for k, v in profile.items()},
        quarantine=tuple((c, k, n) for (c, k), n in sorted(by_check.items(), key=str)),
        batches=tuple((b.model.rows, b.compute_ms) for b in batches if b.compute_ms is not None),
        challengers=_fold_challengers(name, batches, records, challengers),
        preprocess=sum((b.preprocess for b in batches), PreprocessStats()))


def _fold_challengers(name: str, batches: list[BatchRecord], records: Sequence[Record],
                      challengers: Sequence[str]) -> dict[str, ChallengerShard]:
    """Each challenger's part of the shard. It must have scored exactly the batches, and the
    rows, that reached the champion's model: the same prepared batches went to both."""
    given = {b.batch: b.model.rows for b in batches}
    return {challenger: fold_challenger(name, challenger, [
        r for r in records if isinstance(r, ChallengerBatchRecord) and r.name == challenger], given)
        for challenger in challengers}


def fold_challenger(name: str, challenger: str, records: Sequence[ChallengerBatchRecord],
                    given: dict[int, int] | None = None) -> ChallengerShard:
    """Challenger ``challenger``'s part of shard ``name`` from its batch records, which must be
    ``given`` (batch number → rows the batch brought to the model), when it is known (its
    writer knows only its own: the commit checks the rows against the champion's,
    ``ShardResult.joined``).

    Raises:
        RuntimeError: they are other batches, or other rows (a bug, never bad data).
    """
    mine = sorted(records, key=lambda r: r.batch)
    if given is not None and {r.batch: r.rows_in for r in mine} != given:
        raise RuntimeError(f"accounting failed for challenger {challenger} on shard {name}: "
                           f"it was given batches {[(r.batch, r.rows_in) for r in mine]}, "
                           f"the champion {sorted(given.items())}")
    return ChallengerShard(
        path=name, rows_scored=sum(r.rows_scored for r in mine),
        rows_rejected=sum(r.rows_rejected for r in mine),
        reason=next((r.first_reason for r in mine if r.first_reason), None),
        compute_ms=sum(r.compute_ms for r in mine), files=tuple(f for r in mine for f in r.files))
