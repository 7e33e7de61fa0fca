"""Fault injection for crash-safety tests: ``BATCHINFER_FAULT=<point>[:<n>]`` kills the process
with SIGKILL (no cleanup, no atexit, like ``kill -9``) the n-th time (default 1st) it reaches
``<point>``.

The variable is read once per process, where the process starts: when it first imports this
module, before any run or pipeline step begins in it (the CLI's process, and a worker process
started by the runner, which inherits the CLI's environment; the test suite's fork server
reloads the module in each child it forks, to the same effect). What it says is a plain value,
:class:`Faults`, which :func:`install` or :func:`scoped` can replace (a test, a program that runs
jobs in-process), and which pickles: the handler reads the ``oom`` fault when the run builds it
and carries it to its workers. A point consults that value, never ``os.environ``: unset, every
call is one string comparison.

Points, in the order a run meets them:
    read          a shard's bytes have been read
    mid_write     half of an output file's bytes are written (then the process dies)
    write         an output file was written
    shard_done    a shard's result record was written to _tmp, then its last batch's files
    before_commit the pipeline finished, thresholds passed, manifest not yet written
    during_commit the manifest's bytes are in scratch, not yet linked into place
    after_table_commit  tables: the predictions table holds the commit, the manifest not yet
    after_commit  the manifest exists, other attempts not yet cleaned up

One point is not a crash: ``oom:<n>`` makes every model call of more than n rows fail as if the
device ran out of memory (:func:`Faults.oom_rows`; handlers/oom.py halves the call and retries
the rows).
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

VARIABLE = "BATCHINFER_FAULT"


@dataclass(frozen=True)
class Faults:
    """The fault to inject: a point's name ("" for none) and the occurrence that dies there."""

    point: str = ""
    nth: int = 1

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "Faults":
        """``BATCHINFER_FAULT`` of ``environ``, e.g. ``write:2`` → ``Faults("write", 2)``."""
        name, _, nth = environ.get(VARIABLE, "").partition(":")
        return cls(name, int(nth) if nth.isdigit() else 1)

    def oom_rows(self) -> Optional[int]:
        """With ``oom:<n>``: the most rows a model call may take before it "runs out of memory"."""
        return self.nth if self.point == "oom" else None


_lock = threading.Lock()
_active = Faults.from_environ(os.environ)   # the process's edge: see the module docstring
_count = 0                                  # times the active point was reached


def active() -> Faults:
    """The faults this process injects."""
    return _active


def install(faults: Faults) -> None:
    """Make ``faults`` this process's faults, its point not yet reached."""
    global _active, _count
    with _lock:
        _active, _count = faults, 0


@contextmanager
def scoped(faults: Faults) -> Iterator[Faults]:
    """``faults`` for the block, the previous ones after it."""
    previous = _active
    install(faults)
    try:
        yield faults
    finally:
        install(previous)


def point(name: str) -> None:
    """Die here if this is the configured fault point and occurrence."""
    global _count
    faults = _active
    if name != faults.point:
        return
    with _lock:
        _count += 1
        hit = _count == faults.nth
    if hit:
        os.kill(os.getpid(), signal.SIGKILL)


def armed(name: str) -> bool:
    """True if ``name`` is the configured point (for faults that need to act before dying)."""
    return name == _active.point
