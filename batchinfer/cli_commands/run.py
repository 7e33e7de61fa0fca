"""``batchinfer run JOB``: score one partition (the work: :mod:`batchinfer.commands.run`)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from .arguments import job_args, load, update_or_overwrite, watcher
from .results import Result, totals_line

if TYPE_CHECKING:
    from ..commands.run import Outcome

HELP = "score one partition"


def add_arguments(p: argparse.ArgumentParser) -> None:
    job_args(p)
    p.add_argument("--overwrite", action="store_true", help="replace a partition committed under another triple")
    p.add_argument("--update", action="store_true",
                   help="on a committed partition whose shards changed: score only the new and "
                        "rewritten shards, keep the others, drop the removed ones")
    p.add_argument("--dry-run", action="store_true", help="check everything, score nothing")
    p.add_argument("--quiet", action="store_true", help="no progress display while scoring")


@dataclass(frozen=True)
class Ran(Result):
    outcome: Outcome

    def render(self, out: TextIO, err: TextIO) -> None:
        outcome = self.outcome
        print(outcome.message, file=out)
        if outcome.status == "committed" and outcome.manifest is not None:
            print(totals_line(outcome.manifest), file=out)
            print(f"tracking: {outcome.tracking}", file=out)
            print(f"wall time: {outcome.timings['wall_s']:.1f} s", file=out)


def execute(args: argparse.Namespace) -> Ran:
    update_or_overwrite(args)
    job = load(args)
    tracking = None
    if not args.dry_run:  # MLflow's helper starts first: it takes longer than our own imports
        from ..io.tracking import TrackingRun

        tracking = TrackingRun(job.spec.tracking.uri, job.spec.tracking.experiment or job.spec.name)
    from ..commands.run import run_job

    return Ran(run_job(job, overwrite=args.overwrite, update=args.update, dry_run=args.dry_run,
                       progress=print, tracking=tracking, watch=watcher(args.quiet)))
