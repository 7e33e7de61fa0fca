"""One exception tree for batchinfer, mapped to the exit codes of the contract (contract §2).

    BatchInferError                 (root; never raised itself)
     ├── UsageError           → 2   the user's mistake in how the job is described
     │    ├── SpecError               bad, missing or unknown job-spec key; bad --set; {ds} without --ds
     │    ├── UnknownSchemaError      `name@N` not found (the message lists the known versions)
     │    ├── PreprocessError         the preprocessing module or function cannot be imported,
     │    │                           returns something that does not fit the batch or the model
     │    │                           (another shape than the model's input), or raises on (nearly)
     │    │                           every row: a fault of the function, not of the data
     │    ├── ModelFileError          model.uri names no model of its backend: no such file or
     │    │                           registry version, a folder, bytes not of the backend's format
     │    └── NoShardsError           no shard matches input.path
     ├── ContractError        → 3   the version triple or declaration does not hold
 │    └── TableVersionGone        the table version a committed partition was scored from is
 │                                no longer the table's (vacuumed, expired)
     ├── DataQualityError     → 4   bad rows or unreadable shards above the quarantine thresholds
     └── RuntimeFailure       → 5   the system failed: model load/run, backend, device, storage
          ├── ModelError              includes a model that breaks the batch contract (output rows
          │                           ≠ input rows)
          └── StorageError

Every error carries what was wrong (``what``, one line), the file and the field it is about when
there is one (``path``, ``field``), and what to do about it as values (``remedies``, each a
:class:`Remedy`: an action and what it achieves). Only the commands' layer says a remedy in a
command line's words — ``--overwrite``, ``batchinfer stamp`` (``batchinfer/commands/remedies.py``,
which the CLI prints through); ``str(error)`` says it plainly for a caller of the Python API.
Secrets — ``${NAME}`` values named or listed as secrets, credentials inside
URLs — are masked when the message is made (:mod:`batchinfer.redaction`), so no output path can
show them. Exceptions must survive
pickling (they may cross Beam workers), so each one keeps its constructor arguments in ``args``.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Sequence

from .redaction import redact


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, at most ``limit`` characters (its type if empty)."""
    return " ".join(str(exc).split())[:limit] or type(exc).__name__


class Action(Enum):
    """What a user can do about an error, in the data's terms: the commands' layer knows which
    flag or command does it."""

    OVERWRITE = "overwrite"   # score the partition again, replacing what is committed
    UPDATE = "update"         # score only the shards that are new or changed
    UNPIN = "unpin"           # score again from the table's latest version, not the pinned one
    STAMP = "stamp"           # declare the model (again) for this job


@dataclass(frozen=True)
class Remedy:
    """One thing to do about an error: ``action``, and ``purpose``, what it achieves ("to
    replace it"); ``subject`` what it acts on where the action needs one (the model to stamp,
    the version to unpin to)."""

    action: Action
    purpose: str = ""
    subject: str = ""

    def plain(self) -> str:
        """The remedy in words that name no command line (``str`` of an error)."""
        return " ".join(w for w in (self.action.value, self.subject, self.purpose) if w)


class BatchInferError(Exception):
    """Root of every error batchinfer raises on purpose.

    Attributes:
        what: what was wrong, one line (masked: :mod:`batchinfer.redaction`).
        path: the file (or table, folder) it is about, when there is one.
        field: the field of that file, when there is one.
        remedies: what to do about it, alternatives in order (none: the line says it).
    """

    exit_code = 1

    def __init__(self, what: str, *, path: str | None = None, field: str | None = None,
                 remedies: Sequence[Remedy] = ()):
        what = redact(what)
        super().__init__(what)
        self.what = what
        self.path = path
        self.field = field
        self.remedies = tuple(remedies)

    @property
    def message(self) -> str:
        """The line, with its remedies in plain words."""
        if not self.remedies:
            return self.what
        return f"{self.what}: " + ", or ".join(r.plain() for r in self.remedies)

    def within(self, context: str) -> "BatchInferError":
        """The same error (type, path, field, remedies) about ``context`` ("challenger x")."""
        return type(self)(f"{context}: {self.what}", path=self.path, field=self.field,
                          remedies=self.remedies)

    def __str__(self) -> str:
        return self.message


class UsageError(BatchInferError):
    exit_code = 2


class SpecError(UsageError):
    """The job spec (or a --set override) is invalid."""


class UnknownSchemaError(UsageError):
    """A `name@N` schema reference that the registry does not know."""


class PreprocessError(UsageError):
    """The preprocessing cannot be loaded, returns what the batch or the model cannot take, or
    fails on (nearly) every row for one reason (contract §6 "Preprocessing faults")."""


class ModelFileError(UsageError):
    """``model.uri`` names no model its backend can read: the same bytes (or their absence) fail
    the same way on every retry, so it is the user's to fix, not the system's (exit 2, not 5)."""


class NoShardsError(UsageError):
    """input.path matches no shard."""


class ContractError(BatchInferError):
    """The version triple, the model declaration or a committed partition disagree."""

    exit_code = 3


class TableVersionGone(ContractError):
    """The table version (snapshot) a committed partition's manifest pinned is gone from the table."""


class DataQualityError(BatchInferError):
    """Too many bad rows or unreadable shards: nothing was committed."""

    exit_code = 4


class RuntimeFailure(BatchInferError):
    """The system failed (not the user's input): model, backend, device or storage."""

    exit_code = 5


class ModelError(RuntimeFailure):
    """The model cannot be loaded or cannot run at all."""


class StorageError(RuntimeFailure):
    """Reading or writing storage failed after retries."""
