"""Isolating the rows that make a batch fail, by splitting the batch (pure, no I/O).

A model that rejects a batch usually rejects one or two rows of it. Rather than lose the
batch, :func:`run_isolating` bisects: halves that succeed are kept, halves that fail are split
again, and single rows that still fail are reported with the error. Cost: O(k log n) calls for
k bad rows in n.
"""
from __future__ import annotations

from typing import Callable, TypeVar

from ..errors import BatchInferError, one_line

T = TypeVar("T")

# A model that fails on every row (broken, not picky) would otherwise cost one call per row.
# After this many single-row failures with no success at all, the rest of the batch is failed
# with the same error without further calls.
MAX_LONE_FAILURES = 256


def run_isolating(n_rows: int, run: Callable[[int, int], T]
                  ) -> tuple[list[tuple[int, int, T]], list[tuple[int, str]]]:
    """Run ``run(start, stop)`` over rows ``[0, n_rows)``, isolating failing rows.

    Args:
        n_rows: how many rows there are.
        run: computes the result for rows ``[start, stop)``; raises to reject them.

    Returns:
        ``(done, failed)``: ``done`` lists ``(start, stop, result)`` in row order; ``failed``
        lists ``(row, error message)`` in row order. Every row is in exactly one of them.

    Raises:
        BatchInferError: whatever ``run`` raised of batchinfer's own errors, unsplit.
    """
    done: list[tuple[int, int, T]] = []
    failed: list[tuple[int, str]] = []
    state = {"lone_failures": 0, "successes": 0}
    stack = [(0, n_rows)] if n_rows else []
    while stack:
        start, stop = stack.pop()
        if state["lone_failures"] >= MAX_LONE_FAILURES and not state["successes"]:
            message = failed[-1][1] if failed else "failed"
            failed.extend((row, message) for row in range(start, stop))
            continue
        try:
            result = run(start, stop)
        except BatchInferError:
            # Raised on purpose (a model or preprocessing step that breaks the batch contract):
            # a fault of the whole step, never of the rows, so splitting cannot help.
            raise
        except Exception as exc:  # any error of the model on these rows
            if stop - start == 1:
                failed.append((start, f"{type(exc).__name__}: {one_line(exc)}"))
                state["lone_failures"] += 1
            else:
                middle = (start + stop) // 2
                stack.append((middle, stop))  # pushed first, so the left half runs first
                stack.append((start, middle))
            continue
        state["successes"] += 1
        done.append((start, stop, result))
    failed.sort()
    return done, failed
