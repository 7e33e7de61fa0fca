"""Loading user code (schema versions, preprocessing modules) from its exact source text.

The version triple names code by the hash of its source. To make "the code that ran is the
code that was hashed" true on every runner, we read a module's source once, hash that text, and
execute that same text (on the driver and, after pickling, on remote workers) instead of
importing whatever file a worker happens to find under the same name.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path

_lock = threading.Lock()


def normalise_source(raw: bytes) -> str:
    """Decode source bytes as UTF-8 with LF line endings (the form that is hashed)."""
    return raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")


@dataclass(frozen=True)
class ModuleSource:
    """A module's name, file and exact source text; picklable, loaded on demand.

    Attributes:
        name: the module name (dotted for modules inside packages).
        filename: where the source was read (set as ``__file__`` so relative asset paths work).
        text: the LF-normalised source.
        search_path: folders put first on ``sys.path`` while the module executes (and removed
            afterwards), so that its own imports resolve as they would from the job's folder.
    """

    name: str
    filename: str
    text: str
    search_path: tuple[str, ...] = ()
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @classmethod
    def read(cls, name: str, filename: str | Path, search_path: tuple[str, ...] = ()) -> "ModuleSource":
        raw = Path(filename).read_bytes()
        return cls(name=name, filename=str(filename), text=normalise_source(raw),
                   search_path=tuple(search_path))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def load(self) -> types.ModuleType:
        """Execute the source in a fresh module (once per process and object) and return it."""
        module = self._cache.get("module")
        if module is not None:
            return module
        with _lock:
            module = self._cache.get("module")
            if module is None:
                module = _execute(self)
                self._cache["module"] = module
        return module

    def __getstate__(self):
        return {"name": self.name, "filename": self.filename, "text": self.text,
                "search_path": self.search_path}

    def __setstate__(self, state):
        for key, value in state.items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "_cache", {})


def _execute(source: ModuleSource) -> types.ModuleType:
    # The job's folders are first on sys.path while the module executes (its own imports
    # resolve as from the job's folder), and only then: a process that runs several jobs must
    # not find one job's modules through another's folder.
    added = [folder for folder in source.search_path if folder not in sys.path]
    sys.path[:0] = added
    try:
        return _execute_here(source)
    finally:
        for folder in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(folder)


def _execute_here(source: ModuleSource) -> types.ModuleType:
    module = types.ModuleType(source.name)
    module.__file__ = source.filename
    module.__package__ = source.name.rpartition(".")[0]
    # A real spec keeps importlib (find_spec, reload, pickling by reference) working on it.
    module.__spec__ = importlib.util.spec_from_file_location(source.name, source.filename)
    # Registered while it executes: dataclasses, pickling by reference and typing look the
    # module up by name in sys.modules.
    previous = sys.modules.get(source.name)
    sys.modules[source.name] = module
    try:
        exec(compile(source.text, source.filename, "exec"), module.__dict__)
    except BaseException:
        if previous is not None:
            sys.modules[source.name] = previous
        else:
            sys.modules.pop(source.name, None)
        raise
    return module


def find_module_file(name: str, search_path: tuple[str, ...]) -> Path | None:
    """Locate a module's source file as ``import`` would, with ``search_path`` first."""
    # Search the job's folders themselves first: find_spec answers from sys.modules, which may
    # hold a same-named module that another job loaded from another folder.
    spec, locations = None, list(search_path)
    for depth in range(len(name.split("."))):
        spec = importlib.machinery.PathFinder.find_spec(
            ".".join(name.split(".")[:depth + 1]), locations) if locations else None
        if spec is None:
            break
        locations = list(spec.submodule_search_locations or [])
    if spec is not None and spec.origin and spec.origin.endswith(".py"):
        return Path(spec.origin)
    added = [f for f in search_path if f not in sys.path]
    sys.path[:0] = added
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    finally:
        for folder in added:
            sys.path.remove(folder)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)
