"""``batchinfer schema publish|verify``: the lock of published schema versions (contract §6
"Published schemas"): ``<schemas root>/lock.json`` maps each published ``name@N`` to the sha256
of its source, and a job refuses a published version whose file no longer matches."""
from __future__ import annotations

from pathlib import Path

from ..triple.schemas import LOCK_FILE, lock_schemas, read_lock, resolve_schema, verify_lock


def publish_schema(root: str | Path, ref: str) -> tuple[str, bool]:
    """Add ``ref`` (``name@N``) to the lock; return its sha256 and whether it was added (False:
    already published with this hash, a no-op).

    Raises:
        UnknownSchemaError: no such version (exit 2).
        UsageError: the version does not load as a schema (exit 2): nothing broken is published.
        ContractError: already published with another hash (exit 3): the file was edited.
    """
    version = resolve_schema(root, ref)   # the lock check included
    return version.source.sha256, bool(lock_schemas(root, [ref]))


def verify_schemas(root: str | Path) -> tuple[int, list[str]]:
    """How many versions the lock holds, and one line per version whose file is missing or
    changed."""
    return len(read_lock(root)), verify_lock(root)


def lock_path(root: str | Path) -> Path:
    return Path(root) / LOCK_FILE
