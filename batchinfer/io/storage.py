"""fsspec helpers: one place that turns URLs into (filesystem, path) and back."""
from __future__ import annotations

import os
import posixpath
import re

import fsspec
from fsspec import AbstractFileSystem


def url_to_fs(url: str) -> tuple[AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path.rstrip("/") or "/"


def is_local(fs: AbstractFileSystem) -> bool:
    return "file" in _protocols(fs)


def full_url(fs: AbstractFileSystem, path: str) -> str:
    """The URL a user would write for ``path`` on ``fs`` (local paths stay plain paths)."""
    if is_local(fs):
        return path
    return fs.unstrip_protocol(path)


def local_path(url: str) -> str | None:
    """The local path a URL names (a plain path, or ``file://…``); None for any other scheme
    (``s3://``, ``gs://``, ``http://``, a chained ``simplecache::…``)."""
    if url.startswith("file://"):
        return url[len("file://"):]
    if "::" in url or (re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", url) and not re.match(r"^[A-Za-z]:[\\/]", url)):
        return None
    return url


def join(*parts: str) -> str:
    return posixpath.join(*parts)


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def protocol(url: str) -> str:
    """The fsspec protocol of ``url`` (``file``, ``s3``, ``gcs``, …): the first of its names."""
    return _protocols(url_to_fs(url)[0])[0]


def s3_endpoint() -> str | None:
    """The S3 endpoint that fsspec's S3 would use (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``),
    for libraries with stores of their own (a table format's), which must be told it."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def s3_region() -> str | None:
    """The region that fsspec's S3 would use (``AWS_REGION``, ``AWS_DEFAULT_REGION``)."""
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
