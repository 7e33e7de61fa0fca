"""What differs between writing the champion's batches and a challenger's — everything else is
the same code (pipeline/transforms.py's ``WritePredictions``, the parts in this package).

The champion's files go to ``predictions``; the rows it rejects are quarantined; its batches are
profiled; its record (:class:`~batchinfer.pipeline.shard_reports.BatchRecord`) carries the
partition's accounting and drift statistics. A challenger's files go to
``challengers/<name>``; the rows it rejects are only counted; it is not profiled; its record
(:class:`~batchinfer.pipeline.shard_reports.ChallengerBatchRecord`), folded into its part of
the shard's result, is joined to the champion's at the commit, so it is committed (or not) with
the partition and never changes what it commits.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from ...io.outputs import PREDICTIONS, Layout, challenger_folder
from ...io.records import ChallengerShard, FileRecord, ModelStats, ShardResult
from ...rows.column_profiles import ColumnStats
from ..shard_reports import BatchRecord, ChallengerBatchRecord, ShardInfo, fold_challenger, fold_shard
from .rejects import Rejected, counted, quarantined
from .scored import ScoredBatch

RejectPolicy = Literal["quarantine", "count"]


@dataclass(frozen=True, kw_only=True)
class WritePolicy:
    """How one model's batches are written.

    Attributes:
        step: the writer's step name in the pipeline (``WriteBatch``,
            ``WriteChallenger[<name>]``: docs/runners.md shows them).
        folder: the kind its prediction files are written as (``predictions``,
            ``challengers/<name>``: io/outputs.py's ``Layout.part``).
        rejects: ``quarantine`` (the champion) or ``count`` (a challenger).
        name: the challenger's name, which its records carry ("" for the champion).
    """

    step: str
    folder: str
    rejects: RejectPolicy
    name: str = ""

    @classmethod
    def champion(cls) -> "WritePolicy":
        return cls(step="WriteBatch", folder=PREDICTIONS, rejects="quarantine")

    @classmethod
    def challenger(cls, name: str) -> "WritePolicy":
        return cls(step=f"WriteChallenger[{name}]", folder=challenger_folder(name), rejects="count",
                   name=name)

    @property
    def quarantines(self) -> bool:
        return self.rejects == "quarantine"

    @property
    def profiles(self) -> bool:
        """Whether its batches' drift statistics are counted: the partition's model's only (its
        record is the one that carries them to the drift gate)."""
        return self.quarantines

    def rejected(self, batch: ScoredBatch) -> Rejected:
        """The batch's rejected rows, quarantined or only counted."""
        return quarantined(batch) if self.quarantines else counted(batch)

    def record(self, batch: ScoredBatch, files: tuple[FileRecord, ...], rejected: Rejected, *,
               seconds: dict[str, float], profile: dict[str, ColumnStats],
               explanation: dict[str, Any]) -> BatchRecord | ChallengerBatchRecord:
        """The batch's record: ``files`` written, ``rejected`` as :meth:`rejected` kept them,
        the time spent per stage, the statistics (profiled only), the explanation figures
        (:meth:`ExplanationColumns.stats <.explanations.ExplanationColumns.stats>`)."""
        inference, scored = batch.inference, int(batch.ok.size)
        if not self.quarantines:
            return ChallengerBatchRecord(
                name=self.name, batch=batch.number, rows_in=batch.rows, rows_scored=scored,
                rows_rejected=rejected.rows, files=files, first_reason=rejected.first_reason,
                compute_ms=inference.compute_ms if batch.rows else 0.0)
        model = ModelStats(rows=batch.rows, raised=len(inference.failed),
                           error=inference.failed[0][1] if inference.failed else None,
                           oom_backoffs=inference.oom_backoffs, chunk_rows=inference.chunk_rows,
                           warmup_ms=inference.warmup_ms, tokens=inference.tokens,
                           padded_tokens=inference.padded_tokens, **explanation)
        payload = batch.payload
        return BatchRecord(
            batch=batch.number, rows_in=payload.rows_in, rows_scored=scored,
            rows_quarantined=rejected.rows, files=files, first_reason=rejected.first_reason,
            seconds=seconds, model=model, profile=profile, quarantine=rejected.by_check,
            compute_ms=inference.compute_ms if batch.rows else None, preprocess=payload.preprocess,
            last=payload.last)

    def fold(self, name: str, info: ShardInfo, records: Sequence[BatchRecord | ChallengerBatchRecord],
             *, attempt: str) -> ShardResult | ChallengerShard:
        """A shard's result from all its batches' records (``name``: the shard as the manifest
        names it; ``info``: the shard as read), scored by ``attempt``: the champion's
        :class:`~batchinfer.io.records.ShardResult`, or this challenger's part of it."""
        if not self.quarantines:
            mine = [r for r in records if isinstance(r, ChallengerBatchRecord)]
            return fold_challenger(name, self.name, mine)
        result = fold_shard(name, [info, *records])
        return dataclasses.replace(result, record=dataclasses.replace(result.record, scored_by=attempt))

    def result_path(self, layout: Layout, shard: int) -> str:
        """Where its part of a shard's result goes in the attempt's scratch."""
        return layout.shard_result(shard) if self.quarantines else layout.challenger_result(self.name, shard)
