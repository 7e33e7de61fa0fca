"""A loaded model, as everything outside its backend reaches it: :class:`LoadedModel`.

It is what ``BatchModelHandler.load_model()`` returns, the one surface to a model: the backend
(handlers/protocol.py) bound to the model it loaded, its declared facts as plain data, and the
model's call lock around ``predict`` for a backend that is not thread-safe. The handler's
scoring (handlers/scorer.py), the run's pre-flight checks and explain all call it.

The same object serves a model that ``share_across_processes`` serves from a process of its own
(Beam's ``multi_process_shared``): workers hold a proxy to it, which pickles whatever a method
takes or returns, so every answer is plain data (lists, dicts, strings, arrays; a backend's own
answers may not pickle, ONNX Runtime's ``NodeArg`` say), and its lock is in the process that
serves it, where the calls of every worker process arrive, each in a thread of its own.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Generic, Optional, TypeVar

import numpy as np

from .protocol import ModelBackend, ModelFacts

ModelT = TypeVar("ModelT")


class LoadedModel(Generic[ModelT]):
    """A backend's model in this process, with its facts and its call lock.

    Args:
        backend: what loaded it.
        model: what ``backend.load`` returned.
        lock: held around every ``predict`` (and ``attribute``): the model's
            :func:`~batchinfer.handlers.sharing.call_lock`, or None for a thread-safe backend.
    """

    __slots__ = ("_backend", "_model", "_predict", "_lock", "_facts", "_waits", "__weakref__")

    def __init__(self, backend: ModelBackend[ModelT], model: ModelT,
                 lock: Optional[threading.Lock] = None):
        declared = backend.facts(model)
        self._backend = backend
        self._model = model
        self._predict = backend.predict
        self._lock = lock
        # plain data, asked once: it crosses to the workers of a served model as it is
        self._facts = ModelFacts(inputs=list(declared.inputs), outputs=list(declared.outputs),
                                 input_shapes={k: tuple(v) for k, v in declared.input_shapes.items()},
                                 device=str(declared.device),
                                 default_chunk_rows=declared.default_chunk_rows,
                                 # calls that take turns gain nothing from being made at once
                                 call_threads=declared.call_threads if lock is None else 1)
        self._waits = threading.local()

    @property
    def model(self) -> ModelT:
        """What the backend loaded (its own object: an ``InferenceSession``, a ``TorchModel``)."""
        return self._model

    def facts(self) -> ModelFacts:
        return self._facts

    def input_names(self) -> list[str]:
        return list(self._facts.inputs)

    def output_names(self) -> list[str]:
        return list(self._facts.outputs)

    def input_shapes(self) -> dict[str, tuple]:
        return dict(self._facts.input_shapes)

    def default_chunk_rows(self) -> Optional[int]:
        return self._facts.default_chunk_rows

    def call_threads(self) -> int:
        return self._facts.call_threads

    def device_used(self) -> str:
        return self._facts.device

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The backend's ``predict`` on this model, taking turns with other threads' calls
        when the backend is not thread-safe."""
        lock = self._lock
        if lock is None:
            return self._predict(self._model, inputs)
        t0 = time.perf_counter()
        with lock:
            waits = self._waits
            waits.s = getattr(waits, "s", 0.0) + time.perf_counter() - t0
            return self._predict(self._model, inputs)

    def waited_s(self) -> float:
        """Seconds this thread's calls have waited for the call lock (not the model's time)."""
        return float(getattr(self._waits, "s", 0.0))

    def attribute(self, name: str, x: np.ndarray, baseline: np.ndarray, output: str,
                  method: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """The backend's gradient attributions (explain: handlers/protocol.py), under the same
        call lock as predict."""
        attribute: Any = getattr(self._backend, "attribute", None)
        if attribute is None:
            raise NotImplementedError(f"{type(self._backend).__name__} gives no gradients")
        if self._lock is None:
            return attribute(self._model, name, x, baseline, output, method, steps)
        with self._lock:
            return attribute(self._model, name, x, baseline, output, method, steps)
