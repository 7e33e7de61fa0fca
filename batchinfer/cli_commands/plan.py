"""``batchinfer plan JOB``: resolve shards, triple and contract, and say what a run would do;
write nothing (the work: :mod:`batchinfer.app.resolve`, :func:`batchinfer.commands.run.planned`)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from .arguments import job_args, load
from .results import Result, table_read

if TYPE_CHECKING:
    from ..app.resolve import Resolved
    from ..spec import Job

HELP = "resolve shards, triple and contract; write nothing"


def add_arguments(p: argparse.ArgumentParser) -> None:
    job_args(p)


@dataclass(frozen=True)
class Planned(Result):
    job: Job
    resolved: Resolved
    pinned: int | None     # the table version the partition's manifest pins
    output: str            # the partition, as shown
    would: str | None      # what a run would do (None: finding out failed with ``error``)
    error: Exception | None = None

    def render(self, out: TextIO, err: TextIO) -> None:
        for line in self.lines():
            print(line, file=out)

    def lines(self) -> list[str]:
        job, resolved, spec = self.job, self.resolved, self.job.spec
        ignored = f", {len(resolved.ignored)} metadata file(s) ignored" if resolved.ignored else ""
        lines = [f"job:        {spec.name}  (spec sha256 {job.spec_sha256[:16]}…)",
                 f"partition:  {job.ds or '-'}",
                 f"input:      {job.display(spec.input.path)}  ({len(resolved.shards)} shards{ignored})"]
        if resolved.table is not None:
            lines.append(f"  {resolved.table.format} {table_read(resolved.table, self.pinned)}")
        lines += [f"  {name}" for name in resolved.shard_names()]
        lines += [f"  ignored: {job.display(url)}  (metadata: name starts with _ or .)"
                  for url in resolved.ignored]
        lines.append(f"schema:     {resolved.schema.ref}  ({len(resolved.features)} features)")
        lines.append(f"preprocess: {spec.preprocess or 'default (FEATURES as float32)'}")
        if spec.preprocess:   # what its hash covers besides the module, and what it records
            lines.append(f"  {'local modules':<16} {', '.join(resolved.preprocessor.local_modules) or 'none'}")
            lines.append(f"  {'packages':<16} {' '.join(resolved.preprocessor.packages) or 'none'}")
        lines.append(f"model:      {job.display(spec.model.uri)}  ({spec.model.backend}, device "
                     f"{spec.model.device})")
        lines += [f"  {key:<16} {value}" for key, value in resolved.triple.as_dict().items()]
        for challenger in resolved.challengers:
            its = challenger.spec
            lines.append(f"challenger: {challenger.name}  {job.display(its.uri)}  ({its.backend}, device "
                         f"{its.device}; {challenger.triple.model_version}, digest "
                         f"{challenger.triple.model_digest[:16]}…)")
        lines.append("contract:   ok (declaration matches)" if not resolved.challengers
                     else "contract:   ok (declarations match)")
        lines.append(f"output:     {self.output}")
        if self.would is None:
            return lines
        return lines + [f"  {'a run would':<16} {self.would}", f"runner:     {spec.runner.name}"]


def execute(args: argparse.Namespace) -> Planned:
    from ..app.resolve import partition_listing, partition_of, pinned_version, resolve, shown_partition
    from ..commands.run import planned

    job = load(args)
    partition = partition_of(job)
    resolved = resolve(job, listing=partition_listing(job, partition))
    pinned = pinned_version(job, partition.committed()) if resolved.table is not None else None
    shown = shown_partition(job)
    try:
        would = planned(job, resolved)
    except Exception as exc:   # failed after the lines above it: printed first, as they were
        return Planned(job, resolved, pinned, shown, None, exc)
    return Planned(job, resolved, pinned, shown, would)
