"""``batchinfer profile JOB --out PROFILE``: the baseline profile of a committed partition (the
work: :mod:`batchinfer.commands.profile`)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from .arguments import job_args, load
from .results import Result

if TYPE_CHECKING:
    from ..commands.profile import ProfileWritten

HELP = "write the baseline profile of a committed partition (monitor.baseline)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    job_args(p)
    p.add_argument("--out", required=True, help="the profile file to write (JSON)")


@dataclass(frozen=True)
class Profiled(Result):
    written: ProfileWritten
    out: str

    def render(self, out: TextIO, err: TextIO) -> None:
        w = self.written
        print(f"profiled {w.rows} scored rows ({w.features} feature and {w.predictions} "
              f"prediction columns) into {self.out}", file=out)
        print("use it with: monitor: {baseline: " + self.out + "}", file=out)


def execute(args: argparse.Namespace) -> Profiled:
    from ..commands.profile import profile_partition

    return Profiled(profile_partition(load(args), args.out), args.out)
