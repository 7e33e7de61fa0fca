"""The model protocol: what a backend implements, in three methods, and nothing else.

A backend is any object with

- ``load(path)``: load the model file at ``path`` (called at most once per process and model
  while a handler holds it, handlers/sharing.py) and return the backend's own model object;
- ``facts(model)``: what the loaded model declares, as :class:`ModelFacts` (asked once, at load);
- ``predict(model, inputs)``: run it on a dict of input arrays (axis 0 rows), return a dict of
  output arrays, one entry per input row.

It needs no base class: :class:`ModelBackend` is a ``Protocol``. Everything else a run does
with a model — ordering rows by tokens, isolating the rows it rejects, halving calls that run
out of device memory, holding outputs to the batch contract, serialising calls, sharing one copy
per process — is a part the Beam handler (handlers/base.py ``BatchModelHandler``) composes
around it; none of it is a backend's to implement.

A backend may say more, with attributes and methods it simply has (:class:`Traits` and the
functions below give the defaults for one that does not):

- ``thread_safe`` (False): threads may call ``predict`` on one loaded model at once; otherwise
  the calls take turns (handlers/sharing.py ``call_lock``);
- ``warm_up`` (True): the first call of a process is made once untimed (set-up is not the
  model's work);
- ``is_out_of_memory(exc)`` (False): ``exc``, raised by ``predict``, means the device ran out of
  memory: the rows are retried in smaller calls (handlers/oom.py), not blamed;
- ``gradients`` (False) and ``attribute(model, name, x, baseline, output, method, steps)``:
  gradient attributions for explain (handlers/explain.py);
- ``build_facts(path)`` (a classmethod, {}): what the model file was built for that the runtime
  must match (a TensorRT engine: its TensorRT version and GPU), recorded by ``stamp``
  (``backends.build_facts``);
  ``runtime_facts()`` ({}): the same facts of this machine, compared before the model loads.

A registered backend (:mod:`batchinfer.backends`) is built as ``cls(device=…, options=…)``,
its options already checked against its entry.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol, Sequence, TypeVar

import numpy as np

from .. import backends
from ..errors import ModelError, PreprocessError

ModelT = TypeVar("ModelT")


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What a loaded model declares.

    Attributes:
        inputs: its inputs, by name (a single-input model gets the one array it is given).
        outputs: its outputs, by name (they become prediction columns).
        input_shapes: each input's shape past the rows: an int for a fixed size, a str naming a
            dynamic dim (ONNX's ``dim_param``, a torch.export symbol: inputs that share the name
            share the size), None for a dynamic dim without a name. An input left out has an
            unknown shape and is not checked. Example: inputs ``x [N, 8]`` and ``ids [N, L]`` →
            ``{"x": (8,), "ids": ("L",)}``.
        device: where it runs, as the manifest records it ("cpu", "cuda:0").
        default_chunk_rows: rows per ``predict`` call when the job does not say (None: the
            whole batch).
        call_threads: how many of a batch's ``predict`` calls the scorer makes at once, each on
            a thread of its own (1: one after another). Only a thread-safe backend may say more
            than 1; ONNX Runtime on the CPU says one per core, each call then on one thread of
            its own (handlers/onnx.py).
    """

    inputs: Sequence[str]
    outputs: Sequence[str]
    input_shapes: Mapping[str, tuple] = field(default_factory=dict)
    device: str = "cpu"
    default_chunk_rows: Optional[int] = None
    call_threads: int = 1


class ModelBackend(Protocol[ModelT]):
    """A model backend: load, declared facts, predict (see the module docstring)."""

    def load(self, path: str) -> ModelT: ...

    def facts(self, model: ModelT) -> ModelFacts: ...

    def predict(self, model: ModelT, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class Traits:
    """What a backend says about itself besides its three methods, read once (defaults for a
    backend that says nothing)."""

    thread_safe: bool = False
    warm_up: bool = True
    gradients: bool = False

    @classmethod
    def of(cls, backend: Any) -> "Traits":
        return cls(thread_safe=bool(getattr(backend, "thread_safe", False)),
                   warm_up=bool(getattr(backend, "warm_up", True)),
                   gradients=bool(getattr(backend, "gradients", False)))


def is_out_of_memory(backend: Any, exc: BaseException) -> bool:
    """The backend's ``is_out_of_memory(exc)``, False for one that has none."""
    check = getattr(backend, "is_out_of_memory", None)
    return bool(check(exc)) if check is not None else False


def runtime_facts(backend: Any) -> dict[str, str]:
    """The backend's ``runtime_facts()``, {} for one that has none."""
    facts = getattr(backend, "runtime_facts", None)
    return dict(facts()) if facts is not None else {}


def require(backend: str, module: str) -> Any:
    """Import backend ``backend``'s library ``module``, or exit 5 saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ModelError(f"backend {backend!r} needs {module}, which is not installed: "
                         f"{backends.get(backend).install}") from None


def cast_input(name: str, value: np.ndarray, want: Any) -> np.ndarray:
    """``value`` as dtype ``want`` for model input ``name``, if the cast stays within a kind.

    float64 → float32 is what users mean; float → int64 would truncate token ids or counts
    without a word, so only casts within a kind are made.

    Raises:
        PreprocessError: a cast that could change values (the preprocessing must return the
            model's dtype).
    """
    want = np.dtype(want)
    if value.dtype == want:
        return value
    if not np.can_cast(value.dtype, want, casting="same_kind"):
        raise PreprocessError(
            f"preprocessing returned {value.dtype} for model input {name!r}, which takes "
            f"{want.name}: return {want.name} (a cast from {value.dtype} could change values); "
            f"nothing committed")
    return value.astype(want)
