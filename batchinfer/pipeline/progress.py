"""Process-wide progress counters that the pipeline's stages bump once per shard or batch.

Live progress (``commands/progress.py``) polls them from the driver. They are plain integers
under a lock, touched a few times per batch of tens of thousands of rows: no per-row work. They
count only what runs in this process (the direct runner's in-memory mode, the default); with a
runner whose workers are elsewhere they stay at zero and progress shows nothing moving.

A shard is done once all the rows its footer announced are written (scored or quarantined), or
once it is known to be unreadable — not only when ``FinishShard`` folds its records, which comes
after a GroupByKey and so, on the direct runner, only at the end of the whole partition.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class Counts:
    shards_opened: int = 0        # shards whose footer was read (their rows are known)
    shards_done: int = 0          # shards whose rows are all written, or that are unreadable
    rows_known: int = 0           # rows in the footers of the shards opened so far
    rows_done: int = 0            # rows written (scored or quarantined)
    rows_quarantined: int = 0


_lock = threading.Lock()
_counts = Counts()
_rows_left: dict[int, int] = {}   # shard index → rows of its footer not written yet
_done: set[int] = set()           # shard indices counted in shards_done


def reset() -> None:
    global _counts
    with _lock:
        _counts = Counts()
        _rows_left.clear()
        _done.clear()


def shard_opened(shard: int, rows: int) -> None:
    """``shard``'s footer was read: it holds ``rows`` rows (done at once when it has none)."""
    with _lock:
        _counts.shards_opened += 1
        _counts.rows_known += rows
        _rows_left[shard] = _rows_left.get(shard, 0) + rows
        if _rows_left[shard] <= 0:
            _finish(shard)


def rows_written(shard: int, rows: int, quarantined: int = 0) -> None:
    """One batch of ``shard`` is written: ``rows`` rows in, ``quarantined`` of them quarantined."""
    with _lock:
        _counts.rows_done += rows
        _counts.rows_quarantined += quarantined
        if shard in _rows_left:
            _rows_left[shard] -= rows
            if _rows_left[shard] <= 0:
                _finish(shard)


def shard_finished(shard: int) -> None:
    """``shard`` is done whatever its rows say: unreadable, or its result is in scratch (counted
    once, however many of these calls and :func:`rows_written` say so)."""
    with _lock:
        _finish(shard)


def _finish(shard: int) -> None:
    if shard not in _done:
        _done.add(shard)
        _counts.shards_done += 1


def snapshot() -> Counts:
    with _lock:
        return Counts(**vars(_counts))
