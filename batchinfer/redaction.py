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
raised deep in the I/O layer (or in a runner's worker thread) has no job to ask.

How long a value stays registered is a :func:`scope`'s: a program that runs several jobs opens
one per job (``with redaction.scope(): run_job(load_job(...))``), and the values registered
inside are hidden while it is open — from every thread — and forgotten when it closes, so that
the next job neither hides the last one's values nor loses its own when another closes. Values
registered outside any scope (the CLI: one command, one job, one process) stay for the process.

A secret the workers need (a ``${NAME}`` in ``input.path`` or ``output.path``) travels as a
:class:`Deferred`: the text with the secret's value put back as ``${NAME}``, which the process that
uses it — a worker, wherever it runs — fills in from its own environment and registers there.
Secret values are never part of the job graph a runner stages (docs/runners.md "What travels to
the workers").
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Collection, Iterable, Iterator, Mapping

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


class Scope:
    """The values registered while one :func:`scope` is open (value → name)."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}


_lock = threading.Lock()
_process = Scope()             # registered outside any scope: kept for the process
_open: list[Scope] = []        # every scope open now, in any thread: redact() hides all their values
# Where register() puts values: the innermost scope opened in this context (thread, task).
_current: ContextVar[Scope | None] = ContextVar("batchinfer_redaction_scope", default=None)


@contextlib.contextmanager
def scope() -> Iterator[Scope]:
    """Hide the values registered inside (:func:`register`, as :func:`~batchinfer.spec.load_job`
    does) until the block ends, then forget them. Scopes nest, and scopes open in other threads
    are independent: each forgets only its own values."""
    opened = Scope()
    token = _current.set(opened)
    with _lock:
        _open.append(opened)
    try:
        yield opened
    finally:
        _current.reset(token)
        with _lock:
            _open.remove(opened)


def is_secret_name(name: str, listed: Collection[str] = ()) -> bool:
    """True when the variable ``name`` holds a secret: listed, or named like one."""
    upper = name.upper()
    return name in listed or any(word in upper for word in SECRET_WORDS)


def register(secrets: Mapping[str, str]) -> None:
    """Remember ``name → value`` pairs so that :func:`redact` hides the values from now on: until
    the current :func:`scope` closes, or for the process outside any."""
    target = _current.get() or _process
    with _lock:
        for name, value in secrets.items():
            if len(value) >= MIN_LENGTH:
                target.values[value] = name


def mask(text: str, secrets: Mapping[str, str]) -> str:
    """``text`` with each of ``secrets``' values (longest first) replaced by ``${NAME}``, then
    the credentials of every URL in it hidden (:func:`mask_urls`)."""
    return _mask(text, secrets.items())


def redact(text: str) -> str:
    """``text`` with every registered value replaced by ``${NAME}`` and URL credentials hidden."""
    with _lock:
        values = {value: name for held in (_process, *_open) for value, name in held.values.items()}
    return _mask(text, ((name, value) for value, name in values.items()))


def _mask(text: str, secrets: Iterable[tuple[str, str]]) -> str:
    # (name, value) pairs rather than a mapping by name: two open scopes may hold different
    # values under one name, and both are hidden.
    for name, value in sorted(secrets, key=lambda kv: -len(kv[1])):
        if len(value) >= MIN_LENGTH and value in text:
            text = text.replace(value, "${%s}" % name)
    return mask_urls(text)


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


@dataclass(frozen=True)
class Deferred:
    """A string that a worker needs, with each secret value in it put back as ``${NAME}``: it
    pickles (into the job graph) without the values, and :meth:`value` fills them in from the
    environment of the process that uses it.

    Attributes:
        template: the text, secret values as ``${NAME}``.
        names: the variables :meth:`value` fills in (any other ``${…}`` in the text stays).
    """

    template: str
    names: tuple[str, ...] = ()

    @classmethod
    def of(cls, text: str, secrets: Mapping[str, str]) -> "Deferred":
        """``text`` with each of ``secrets``' values (name → value; longest first) as ``${NAME}``.

        Raises:
            SpecError: the text would not come back as it is (it holds a ``${NAME}`` of its own
                for a secret's name, as well as the secret's value).
        """
        template, names = text, []
        for name, value in sorted(secrets.items(), key=lambda kv: -len(kv[1])):
            if value and value in template:
                template = template.replace(value, "${%s}" % name)
                names.append(name)
        deferred = cls(template, tuple(sorted(names)))
        if deferred.value(secrets, register_values=False) != text:
            from .errors import SpecError

            raise SpecError(f"{redact(text)} holds both a secret's value and ${{NAME}} of a secret's "
                            f"name ({', '.join(deferred.names)}): the workers could not tell them apart")
        return deferred

    def value(self, environ: Mapping[str, str] | None = None, *, register_values: bool = True) -> str:
        """The text, each ``${NAME}`` of :attr:`names` filled in from ``environ`` (default: this
        process's environment); the values are registered as secrets here (see :func:`register`)
        unless an open scope or this process hides them already.

        Raises:
            RuntimeFailure: the environment lacks one of the variables (exit 5: the workers
                need the job's secret variables, as they need their store's credentials).
        """
        if not self.names:
            return self.template
        env = os.environ if environ is None else environ
        missing = [name for name in self.names if name not in env]
        if missing:
            from .errors import RuntimeFailure

            raise RuntimeFailure(
                f"this process's environment has no {', '.join('${%s}' % n for n in missing)}, "
                f"which {self.template} uses: give every worker the job's secret variables "
                f"(docs/runners.md \"What travels to the workers\")")
        values = {name: env[name] for name in self.names}
        if register_values:
            with _lock:
                hidden = {v for held in (_process, *_open) for v in held.values}
            register({n: v for n, v in values.items() if v not in hidden})
        text = self.template
        for name, value in values.items():
            text = text.replace("${%s}" % name, value)
        return text
