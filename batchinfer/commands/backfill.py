"""``batchinfer backfill``: score every partition of a date range, one after another (contract §2).

Each date is a ``run`` of its own: the same checks, its own commit and its own MLflow run.
Partitions already committed with the job's triple are no-ops, so a backfill that stopped (a
failure, Ctrl-C, a lost machine) is resumed by starting it again. By default it stops at the
first partition that fails; ``keep_going`` scores the rest and reports every failure.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import BatchInferError, SpecError
from ..io.records import Manifest
from ..spec import check_date, load_job
from .remedies import error_line


@dataclass(frozen=True)
class PartitionResult:
    """What happened to one date: ``status`` is an Outcome status or ``failed``."""

    ds: str
    status: str
    message: str
    exit_code: int = 0
    manifest: Manifest | None = None


def partition_dates(start: str, end: str) -> list[str]:
    """Every date from ``start`` to ``end``, both included, as YYYY-MM-DD.

    Raises:
        SpecError: a date that is not YYYY-MM-DD or not a real day, or ``end`` before ``start``.
    """
    first, last = check_date(start, "--start"), check_date(end, "--end")
    if last < first:
        raise SpecError(f"--end {end} is before --start {start}")
    return [(first + timedelta(days=n)).isoformat() for n in range((last - first).days + 1)]


def backfill(job_path: str | Path, dates: Sequence[str], *, overrides: Sequence[str] = (),
             overwrite: bool = False, update: bool = False, dry_run: bool = False,
             keep_going: bool = False,
             progress: Callable[[str], None] = lambda line: None,
             done: Callable[[PartitionResult], None] = lambda result: None,
             watch: Callable[[int, str], Any] | None = None) -> list[PartitionResult]:
    """Run the job for each date in order; return one result per date attempted. ``update``
    (``--update``): a committed partition whose shards changed since (late data) gets its new
    and rewritten shards scored (contract §5.3 "Update"), an unchanged one stays a no-op.

    The spec is loaded for the first date before anything runs, so an error in the spec itself
    is raised (exit 2) instead of being reported once per date. KeyboardInterrupt propagates.

    One process runs every date, so what does not change between dates is paid once: MLflow's
    helper process (started here, before Beam is imported, and kept from one date's run to the
    next: ``io/tracking.py``), the model's load (``handlers/sharing.py``), the runner's options
    check (``pipeline/runner_options.checked_once``), the imports. Each date is still a run of
    its own: its checks, attempt, commit and MLflow run.
    """
    first = load_job(job_path, ds=dates[0], overrides=overrides)  # raises SpecError: nothing to attempt
    tracking = None
    if not dry_run:  # its import of MLflow runs while this process imports Beam and the rest
        from ..io.tracking import TrackingRun

        tracking = TrackingRun(first.spec.tracking.uri, first.spec.tracking.experiment or first.spec.name)
    from ..pipeline.runner_options import checked_once
    from .run import run_job

    results = []
    with checked_once():
        for ds in dates:
            try:
                job = first if ds == dates[0] else load_job(job_path, ds=ds, overrides=overrides)
                outcome = run_job(job, overwrite=overwrite, update=update, dry_run=dry_run,
                                  progress=progress, watch=watch,
                                  tracking=tracking if ds == dates[0] else None)
                result = PartitionResult(ds, outcome.status, outcome.message, 0, outcome.manifest)
            except BatchInferError as exc:
                # Messages are masked when made (batchinfer.redaction): no ${NAME} value in them.
                result = PartitionResult(ds, "failed", error_line(exc), exc.exit_code)
            results.append(result)
            done(result)
            if result.status == "failed" and not keep_going:
                break
    return results
