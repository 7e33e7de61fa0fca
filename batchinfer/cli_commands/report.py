"""``batchinfer report OUTPUT``: (re)build ``report.html`` of a committed output (the work:
:mod:`batchinfer.app.job_report`)."""
from __future__ import annotations

import argparse

from .results import Lines

HELP = "(re)build report.html of a committed output"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output")


def execute(args: argparse.Namespace) -> Lines:
    from ..app.job_report import rebuild_report

    return Lines((f"wrote {rebuild_report(args.output)}",))
