"""Live progress of a run: shards and rows done of the total, rows/s, ETA, quarantined so far.

A driver thread polls the pipeline's counts (:mod:`batchinfer.pipeline.counters`) while the
pipeline runs, from where the runner has them (``live``, the runner's ``live_metrics``): the
process-wide counters of a pipeline that runs in this process (``process``), the pipeline
result's Beam metrics (``result``: polled at most every :data:`RESULT_POLL_S` seconds, attempted
figures), or nowhere (``end``: the runner reports its metrics when the job ends, and progress
says so rather than show zeros). The pipeline itself only bumps them once per batch. On a
terminal it draws a ``rich`` progress bar (removed when scoring ends: the run's summary
follows); otherwise it prints a plain line every ``BATCHINFER_PROGRESS_SECONDS`` (default 30)
when something moved, and one last line where scoring ended, from the result's Beam metrics
(committed where the runner gives them); ``--quiet`` shows nothing.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import IO, Any, Callable, Iterator

from ..pipeline import counters

MODES = ("rich", "plain", "quiet")
LIVE = ("process", "result", "end")
RESULT_POLL_S = 2.0
NOT_LIVE = "not available live on this runner (it reports its metrics when the job ends)"
NO_FIGURES = "no figures: the runner reported no batchinfer metrics"
log = logging.getLogger("batchinfer")


class Watching:
    """Where the figures come from while the pipeline runs, and once it has ended.

    ``live``: see :data:`LIVE`. :meth:`follow` is told the pipeline's result as the runner hands
    it over, :meth:`end` once the job has ended; :meth:`counts` is what to show now (None: no
    figure to show yet on this runner)."""

    def __init__(self, live: str):
        if live not in LIVE:
            raise ValueError(f"live must be one of {LIVE}, not {live!r}")
        self.live = live
        self.result: Any = None
        self._final: counters.Counts | None = None
        self._polled: counters.Counts | None = None
        self._polled_at = -RESULT_POLL_S
        self._ended = False
        self.kind = ""   # which Beam figures the final counts are: committed or attempted

    def follow(self, result: Any) -> None:
        self.result = result

    def end(self, result: Any) -> None:
        """The job ended: its final figures, from its Beam metrics (the live source's where the
        runner has none)."""
        try:
            found = counters.from_metrics(result.metrics(), prefer="committed")
        except Exception as exc:   # a runner without metrics: say so, keep what was counted
            log.warning("progress: the runner's metrics could not be read (%s)", exc)
            found = None
        self._ended = True
        if found is not None:
            self._final, self.kind = found

    @property
    def ended(self) -> bool:
        """:meth:`end` was called (the job ended, whether its metrics could be read or not)."""
        return self._ended

    def counts(self) -> counters.Counts | None:
        if self._final is not None:
            return self._final
        if self._ended and self.live != "process":   # no figures, rather than zeros
            return None
        if self.live == "process":
            return counters.snapshot()
        if self.live == "result" and self.result is not None:
            now = time.perf_counter()
            if now - self._polled_at >= RESULT_POLL_S:
                self._polled_at = now
                try:
                    found = counters.from_metrics(self.result.metrics(), prefer="attempted")
                except Exception:   # the runner could not answer this time: keep the last
                    found = None
                if found is not None:
                    self._polled = found[0]
            return self._polled or counters.Counts()
        if self.live == "result":
            return counters.Counts()   # not handed over yet: nothing has run
        return None


def choose_mode(quiet: bool, stream: IO[str] | None = None) -> str:
    if quiet:
        return "quiet"
    stream = stream or sys.stdout
    return "rich" if stream.isatty() else "plain"


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


BAR_WIDTH = 40


def describe(snap: counters.Counts, shards: int, elapsed: float) -> tuple[str, int, int | None]:
    """The progress line, rows done and rows expected in all: estimated from the shards opened
    until every footer is read, and None (unknown) before the first footer is read."""
    total: int | None = None
    if snap.shards_opened:
        total = snap.rows_known
        if snap.shards_opened < shards:
            total = int(snap.rows_known / snap.shards_opened * shards)
        total = max(total, snap.rows_done)
    rate = snap.rows_done / elapsed if elapsed > 0 else 0.0
    left = (total - snap.rows_done) / rate if rate > 0 and total is not None else None
    shown = "?" if total is None else f"{'~' if snap.shards_opened < shards else ''}{total:,}"
    line = (f"shards {snap.shards_done}/{shards}, rows {snap.rows_done:,}/{shown}, "
            f"{rate:,.0f} rows/s, ETA {_eta(left)}, {snap.rows_quarantined:,} quarantined")
    return line, snap.rows_done, total


def bar(done: int, total: int | None, width: int = BAR_WIDTH) -> str:
    """The bar, as rich markup: ``━`` for the share of rows done, a thin ``─`` for the rest.

    Drawn by us rather than by rich's BarColumn, whose empty part is the same ``━`` in grey: on
    many terminals (and in any captured text) a bar that has not started looks full. While the
    row total is unknown (no footer read yet) the bar is empty."""
    filled = min(width, width * done // total) if total else 0
    parts = []
    if filled:
        parts.append(f"[bar.complete]{'━' * filled}[/]")
    if filled < width:
        parts.append(f"[bar.back]{'─' * (width - filled)}[/]")
    return "".join(parts)


@contextlib.contextmanager
def watch(shards: int, mode: str, *, live: str = "process", label: str = "scoring",
          emit: Callable[[str], None] = lambda line: print(line, flush=True),
          console: Any = None) -> Iterator[Watching]:
    """Show progress while the block runs (the pipeline), in ``mode`` (see :data:`MODES`), from
    ``live`` (see :data:`LIVE`); yields the :class:`Watching` to tell the result.
    ``console``: the rich Console to draw on (default: stdout's)."""
    watching = Watching(live)
    if mode == "quiet":
        yield watching
        return
    counters.reset()
    start = time.perf_counter()
    if mode == "rich":
        from rich.progress import Progress, TextColumn

        progress = Progress(TextColumn("{task.description}"), TextColumn("{task.fields[bar]}"),
                            TextColumn("{task.fields[line]}"), transient=True,
                            refresh_per_second=4, console=console)
        def fields() -> tuple[str, str]:
            snap = watching.counts()
            if snap is None:
                return bar(0, None), NOT_LIVE
            line, done, total = describe(snap, shards, time.perf_counter() - start)
            return bar(done, total), line

        # The first frame already says what is counted (shards 0/N, rows 0/?): a short job may
        # end before the first poll.
        shown, line = fields()
        task = progress.add_task(label, total=None, bar=shown, line=line)

        def tick() -> None:
            shown, line = fields()
            progress.update(task, bar=shown, line=line)

        with progress, _polling(tick, 0.25):
            yield watching
        return
    every = float(os.environ.get("BATCHINFER_PROGRESS_SECONDS", "30"))
    last = {"at": start, "done": -1}
    if live == "end":
        emit(f"progress: {NOT_LIVE}")

    def plain(final: bool = False) -> None:
        snap = watching.counts()
        now = time.perf_counter()
        if snap is None:
            if final and watching.ended:
                emit(f"progress: {NO_FIGURES}")
            return
        if snap.rows_done != last["done"] and (final or now - last["at"] >= every):
            last["at"], last["done"] = now, snap.rows_done
            emit(f"progress: {describe(snap, shards, now - start)[0]}")

    with _polling(plain, min(1.0, max(every, 0.05))):
        yield watching
    # A last line with where scoring ended (the runner's final Beam metrics): a short job's rows
    # may all be counted between two polls, and the log should not end on a line that says less
    # than was done.
    plain(final=True)


@contextlib.contextmanager
def _polling(tick: Callable[[], None], interval: float) -> Iterator[None]:
    """Call ``tick`` every ``interval`` seconds on a thread of its own while the block runs."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(interval):
            tick()

    thread = threading.Thread(target=poll, daemon=True, name="batchinfer-progress")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
