"""Call planning: which rows each model call takes; pure, no I/O.

A batch's rows ``[start, stop)`` (a range that row isolation may have narrowed) become model
calls ``(lo, hi, width)``, in order: rows ``[lo, hi)``, sequence inputs cut to ``width`` (the
padded width when calls are sized by rows, which cut nothing). One planner for both ways of
sizing a call:

- by rows: every call holds ``rows`` rows (the last what is left);
- by tokens (``batch.tokens``, handlers/tokens.py): the rows are longest first, and each call
  holds at most ``tokens`` padded tokens — its rows × its longest row — and at most ``rows``
  rows.

The handler plans the rest of a range again when a call runs out of device memory, with the
smaller limits the out-of-memory policy (handlers/oom.py) then gives.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

Call = tuple[int, int, int]   # (lo, hi, width)


def plan_calls(start: int, stop: int, *, rows: Optional[int], width: int = 0,
               lengths: Optional[np.ndarray] = None, tokens: Optional[int] = None) -> list[Call]:
    """Rows ``[start, stop)`` as model calls ``(lo, hi, width)`` that cover each row once.

    Args:
        start, stop: the rows to call the model on.
        rows: the most rows a call may hold (None: no limit; by rows, the whole range).
        width: by rows, the width every call is given (the lengths input's padded width, or 0).
        lengths: by tokens, every row's length, in non-increasing order (None: by rows).
        tokens: by tokens, the most padded tokens a call may hold; a row longer than that still
            gets a call of its own.

    Example: ``plan_calls(0, 10, rows=4)`` → ``[(0, 4, 0), (4, 8, 0), (8, 10, 0)]``.
    """
    calls = []
    lo = start
    if lengths is None or tokens is None:
        step = rows or (stop - start)
        while lo < stop:
            hi = min(stop, lo + step)
            calls.append((lo, hi, width))
            lo = hi
        return calls
    while lo < stop:
        longest = max(1, int(lengths[lo]))   # at least 1: a call never has an empty sequence axis
        fit = max(1, tokens // longest)
        if rows:
            fit = min(fit, rows)
        hi = min(stop, lo + fit)
        calls.append((lo, hi, longest))
        lo = hi
    return calls
