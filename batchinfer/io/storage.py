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


def delta_options(url: str) -> dict[str, str]:
    """delta-rs's object-store options for ``url``: on S3, conditional puts for the log (the
    store itself makes two commits of one version impossible, no lock table needed) and the
    endpoint that fsspec's S3 would use."""
    fs, _ = url_to_fs(url)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol not in ("s3", "s3a"):
        return {}
    options = {"conditional_put": "etag"}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_url"] = endpoint
        if endpoint.startswith("http://"):
            options["allow_http"] = "true"
    return options


def iceberg_s3_options() -> dict[str, str]:
    """pyiceberg's S3 FileIO properties for the endpoint and region that fsspec's S3 would use
    (from ``AWS_ENDPOINT_URL`` and ``AWS_REGION``): without them it resolves every bucket at
    amazonaws.com."""
    options = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["s3.endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["s3.region"] = region
    return options

