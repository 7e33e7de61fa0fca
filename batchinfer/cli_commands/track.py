"""``batchinfer track OUTPUT``: upload the metrics that MLflow missed at run time (the work:
:mod:`batchinfer.commands.inspect`)."""
from __future__ import annotations

import argparse

from .results import Lines

HELP = "upload metrics that MLflow missed at run time"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output")
    p.add_argument("--tracking-uri", help="upload here instead of the job's tracking.uri")


def execute(args: argparse.Namespace) -> Lines:
    from ..commands.inspect import upload_tracking

    return Lines((f"uploaded to MLflow run {upload_tracking(args.output, args.tracking_uri)}",))
