"""Arguments that several commands take, declared once: the job spec, ``--ds`` and ``--set``
(contract §2), and the checks of argument combinations that more than one command makes."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ..errors import UsageError

if TYPE_CHECKING:
    from ..spec import Job

SET_HELP = "override one spec key by dotted path; value parsed as YAML (repeatable)"


def job_args(p: argparse.ArgumentParser) -> None:
    """``JOB`` (the spec), ``--ds`` and ``--set``."""
    p.add_argument("job", help="job spec (YAML)")
    spec_options(p, "partition date YYYY-MM-DD, replaces {ds}")


def spec_options(p: argparse.ArgumentParser, ds_help: str, set_help: str = SET_HELP) -> None:
    """``--ds`` and ``--set``, as every command that reads a job spec takes them (contract §2)."""
    p.add_argument("--ds", help=ds_help)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help=set_help)


def load(args: argparse.Namespace, **kwargs: Any) -> Job:
    """The job ``args.job`` names, with ``--ds`` and ``--set``."""
    from ..spec import load_job

    return load_job(args.job, ds=args.ds, overrides=args.overrides, **kwargs)


def update_or_overwrite(args: argparse.Namespace) -> None:
    if args.update and args.overwrite:
        raise UsageError("give --update (score the new and rewritten shards of a committed "
                         "partition) or --overwrite (score it all again), not both")


def watcher(quiet: bool):
    """Live progress for the pipeline: a bar on a terminal, plain lines otherwise, or nothing.

    Its module (which imports Beam) is imported when scoring starts, not here: a command's
    MLflow helper starts first (``backfill``: :func:`batchinfer.commands.backfill.backfill`)."""
    def watching(shards: int, live: str):
        from ..app.run_progress import choose_mode, watch

        return watch(shards, choose_mode(quiet), live=live)

    return watching
