"""The files batchinfer reads back, checked at the edge, where they are read.

Every JSON file that batchinfer reads again — a manifest, the scratch records of a run, a
profile, ``_metrics.json`` — is validated by :func:`check` (strict pydantic validation, as the
job spec is) before any command uses it, against the one declaration of its record, the same
that wrote it (pydantic validates the dataclass itself): a record of a partition or the metrics
record in :mod:`batchinfer.io.records`, a profile in :mod:`batchinfer.profile_records`. So
that a malformed or hand-edited file is one line, ``<file>: <field>: <what is
wrong>``, with the exit code of whoever can fix it, never a ``KeyError`` deep inside a command:

=========================  ==================  ===============================================
file                       error (exit code)   why
=========================  ==================  ===============================================
``_manifest.json``         ContractError (3)   the committed partition is not one batchinfer can
                                               vouch for (edited or damaged): like a partition
                                               of another triple, it takes ``--overwrite``; not
                                               5, which a scheduler retries to no end
``_tmp/<attempt>/…``       StorageError (5)    scratch that only a run writes: bad bytes there
                                               are the store's fault, and a rerun (a new
                                               attempt) does not read them
a profile (a baseline,     SpecError (2)       the user's file (named by the job, by ``stamp
``_profile.json``)                             --baseline``, or hand-edited)
``_metrics.json``          SpecError (2)       the user's to upload (``batchinfer track``)
=========================  ==================  ===============================================

Unknown keys are ignored (a newer batchinfer may add some); missing keys that older files lack
get the defaults that :mod:`batchinfer.io.records` gives them. Pure: bytes in, records out.
"""
from __future__ import annotations

import math
from typing import Any, Sequence, TypeVar

from pydantic import ValidationError

from ..codec import adapter
from ..errors import BatchInferError, Remedy

T = TypeVar("T")


def check(kind: type[T], data: bytes | str, shown: str, error: type[BatchInferError],
          hint: str = "", remedies: Sequence[Remedy] = ()) -> T:
    """``data`` (a file's bytes) validated as ``kind``: a record (io/records.py,
    profile_records.py: each declared once there).

    Args:
        shown: the file, as the message names it.
        error: the exception to raise (its exit code is the file kind's, see the module).
        hint: what the file is not, appended to the message after ": ".
        remedies: what to do about it (the error's ``remedies``).

    Raises:
        BatchInferError: of type ``error``: ``<shown>: <field>: <what is wrong>[: <hint>]``, its
            ``path`` ``shown`` and its ``field`` the first wrong one (dotted; None for bytes
            that are no JSON).
    """
    try:
        return adapter(kind).validate_json(data)
    except ValidationError as exc:
        loc = exc.errors(include_url=False)[0]["loc"]
        field = ".".join(str(part) for part in loc) or None
        raise error(f"{shown}: {describe(exc)}" + (f": {hint}" if hint else ""), path=shown,
                    field=field, remedies=remedies) from None


def describe(exc: ValidationError) -> str:
    """The first thing wrong, as ``field: what`` (``field`` dotted, list items by index)."""
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in err["loc"])
    kind, message = err["type"], err["msg"]
    if kind == "json_invalid":
        return f"not valid JSON ({message.removeprefix('Invalid JSON: ')})"
    if kind == "missing":
        message = "missing"
    elif kind == "value_error":  # our own checks: the message says it all
        message = message.removeprefix("Value error, ")
    else:
        got = err.get("input")
        if not isinstance(got, (dict, list)):
            message += f" (got {_shown(got)})"
    return f"{where}: {message}" if where else message


def _shown(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return repr(value)[:60]
