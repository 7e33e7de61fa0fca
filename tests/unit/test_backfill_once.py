"""``backfill`` pays once what does not change between dates (commands/backfill.py): MLflow's
helper is started for the first date before anything else (its job, loaded for the spec check,
is the first date's), later dates take the helper each run hands on; the runner's options are
checked once. Each date is still a ``run_job`` of its own: the end-to-end behaviour is in
tests/e2e/test_backfill_diff.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from factories import write_job

DATES = ["2026-01-15", "2026-01-16", "2026-01-17"]


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    from batchinfer.commands import backfill as backfill_module
    from batchinfer.commands import run as run_module
    from batchinfer.io import tracking as tracking_module
    from batchinfer.pipeline import runner_options

    write_job(tmp_path)
    started, calls, loads = [], [], []

    class FakeTracking:
        def __init__(self, uri, experiment):
            started.append((uri, experiment))

    def run_job(job, **kwargs):
        calls.append((job.ds, kwargs["tracking"], runner_options._passed.get() is not None))
        return SimpleNamespace(status="committed", message="ok", manifest=None)

    real_load = backfill_module.load_job

    def load_job(*args, **kwargs):
        loads.append(kwargs["ds"])
        return real_load(*args, **kwargs)

    monkeypatch.setattr(tracking_module, "TrackingRun", FakeTracking)
    monkeypatch.setattr(run_module, "run_job", run_job)
    monkeypatch.setattr(backfill_module, "load_job", load_job)
    return backfill_module.backfill, tmp_path / "job.yaml", started, calls, loads


def test_the_first_date_gets_the_helper_started_first_and_each_date_is_its_own_run(recorded):
    backfill, job, started, calls, loads = recorded
    results = backfill(job, DATES)
    assert [r.status for r in results] == ["committed"] * 3
    assert started == [(f"sqlite:///{job.parent / 'mlflow.db'}", "testjob")]   # the first date's
    assert [ds for ds, _, _ in calls] == DATES and loads == DATES   # the spec loaded once a date
    assert calls[0][1] is not None and [t for _, t, _ in calls[1:]] == [None, None]
    assert all(once for _, _, once in calls)   # within runner_options.checked_once()


def test_a_dry_run_starts_no_helper(recorded):
    backfill, job, started, calls, _ = recorded
    backfill(job, DATES[:2], dry_run=True)
    assert started == [] and [t for _, t, _ in calls] == [None, None]
