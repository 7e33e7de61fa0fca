"""Sharing a loaded model within a process: the model cache, and the lock on its calls.

:func:`shared_model` is the per-process cache: a model stays in it while a handler that loaded
it is alive, so the driver's pre-flight load is reused by in-process workers (the driver's
handler lives as long as the run), several handler instances never hold two copies, and a
process that runs job after job (a backfill, an Airflow worker, a test session) does not keep
every model it ever loaded — a GPU's memory would fill with models no run uses.

:func:`call_lock` is the lock every ``predict`` on one model takes, for a backend whose
``predict`` is not thread-safe (handlers/loaded.py holds it). Beam shares a worker's model
between its threads: it unpickles a handler per thread and loads the model in one of them (its
``Shared``), so the other threads' handlers never load it and hold nothing; what every thread has
is the model's key, which is also what makes the cache give two handlers one model. So the locks
are kept by key, here, never on the handler (it pickles to the workers; a lock does not). A lock
outlives its model (one per key a process loads, a few bytes): a model loaded again under its
key, while threads still use a copy the cache let go, shares that copy's lock (over-cautious,
never unguarded). Its own lock, not the cache's, which is held while a model loads.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Hashable


class Held:
    """A loaded model, as the handlers that loaded it hold it (the cache holds it weakly)."""

    __slots__ = ("model", "__weakref__")

    def __init__(self, model: Any):
        self.model = model


_models: "weakref.WeakValueDictionary[Hashable, Held]" = weakref.WeakValueDictionary()
_models_lock = threading.Lock()


def shared_model(key: Hashable, load: Callable[[], Any]) -> Held:
    """The model ``key`` names, loaded once while anything holds what this returns."""
    with _models_lock:
        held = _models.get(key)
        if held is None:
            held = Held(load())
            _models[key] = held
        return held


_call_locks: dict[Hashable, threading.Lock] = {}
_call_locks_lock = threading.Lock()


def call_lock(key: Hashable) -> threading.Lock:
    """The lock held around every ``predict`` on the model ``key`` names, in this process."""
    with _call_locks_lock:
        return _call_locks.setdefault(key, threading.Lock())
