"""What a preprocessing module imports, found from its source without running it (contract §6
"Preprocessing code"): the *local* modules — the job's own code, whose text goes into
``preprocess_hash`` and travels with the job — and the *installed* packages, recorded by
distribution name and version in the declaration.

Every ``import x``, ``from x import y`` and relative import anywhere in the file (function
bodies too), and ``importlib.import_module("x")`` with a literal name, is resolved as the run
resolves it: the job's folder first, then ``sys.path`` (``PYTHONPATH`` included), without
importing anything. Each local module found is walked the same way. A module is local when its
file is under the job's folder or a ``PYTHONPATH`` folder, or outside both the standard library
and the installed packages (``sysconfig``'s and ``site``'s paths). The standard library is
ignored. A name computed at run time (``import_module(name)``) cannot be seen.
"""
from __future__ import annotations

import ast
import functools
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from .. import __version__
from .sources import ModuleSource, SourceFinder


@dataclass(frozen=True)
class Imports:
    """What a module imports, directly or through its local modules.

    Attributes:
        local: the local modules (the entry module itself excluded), sorted by name, each read
            once: the text hashed is the text that runs.
        packages: ``"distribution==version"`` of each installed distribution imported, sorted.
    """

    local: tuple[ModuleSource, ...]
    packages: tuple[str, ...]


def walk_imports(entry: ModuleSource, job_folder: Path) -> Imports:
    """The local modules and installed packages ``entry`` imports, recursively."""
    resolver = _Resolver(job_folder)
    local: dict[str, ModuleSource] = {}
    packages: set[str] = set()
    queue = [entry]
    while queue:
        module = queue.pop()
        for name in imported_names(module):
            for kind, dotted, where in resolver.resolve(name):
                if kind == "installed":
                    packages.add(where)
                elif dotted != entry.name and dotted not in local:
                    found = ModuleSource.read(dotted, where)
                    local[dotted] = found
                    queue.append(found)
    return Imports(tuple(local[name] for name in sorted(local)), tuple(sorted(packages)))


def imported_names(module: ModuleSource) -> Iterator[str]:
    """The absolute dotted name of each import in the module's source; ``from a import b``
    gives ``a`` and ``a.b`` (a submodule, or a name defined in ``a``)."""
    try:
        tree = ast.parse(module.text, module.filename)
    except SyntaxError:
        return   # executing it says so, with the line
    package = module.name if Path(module.filename).name == "__init__.py" \
        else module.name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            if base is None:
                continue
            yield base
            for alias in node.names:
                if alias.name != "*":
                    yield f"{base}.{alias.name}"
        elif isinstance(node, ast.Call) and _is_import_call(node):
            literal = node.args[0]
            if isinstance(literal, ast.Constant) and isinstance(literal.value, str) \
                    and literal.value and not literal.value.startswith("."):
                yield literal.value


def _absolute(name: str | None, level: int, package: str) -> str | None:
    """The absolute name of ``from <level dots><name> import …`` in ``package``; None when it
    climbs above the top (the import fails when it runs)."""
    if level == 0:
        return name
    parts = package.split(".") if package else []
    if level - 1 >= len(parts):
        return None
    base = ".".join(parts[:len(parts) - (level - 1)])
    return f"{base}.{name}" if name else base


def _is_import_call(node: ast.Call) -> bool:
    func = node.func
    called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return called in ("import_module", "__import__") and bool(node.args)


class _Resolver:
    """Finds where a dotted name comes from, as ``import`` would with the job's folder first."""

    def __init__(self, job_folder: Path):
        self.job_folder = str(job_folder)
        pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.local_roots = _real([self.job_folder, *pythonpath])
        paths = [sysconfig.get_paths(), sysconfig.get_paths(vars={"base": sys.base_prefix,
                                                                  "platbase": sys.base_exec_prefix})]
        self.installed_roots = _real([p[k] for p in paths for k in ("purelib", "platlib")]
                                     + list(getattr(site, "getsitepackages", list)())
                                     + [site.getusersitepackages()])
        self.stdlib_roots = _real([p[k] for p in paths for k in ("stdlib", "platstdlib")])
        self._tops: dict[str, _Spot | None] = {}

    def resolve(self, dotted: str) -> Iterator[tuple[str, str, str]]:
        """``(kind, module name, where)`` for the modules importing ``dotted`` runs (its parent
        packages first): ``local`` with the source file, ``installed`` with
        ``distribution==version``. The standard library, local modules that are not source (C
        extensions: not covered) and names not found yield nothing (``from a import b`` where
        ``b`` is a name ``a`` defines; an import that fails, which fails when the module runs)."""
        parts = dotted.split(".")
        top = parts[0]
        if not top or top in sys.stdlib_module_names or top in sys.builtin_module_names:
            return
        if top == "batchinfer":   # the framework itself, even from a checkout: not job code
            yield "installed", top, f"batchinfer=={__version__}"
            return
        spot = self._top(top)
        for depth in range(1, len(parts) + 1):
            if spot is None:
                return
            name = ".".join(parts[:depth])
            where = [spot.origin] if spot.origin else list(spot.locations or ())
            if not where:   # built-in or frozen
                return
            kind = self._kind(where)
            if kind == "stdlib":
                return
            if kind == "installed":
                if spot.origin is not None:   # (a namespace has no code of its own: look inside)
                    yield "installed", top, _distribution(top, spot.origin)
                    return
            elif spot.origin is not None:
                if not spot.origin.endswith(".py"):
                    return
                yield "local", name, spot.origin
            if depth == len(parts) or spot.locations is None:
                return
            spot = _find_in(parts[depth], spot.locations)

    def _top(self, top: str) -> "_Spot | None":
        if top not in self._tops:
            self._tops[top] = self._find_top(top)
        return self._tops[top]

    def _find_top(self, top: str) -> "_Spot | None":
        """Where ``import top`` would find it: a module or package in the job's folder first
        (what the run puts first on sys.path), else what the import system's finders find — not
        its cache of modules (which may hold another job's module of that name)."""
        found = _find_in(top, [self.job_folder])
        if found is not None and found.origin is not None:
            return found
        added = self.job_folder not in sys.path
        if added:
            sys.path.insert(0, self.job_folder)
        try:
            for finder in sys.meta_path:
                if isinstance(finder, SourceFinder) or not hasattr(finder, "find_spec"):
                    continue
                try:
                    spec = finder.find_spec(top, None)
                except (ImportError, ValueError):
                    spec = None
                if spec is not None:
                    locations = spec.submodule_search_locations
                    return _Spot(spec.origin if spec.has_location else None,
                                 None if locations is None else tuple(locations))
            return None
        finally:
            if added:
                sys.path.remove(self.job_folder)

    def _kind(self, where: list[str]) -> str:
        """local, installed or stdlib, by where the module's file (or namespace folders) are:
        local if any of them is."""
        kinds = {self._kind_of(path) for path in _real(where)}
        return next(kind for kind in ("local", "installed", "stdlib") if kind in kinds)

    def _kind_of(self, path: str) -> str:
        """The kind of the most specific root ``path`` is under (a virtual environment inside the
        job's folder is installed packages; a job folder inside site-packages is the job's), or
        local when it is under none."""
        parts = Path(path).parts
        site_dirs = [str(Path(*parts[:i + 1])) for i, part in enumerate(parts)
                     if part in ("site-packages", "dist-packages")]
        best, depth = "local", -1
        for kind, roots in (("local", self.local_roots),
                            ("installed", [*self.installed_roots, *site_dirs]),
                            ("stdlib", self.stdlib_roots)):
            for root in roots:
                if _under(path, [root]) and len(root) > depth:
                    best, depth = kind, len(root)
        return best


@dataclass(frozen=True)
class _Spot:
    """Where a module was found: its file (None for a namespace package, or built-in), and for a
    package the folders its submodules are looked for in."""

    origin: str | None
    locations: tuple[str, ...] | None


def _find_in(name: str, folders: Sequence[str]) -> _Spot | None:
    """Module ``name`` (one name, no dots) in ``folders``, as the path finder looks: in each
    folder a package, then a module (extension, source, bytecode); a folder without
    ``__init__.py`` is a portion of a namespace package, used only when no folder has more.
    (Not importlib's PathFinder: for a nested namespace it wants the parent imported.)"""
    suffixes = [*importlib.machinery.EXTENSION_SUFFIXES, *importlib.machinery.SOURCE_SUFFIXES,
                *importlib.machinery.BYTECODE_SUFFIXES]
    portions = []
    for folder in folders:
        base = Path(folder, name)
        if base.is_dir():
            for suffix in suffixes:
                init = base / f"__init__{suffix}"
                if init.is_file():
                    return _Spot(str(init), (str(base),))
        for suffix in suffixes:
            file = Path(folder, name + suffix)
            if file.is_file():
                return _Spot(str(file), None)
        if base.is_dir():
            portions.append(str(base))
    return _Spot(None, tuple(portions)) if portions else None


def _distribution(top: str, file: str) -> str:
    """``name==version`` of the installed distribution that provides top-level package ``top``
    (``file``: the imported module's file, which tells distributions sharing a namespace apart)."""
    try:   # the usual case: the distribution is named like its package, and ships it
        dist = importlib.metadata.distribution(top)
        if any(str(f).split("/")[0] in (top, f"{top}.py") for f in dist.files or ()):
            return f"{dist.metadata['Name']}=={dist.version}"
    except importlib.metadata.PackageNotFoundError:
        pass
    names = _packages_distributions().get(top, [])
    if len(names) > 1:   # a namespace shared by several distributions: the one with this file
        real = os.path.realpath(file)
        owners = [n for n in names if any(os.path.realpath(str(importlib.metadata.distribution(n)
                                                                 .locate_file(f))) == real
                                          for f in importlib.metadata.distribution(n).files or ())]
        names = owners or names
    if not names:
        return f"{top}==unknown"   # files in site-packages that no distribution lists
    return " ".join(sorted(f"{n}=={importlib.metadata.version(n)}" for n in set(names)))


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


def _real(paths: list[str]) -> list[str]:
    return [os.path.realpath(p) for p in paths if p]


def _under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)
