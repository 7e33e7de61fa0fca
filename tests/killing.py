"""Killing a run from outside at a moment taken from the clock (issue 34, contract §5.3), and
what a user can see of it afterwards: which shards have all their rows on the store.

A moment is a fraction of a clean run's *scoring*: the span from its first data file to its last,
read from the files' modification times against the wall clock when the run started. The kill
is SIGKILL from this process to the run's whole process tree (a worker process too: a machine
that dies takes its workers with it), at that moment of the victim's own run — wherever the run
is then, not at a point the code placed for it.
"""
from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import pyarrow.parquet as pq

from servers import processes_of

KINDS = ("predictions", "quarantine")


@dataclass(frozen=True)
class Scoring:
    """When a clean run scored, in seconds after it was started: its first and last data file."""

    first: float
    last: float

    def at(self, fraction: float) -> float:
        return self.first + fraction * (self.last - self.first)


def data_files(out: Path) -> list[Path]:
    return [p for kind in KINDS if (out / kind).exists() for p in (out / kind).rglob("*.parquet")]


def scoring_of(out: Path, started: float) -> Scoring:
    """The scoring span of the committed run into ``out`` that was started at ``started``
    (``time.time()``)."""
    times = sorted(p.stat().st_mtime - started for p in data_files(out))
    assert len(times) >= 2, f"the clean run into {out} wrote {len(times)} data files"
    return Scoring(times[0], times[-1])


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and every process descended from it (children first listed, all killed as
    near to at once as one loop allows); returns the pids killed."""
    pids = processes_of(pid)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def kill_at(start: Callable[[], object], pid_of: Callable[[object], int], after: float, *,
            since: Callable[[], bool] | None = None, timeout: float = 300) -> tuple[object, float]:
    """Start a run (``start()``), and SIGKILL its process tree ``after`` seconds later by the
    clock — after its start, or with ``since`` after ``since()`` first holds (polled every 5 ms:
    its first data file, where the start-up of worker processes varies more than their
    scoring); returns (the run, the seconds after its start when it was killed)."""
    t0 = time.monotonic()
    run = start()
    anchor = t0
    if since is not None:
        while not since():
            assert time.monotonic() - t0 < timeout, "the run never reached its scoring"
            time.sleep(0.005)
        anchor = time.monotonic()
    delay = after - (time.monotonic() - anchor)
    if delay > 0:
        time.sleep(delay)
    kill_tree(pid_of(run))
    return run, time.monotonic() - t0


def complete_on_disk(out: Path, shards: Sequence[Path]) -> set[str]:
    """The input shards whose rows are all in data files under ``out`` (predictions and
    quarantine of any attempt, each file read back): what a user counting the files after a crash
    sees as finished. A file cut short by the kill does not read, and counts for nothing."""
    rows: dict[tuple[str, int], int] = defaultdict(int)
    for path in data_files(out):
        attempt = path.parent.name
        shard = int(path.name.split("-")[1])
        try:
            rows[(attempt, shard)] += pq.read_metadata(path).num_rows
        except Exception:   # noqa: BLE001 - a torn file is no rows, whatever pyarrow raises
            continue
    wanted = {i: pq.read_metadata(p).num_rows for i, p in enumerate(shards)}
    # Scored rows and quarantined rows of one attempt make up a shard (another attempt's files
    # of the same shard are not added to them).
    return {str(shards[i]) for (attempt, i), n in rows.items() if n == wanted[i]}
