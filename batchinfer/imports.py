"""Importing heavy libraries without the optional extras they pull in but batchinfer never uses.

Beam's inference base imports torch for a model manager we do not use (1–6 s here), Beam's
filesystems import boto3 for an S3 client we do not use (fsspec reads S3), and pandera imports
hypothesis for data synthesis (``schema.example()``), never for validation. Each library guards
that import with ``except ImportError``, so hiding the extra for the duration of the import
makes it take its fallback. The extra stays importable afterwards for whoever wants it; a module
already imported (a test session that loaded hypothesis first, the torch backend) is not hidden.

Beam also imports, whenever their packages are installed (the ``dataflow`` extra), the Dataflow
API's client and its own GCS, S3 and BigQuery I/O: 0.3-0.7 s of a run's serial start here. A run
on the direct runner uses none of them (batchinfer reads and writes through fsspec), so its check
imports Beam without them (:func:`import_beam`).
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Iterator


@contextlib.contextmanager
def without(*names: str) -> Iterator[None]:
    """Within the block, ``import name`` raises ImportError for each name not yet imported."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # what makes `import name` raise
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


# Beam guards each of these with ``except ImportError`` (its Dataflow runner, its filesystems
# registry, apache_beam.io's BigQuery/Pub/Sub/GCS block). A filesystem hidden this way is not
# registered with Beam's FileSystems until something imports it (Beam's Dataflow client does).
CLOUD_CLIENTS = ("google.cloud.dataflow", "apache_beam.io.gcp.gcsfilesystem",
                 "apache_beam.io.aws.s3filesystem", "apache_beam.io.gcp.bigquery")


def import_beam(*, cloud_clients: bool) -> None:
    """Import Beam the one way batchinfer does (:mod:`batchinfer.beam_compat`), without
    :data:`CLOUD_CLIENTS` unless ``cloud_clients``. Only Beam's first import decides."""
    with without(*(() if cloud_clients else CLOUD_CLIENTS)):
        importlib.import_module("batchinfer.beam_compat")
