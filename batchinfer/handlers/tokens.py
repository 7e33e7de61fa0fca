"""Model calls sized by tokens, not rows (``batch.tokens``); pure, no I/O.

A transformer's call costs about rows × the call's longest sequence: every row is padded to it.
Row-count batching pads a short document to the longest one that happens to share its batch;
on a realistic length mix most of the compute is then spent on padding. With ``batch.tokens``
the handler sorts a batch's rows by length (the batch of ``batch.rows`` rows is the bounded
window: memory stays what it was) and cuts the sorted rows into calls of at most ``tokens``
padded tokens, each call trimmed to its own longest row. Results go back to the rows' places
before anything leaves the handler, so output order and accounting do not change.

Sequence inputs are right-padded (real tokens first, then padding), as every tokenizer pads by
default; a row's length is the position after its last non-zero entry in the lengths input
(``attention_mask`` unless ``batch.lengths_from`` names another).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np


def sequence_lengths(mask: np.ndarray) -> np.ndarray:
    """Each row's length: one past its last non-zero position (0 for an all-zero row).

    Args:
        mask: ``[rows, padded length]``, non-zero on real tokens.
    """
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"a lengths input must be [rows, length], not {list(mask.shape)}")
    if mask.shape[1] == 0:
        return np.zeros(mask.shape[0], np.int64)
    nonzero = mask != 0
    last = mask.shape[1] - np.argmax(nonzero[:, ::-1], axis=1)
    return np.where(nonzero.any(axis=1), last, 0).astype(np.int64)


def longest_first(lengths: np.ndarray) -> np.ndarray:
    """The order to score rows in: longest first (the first call, which also warms the model
    up, is the largest; stable, so equal lengths keep their order)."""
    return np.argsort(-np.asarray(lengths), kind="stable")


def next_call(lengths: np.ndarray, lo: int, stop: int, tokens: int,
              max_rows: int | None = None) -> tuple[int, int]:
    """The model call that starts at row ``lo`` of a longest-first batch: ``(hi, width)``.

    Args:
        lengths: every row's length, in non-increasing order.
        lo, stop: the call takes rows from ``lo``, never reaching ``stop``.
        tokens: the most padded tokens (rows × width) a call may hold; a row longer than that
            still gets a call of its own.
        max_rows: the most rows a call may hold (None: no limit).

    Returns:
        The call's rows ``[lo, hi)`` and ``width``, its longest row (at least 1, so that a call
        never has an empty sequence axis).
    """
    width = max(1, int(lengths[lo]))
    rows = max(1, tokens // width)
    if max_rows:
        rows = min(rows, max_rows)
    return min(stop, lo + rows), width


def plan_calls(lengths: np.ndarray, start: int, stop: int, tokens: int,
               max_rows: int | None = None) -> list[tuple[int, int, int]]:
    """Rows ``[start, stop)`` of a longest-first batch as model calls ``(lo, hi, width)``, in
    order (:func:`next_call` one after the other)."""
    calls = []
    lo = start
    while lo < stop:
        hi, width = next_call(lengths, lo, stop, tokens, max_rows)
        calls.append((lo, hi, width))
        lo = hi
    return calls


def call_inputs(inputs: Mapping[str, np.ndarray], lo: int, hi: int, padded: int,
                width: int) -> dict[str, np.ndarray]:
    """Rows ``[lo, hi)`` of ``inputs``, every sequence input (second axis ``padded`` long, as
    the lengths input's) cut to ``width``: the rest of it is padding for these rows."""
    out = {}
    for name, value in inputs.items():
        if value.ndim >= 2 and value.shape[1] == padded:
            out[name] = value[lo:hi, :width]
        else:
            out[name] = value[lo:hi]
    return out

