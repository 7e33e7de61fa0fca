"""One model's result for one batch, as every part of the writer reads it: screened once (the
rows it scored with finite outputs, those it rejected and why), the scored rows taken from the
valid rows once, their ``_input_hash`` computed once, and with ``explain`` the attributions by
feature made once — for the file's columns, the drift statistics and the record alike.

Pure: numpy and Arrow, no I/O, no Beam.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pyarrow as pa

from ...handlers.base import Inference, Prepared
from ...handlers.explain import Attributions, ExplainPlan, grouped, top
from ...io.records import PreprocessStats
from ...rows.hashing import row_hashes
from ..shard_reports import ShardInfo


@dataclass
class Payload:
    """What travels beside the features to the writer."""

    first_row: int
    rows_in: int
    valid: pa.RecordBatch          # original rows that passed validation and preprocessing
    source_rows: np.ndarray        # int64 row of each valid row within its shard
    quarantine: list[pa.Table]     # rows already quarantined (schema, preprocess)
    seconds: dict[str, float] = field(default_factory=dict)   # time spent per stage
    preprocess: PreprocessStats = PreprocessStats()
    last: bool = False             # the shard's last batch (pipeline/counters.py counts it done)
    info: ShardInfo | None = None  # on the last batch: the shard as read (writer/finished.py)


@dataclass(frozen=True, kw_only=True)
class Shown:
    """One batch's attributions by feature, and what ``_explanation`` keeps of them."""

    names: np.ndarray        # the feature names
    by_feature: np.ndarray   # [explained rows, features]: the positions of one feature summed
    positions: np.ndarray    # [explained rows, k]: the features ``_explanation`` keeps
    values: np.ndarray       # their attributions

    @classmethod
    def of(cls, explained: Attributions, plan: ExplainPlan) -> "Shown":
        """The top ``k`` features by |attribution| of each explained row, or every one."""
        width = int(np.shape(explained.values)[1]) if explained.values.size else 0
        names = np.array(plan.names(width) if width else (), dtype=object)
        by_feature = grouped(explained.values, plan.groups, len(names))
        positions, values = top(by_feature, plan.top_k) if len(names) else (
            np.zeros((explained.rows.size, 0), np.int64), np.zeros((explained.rows.size, 0)))
        return cls(names=names, by_feature=by_feature, positions=positions, values=values)


@dataclass(frozen=True, kw_only=True)
class ScoredBatch:
    """One batch as one model scored it.

    Attributes:
        shard, number: the shard's index and the batch's within it; shard_name: what
            ``_source_shard`` records.
        rows: the prepared rows given to the model.
        payload: what came beside the features (the valid rows, their places, the rows
            quarantined before the model).
        inference: the model's result, as RunInference (and Explain) left it.
        ok: indices into the valid rows of the rows scored with finite outputs, ascending;
            outputs: their outputs; failed: ``(row, why)`` of the rows rejected, ascending.
        scored: those rows of the input (None when none was scored); input_hash: their
            ``_input_hash``, and hash_s the time it took (0 when the sample had it already).
        explained: the attributions (with ``explain``), shown: by feature and top k.
    """

    shard: int
    number: int
    shard_name: str
    rows: int
    payload: Payload
    inference: Inference
    ok: np.ndarray
    outputs: dict[str, np.ndarray]
    failed: list[tuple[int, str]]
    scored: pa.RecordBatch | None = None
    input_hash: pa.Array | None = None
    hash_s: float = 0.0
    explained: Attributions | None = None
    shown: Shown | None = None

    @classmethod
    def of(cls, item: Prepared, inference: Inference, *, shard_names: Sequence[str],
           hash_columns: Sequence[str], explain: ExplainPlan | None) -> "ScoredBatch":
        payload: Payload = item.payload
        index, number = item.key
        ok, outputs, failed = screen_outputs(inference)
        explained: Attributions | None = inference.explained
        scored = input_hash = shown = None
        hash_s = 0.0
        if ok.size:
            scored = scored_rows(payload, ok)
            t0 = time.perf_counter()
            if explained is not None and explained.hashes is not None:
                input_hash = explained.hashes   # the sample needed them first
            else:
                input_hash = row_hashes(scored, hash_columns)
            hash_s = time.perf_counter() - t0
            if explained is not None and explain is not None:
                shown = Shown.of(explained, explain)
        return cls(shard=index, number=number, shard_name=shard_names[index], rows=item.rows,
                   payload=payload, inference=inference, ok=ok, outputs=outputs, failed=failed,
                   scored=scored, input_hash=input_hash, hash_s=hash_s, explained=explained,
                   shown=shown)


def screen_outputs(inference: Inference) -> tuple[np.ndarray, dict[str, np.ndarray], list[tuple[int, str]]]:
    """(rows scored, their outputs, rows rejected with why): the rows the model raised on, and
    those whose outputs are not finite, are rejected; ascending row order."""
    ok = inference.ok_rows
    outputs = inference.outputs
    failed = list(inference.failed)
    if ok.size:
        finite = _finite_rows(outputs, ok.size)
        if not finite.all():
            bad_outputs = {k for k, v in outputs.items() if not _finite_rows({k: v}, ok.size).all()}
            failed.extend((int(r), f"non-finite model output in {', '.join(sorted(bad_outputs))}")
                          for r in ok[~finite])
            outputs = {k: v[finite] for k, v in outputs.items()}
            ok = ok[finite]
    failed.sort()
    return ok, outputs, failed


def scored_rows(payload: Payload, ok: np.ndarray) -> pa.RecordBatch:
    """The valid rows the model scored (``ok`` indexes them in the batch)."""
    return payload.valid if ok.size == payload.valid.num_rows else payload.valid.take(pa.array(ok))


def _finite_rows(outputs: dict[str, np.ndarray], n: int) -> np.ndarray:
    ok = np.ones(n, dtype=bool)
    for value in outputs.values():
        value = np.asarray(value)
        if value.dtype.kind in "fc":
            ok &= np.isfinite(value.reshape(n, -1)).all(axis=1)
    return ok
