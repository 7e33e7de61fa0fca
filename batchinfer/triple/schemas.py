"""Schema registry: ``name@N`` → the pandera schema in ``<root>/<name>/v<N>.py``.

A schema version is a module that defines ``SCHEMA`` (a pandera schema object or
``DataFrameModel`` subclass, pandas or polars) and may define ``FEATURES``, the ordered model
inputs (default: every schema column that is not an id column).

Published versions are immutable. ``<root>/lock.json`` maps ``name@N`` to the sha256 of that
version's source (LF line endings); :func:`resolve_schema` refuses a locked version whose file no
longer matches (exit 3), and :func:`lock_schemas` adds new versions without ever changing an
entry. Editing a published schema would silently change what a ``schema_version`` in the triple
means, so the only way forward is a new version.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..errors import ContractError, SpecError, UnknownSchemaError, UsageError
from .sources import ModuleSource

LOCK_FILE = "lock.json"
_REF = re.compile(r"(?P<name>[A-Za-z0-9_][A-Za-z0-9_.-]*)@(?P<version>[0-9]+)")  # fullmatch
_VERSION_FILE = re.compile(r"v(?P<version>[0-9]+)\.py")  # fullmatch: `$` passes "v1.py\n"


@dataclass(frozen=True)
class SchemaVersion:
    """One published (or draft) schema version, loaded.

    Attributes:
        ref: ``name@N``.
        source: the module's exact source (executed to get ``SCHEMA``).
        schema: the compiled pandera schema (:class:`~batchinfer.rows.validation.CompiledSchema`;
            ``DataFrameModel`` classes are converted), what ``validate_batch`` takes.
        columns: the columns the schema declares, in declaration order.
        features: ``FEATURES`` if the module defines it, else None (the job decides).
    """

    ref: str
    source: ModuleSource
    schema: Any
    columns: tuple[str, ...]
    features: tuple[str, ...] | None

    def __getstate__(self) -> dict[str, Any]:
        # Not the compiled schema: its checks are the module's functions, which would be pickled
        # by value with the launcher's path of the file. The source travels, and is compiled
        # again where it lands (once per process).
        return {**self.__dict__, "schema": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)
        if self.schema is None:
            object.__setattr__(self, "schema", _compiled(self.source))

    def features_for(self, id_columns: list[str]) -> tuple[str, ...]:
        if self.features is not None:
            return self.features
        ids = set(id_columns)
        return tuple(c for c in self.columns if c not in ids)


_compiled_here: dict[tuple[str, str], Any] = {}


def _compiled(source: ModuleSource) -> Any:
    """The compiled ``SCHEMA`` of a schema version's source that travelled (it compiled where
    it was resolved), once per process and text."""
    from ..rows.validation import compile_schema, import_pandera

    key = (source.name, source.sha256)
    if key not in _compiled_here:
        import_pandera()
        _compiled_here[key] = compile_schema(source.load().SCHEMA)
    return _compiled_here[key]


def parse_ref(ref: str) -> tuple[str, int]:
    match = _REF.fullmatch(ref)
    if not match:
        raise SpecError(f"schema {ref!r}: use name@N, e.g. credit_features@2")
    return match["name"], int(match["version"])


def known_versions(root: str | Path) -> list[str]:
    """Every ``name@N`` under ``root``, sorted by name then version."""
    found = []
    root = Path(root)
    if root.is_dir():
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            for file in folder.iterdir():
                match = _VERSION_FILE.fullmatch(file.name)
                if match:
                    found.append((folder.name, int(match["version"])))
    return [f"{name}@{version}" for name, version in sorted(found)]


def schema_file(root: str | Path, ref: str) -> Path:
    name, version = parse_ref(ref)
    return Path(root) / name / f"v{version}.py"


def resolve_schema(root: str | Path, ref: str) -> SchemaVersion:
    """Load ``ref`` from ``root``, checking the lock of published versions.

    Raises:
        UnknownSchemaError: no such version (the message lists the known ones).
        UsageError: the module fails to import or defines no usable ``SCHEMA``.
        ContractError: a published version was edited after it was locked.
    """
    from ..rows.validation import compile_schema, import_pandera  # heavy: only pay for it here

    import_pandera()

    path = schema_file(root, ref)
    if not path.is_file():
        known = known_versions(root)
        listing = ", ".join(known) if known else "none"
        raise UnknownSchemaError(f"unknown schema {ref} under {root} (known: {listing})")
    name, version = parse_ref(ref)
    source = ModuleSource.read(f"batchinfer_schemas.{name}.v{version}", path)
    locked = read_lock(root).get(ref)
    if locked is not None and locked != source.sha256:
        raise ContractError(
            f"schema {ref} was edited after it was published ({path} has sha256 "
            f"{source.sha256[:12]}…, the lock says {locked[:12]}…): restore it and publish "
            f"the change as {next_version(root, name)}")
    try:
        module = source.load()
    except Exception as exc:  # user code: any error is the user's to fix
        raise UsageError(f"schema {ref} ({path}) failed to import: {type(exc).__name__}: {exc}") from None
    schema = getattr(module, "SCHEMA", None)
    if schema is None:
        raise UsageError(f"schema {ref} ({path}) defines no SCHEMA")
    compiled = compile_schema(schema)   # the one compilation of this version in this process
    columns = compiled.columns
    features = getattr(module, "FEATURES", None)
    if features is not None:
        if isinstance(features, (str, bytes)) or not all(isinstance(f, str) for f in features):
            raise UsageError(f"schema {ref}: FEATURES must be a list of column names, not "
                             f"{features!r}")
        features = tuple(features)
        twice = sorted({f for f in features if features.count(f) > 1})
        if twice:
            raise UsageError(f"schema {ref}: FEATURES lists {twice} more than once")
        unknown = [f for f in features if f not in columns]
        if unknown:
            raise UsageError(f"schema {ref}: FEATURES names columns the schema lacks: {unknown}")
    return SchemaVersion(ref=ref, source=source, schema=compiled, columns=columns,
                         features=features)


def read_lock(root: str | Path) -> dict[str, str]:
    lock = Path(root) / LOCK_FILE
    if not lock.is_file():
        return {}
    try:
        data = json.loads(lock.read_text())
    except ValueError:
        raise ContractError(f"{lock} is not valid JSON: restore it from version control") from None
    return dict(data.get("versions", {}))


def lock_schemas(root: str | Path, refs: Iterable[str] | None = None) -> dict[str, str]:
    """Record not-yet-locked versions under ``root`` in its lock — ``refs``, or every version —;
    never change an entry.

    Returns:
        The versions newly locked, with their hashes.
    """
    root = Path(root)
    versions = read_lock(root)
    added = {}
    for ref in known_versions(root) if refs is None else refs:
        if ref not in versions:
            added[ref] = ModuleSource.read("_", schema_file(root, ref)).sha256
    if added:
        versions.update(added)
        body = {"comment": "sha256 of each published schema version's source (LF line endings). "
                           "Never edit an entry: publish a new version instead.",
                "versions": dict(sorted(versions.items()))}
        lock = root / LOCK_FILE
        tmp = lock.with_name(f".{LOCK_FILE}.tmp")
        tmp.write_text(json.dumps(body, indent=2) + "\n")
        os.replace(tmp, lock)   # a reader never sees half a lock
    return added


def verify_lock(root: str | Path) -> list[str]:
    """Return one line per locked version whose file is missing or differs from the lock."""
    problems = []
    for ref, digest in sorted(read_lock(root).items()):
        path = schema_file(root, ref)
        if not path.is_file():
            problems.append(f"{ref}: {path} is missing")
        elif ModuleSource.read("_", path).sha256 != digest:
            problems.append(f"{ref}: {path} changed after it was published")
    return problems


def next_version(root: str | Path, name: str) -> str:
    """``name@N``: the version after the highest one of ``name`` under ``root``."""
    versions = [int(r.rsplit("@", 1)[1]) for r in known_versions(root) if r.split("@")[0] == name]
    return f"{name}@{max(versions, default=0) + 1}"
