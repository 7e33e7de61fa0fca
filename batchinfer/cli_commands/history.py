"""``batchinfer history JOB|OUTPUT --start D --end D``: one page (or ``--json``) of a job's
committed dates (the work: :mod:`batchinfer.commands.history`)."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from ..errors import UsageError
from .arguments import SET_HELP
from .results import Result

if TYPE_CHECKING:
    from ..app.job_history import History

HELP = "one page of a job's dates: rows, quarantine, drift, scores, changes, compute"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="JOB|OUTPUT",
                   help="job spec (YAML), or the job's output: the folder of its partitions, its "
                        "tables' root, or a path with {ds}")
    p.add_argument("--start", required=True, help="first date YYYY-MM-DD")
    p.add_argument("--end", required=True, help="last date YYYY-MM-DD (included)")
    p.add_argument("--out", help="where to write the page (a path or URL; default: history.html "
                                 "beside the last date's report)")
    p.add_argument("--json", action="store_true",
                   help="print the history as JSON (and write the page only if --out is given)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help=f"with a job spec: {SET_HELP}")


@dataclass(frozen=True)
class HistoryRead(Result):
    history: History
    written: str | None
    as_json: bool = False

    def render(self, out: TextIO, err: TextIO) -> None:
        if self.as_json:
            print(json.dumps(self.history.to_dict(), indent=1), file=out)
            return
        h = self.history
        counts = h.counts()
        gaps = ", ".join(f"{counts[s]} {s}" for s in ("missing", "uncommitted", "unreadable") if counts[s])
        print(f"wrote {self.written}: {counts['dates']} dates from {h.dates[0]} to {h.dates[-1]}, "
              f"{counts['committed']} committed, {counts['gaps']} gap(s){f' ({gaps})' if gaps else ''}, "
              f"{len(h.changes)} change(s)", file=out)
        for ds, notes in h.notes.items():
            for note in notes:
                print(f"  {ds}  {note}", file=out)


def execute(args: argparse.Namespace) -> HistoryRead:
    from ..commands.history import (
        history_dates,
        is_job_spec,
        job_partitions,
        output_partitions,
        read_history,
        write_page,
    )

    dates = history_dates(args.start, args.end)
    if is_job_spec(args.source):
        partitions = job_partitions(args.source, dates, args.overrides)
    elif args.overrides:
        raise UsageError("--set applies to a job spec, not to an output")
    else:
        partitions = output_partitions(args.source, dates)
    history = read_history(partitions, dates)
    written = write_page(history, partitions, args.out) if args.out or not args.json else None
    return HistoryRead(history, written, args.json)
