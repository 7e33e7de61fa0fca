"""Process-wide progress counters that the pipeline's stages bump once per shard or batch.

Live progress (``commands/progress.py``) polls them from the driver. They are plain integers
under a lock, touched a few times per batch of tens of thousands of rows: no per-row work. They
count only what runs in this process (the direct runner's in-memory mode, the default); with a
runner whose workers are elsewhere they stay at zero and progress shows nothing moving.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class Counts:
    shards_opened: int = 0        # shards whose footer was read (their rows are known)
    shards_done: int = 0          # shards whose result is in scratch
    rows_known: int = 0           # rows in the footers of the shards opened so far
    rows_done: int = 0            # rows written (scored or quarantined)
    rows_quarantined: int = 0


_lock = threading.Lock()
_counts = Counts()


def reset() -> None:
    global _counts
    with _lock:
        _counts = Counts()


def add(shards_opened: int = 0, shards_done: int = 0, rows_known: int = 0, rows_done: int = 0,
        rows_quarantined: int = 0) -> None:
    with _lock:
        _counts.shards_opened += shards_opened
        _counts.shards_done += shards_done
        _counts.rows_known += rows_known
        _counts.rows_done += rows_done
        _counts.rows_quarantined += rows_quarantined


def snapshot() -> Counts:
    with _lock:
        return Counts(**vars(_counts))
