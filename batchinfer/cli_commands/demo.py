"""``batchinfer demo``: write and score the credit-risk demo (the work: :mod:`batchinfer.demo`)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ..demo import DEMO_ROWS
from ..errors import UsageError
from .results import Result

HELP = "write and score the credit-risk demo under ./demo/"
DIR = "demo"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=DIR, help=f"where to write it (default: ./{DIR})")
    p.add_argument("--rows", type=int, default=DEMO_ROWS, help="rows in all, a multiple of 6 (6 shards)")


@dataclass(frozen=True)
class Demoed(Result):
    """The demo prints as it goes; its exit code is the result."""

    exit_code: int

    def render(self, out: TextIO, err: TextIO) -> None:
        pass


def execute(args: argparse.Namespace) -> Demoed:
    from ..demo.walkthrough import run_demo

    if args.rows < 6 or args.rows % 6:
        raise UsageError(f"--rows {args.rows}: the demo writes 6 equal shards, so give a positive "
                         f"multiple of 6 (e.g. {max(6, args.rows - args.rows % 6)})")
    return Demoed(run_demo(Path(args.dir), rows=args.rows))
