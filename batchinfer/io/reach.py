"""Whether a job's input pattern can reach its own output (pure: string matching, no I/O).

An output inside the input's reach is read back as input: the next date (or the rerun of this
one) finds the previous predictions among its shards and quarantines them as bad rows, and an
output folder that *is* the input folder commits into the data it came from. Both are refused
before any work.

The input pattern is compared as it reads any date (``{ds}`` → :data:`ANY_DATE`), the output as
one date writes it. The input *reaches* a path when it matches that path or a folder above it
(a matched folder is read whole, see :mod:`batchinfer.io.shards`). Names starting with ``_`` or
``.`` are never shards, so the manifest, the metrics and the scratch folder do not count; the
``predictions/`` and ``quarantine/`` files do.
"""
from __future__ import annotations

import fnmatch
import posixpath

from fsspec.core import split_protocol

# {ds} in a pattern: any date.
ANY_DATE = "[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]"
# What a run writes under output.path that a reader of shards would take as data.
_WRITTEN = (("predictions", "20260101T000000Z-0123abcd", "part-00000-00000.parquet"),
            ("quarantine", "20260101T000000Z-0123abcd", "part-00000-00000.parquet"))
_LOCAL = {None, "file", "local"}


def reach_conflict(input_pattern: str, output: str) -> str | None:
    """Why ``output`` may not be written where ``input_pattern`` reads, or None when it may.

    Args:
        input_pattern: ``input.path`` (a file, folder or glob; absolute, or a URL).
        output: ``output.path`` (a folder; absolute, or a URL).
    """
    in_proto, in_path = _split(input_pattern)
    out_proto, out_path = _split(output)
    if in_proto != out_proto:
        return None
    pattern, folder = _parts(in_path), _parts(out_path)
    if len(pattern) > 1 and _matches(pattern[:-1], folder):
        return "is the folder input.path reads from: its files would be written among the input"
    for written in _WRITTEN:
        target = folder + list(written)
        for depth in range(1, len(target) + 1):
            if _matches(pattern, target[:depth]):
                return ("is inside input.path's reach: a later run (of this date or another) "
                        "would read its predictions as input")
    return None


def _split(url: str) -> tuple[str | None, str]:
    protocol, path = split_protocol(url)
    if protocol in _LOCAL:
        return None, posixpath.normpath(path)
    return protocol, path.strip("/")


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p]


def _matches(pattern: list[str], path: list[str]) -> bool:
    """Does the glob ``pattern`` (by components; ``**`` is any number of them) match ``path``?"""
    if not pattern:
        return not path
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_matches(rest, path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatch.fnmatchcase(path[0], head) and _matches(rest, path[1:])
