"""Values that came from ``${NAME}`` in a job spec, and putting ``${NAME}`` back in their place.

Secrets (credentials in URLs, private bucket names) reach batchinfer's strings through paths and
URIs: an error message about a shard, a log line from a library, a traceback under ``--debug``.
Rather than remember to mask each string where it is printed, every value is registered here when
the job is loaded, and :func:`redact` is applied where strings are *made* (every
:class:`~batchinfer.errors.BatchInferError` message) and where they *leave* the process (the
CLI's error line, ``--debug`` tracebacks, log records). Process-wide on purpose: an exception
raised deep in the I/O layer has no job to ask.
"""
from __future__ import annotations

import threading
from typing import Mapping

# Secrets shorter than this are not searched for: a one-letter value would mangle every path
# that happens to contain that letter.
MIN_LENGTH = 4

_lock = threading.Lock()
_values: dict[str, str] = {}   # value → name


def register(secrets: Mapping[str, str]) -> None:
    """Remember ``name → value`` pairs so that :func:`redact` hides the values from now on."""
    with _lock:
        for name, value in secrets.items():
            if len(value) >= MIN_LENGTH:
                _values[value] = name


def mask(text: str, secrets: Mapping[str, str]) -> str:
    """``text`` with each of ``secrets``' values (longest first) replaced by ``${NAME}``."""
    for name, value in sorted(secrets.items(), key=lambda kv: -len(kv[1])):
        if len(value) >= MIN_LENGTH and value in text:
            text = text.replace(value, "${%s}" % name)
    return text


def redact(text: str) -> str:
    """``text`` with every registered value replaced by ``${NAME}``."""
    if not _values:
        return text
    with _lock:
        secrets = {name: value for value, name in _values.items()}
    return mask(text, secrets)
