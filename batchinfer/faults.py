"""Fault injection for crash-safety tests: ``BATCHINFER_FAULT=<point>[:<n>]`` kills the process
with SIGKILL (no cleanup, no atexit, like ``kill -9``) the n-th time (default 1st) it reaches
``<point>``. The variable is read on the first call, not on import. Unset, every call is one
dictionary look-up.

Points, in the order a run meets them:
    read          a shard's bytes have been read
    mid_write     half of an output file's bytes are written (then the process dies)
    write         an output file was written
    shard_done    a shard's result record was written to _tmp
    before_commit the pipeline finished, thresholds passed, manifest not yet written
    during_commit the manifest's bytes are in scratch, not yet linked into place
    after_commit  the manifest exists, other attempts not yet cleaned up

One point is not a crash: ``oom:<n>`` makes the torch backend raise CUDA's out-of-memory error
for every model call of more than n rows (the handler halves its chunk and retries the rows).
"""
from __future__ import annotations

import os
import signal
import threading

_lock = threading.Lock()
_state: dict = {}   # point, target occurrence, count; read from the environment on first use


def _configured() -> dict:
    if not _state:
        spec = os.environ.get("BATCHINFER_FAULT", "")
        point_name, _, nth = spec.partition(":")
        _state.update(point=point_name, target=int(nth) if nth.isdigit() else 1, count=0)
    return _state


def point(name: str) -> None:
    """Die here if this is the configured fault point and occurrence."""
    state = _state or _configured()
    if name != state["point"]:
        return
    with _lock:
        state["count"] += 1
        hit = state["count"] == state["target"]
    if hit:
        os.kill(os.getpid(), signal.SIGKILL)


def armed(name: str) -> bool:
    """True if ``name`` is the configured point (for faults that need to act before dying)."""
    return name == (_state or _configured())["point"]


def number() -> int:
    """The ``<n>`` of the configured point (for ``oom``: the most rows a model call may take)."""
    return (_state or _configured())["target"]
