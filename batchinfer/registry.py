"""A registry of named entries (backends, runners, formats), filled by batchinfer and by installed
distributions through entry points.

What fsspec does for file systems: batchinfer registers its own entries when the module that
owns them is imported; a distribution adds its own by naming an entry in an entry-point group
(``batchinfer.backends``, ``batchinfer.runners``, ``batchinfer.formats``), as in its ``pyproject.toml``::

    [project.entry-points."batchinfer.backends"]
    echo = "echo_backend:BACKEND"       # a batchinfer.backends.Backend named "echo"

The groups are read once, at the first lookup, not at import (about 5 ms per group here to read
the installed distributions' metadata), and each entry point's object is loaded then: its module
should hold data only, as batchinfer's own entries do (a backend's handler and a runner's Beam
runner are named by strings, imported when a job uses them). The entries are shown through a
read-only view; :meth:`Registry.register` refuses a name that is taken, unless told to
``clobber`` an entry that ``register()`` itself added, and so does discovery. batchinfer's own
entries and those of installed distributions are never replaced, clobber or not: the code a
plugin runs (its module, imported at discovery) cannot take over ``onnxruntime`` and have an
ordinary job commit its predictions under batchinfer's name.

Every entry knows where it came from (:meth:`Registry.provenance`): batchinfer, or the
distribution (and version) that holds it, which the manifest of a run that uses it names.
"""
from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass, replace
from importlib.metadata import EntryPoint, entry_points, packages_distributions, version
from types import MappingProxyType
from typing import Generic, Iterable, Mapping, Protocol, TypeVar

from .errors import RuntimeFailure


class Named(Protocol):
    @property
    def name(self) -> str: ...


E = TypeVar("E", bound=Named)


BATCHINFER = "batchinfer"


@dataclass(frozen=True)
class Provenance:
    """Where an entry came from.

    Attributes:
        distribution: the installed distribution that holds it (its entry point's, or the one
            whose module called ``register()``); None for batchinfer's own, or for an entry a
            program registered from code no distribution holds (a script).
        version: that distribution's version.
        origin: ``batchinfer``, ``entry point NAME = VALUE (group …)`` or ``register() in
            MODULE``: for messages.
        module: the module that called ``register()``, whose distribution is looked up when
            the provenance is first asked for (reading every installed distribution's files
            takes a second or two: a program that registers need not pay it unless a run
            names its entry).
    """

    distribution: str | None
    version: str | None
    origin: str
    module: str | None = None

    @property
    def builtin(self) -> bool:
        return self.origin == BATCHINFER


class Registry(Generic[E]):
    """Entries of one kind by name, in the order they were registered (batchinfer's first).

    Args:
        kind: what an entry is, for messages (``"backend"``).
        entry_type: the class every entry is an instance of.
        group: the entry-point group read for entries from installed distributions.
        builtin: batchinfer's own entries.
    """

    def __init__(self, *, kind: str, entry_type: type[E], group: str, builtin: Iterable[E] = ()):
        self.kind = kind
        self.entry_type = entry_type
        self.group = group
        self._entries: dict[str, E] = {}
        self._origin: dict[str, Provenance] = {}   # name → who registered it
        self._view: Mapping[str, E] = MappingProxyType(self._entries)
        self._lock = threading.RLock()
        self._discovered = False
        for entry in builtin:
            self._add(entry, Provenance(None, None, BATCHINFER), clobber=False)

    def register(self, entry: E, *, clobber: bool = False) -> None:
        """Add ``entry`` under ``entry.name``.

        Raises:
            ValueError: the name is taken by another entry (the same entry registered again is
                no clash) and ``clobber`` is False, or it is taken by batchinfer or an
                installed distribution, whose entries are never replaced.
        """
        caller = _caller()
        with self._lock:
            self._discover()
            self._add(entry, Provenance(None, None, f"register() in {caller}", caller),
                      clobber=clobber)

    def entries(self) -> Mapping[str, E]:
        """Every entry by name: a read-only view, which later registrations show too."""
        with self._lock:
            self._discover()
        return self._view

    def names(self) -> tuple[str, ...]:
        return tuple(self.entries())

    def find(self, name: str) -> E | None:
        """The entry called ``name``, or None."""
        return self.entries().get(name)

    def provenance(self, name: str) -> Provenance | None:
        """Where the entry called ``name`` came from (None: there is none)."""
        with self._lock:
            self._discover()
            found = self._origin.get(name)
            if found is not None and found.module is not None:   # register()'s: look it up once
                distribution, version = _distribution_of(found.module.split(".")[0])
                found = replace(found, module=None, distribution=distribution, version=version)
                self._origin[name] = found
            return found

    def _add(self, entry: E, provenance: Provenance, *, clobber: bool) -> None:
        if not isinstance(entry, self.entry_type):
            raise TypeError(f"a {self.kind} entry must be a {self.entry_type.__name__}, "
                            f"not {type(entry).__name__}")
        if self._entries.get(entry.name) == entry:
            return   # the same entry again: no clash, and it stays whose it was
        taken = self._clash(entry)
        if taken and not self._origin[entry.name].origin.startswith("register()"):
            raise ValueError(f"{taken}, whose entries cannot be replaced: register yours under "
                             f"another name")
        if taken and not clobber:
            raise ValueError(f"{taken}: pass clobber=True to replace it")
        self._entries[entry.name] = entry
        self._origin[entry.name] = provenance

    def _clash(self, entry: E) -> str:
        """Why ``entry`` cannot take its name ('' when it is free, or holds this very entry)."""
        taken = self._entries.get(entry.name)
        if taken is None or taken == entry:
            return ""
        return f"{self.kind} {entry.name!r} is already registered (by {self._origin[entry.name].origin})"

    def _discover(self) -> None:
        """Load the group's entry points, once (the caller holds the lock). A failure is raised
        again at the next lookup, not left as a registry with some entries missing."""
        if self._discovered:
            return
        self._discovered = True   # first: an entry point's module may look the registry up
        try:
            for point in sorted(entry_points(group=self.group), key=lambda p: p.name):
                self._add_entry_point(point)
        except BaseException:
            self._discovered = False
            raise

    def _add_entry_point(self, point: EntryPoint) -> None:
        where = (f"entry point {point.name} = {point.value} (group {self.group}"
                 f"{', distribution ' + point.dist.name if point.dist else ''})")
        try:
            entry = point.load()
        except Exception as exc:
            raise RuntimeFailure(f"{where} cannot be loaded: {type(exc).__name__}: {exc}") from None
        if not isinstance(entry, self.entry_type) or entry.name != point.name:
            raise RuntimeFailure(f"{where} is not a {self.entry_type.__name__} named "
                                 f"{point.name!r}: fix the distribution's entry point")
        taken = self._clash(entry)
        if taken:
            raise RuntimeFailure(f"{where}: {taken}: uninstall one of the two distributions")
        dist = point.dist
        self._add(entry, Provenance(dist.name if dist else None, dist.version if dist else None, where),
                  clobber=False)


def _caller() -> str:
    """The module that called ``register()``: the first frame outside the registries."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in _OURS:
        frame = frame.f_back   # type: ignore[assignment]
    return str(frame.f_globals.get("__name__", "?")) if frame is not None else "?"


_OURS = frozenset({__name__, "batchinfer.backends", "batchinfer.runners", "batchinfer.io.formats"})


@functools.cache
def _distribution_of(top: str) -> tuple[str | None, str | None]:
    """The installed distribution (and its version) that holds the top-level package ``top``,
    or (None, None): a script's ``__main__``, a folder on ``sys.path`` with no metadata."""
    names = packages_distributions().get(top, [])
    if not names:
        return None, None
    try:
        return names[0], version(names[0])
    except Exception:   # metadata that disappeared meanwhile: name it without a version
        return names[0], None
