"""Importing heavy libraries without the optional extras they pull in but batchinfer never uses.

Beam's inference base imports torch for a model manager we do not use (1–6 s here), Beam's
filesystems import boto3 for an S3 client we do not use (fsspec reads S3), and pandera imports
hypothesis for data synthesis (``schema.example()``), never for validation. Each library guards
that import with ``except ImportError``, so hiding the extra for the duration of the import
makes it take its fallback. The extra stays importable afterwards for whoever wants it; a module
already imported (a test session that loaded hypothesis first, the torch backend) is not hidden.
"""
from __future__ import annotations

import contextlib
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
