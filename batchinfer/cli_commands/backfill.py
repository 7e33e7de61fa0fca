"""``batchinfer backfill JOB``: score each partition of a date range, skipping committed ones
(the work: :mod:`batchinfer.commands.backfill`). A line per date is printed as it ends."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from ..errors import UsageError
from .arguments import spec_options, update_or_overwrite, watcher
from .results import Result

if TYPE_CHECKING:
    from ..commands.backfill import PartitionResult

HELP = "score each partition in a date range, skipping committed ones"
LABELS = {"committed": "committed", "noop": "already committed", "lost_race": "committed by another run",
          "dry_run": "checked", "failed": "failed"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job spec (YAML)")
    p.add_argument("--start", help="first date YYYY-MM-DD")
    p.add_argument("--end", help="last date YYYY-MM-DD (included)")
    spec_options(p, "one date: the same as --start DS --end DS")
    p.add_argument("--overwrite", action="store_true", help="replace partitions committed under another triple")
    p.add_argument("--update", action="store_true",
                   help="committed partitions whose shards changed (late data): score only the "
                        "new and rewritten shards")
    p.add_argument("--dry-run", action="store_true", help="check every date, score nothing")
    p.add_argument("--keep-going", action="store_true", help="after a failing date, score the remaining ones")
    p.add_argument("--quiet", action="store_true", help="no progress display while scoring")


def date_line(result: PartitionResult) -> str:
    """What one date's line says once it ends."""
    if result.status == "committed" and result.manifest is not None:
        t = result.manifest.totals
        line = (f"committed: {t.rows_in} rows in, {t.rows_scored} scored, "
                f"{t.rows_quarantined} quarantined")
    elif result.status == "failed":
        line = f"failed (exit {result.exit_code}): {result.message}"
    else:
        line = result.message
    return f"{result.ds}  {line}"


@dataclass(frozen=True)
class Backfilled(Result):
    dates: tuple[str, ...]
    results: tuple[PartitionResult, ...]
    exit_code: int = 0   # the first failed date's

    @property
    def failed(self) -> list[PartitionResult]:
        return [r for r in self.results if r.status == "failed"]

    def render(self, out: TextIO, err: TextIO) -> None:
        dates, results = self.dates, self.results
        counts = {label: sum(LABELS[r.status] == label for r in results) for label in LABELS.values()}
        print(f"{len(dates)} partition(s): " + ", ".join(f"{n} {label}" for label, n in counts.items() if n)
              + (f", {len(dates) - len(results)} not attempted" if len(results) < len(dates) else ""),
              file=out)
        failed = self.failed
        if failed:
            stopped = f"; stopped after {failed[0].ds}" if len(results) < len(dates) else ""
            print(f"batchinfer backfill: {len(failed)} of {len(dates)} partition(s) failed: "
                  f"{', '.join(r.ds for r in failed)}{stopped}; rerun the same command to resume "
                  f"(committed partitions are skipped)", file=err)


def execute(args: argparse.Namespace) -> Backfilled:
    from ..commands.backfill import backfill, partition_dates

    update_or_overwrite(args)
    if args.ds and (args.start or args.end):
        raise UsageError("give --ds or --start/--end, not both")
    start, end = (args.ds, args.ds) if args.ds else (args.start, args.end)
    if not start or not end:
        raise UsageError("give --start and --end (or --ds for one date)")
    dates = partition_dates(start, end)
    print(f"backfill {args.job}: {len(dates)} partition(s), {dates[0]} to {dates[-1]}", flush=True)
    results = backfill(args.job, dates, overrides=args.overrides, overwrite=args.overwrite,
                       update=args.update, dry_run=args.dry_run, keep_going=args.keep_going,
                       progress=lambda line: print(f"            {line}", flush=True),
                       done=lambda result: print(date_line(result), flush=True),
                       watch=watcher(args.quiet))
    failed = [r for r in results if r.status == "failed"]
    return Backfilled(tuple(dates), tuple(results), failed[0].exit_code if failed else 0)
