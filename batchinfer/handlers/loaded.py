"""A loaded model as the rest of batchinfer calls it: :class:`LoadedModel`, typed.

A backend implements its hooks on the handler, each taking the backend's own model
(``handler.predict(session, inputs)``). Everything that calls them — the handler's own machinery
(handlers/base.py) and the run's pre-flight checks — goes through a ``LoadedModel`` instead, so
that the calls are checked and one object answers them wherever the model is:

- :class:`LocalModel`: the model in this process, the handler's hooks bound to it;
- :class:`ServedModel`: the model that ``share_across_processes`` serves from a process of its
  own (Beam's ``multi_process_shared``); workers hold a proxy to it, which pickles whatever a
  method takes or returns, so it answers with plain data.

Both hold the model's call lock around ``predict`` for a backend that is not thread-safe; a
served model's is in the process that serves it, where the calls of every worker process arrive,
each in a thread of its own.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Generic, Optional, Protocol, TypeVar

import numpy as np

if TYPE_CHECKING:
    from .base import BatchModelHandler

ModelT = TypeVar("ModelT")


class LoadedModel(Protocol):
    """What a loaded model is asked; see the hooks of the same names on ``BatchModelHandler``."""

    def input_names(self) -> list[str]: ...

    def output_names(self) -> list[str]: ...

    def input_shapes(self) -> dict[str, tuple]: ...

    def default_chunk_rows(self) -> Optional[int]: ...

    def device_used(self) -> str: ...

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def attribute(self, name: str, x: np.ndarray, baseline: np.ndarray, output: str,
                  method: str, steps: int) -> tuple[np.ndarray, np.ndarray]: ...


class LocalModel(Generic[ModelT]):
    """A backend's model in this process, with the handler's hooks bound to it.

    ``predict`` holds the model's call lock when the backend is not thread-safe
    (``BatchModelHandler.thread_safe``, ``base.call_lock``): every thread's calls on one model
    take turns, whichever handler they come from. ``waited_s`` is the time this object's calls
    waited for it."""

    __slots__ = ("_handler", "_model", "_lock", "waited_s")

    def __init__(self, handler: "BatchModelHandler[ModelT]", model: ModelT):
        self._handler = handler
        self._model = model
        self._lock = handler.calls_lock()
        self.waited_s = 0.0

    def input_names(self) -> list[str]:
        return self._handler.input_names(self._model)

    def output_names(self) -> list[str]:
        return self._handler.output_names(self._model)

    def input_shapes(self) -> dict[str, tuple]:
        return self._handler.input_shapes(self._model)

    def default_chunk_rows(self) -> Optional[int]:
        return self._handler.default_chunk_rows(self._model)

    def device_used(self) -> str:
        return self._handler.device_used(self._model)

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._lock is None:
            return self._handler.predict(self._model, inputs)
        t0 = time.perf_counter()
        with self._lock:
            self.waited_s += time.perf_counter() - t0
            return self._handler.predict(self._model, inputs)

    def attribute(self, name: str, x: np.ndarray, baseline: np.ndarray, output: str,
                  method: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """The backend's gradient attributions (explain), under the same call lock as predict."""
        if self._lock is None:
            return self._handler.attribute(self._model, name, x, baseline, output, method, steps)
        with self._lock:
            return self._handler.attribute(self._model, name, x, baseline, output, method, steps)


class ServedModel(LocalModel[Any]):
    """A :class:`LocalModel` for ``share_across_processes``: Beam serves it from one process and
    hands every worker a proxy to it. A backend's own answers may not pickle (ONNX Runtime's
    ``NodeArg``); these are plain lists, dicts, strings and arrays."""

    __slots__ = ()

    def input_names(self) -> list[str]:
        return list(super().input_names())

    def output_names(self) -> list[str]:
        return list(super().output_names())

    def input_shapes(self) -> dict[str, tuple]:
        return dict(super().input_shapes())
