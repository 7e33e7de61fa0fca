"""Validating and preprocessing one batch — the pipeline's Prepare step, shared with
``batchinfer validate`` so that it rejects exactly the rows a run would before the model. No
Beam here (``validate`` does not start it).

A row the preprocessing raises on is quarantined (``_check: preprocess``, the exception in
``_reason``), found by splitting the batch (:func:`~batchinfer.rows.isolation.run_isolating`).
A function that raises on every row is broken, not picky (a ``KeyError`` on a column the
batch does not have, ``float()`` of a column that is text): quarantining would report a fault
of the code as bad data. So (contract §6 "Preprocessing faults"):

(a) a batch of at least :data:`FAULT_MIN_ROWS` valid rows of which the preprocessing takes
    none — the whole batch and each row tried alone raise the same exception type — is a
    fault, raised here on the first such batch (:class:`PreprocessError`, exit 2);
(b) at the quarantine thresholds, where the rows are over them, one exception type that
    rejected more than half of the rows the preprocessing was given is a fault too
    (:func:`preprocess_fault`; the commit step and ``validate`` apply it).
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import BatchInferError, PreprocessError
from ..io.records import PreprocessStats
from ..rows.isolation import MAX_LONE_FAILURES, run_isolating
from ..rows.quarantine import Failure, build_quarantine
from ..rows.validation import validate_batch
from ..triple.preprocess import Preprocessor
from ..triple.schemas import SchemaVersion

# Rule (a) needs this many valid rows in the batch: the tail batch of a shard may hold a row or
# two, all bad for reasons of their own.
FAULT_MIN_ROWS = 64
TRACE_CHARS = 8000   # of the first failure's traceback kept for --debug


@dataclass
class PreparedRows:
    """One batch, validated and preprocessed.

    Attributes:
        valid: the original rows that passed validation and preprocessing.
        source_rows: int64 row of each within its shard.
        features: the preprocessing's output for them (None when no row is left).
        quarantine: the rows rejected, by the schema and by the preprocessing.
        stats: what the preprocessing did (rows given, rows it raised on by exception type).
        seconds: time spent validating and preprocessing.
    """

    valid: pa.RecordBatch
    source_rows: np.ndarray
    features: Any
    quarantine: list[pa.Table]
    stats: PreprocessStats = PreprocessStats()
    seconds: dict[str, float] = field(default_factory=dict)


def prepare_batch(batch: pa.RecordBatch, schema: SchemaVersion, preprocessor: Preprocessor, *,
                  source_shard: str, first_row: int) -> PreparedRows:
    """Validate ``batch`` (rows ``first_row…`` of ``source_shard``) and preprocess its valid
    rows, isolating and quarantining rows the preprocessing raises on.

    Raises:
        PreprocessError: the preprocessing returned something that does not fit the batch, or
            rule (a) of the module docstring: it raised on every row of the batch.
    """
    t0 = time.perf_counter()
    result = validate_batch(batch, schema.schema, source_shard=source_shard, first_row=first_row)
    t1 = time.perf_counter()
    quarantine = [result.quarantine] if result.quarantine.num_rows else []
    valid = result.valid
    source_rows = result.valid_rows.astype(np.int64) + first_row
    features: Any = None
    stats = PreprocessStats()
    if valid.num_rows:
        done, failed, stats = _preprocess(preprocessor, valid, source_shard)
        if failed:
            rows = np.array([r for r, _ in failed], dtype=np.int64)
            quarantine.append(build_quarantine(
                source_shard, source_rows[rows],
                [[Failure(None, "preprocess", f"preprocessing failed: {msg}")] for _, msg in failed],
                valid.take(pa.array(rows))))
            keep = _rows_of(done)
            valid = valid.take(pa.array(keep))
            source_rows = source_rows[keep]
        features = _concat_features([r for _, _, r in done]) if done else None
    return PreparedRows(valid, source_rows, features, quarantine, stats,
                        {"validate": t1 - t0, "preprocess": time.perf_counter() - t1})


def preprocess_fault(stats: PreprocessStats, ref: str | None) -> str | None:
    """Rule (b): the line of a preprocessing fault, when one exception type rejected more than
    half of the rows the preprocessing was given; else None. Applied only where the rows are
    over the quarantine thresholds: below them, rejected rows are quarantined as usual."""
    if not stats.raised:
        return None
    kind, rows = max(stats.raised.items(), key=lambda item: (item[1], item[0]))
    if 2 * rows <= stats.rows:
        return None
    which = ("every one" if rows == stats.rows else str(rows)) + f" of the {stats.rows} rows"
    return _fault_line(ref, stats.first.get(kind, kind), f"on {which} it was given")


def _preprocess(preprocessor: Preprocessor, valid: pa.RecordBatch, source_shard: str
                ) -> tuple[list[tuple[int, int, Any]], list[tuple[int, str]], PreprocessStats]:
    """The preprocessing over ``valid``, isolating the rows it raises on; rule (a)."""
    first: dict[str, BaseException] = {}   # each exception type's first instance

    def run(start: int, stop: int) -> Any:
        try:
            return preprocessor(valid.slice(start, stop - start))
        except BatchInferError:
            raise   # not a row's fault: run_isolating passes it on unsplit
        except Exception as exc:
            first.setdefault(type(exc).__name__, exc)
            raise

    n = valid.num_rows
    done, failed = run_isolating(n, run)
    if not failed:
        return done, failed, PreprocessStats(rows=n)
    raised: dict[str, int] = {}
    messages: dict[str, str] = {}
    for _, message in failed:
        kind = _kind(message)
        raised[kind] = raised.get(kind, 0) + 1
        messages.setdefault(kind, message)
    kind = _kind(failed[0][1])
    original = first.get(kind)
    if not done and n >= FAULT_MIN_ROWS and len(raised) == 1:
        tried = f"each of its {n} rows" if n <= MAX_LONE_FAILURES else f"each of its first {MAX_LONE_FAILURES} rows"
        raise PreprocessError(_fault_line(
            preprocessor.ref, messages[kind],
            f"on a batch of {n} rows of {source_shard} and on {tried} alone")) from original
    trace = None
    if original is not None:
        trace = "".join(traceback.format_exception(original))[-TRACE_CHARS:]
    return done, failed, PreprocessStats(n, raised, messages, trace)


def _fault_line(ref: str | None, error: str, where: str) -> str:
    function = f"preprocess {ref}" if ref else "the default preprocessing (FEATURES as float32)"
    return (f"{function} raised {error} {where} (a fault of the preprocessing, not of the data: "
            f"fix the function; nothing committed)")


def _kind(message: str) -> str:
    """The exception type of a failure message as run_isolating writes it ("KeyError: …")."""
    return message.partition(":")[0]


def _rows_of(done) -> np.ndarray:
    if not done:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(s, e, dtype=np.int64) for s, e, _ in done])


def _concat_features(parts: list[Any]) -> Any:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], dict):
        return {k: _concat_padded([p[k] for p in parts]) for k in parts[0]}
    return _concat_padded(parts)


def _concat_padded(arrays: list[np.ndarray]) -> np.ndarray:
    """One array from the preprocessing's parts (a batch split around rows it rejected). A
    sequence input is padded to each part's longest row, so parts may differ in length: the
    shorter ones are right-padded with zeros, which is what padding is (docs/contract.md)."""
    arrays = [np.asarray(a) for a in arrays]
    if arrays[0].ndim >= 2 and len({a.shape[1] for a in arrays}) > 1:
        width = max(a.shape[1] for a in arrays)
        arrays = [np.pad(a, [(0, 0), (0, width - a.shape[1])] + [(0, 0)] * (a.ndim - 2))
                  for a in arrays]
    return np.concatenate(arrays)
