"""Loading user code (schema versions, preprocessing modules) from its exact source text.

The version triple names code by the hash of its source. To make "the code that ran is the
code that was hashed" true on every runner, we read a module's source once, hash that text, and
execute that same text (on the driver and, after pickling, on remote workers) instead of
importing whatever file a worker happens to find under the same name. The local modules a
module imports (its helpers in the job's folder, found by :mod:`batchinfer.triple.import_walk`)
travel with it, and a finder on ``sys.meta_path`` serves their hashed text to ``import``.

A module travels without the launcher's paths (docs/runners.md "What travels to the workers"):
pickled, its files are named by its module name (``pkg/prep.py``), and its ``ASSETS`` travel as
bytes. A copy that travelled writes its text, its local modules' and its assets into this
machine's code cache (``$BATCHINFER_CODE_CACHE``, else ``~/.cache/batchinfer/code``), one folder
per content digest, once, and runs from there: ``__file__`` and the assets beside it are the
bytes that were hashed, wherever it runs.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import posixpath
import shutil
import sys
import threading
import types
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

_lock = threading.Lock()
CODE_CACHE_ENV = "BATCHINFER_CODE_CACHE"


def code_cache() -> Path:
    """Where modules that travelled are written on this machine: ``$BATCHINFER_CODE_CACHE``,
    else ``$XDG_CACHE_HOME/batchinfer/code`` (``~/.cache/batchinfer/code``)."""
    configured = os.environ.get(CODE_CACHE_ENV)
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchinfer" / "code"


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
        local_modules: the local modules it imports (directly or through each other), by name:
            ``import`` gets their text from here, not from the files, while it executes and
            afterwards (an import inside a function runs when it is called).
        assets: the files it reads (its ``ASSETS``, as listed: relative to its folder) and
            their bytes, as hashed; they travel with it.

    Pickled, ``filename`` becomes :attr:`relative` and ``search_path`` the folder it is
    imported from, wherever that is: the copy runs from the code cache (:meth:`load`).
    """

    name: str
    filename: str
    text: str
    search_path: tuple[str, ...] = ()
    local_modules: tuple["ModuleSource", ...] = ()
    assets: tuple[tuple[str, bytes], ...] = ()
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @classmethod
    def read(cls, name: str, filename: str | Path, search_path: tuple[str, ...] = ()) -> "ModuleSource":
        raw = Path(filename).read_bytes()
        return cls(name=name, filename=str(filename), text=normalise_source(raw),
                   search_path=tuple(search_path))

    def with_local_modules(self, local_modules: Sequence["ModuleSource"]) -> "ModuleSource":
        """This source (not yet loaded) with the local modules it imports, sorted by name."""
        return ModuleSource(self.name, self.filename, self.text, self.search_path,
                            tuple(sorted(local_modules, key=lambda m: m.name)), self.assets)

    def with_assets(self, assets: Sequence[tuple[str, bytes]]) -> "ModuleSource":
        """This source with the files it reads (name as listed, bytes); loaded already if it was."""
        copy = ModuleSource(self.name, self.filename, self.text, self.search_path,
                            self.local_modules, tuple(assets))
        object.__setattr__(copy, "_cache", self._cache)
        return copy

    @property
    def relative(self) -> str:
        """Its file below the folder it is imported from, as its name says: ``pkg/prep.py``,
        ``pkg/__init__.py`` for a package."""
        base = self.name.replace(".", "/")
        return f"{base}/__init__.py" if Path(self.filename).name == "__init__.py" else f"{base}.py"

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
                module = _execute(_materialise(self) if self._cache.get("travelled") else self)
                self._cache["module"] = module
        return module

    def __getstate__(self):
        # No path of the process that pickles it: its files are named by the module names,
        # and the folder it is imported from is wherever the copy is written.
        return {"name": self.name, "filename": self.relative, "text": self.text,
                "search_path": ("",) if self.search_path else (),
                "local_modules": self.local_modules, "assets": self.assets}

    def __setstate__(self, state):
        for key, value in state.items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "assets", state.get("assets", ()))
        object.__setattr__(self, "_cache", {"travelled": True})


def _materialise(source: ModuleSource) -> ModuleSource:
    """``source`` (a copy that travelled) written into the code cache with its local modules and
    assets, one folder per digest of the files (written once, atomically: processes that
    write the same folder at once keep the first), as a source located there."""
    base = posixpath.dirname(source.relative)
    files = {m.relative: m.text.encode("utf-8") for m in (source, *source.local_modules)}
    for name, data in source.assets:
        where = posixpath.normpath(posixpath.join(base, name))
        if not posixpath.isabs(where):   # an absolute asset is read where it is
            files[where] = data
    # An asset above the module's folder ("../vocab.txt") lands inside the folder too: the
    # modules go that many folders down.
    prefix = "/".join(["_"] * max(_climbs(path) for path in files))
    files = {posixpath.normpath(posixpath.join(prefix, p)): data for p, data in files.items()}
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(f"{path}\0{len(files[path])}\0".encode() + files[path])
    root = code_cache() / digest.hexdigest()
    if not root.is_dir():
        _write_folder(root, files)
    top = root / prefix if prefix else root

    def located(module: ModuleSource, local: tuple[ModuleSource, ...] = ()) -> ModuleSource:
        return ModuleSource(module.name, str(top / module.relative), module.text,
                            (str(top),) if module.search_path else (), local, module.assets)

    return located(source, tuple(located(m) for m in source.local_modules))


def _climbs(path: str) -> int:
    """How many folders a normalised relative path climbs (``../../x``: 2)."""
    parts = path.split("/")
    return next((i for i, part in enumerate(parts) if part != ".."), len(parts))


def _write_folder(root: Path, files: dict[str, bytes]) -> None:
    scratch = root.with_name(f".{root.name}.{uuid.uuid4().hex[:8]}")
    try:
        for relative, data in files.items():
            path = scratch / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        try:
            os.rename(scratch, root)
        except OSError:
            if not root.is_dir():   # not another process's copy of the same files
                raise
    except OSError as exc:
        from ..errors import RuntimeFailure

        raise RuntimeFailure(f"cannot write the job's code into the code cache {root.parent} "
                             f"(set ${CODE_CACHE_ENV}): {exc}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _execute(source: ModuleSource) -> types.ModuleType:
    # The job's folders are first on sys.path while the module executes (its own imports
    # resolve as from the job's folder), and only then: a process that runs several jobs must
    # not find one job's modules through another's folder.
    added = [folder for folder in source.search_path if folder not in sys.path]
    sys.path[:0] = added
    if source.local_modules:
        _serve(source.local_modules)
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


class SourceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves modules to ``import`` from their source text: the local modules a preprocessing
    module imports, as they were hashed. Parent packages without ``__init__.py`` (namespace
    packages) are served as namespaces."""

    def __init__(self, modules: Sequence[ModuleSource]):
        self.modules = {m.name: m for m in modules}
        self.namespaces: dict[str, list[str]] = {}
        for module in modules:
            parts = module.name.split(".")
            folder = Path(module.filename).parent
            if Path(module.filename).name == "__init__.py":
                folder = folder.parent
            for depth in range(len(parts) - 1, 0, -1):
                parent = ".".join(parts[:depth])
                if parent not in self.modules:
                    self.namespaces.setdefault(parent, [])
                    if str(folder) not in self.namespaces[parent]:
                        self.namespaces[parent].append(str(folder))
                folder = folder.parent
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def names(self) -> list[str]:
        return [*self.modules, *self.namespaces]

    def serves(self, module: types.ModuleType) -> bool:
        """Whether ``module`` is the one this finder made for its name."""
        spec = getattr(module, "__spec__", None)
        return spec is not None and self._specs.get(module.__name__) is spec

    def find_spec(self, fullname, path=None, target=None):
        source = self.modules.get(fullname)
        if source is not None:
            package = Path(source.filename).name == "__init__.py"
            spec = importlib.util.spec_from_loader(fullname, self, origin=source.filename,
                                                   is_package=package)
            assert spec is not None
            spec.has_location = True   # __file__: relative paths beside the module still work
            if package:  # submodules not served (a dynamic import) are looked for where it was
                spec.submodule_search_locations = [str(Path(source.filename).parent)]
        elif fullname in self.namespaces:
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = list(self.namespaces[fullname])
        else:
            return None
        self._specs[fullname] = spec
        return spec

    def create_module(self, spec):
        return None   # the default module

    def exec_module(self, module: types.ModuleType) -> None:
        source = self.modules[module.__name__]
        exec(compile(source.text, source.filename, "exec"), module.__dict__)

    def get_source(self, fullname: str) -> str:
        return self.modules[fullname].text   # tracebacks quote the text that ran


# One finder per set of served texts, so that reloading the same code (each unpickled copy of a
# preprocessing step loads it) reuses the modules already imported instead of piling up finders.
_finders: dict[tuple, SourceFinder] = {}


def _serve(modules: tuple[ModuleSource, ...]) -> None:
    """Put the finder for ``modules`` first on ``sys.meta_path`` (and keep it there)."""
    key = tuple((m.name, m.filename, m.sha256) for m in modules)
    finder = _finders.get(key)
    if finder is None:
        finder = _finders[key] = SourceFinder(modules)
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(finder)
    sys.meta_path.insert(0, finder)
    # ``import`` answers from sys.modules first: a module of the same name imported from a file,
    # or another text of it (another job in this process), would win over the hashed text.
    # (A module that imported the other one keeps its reference; only new imports change.)
    for name in finder.names():
        module = sys.modules.get(name)
        if module is not None and not finder.serves(module):
            del sys.modules[name]


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
