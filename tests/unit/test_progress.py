"""Live progress (contract §6 "Live progress"): the counters a real pipeline bumps, and what the bar
and the plain lines show, rendered without a terminal.

The pipeline runs in process (the direct runner's in-memory mode, where the counters count); every
state the counters pass through is recorded by swapping their lock for one that takes a snapshot
each time it is released, so no assertion depends on when a poller happens to look. The run's final
figures are its Beam metrics, which must say what the process counters and the manifest say
(tests/with_servers/test_distributed_runners.py checks the same on Dask and the job service).
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import threading
from pathlib import Path

import pytest

from factories import DS, no_tracking, numeric_project  # noqa: F401  (a fixture)

SHARDS, ROWS, BATCH = 4, 600, 200

pytestmark = pytest.mark.usefixtures("no_tracking")  # MLflow is not under test here


class RecordingLock:
    """The counters' lock, keeping a copy of the counts each time a bump releases it."""

    def __init__(self, counters):
        self._lock = threading.Lock()
        self._counters = counters
        self.states: list = []

    def __enter__(self):
        self._lock.acquire()

    def __exit__(self, *exc):
        self.states.append(self._counters.Counts(**vars(self._counters._counts)))
        self._lock.release()


def test_shards_are_done_as_their_rows_are_written_not_at_the_end(tmp_path, monkeypatch):
    from batchinfer.app import run_progress as progress
    from batchinfer.app.run_progress import describe
    from batchinfer.commands.run import run_job
    from batchinfer.commands.stamp import stamp
    from batchinfer.pipeline import counters
    from batchinfer.spec import load_job

    job_path = numeric_project(tmp_path, shards=SHARDS, rows=ROWS, stamp=False,
                               batch={"rows": BATCH})
    stamp(load_job(job_path, require_ds=False), None, "model:1")
    recorder = RecordingLock(counters)
    monkeypatch.setattr(counters, "_lock", recorder)
    monkeypatch.setenv("BATCHINFER_PROGRESS_SECONDS", "3600")  # the last line only
    lines: list[str] = []
    watched: list[progress.Watching] = []

    @contextlib.contextmanager
    def watch(shards, live):
        with progress.watch(shards, "plain", live=live, emit=lines.append) as watching:
            watched.append(watching)
            yield watching

    outcome = run_job(load_job(job_path, ds=DS), watch=watch)
    assert outcome.status == "committed" and outcome.manifest is not None

    # The final figures are Beam's (committed), and say what the counters and the manifest say.
    (watching,) = watched
    assert watching.live == "process" and watching.kind == "committed"
    totals = outcome.manifest.totals
    assert watching.counts() == counters.snapshot() == counters.Counts(
        shards_opened=SHARDS, shards_done=totals.shards, rows_known=totals.rows_in,
        rows_done=totals.rows_in, rows_quarantined=totals.rows_quarantined)
    # The batch latencies and sizes as Beam distributions: the batches _metrics.json counts.
    from apache_beam.metrics.metric import MetricsFilter

    found = watching.result.metrics().query(MetricsFilter().with_namespace(counters.NAMESPACE))
    dists = {r.key.metric.name: r.committed for r in found["distributions"]}
    job = load_job(job_path, ds=DS)
    kept = json.loads((Path(job.spec.output.path) / "_metrics.json").read_text())["metrics"]
    assert dists[counters.BATCH_ROWS].count == kept["model_batches"] == SHARDS * ROWS // BATCH
    assert dists[counters.BATCH_ROWS].sum == kept["rows_in"]
    latency = dists[counters.MODEL_BATCH_LATENCY_US]
    assert latency.count == kept["model_batches"]
    assert abs(latency.max / 1000 - kept["model_latency_ms_max"]) <= 0.001
    rows = f"{SHARDS * ROWS:,}"
    assert lines[-1].startswith(f"progress: shards {SHARDS}/{SHARDS}, rows {rows}/{rows}, "), lines

    states = recorder.states
    final = states[-1]
    assert (final.shards_done, final.rows_done, final.shards_opened) == (SHARDS, SHARDS * ROWS, SHARDS)
    # Before the last rows are written, some shard already counts as done: the line says so.
    mid_run = [s for s in states if s.rows_done < SHARDS * ROWS and s.shards_done > 0]
    assert mid_run, [(s.shards_done, s.rows_done) for s in states]
    line = describe(mid_run[0], SHARDS, 1.0)[0]
    done = int(re.match(r"shards (\d+)/4, rows ([\d,]+)/", line).group(1))
    assert 0 < done < SHARDS, line
    # A shard is done exactly when its rows are: never more rows than its done shards hold...
    assert all(s.rows_done >= s.shards_done * ROWS for s in states)
    # ...and never a finished shard left uncounted (each shard's batches are written in order).
    assert all(s.shards_done >= s.rows_done // ROWS - 1 for s in states)


def test_an_empty_or_unreadable_shard_is_done_at_once():
    from batchinfer.pipeline import counters

    counters.reset()
    counters.shard_opened(0, 0)
    counters.shard_finished(1)            # unreadable
    counters.shard_opened(2, 10)
    counters.rows_written(2, 4, 1)
    assert counters.snapshot().shards_done == 2
    counters.rows_written(2, 6)
    counters.shard_finished(2)            # its result written, just after: not counted twice
    snap = counters.snapshot()
    assert (snap.shards_done, snap.rows_done, snap.rows_quarantined) == (3, 10, 1)


def _plain_text(ansi: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", ansi)


def test_the_bar_is_empty_until_a_footer_is_read_then_shows_the_share_done():
    """Rendered by rich to a string (a terminal it believes in): the first frame, before any
    footer is read, draws no filled bar and no row total; a frame after one does."""
    from rich.console import Console

    from batchinfer.app import run_progress as progress
    from batchinfer.pipeline import counters

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system="truecolor", width=200)
    with progress.watch(SHARDS, "rich", console=console):
        first = _plain_text(out.getvalue())
        counters.shard_opened(0, 100)
        counters.rows_written(0, 50)
        for _ in range(200):  # wait for the poller's next frame (4 a second)
            if "━" in _plain_text(out.getvalue()):
                break
            threading.Event().wait(0.05)
    assert "scoring" in first and "─" * progress.BAR_WIDTH in first, first
    assert "━" not in first, first
    later = _plain_text(out.getvalue())
    assert "━" * 20 + "─" not in later  # 50 of ~400 rows: an eighth of the bar
    assert "━" * 5 + "─" * 35 in later, later
    assert "rows 50/~400" in later, later


def test_plain_lines_before_and_during_the_run():
    from batchinfer.app.run_progress import bar, describe
    from batchinfer.pipeline.counters import Counts

    start, _, total = describe(Counts(), 12, 0.0)
    assert total is None
    assert start.startswith("shards 0/12, rows 0/?, "), start
    assert "━" not in bar(0, total)
    line, done, total = describe(Counts(shards_opened=3, shards_done=2, rows_known=300,
                                        rows_done=250), 12, 1.0)
    assert line.startswith("shards 2/12, rows 250/~1,200, 250 rows/s, ETA 0:00:03"), line
    assert bar(done, total, width=24) == "[bar.complete]━━━━━[/][bar.back]" + "─" * 19 + "[/]"
    assert bar(10, 10, width=4) == "[bar.complete]━━━━[/]"


def test_plain_mode_ends_on_where_scoring_ended(monkeypatch):
    """A short job may count all its rows between two polls: the last plain line still says
    what was done, not the first frame's ``rows 0/?``."""
    from batchinfer.app import run_progress as progress
    from batchinfer.pipeline import counters

    monkeypatch.setenv("BATCHINFER_PROGRESS_SECONDS", "3600")  # no poll prints during the block
    lines: list[str] = []
    with progress.watch(2, "plain", emit=lines.append):
        counters.shard_opened(0, 100)
        counters.rows_written(0, 100, 1)
    assert lines and lines[-1].startswith("progress: shards 1/2, rows 100/~200, "), lines


def _bump(shard):
    from batchinfer.pipeline import counters

    counters.shard_opened(shard, 100)
    counters.rows_written(shard, 60, 1)
    counters.rows_written(shard, 40, last=True)
    return shard


def test_a_runner_without_live_figures_says_so_then_shows_its_final_beam_metrics(monkeypatch):
    """``live="end"`` (the job service, the direct runner's worker processes): one line saying
    progress is not available live, nothing while the job runs — not zeros —, then the figures of
    the pipeline result's Beam metrics, which a real FnApiRunner run in this process gives."""
    from batchinfer.app import run_progress as progress
    from batchinfer.beam_compat import beam
    from batchinfer.pipeline import counters

    monkeypatch.setenv("BATCHINFER_PROGRESS_SECONDS", "0.05")
    lines: list[str] = []
    with progress.watch(3, "plain", live="end", emit=lines.append) as watching:
        pipeline = beam.Pipeline(
            runner="apache_beam.runners.portability.fn_api_runner.FnApiRunner")
        _ = pipeline | beam.Create([0, 1, 2]) | beam.Map(_bump)
        result = pipeline.run()
        result.wait_until_finish()
        assert lines == [f"progress: {progress.NOT_LIVE}"]   # the process counters moved: unread
        assert counters.snapshot().rows_done == 300
        watching.end(result)
    assert watching.kind == "committed"
    assert watching.counts() == counters.Counts(shards_opened=3, shards_done=3, rows_known=300,
                                                rows_done=300, rows_quarantined=3)
    assert len(lines) == 2 and lines[-1].startswith("progress: shards 3/3, rows 300/300, "), lines
    assert lines[-1].endswith(", 3 quarantined"), lines


def test_a_runner_that_reports_no_metrics_gets_no_figures_not_zeros():
    """A result whose Beam metrics hold none of batchinfer's counters (Beam's own DaskRunner
    dropped every one): the last line says there are no figures."""
    from batchinfer.app import run_progress as progress
    from batchinfer.beam_compat import beam

    lines: list[str] = []
    with progress.watch(2, "plain", live="result", emit=lines.append) as watching:
        pipeline = beam.Pipeline(
            runner="apache_beam.runners.portability.fn_api_runner.FnApiRunner")
        _ = pipeline | beam.Create([0, 1])
        watching.end(pipeline.run())
    assert watching.counts() is None
    assert lines == [f"progress: {progress.NO_FIGURES}"], lines
