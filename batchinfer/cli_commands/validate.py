"""``batchinfer validate JOB``: check the input against the schema and the preprocessing (the
work: :mod:`batchinfer.app.input_validation`); exit 4 where ``run`` would refuse to commit."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from ..errors import BatchInferError
from .arguments import job_args, load
from .results import Result, table_read

if TYPE_CHECKING:
    from ..app.input_validation import ValidationReport
    from ..spec import Job

HELP = "check the input against the schema and the preprocessing"


def add_arguments(p: argparse.ArgumentParser) -> None:
    job_args(p)


@dataclass(frozen=True)
class Validated(Result):
    job: Job
    report: ValidationReport
    breach: str | None                # above the quarantine thresholds: why (then exit 4)
    exit_code: int = 0
    error: Exception | None = None    # the breach is a preprocessing fault (exit 2)

    def render(self, out: TextIO, err: TextIO) -> None:
        job, report = self.job, self.report
        q = job.spec.quarantine
        if report.table is not None:
            print(f"input: {report.table.format} table {job.display(report.table.table)}, "
                  f"{table_read(report.table, None)}", file=out)
        print(f"{report.shards} shards, {report.rows_in} rows, {report.rows_bad} bad "
              f"({report.bad_fraction:.2%}; max {q.max_bad_fraction:.2%}), "
              f"{len(report.unreadable)} unreadable (max {q.max_bad_shards})", file=out)
        raised = report.preprocess.raised
        for (column, check), n in sorted(report.by_reason.items(), key=lambda kv: -kv[1]):
            if check == "preprocess" and raised:   # by exception type: the reason is the error
                for kind, rows in sorted(raised.items(), key=lambda kv: -kv[1]):
                    print(f"  {rows:>8}  (row): preprocess {kind} (first: {report.preprocess.first[kind]})",
                          file=out)
                continue
            print(f"  {n:>8}  {column or '(row)'}: {check}", file=out)
        for name, reason in report.unreadable:
            print(f"  unreadable  {name}: {reason}", file=out)
        for name in report.ignored:
            print(f"  ignored     {name}: metadata (name starts with _ or .), not a shard", file=out)
        if self.breach:
            print(f"batchinfer validate: above the quarantine thresholds ({self.breach}): `run` would "
                  f"exit 4", file=err)


def execute(args: argparse.Namespace) -> Validated:
    from ..app.input_validation import validate_input

    job = load(args)
    report = validate_input(job)
    try:
        breach = report.breach(job)
    except BatchInferError as exc:   # printed after the report's lines, as run would say it
        return Validated(job, report, None, error=exc)
    return Validated(job, report, breach, 4 if breach else 0)
