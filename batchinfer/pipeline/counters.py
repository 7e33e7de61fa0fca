"""What the pipeline's stages count once per shard or batch, twice over: as Beam metrics (counters
and distributions in the ``batchinfer`` namespace), which every runner collects from its
workers, and in process-wide counters, which only see what runs in this process.

Live progress (``app/run_progress.py``) reads one or the other, as the runner allows
(:data:`batchinfer.runners.Runner.live_metrics`, docs/runners.md "Progress and metrics"): the
direct runner's FnApiRunner hands its Beam metrics over only when the pipeline has ended, so
while it runs in this process (its in-memory and multi-threaded modes) the process-wide
counters are what moves; a runner whose result reports metrics while the job runs (Dask,
Dataflow) is polled; every runner's final figures are its Beam metrics. They are touched a few
times per batch of tens of thousands of rows: no per-row work.

A shard is done once all the rows its footer announced are written (scored or quarantined), or
once it is known to be unreadable. The Beam counter knows it without state shared between
workers: ``ReadShard`` marks a shard's last batch, and the writer counts the shard done when it
writes that batch (a shard's batches are read and written by one worker), the moment it writes
the shard's result.

Beam metrics count only on a thread that Beam runs the step on (its metrics container is the
thread's): they are bumped where a step's results are yielded, never on a writer thread.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..beam_compat import beam

NAMESPACE = "batchinfer"
# Beam distributions hold integers: latencies in microseconds (Beam's own
# inference_batch_latency_micro_secs is the model's).
BATCH_ROWS = "batch_rows"
MODEL_BATCH_LATENCY_US = "model_batch_latency_us"
WRITE_BATCH_US = "write_batch_us"
READ_BATCH_US = "read_batch_us"


@dataclass
class Counts:
    shards_opened: int = 0        # shards whose footer was read (their rows are known)
    shards_done: int = 0          # shards whose rows are all written, or that are unreadable
    rows_known: int = 0           # rows in the footers of the shards opened so far
    rows_done: int = 0            # rows written (scored or quarantined)
    rows_quarantined: int = 0


COUNTERS = tuple(Counts.__dataclass_fields__)   # the Beam counters' names: Counts' fields
_beam = {name: beam.metrics.Metrics.counter(NAMESPACE, name) for name in COUNTERS}
_distributions = {name: beam.metrics.Metrics.distribution(NAMESPACE, name)
                  for name in (BATCH_ROWS, MODEL_BATCH_LATENCY_US, WRITE_BATCH_US, READ_BATCH_US)}

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
    _beam["shards_opened"].inc()
    _beam["rows_known"].inc(rows)
    if rows <= 0:
        _beam["shards_done"].inc()
    with _lock:
        _counts.shards_opened += 1
        _counts.rows_known += rows
        _rows_left[shard] = _rows_left.get(shard, 0) + rows
        if _rows_left[shard] <= 0:
            _finish(shard)


def shard_unreadable(shard: int) -> None:
    """``shard`` turned out unreadable (its last batch never reached a writer: ReadShard sends it
    on only once the shard was read to its end)."""
    _beam["shards_done"].inc()
    shard_finished(shard)


def rows_written(shard: int, rows: int, quarantined: int = 0, *, last: bool = False) -> None:
    """One batch of ``shard`` is written: ``rows`` rows in, ``quarantined`` of them quarantined;
    ``last``: the shard's last batch."""
    _beam["rows_done"].inc(rows)
    _beam["rows_quarantined"].inc(quarantined)
    if last:
        _beam["shards_done"].inc()
    with _lock:
        _counts.rows_done += rows
        _counts.rows_quarantined += quarantined
        if shard in _rows_left:
            _rows_left[shard] -= rows
            if _rows_left[shard] <= 0:
                _finish(shard)


def batch_timings(rows: int, seconds: dict[str, float], model_ms: float | None) -> None:
    """One written batch's size and latencies, as Beam distributions (microseconds)."""
    _distributions[BATCH_ROWS].update(rows)
    if model_ms is not None:
        _distributions[MODEL_BATCH_LATENCY_US].update(int(model_ms * 1000))
    for stage, name in (("read", READ_BATCH_US), ("write", WRITE_BATCH_US)):
        if stage in seconds:
            _distributions[name].update(int(seconds[stage] * 1e6))


def shard_finished(shard: int) -> None:
    """``shard`` is done whatever its rows say: unreadable, or its result is in scratch (counted
    once in process, however many of these calls and :func:`rows_written` say so; no Beam
    counter: the writer or the reader counted it)."""
    with _lock:
        _finish(shard)


def _finish(shard: int) -> None:
    if shard not in _done:
        _done.add(shard)
        _counts.shards_done += 1


def snapshot() -> Counts:
    """The process-wide counters."""
    with _lock:
        return Counts(**vars(_counts))


def from_metrics(results: Any, *, prefer: str = "committed") -> tuple[Counts, str] | None:
    """The :class:`Counts` in a runner's Beam metrics (``PipelineResult.metrics()``), summed over
    the steps that bump them, and which figures they are: ``prefer`` (``committed`` or
    ``attempted``) where the runner gives them, else the other. None when it reports none of
    batchinfer's counters (yet, or at all)."""
    from apache_beam.metrics.metric import MetricsFilter

    found = results.query(MetricsFilter().with_namespace(NAMESPACE))["counters"]
    other = "attempted" if prefer == "committed" else "committed"
    counts, kind = Counts(), None
    for result in found:
        if result.key.metric.name not in COUNTERS:
            continue
        value = getattr(result, prefer)
        which = prefer
        if value is None:
            value, which = getattr(result, other), other
        if value is None:
            continue
        kind = kind or which
        name = result.key.metric.name
        setattr(counts, name, getattr(counts, name) + int(value))
    return None if kind is None else (counts, kind)
