"""Update: what ``run --update`` does with a committed partition whose shards changed (contract
§5.3 "Update").

A committed partition is the files of the shards its manifest lists. When ``input.path`` lists
another set now — shards that arrived late, shards no longer there, shards rewritten upstream — an
update keeps every committed shard whose bytes are still the ones it was scored from (the same
name and sha256), scores the others, and drops the rows of the shards no longer listed. A kept
shard's files stay where they are (no copy, on object stores too): the new manifest lists them
there, ``scored_by`` naming the attempt that wrote them.

It applies only to the partition this run would commit but for its shards: the same job and
date, triple, declared options and challengers (:func:`batchinfer.io.commit.decide` checks
those), and the same job spec (its sha256): a spec that changed (``--set batch.rows``, another
``output.id_columns``) may change every shard's files, so it is no update but ``--overwrite``.

:func:`plan_update` is pure; :func:`current_digests` reads the shards (I/O).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Sequence

from ..errors import Action, ContractError, Remedy
from .records import Manifest, ShardResult
from .resume import THREADS, digest_url


@dataclass(frozen=True)
class Update:
    """What an update keeps, scores and drops.

    Attributes:
        committed: the manifest it replaces.
        kept: by shard index as listed now, the committed shard's entry (its files where they
            are, ``scored_by`` its attempt) and each kept challenger's entry for it.
        added: shards listed now that the partition does not hold.
        rewritten: shards it holds whose bytes are other now (or could not be read now).
        removed: shards it holds that ``input.path`` no longer lists (their rows go).
        dropped_challengers: challengers the partition holds that this run does not declare:
            they would not cover the shards it scores, so the new manifest has none of them.
        refusal: why this is no update (the error to raise, exit 3), or None.
    """

    committed: Manifest
    kept: dict[int, ShardResult] = field(default_factory=dict)
    added: tuple[str, ...] = ()
    rewritten: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    dropped_challengers: tuple[str, ...] = ()
    refusal: ContractError | None = None

    @property
    def unchanged(self) -> bool:
        """Nothing added, rewritten or removed: the committed partition is this run's."""
        return not (self.added or self.rewritten or self.removed)

    @property
    def rows_kept(self) -> int:
        return sum(r.record.rows_in or 0 for r in self.kept.values())

    def summary(self, total: int, lead: str = "updating: keeping") -> str:
        """``updating: keeping 63 of 64 shards (…) scored by attempt(s) …; scoring 1 (1 new, 0
        rewritten); dropping 0 no longer listed`` (``lead``: its first words)."""
        attempts = sorted({r.record.scored_by or self.committed.attempt for r in self.kept.values()})
        line = (f"{lead} {len(self.kept)} of {total} shards ({self.rows_kept:,} rows) "
                f"scored by attempt(s) {', '.join(attempts) or '-'}; scoring {total - len(self.kept)} "
                f"({len(self.added)} new, {len(self.rewritten)} rewritten); dropping "
                f"{len(self.removed)} no longer listed")
        if self.rewritten:
            line += f" (rewritten: e.g. {self.rewritten[0]})"
        if self.dropped_challengers:
            line += f"; challenger(s) {', '.join(self.dropped_challengers)} not declared: dropped"
        return line


def plan_update(committed: Manifest, listed: Sequence[tuple[str, str | None]], *,
                job_spec_sha256: str, challengers: Sequence[str], shown: str,
                as_then: Sequence[str] | None = None) -> Update:
    """What an update of ``committed`` keeps, scores and drops.

    Args:
        listed: (name, sha256 of its bytes now — None if they cannot be read) of each shard
            ``input.path`` lists now, by index.
        job_spec_sha256: this run's spec hash; another than the committed one refuses an update
            that would score anything (a spec that changed may change every shard's files).
        challengers: the names of the challengers this run declares (the partition holds each:
            :func:`batchinfer.io.commit.decide` checked it).
        as_then: the shards' names with every ``${NAME}`` value put back, as partitions
            committed before only secrets were masked name them (by index, as ``listed``).

    Example: a committed partition of a, b and c; listed now a, b' (rewritten) and d → keeps a,
    scores b' and d, drops c.
    """
    held = {s.path: (i, s) for i, s in enumerate(committed.shards)}
    declared = set(challengers)
    kept: dict[int, ShardResult] = {}
    added, rewritten, seen = [], [], set()
    for index, (name, sha) in enumerate(listed):
        then = as_then[index] if as_then is not None else name
        key = name if name in held else then if then in held else None
        if key is None:
            added.append(name)
            continue
        seen.add(key)
        position, shard = held[key]
        if sha is None or shard.sha256 != sha:
            rewritten.append(name)
            continue
        record = replace(shard, scored_by=committed.scored_by(shard))
        kept[index] = ShardResult(record=record, challengers={
            c.name: c.shards[position] for c in committed.challengers
            if c.name in declared and position < len(c.shards)})
    removed = tuple(path for path in held if path not in seen)
    update = Update(committed, kept, tuple(added), tuple(rewritten), removed,
                    tuple(c.name for c in committed.challengers if c.name not in declared))
    if not update.unchanged and committed.job_spec_sha256 != job_spec_sha256:
        return replace(update, refusal=ContractError(
            f"{shown} was committed from another job spec (sha256 {committed.job_spec_sha256[:12]}…, "
            f"this run's {job_spec_sha256[:12]}…; a --set counts), and its shards changed since "
            f"({len(added)} new, {len(rewritten)} rewritten, {len(removed)} no longer listed): "
            f"an update keeps shards only under the spec that scored them", path=shown,
            field="job_spec_sha256", remedies=[Remedy(Action.OVERWRITE, "to score the partition again")]))
    return update


def current_digests(urls: Sequence[str | None]) -> list[str | None]:
    """The sha256 of each shard's bytes now (None where they cannot be read, or for a None
    URL: not asked for), hashed ``THREADS`` at a time (object stores are latency-bound)."""
    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(lambda url: digest_url(url) if url is not None else None, urls))
