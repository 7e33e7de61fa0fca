"""The out-of-memory policy: halve the call and retry the same rows.

A model call that runs out of device memory is not its rows' fault: blaming them would
quarantine good rows, and isolating them one by one would take a call per row. Instead the
call is halved and the same rows retried, down to a single row (which then fails the run,
exit 5). The smaller limit is kept for the rest of the process's batches — the next batch would
run out of memory just the same — as rows per call, or, for calls sized by tokens, as padded
tokens per call (the halved call's rows × its width).

Whether an exception means "out of memory" is the backend's to say
(``BatchModelHandler.is_out_of_memory``), except for the injected fault ``oom:<n>``
(batchinfer/faults.py), which this policy raises itself before a call of more than n rows, so
that halving and retrying can be tested through a real pipeline on any backend and machine.
"""
from __future__ import annotations

import logging
from typing import Optional

from ..errors import ModelError, one_line

log = logging.getLogger("batchinfer")


class InjectedOutOfMemory(RuntimeError):
    """What the ``oom:<n>`` fault raises in place of a device's out-of-memory error."""


class OutOfMemoryPolicy:
    """Halve and retry; the limits it learnt, for one handler (so one model) in one process.

    Args:
        inject_above: the ``oom:<n>`` fault's n (None: no fault): calls of more rows fail.
    """

    def __init__(self, inject_above: Optional[int] = None):
        self.inject_above = inject_above
        self.rows: Optional[int] = None     # rows per call since a back-off (calls by rows)
        self.tokens: Optional[int] = None   # padded tokens per call since then (by tokens)

    def row_limit(self, rows: int) -> int:
        """``rows`` per call, or fewer since a back-off."""
        return rows if self.rows is None else min(rows, self.rows)

    def token_limit(self, tokens: int) -> int:
        """``tokens`` per call, or fewer since a back-off."""
        return tokens if self.tokens is None else min(tokens, self.tokens)

    def before_call(self, rows: int) -> None:
        """The injected fault, if armed (tests; see the module docstring).

        Raises:
            InjectedOutOfMemory: a call of more rows than the fault allows.
        """
        if self.inject_above is not None and rows > self.inject_above:
            raise InjectedOutOfMemory(f"CUDA out of memory (injected above {self.inject_above} rows)")

    def back_off(self, exc: BaseException, rows: int, width: int, *, by_tokens: bool) -> int:
        """A call of ``rows`` rows (sequences cut to ``width``) ran out of memory: the rows a
        call takes from now on (half), remembered for the handler's next calls.

        Raises:
            ModelError: it was a single row; nothing smaller can be tried (exit 5).
        """
        if rows == 1:
            raise ModelError(f"the model runs out of device memory on a single row "
                             f"({one_line(exc)}); nothing committed") from None
        half = rows // 2
        if by_tokens:
            self.tokens = half * width
        else:
            self.rows = half
        log.warning("out of device memory at %d rows per model call; retrying the same rows at %d",
                    rows, half)
        return half
