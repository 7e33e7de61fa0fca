"""fsspec helpers: one place that turns URLs into (filesystem, path) and back."""
from __future__ import annotations

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
