"""``batchinfer inspect OUTPUT``: summarise a committed output (the work:
:mod:`batchinfer.commands.inspect`)."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from .results import Result, totals_line

if TYPE_CHECKING:
    from ..io.records import Manifest

HELP = "summarise a committed output"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")


@dataclass(frozen=True)
class Inspected(Result):
    output: str
    manifest: Manifest
    as_json: bool

    def render(self, out: TextIO, err: TextIO) -> None:
        if self.as_json:
            print(json.dumps(self.manifest.to_dict(), indent=2), file=out)
            return
        for line in self.lines():
            print(line, file=out)

    def lines(self) -> list[str]:
        manifest = self.manifest
        lines = [f"{self.output}: job {manifest.job}, ds {manifest.ds}, attempt {manifest.attempt}"]
        lines += [f"  {key:<16} {value}" for key, value in manifest.triple.items()]
        lines.append(f"runner {manifest.runner}, device {manifest.device}, "
                     f"{manifest.started_at} → {manifest.finished_at}, MLflow run {manifest.mlflow_run_id}")
        lines.append(totals_line(manifest))
        by_status: dict[str, int] = {}
        for shard in manifest.shards:
            by_status[shard.status] = by_status.get(shard.status, 0) + 1
        lines.append("shards by status: " + ", ".join(f"{k} {v}" for k, v in sorted(by_status.items())))
        lines += [f"  {shard.status:<12} {shard.path}: {shard.reason or ''}"
                  for shard in manifest.shards if shard.status != "scored"]
        files = [f for s in manifest.shards for f in s.files]
        lines.append(f"files: {len(files)} ({sum(f.rows for f in files)} rows)")
        reused = manifest.reused()
        if reused:   # a resumed or updated run (contract §5.3 "Resume", "Update"): who scored what
            by: dict[str, int] = {}
            for shard in reused:
                by[manifest.scored_by(shard)] = by.get(manifest.scored_by(shard), 0) + 1
            lines.append(f"reused: {len(reused)} of {len(manifest.shards)} shards "
                         f"({sum(s.rows_in or 0 for s in reused)} rows) scored by earlier attempt(s) "
                         + ", ".join(f"{a} ({n})" for a, n in sorted(by.items()))
                         + f"; {len(manifest.shards) - len(reused)} scored by {manifest.attempt}")
        for c in manifest.challengers:
            lines.append(f"challenger {c.name}: {c.triple.get('model_version')} ({c.backend}, {c.device}): "
                         f"{c.rows_scored} rows scored, {c.rows_rejected} rejected, "
                         f"{sum(len(s.files) for s in c.shards)} files; compare with `batchinfer diff "
                         f"{self.output} --challenger {c.name}`")
        return lines


def execute(args: argparse.Namespace) -> Inspected:
    from ..commands.inspect import inspect_output

    return Inspected(args.output, inspect_output(args.output), args.json)
