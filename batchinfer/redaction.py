"""Secrets in the strings batchinfer shows or writes: ``${NAME}`` values that are secrets, put back
as ``${NAME}``, and credentials inside URLs, put as ``***``.

Only secrets are hidden; every other value is shown as it is, so that a path in ``plan``, in
``_source_shard`` or in a manifest says where the data came from. A ``${NAME}`` value is a secret
when its name says so (:data:`SECRET_WORDS`) or when the job lists the name under ``secrets``.
Credentials embedded in a URL — its userinfo (``s3://user:pass@host/…``) and the values of query
parameters named like secrets (``?sig=…``, ``X-Amz-Signature=…``) — are hidden whatever variable,
if any, they came from.

Rather than remember to mask each string where it is printed, every secret value is registered
here when the job is loaded, and :func:`redact` is applied where strings are *made* (every
:class:`~batchinfer.errors.BatchInferError` message) and where they *leave* the process (the
CLI's error line, ``--debug`` tracebacks, log records). Process-wide on purpose: an exception
raised deep in the I/O layer has no job to ask.
"""
from __future__ import annotations

import re
import threading
from typing import Collection, Mapping

# Secrets shorter than this are not searched for: a one-letter value would mangle every path
# that happens to contain that letter.
MIN_LENGTH = 4

# A variable whose name contains one of these (any case) holds a secret. Not PWD: the shell's
# ${PWD} is the working directory, a path.
SECRET_WORDS = ("SECRET", "TOKEN", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH", "SIGNATURE")
# Query parameters that hold secrets besides those named with SECRET_WORDS: Azure SAS's `sig`,
# ODBC-style `pwd`.
SECRET_PARAMETERS = frozenset({"sig", "pwd"})
HIDDEN = "***"

_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<rest>[^\s'\"<>`]*)")
_PLACEHOLDERS = re.compile(r"(?:\$\{[A-Za-z_][A-Za-z0-9_]*\})+")
_PARAMETER = re.compile(r"(?P<name>[^=&;#]+)=(?P<value>[^&;#]*)")

_lock = threading.Lock()
_values: dict[str, str] = {}   # value → name


def is_secret_name(name: str, listed: Collection[str] = ()) -> bool:
    """True when the variable ``name`` holds a secret: listed, or named like one."""
    upper = name.upper()
    return name in listed or any(word in upper for word in SECRET_WORDS)


def register(secrets: Mapping[str, str]) -> None:
    """Remember ``name → value`` pairs so that :func:`redact` hides the values from now on."""
    with _lock:
        for name, value in secrets.items():
            if len(value) >= MIN_LENGTH:
                _values[value] = name


def mask(text: str, secrets: Mapping[str, str]) -> str:
    """``text`` with each of ``secrets``' values (longest first) replaced by ``${NAME}``, then
    the credentials of every URL in it hidden (:func:`mask_urls`)."""
    for name, value in sorted(secrets.items(), key=lambda kv: -len(kv[1])):
        if len(value) >= MIN_LENGTH and value in text:
            text = text.replace(value, "${%s}" % name)
    return mask_urls(text)


def redact(text: str) -> str:
    """``text`` with every registered value replaced by ``${NAME}`` and URL credentials hidden."""
    with _lock:
        secrets = {name: value for value, name in _values.items()}
    return mask(text, secrets)


def mask_urls(text: str) -> str:
    """``text`` with each URL's userinfo and secret query values hidden.

    A user name is kept before a password (``https://ci:***@host/``); userinfo without a
    password may be a token and is hidden whole (``https://***@host/``). A part that is only
    ``${NAME}`` placeholders reveals nothing and stays (``batchinfer track`` expands it again).

    >>> mask_urls("s3://ak:pw@minio:9000/b/x.parquet?versionId=3&X-Amz-Signature=ab12")
    's3://ak:***@minio:9000/b/x.parquet?versionId=3&X-Amz-Signature=***'
    """
    if "://" not in text:
        return text
    return _URL.sub(_mask_url, text)


def _mask_url(match: re.Match) -> str:
    rest = match["rest"]
    end = len(rest)
    for mark in "/?#":
        found = rest.find(mark)
        if found != -1:
            end = min(end, found)
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:
        userinfo, host = authority.rsplit("@", 1)
        user, colon, password = userinfo.partition(":")
        if colon:
            userinfo = f"{user}:{_hide(password)}"
        else:
            userinfo = _hide(userinfo)
        authority = f"{userinfo}@{host}"
    if "?" in tail:
        path, _, query = tail.partition("?")
        query, hash_mark, fragment = query.partition("#")
        tail = f"{path}?{_PARAMETER.sub(_mask_parameter, query)}{hash_mark}{fragment}"
    return f"{match['scheme']}{authority}{tail}"


def _mask_parameter(match: re.Match) -> str:
    name = match["name"]
    if name.lower() in SECRET_PARAMETERS or is_secret_name(name):
        return f"{name}={_hide(match['value'])}"
    return match[0]


def _hide(part: str) -> str:
    return part if not part or _PLACEHOLDERS.fullmatch(part) else HIDDEN
