"""A writer's shards that are not finished yet: the records of the batches it has written of each,
until the last one is written — then the shard's result, folded at once (pure).

The result must be durable the moment a shard's files are, so a run killed at any moment leaves
every shard it finished for the next run to adopt (contract §5.3 "Resume"): no GroupByKey may
stand between a shard's files and its result, since on a batch runner a GroupByKey waits for the
whole partition. The writer can fold a shard on its own because a shard's batches are read by one
``ReadShard`` call and flow through fused steps to the same writer, and because the last one
carries what the shard's result needs besides them (its :class:`ShardInfo`: the sha256 and the
footer's row count). A shard is finished when that batch and every batch before it are written,
in whatever order they came — its result is written just before the last batch's files are put
(``WritePredictions._complete`` says why).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...io.records import ChallengerShard, ShardResult
from ..shard_reports import BatchRecord, ChallengerBatchRecord, ShardInfo
from .policy import WritePolicy


@dataclass
class _Open:
    records: dict[int, BatchRecord | ChallengerBatchRecord] = field(default_factory=dict)
    info: ShardInfo | None = None
    batches: int | None = None     # how many: known from the last batch


@dataclass
class OpenShards:
    """One writer's records by shard, until each shard is finished (one writer thread uses it)."""

    policy: WritePolicy
    shard_names: tuple[str, ...]
    attempt: str
    _open: dict[int, _Open] = field(default_factory=dict)

    def finishes(self, shard: int, number: int, info: ShardInfo | None) -> bool:
        """Whether batch ``number`` of ``shard`` (``info``: as :meth:`add` takes it) is the last
        of the shard still to be written."""
        entry = self._open.get(shard, _Open())
        batches = number + 1 if info is not None else entry.batches
        seen = len(entry.records) + (number not in entry.records)
        return batches is not None and seen >= batches

    def add(self, shard: int, number: int, record: BatchRecord | ChallengerBatchRecord,
            info: ShardInfo | None) -> ShardResult | ChallengerShard | None:
        """Batch ``number`` of ``shard`` is written (``info``: the shard's, on its last batch):
        the shard's result (or this challenger's part of it) if that finished the shard."""
        entry = self._open.setdefault(shard, _Open())
        entry.records[number] = record
        if info is not None:
            entry.info, entry.batches = info, number + 1
        if entry.info is None or len(entry.records) < (entry.batches or 0):
            return None
        del self._open[shard]
        return self.policy.fold(self.shard_names[shard], entry.info, list(entry.records.values()),
                                attempt=self.attempt)

    def __len__(self) -> int:
        return len(self._open)
