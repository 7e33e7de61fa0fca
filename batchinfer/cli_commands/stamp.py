"""``batchinfer stamp MODEL --job JOB``: write a model's declaration of the version triple (the
work: :mod:`batchinfer.commands.stamp`)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from .arguments import load, spec_options
from .results import Result

if TYPE_CHECKING:
    from ..triple.contract import Triple

HELP = "write a model's declaration (version triple)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..triple.contract import PACKAGE_POLICIES

    p.add_argument("model", help="model file or models:/name/version")
    p.add_argument("--job", required=True, help="the job whose schema and preprocessing to declare")
    p.add_argument("--model-version", help="e.g. credit_risk:3 (default: the job's model.version)")
    p.add_argument("--challenger", metavar="NAME",
                   help="stamp MODEL as the job's challenger NAME (its backend, options, version)")
    p.add_argument("--baseline", metavar="PROFILE",
                   help="declare this profile (batchinfer profile) as the model's drift baseline")
    p.add_argument("--packages", choices=PACKAGE_POLICIES, default=PACKAGE_POLICIES[0],
                   help="when the installed packages the preprocessing imports differ from the "
                        f"stamped versions, a run {PACKAGE_POLICIES[0]}s (default) or exits 3")
    spec_options(p, "the partition date, if the spec's paths need one")


@dataclass(frozen=True)
class Stamped(Result):
    model: str
    triple: Triple
    where: str

    def render(self, out: TextIO, err: TextIO) -> None:
        print(f"declared {self.model} in {self.where}:", file=out)
        for key, value in self.triple.as_dict().items():
            print(f"  {key:<16} {value}", file=out)


def execute(args: argparse.Namespace) -> Stamped:
    from ..commands.stamp import stamp

    job = load(args, require_ds=False)
    triple, where = stamp(job, args.model, args.model_version, args.challenger, args.baseline,
                          args.packages)
    return Stamped(args.model, triple, str(where))
