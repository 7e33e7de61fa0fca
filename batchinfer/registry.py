"""A registry of named entries (backends, runners), filled by batchinfer and by installed
distributions through entry points.

What fsspec does for file systems: batchinfer registers its own entries when the module that
owns them is imported; a distribution adds its own by naming an entry in an entry-point group
(``batchinfer.backends``, ``batchinfer.runners``), as in its ``pyproject.toml``::

    [project.entry-points."batchinfer.backends"]
    echo = "echo_backend:BACKEND"       # a batchinfer.backends.Backend named "echo"

The groups are read once, at the first lookup, not at import (about 5 ms per group here to read
the installed distributions' metadata), and each entry point's object is loaded then: its module
should hold data only, as batchinfer's own entries do (a backend's handler and a runner's Beam
runner are named by strings, imported when a job uses them). The entries are shown through a
read-only view; :meth:`Registry.register` refuses a name that is taken, unless told to
``clobber`` it, and so does discovery: an installed distribution cannot silently replace one of
batchinfer's entries or another distribution's.
"""
from __future__ import annotations

import threading
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType
from typing import Generic, Iterable, Mapping, Protocol, TypeVar

from .errors import RuntimeFailure


class Named(Protocol):
    @property
    def name(self) -> str: ...


E = TypeVar("E", bound=Named)


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
        self._origin: dict[str, str] = {}   # name → who registered it, for a clash's message
        self._view: Mapping[str, E] = MappingProxyType(self._entries)
        self._lock = threading.RLock()
        self._discovered = False
        for entry in builtin:
            self._add(entry, origin="batchinfer", clobber=False)

    def register(self, entry: E, *, clobber: bool = False) -> None:
        """Add ``entry`` under ``entry.name``.

        Raises:
            ValueError: the name is taken by another entry and ``clobber`` is False (the same
                entry registered again is no clash).
        """
        with self._lock:
            self._discover()
            self._add(entry, origin="register()", clobber=clobber)

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

    def _add(self, entry: E, *, origin: str, clobber: bool) -> None:
        if not isinstance(entry, self.entry_type):
            raise TypeError(f"a {self.kind} entry must be a {self.entry_type.__name__}, "
                            f"not {type(entry).__name__}")
        taken = self._clash(entry)
        if taken and not clobber:
            raise ValueError(f"{taken}: pass clobber=True to replace it")
        self._entries[entry.name] = entry
        self._origin[entry.name] = origin

    def _clash(self, entry: E) -> str:
        """Why ``entry`` cannot take its name ('' when it is free, or holds this very entry)."""
        taken = self._entries.get(entry.name)
        if taken is None or taken == entry:
            return ""
        return f"{self.kind} {entry.name!r} is already registered (by {self._origin[entry.name]})"

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
        self._add(entry, origin=where, clobber=False)
