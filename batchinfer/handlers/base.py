"""The Beam ``ModelHandler`` of every batchinfer model: :class:`BatchModelHandler`, one class.

A backend is not a subclass of it: a backend implements the small model protocol of
handlers/protocol.py (``load``, ``facts``, ``predict``), and the handler composes the policies
around it, each a part of its own:

- fetching a model in a store into the machine's model cache (``source``) before it loads;
- the per-process model cache and the call lock of a backend that is not thread-safe
  (handlers/sharing.py), applied by the :class:`~batchinfer.handlers.loaded.LoadedModel` that
  :meth:`BatchModelHandler.load_model` returns — the one surface to a loaded model;
- one model served to every worker process of a machine (``share_across_processes``);
- per batch, the :class:`~batchinfer.handlers.scorer.Scorer`: inputs checked against the
  model, token ordering (handlers/tokens.py), isolation of rejected rows (rows/isolation.py),
  call planning, the out-of-memory back-off and the batch contract (handlers/calls.py, oom.py,
  batch_contract.py).

:func:`handler_for` builds the handler of a registered backend (:mod:`batchinfer.backends`) the
way a run does. Elements are :class:`Prepared` batches of many rows (never one row), so Beam's
``BatchElements`` is told to pass them one at a time, and ``get_num_bytes`` sums array sizes
instead of pickling (pickling a batch was measured at ~34 ms).
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Hashable, Iterable, Mapping, Optional, Protocol, Sequence

from .. import backends, faults
from ..beam_compat import ModelHandler, PredictionResult
from . import protocol
from .loaded import LoadedModel
from .oom import OutOfMemoryPolicy
from .protocol import ModelBackend, Traits
from .scorer import Inference, Prepared, Scorer
from .sharing import Held, call_lock, shared_model
from .tokens import TokenOrder

__all__ = ["BatchModelHandler", "Inference", "ModelSource", "Prepared", "handler_for"]


class ModelSource(Protocol):
    """A model in a store, as the run gives it to a handler (triple/model_cache.py): its URL, and
    the model file in this machine's model cache, fetched and checked against the run's digest."""

    @property
    def url(self) -> str: ...

    def local_path(self) -> str: ...


class BatchModelHandler(ModelHandler[Prepared, PredictionResult, LoadedModel]):
    """Beam ``ModelHandler`` over :class:`Prepared` batches, around one backend.

    Args:
        backend: the model backend (handlers/protocol.py), built for the job's device and
            options.
        model_path: the local model file (for a model in a store: its URL until it is fetched).
        digest: the model digest that was checked (part of the per-process cache key).
        name: the backend's ``model.backend`` name ("" for a backend outside the registry:
            its class name keys the model cache).
        source: a model in a store: :meth:`load_model` fetches it into the machine's model cache
            (verified against ``digest``) and loads it from there; None: ``model_path`` is local.
        device: ``auto`` | ``cpu`` | ``cuda`` (the job's ``model.device``).
        options: the job's ``model.options`` (``chunk_rows``, ``share_across_processes`` and
            ``model_copies`` are the handler's; the rest the backend's).
        tokens: the job's ``batch.tokens``: size model calls by padded tokens, longest rows
            first (handlers/tokens.py); None sizes them by rows.
        lengths_from: the input whose non-zero entries mark a row's real tokens.
        sequence_inputs: the inputs cut to each call's longest row with ``tokens`` (the job's
            ``batch.sequence_inputs``); None: the lengths input and the inputs the model
            declares alike (:func:`~batchinfer.handlers.tokens.sequence_inputs`).
    """

    def __init__(self, backend: ModelBackend[Any], model_path: str, *, digest: str,
                 name: str = "", device: str = "auto", options: Optional[Mapping[str, Any]] = None,
                 tokens: Optional[int] = None, lengths_from: str = "attention_mask",
                 sequence_inputs: Optional[Sequence[str]] = None,
                 source: Optional[ModelSource] = None):
        super().__init__(min_batch_size=1, max_batch_size=1)
        self.model_backend = backend
        self.backend = name   # the name in batchinfer.backends ("" outside it)
        self.traits = Traits.of(backend)
        self.model_path = model_path
        self.source = source
        self.digest = digest
        self.device = device
        self.options = dict(options or {})
        # The per-batch policies; the injected oom fault is read here, where the run builds its
        # handlers, and pickles with the handler to its workers.
        self.scorer = Scorer(model_path=model_path, chunk_rows=self.options.get("chunk_rows"),
                             tokens=TokenOrder(tokens, lengths_from, sequence_inputs),
                             oom=OutOfMemoryPolicy(faults.active().oom_rows()),
                             out_of_memory=functools.partial(protocol.is_out_of_memory, backend),
                             warm_up=self.traits.warm_up,
                             served=self.share_model_across_processes())
        self._held: Optional[Held] = None  # the backend's model, while this handler lives
        self._loaded: Optional[LoadedModel] = None   # it, bound to this handler's backend

    @property
    def gradients(self) -> bool:
        """Whether the backend gives gradient attributions (explain's gradient methods)."""
        return self.traits.gradients

    def runtime_facts(self) -> dict[str, str]:
        """This machine's facts that the model's build facts must match (handlers/protocol.py)."""
        return protocol.runtime_facts(self.model_backend)

    def model_key(self) -> Hashable:
        """Identity of the loaded model for the per-process cache."""
        return (self.backend or type(self.model_backend).__name__, self.digest, self.device,
                repr(sorted(self.options.items())))

    # -- Beam's ModelHandler -----------------------------------------------------------------
    def load_model(self) -> LoadedModel:
        """The loaded model: the backend's model (loaded once per process and key while a
        handler holds it) bound to this handler's backend, with the model's call lock. With
        ``share_across_processes`` Beam calls this in the process that serves the model and
        hands the workers a proxy to what it returns."""
        held = shared_model(self.model_key(), self._fetch_and_open)
        if self._loaded is None or self._held is not held:
            lock = None if self.traits.thread_safe else call_lock(self.model_key())
            self._held = held
            self._loaded = LoadedModel(self.model_backend, held.model, lock)
        return self._loaded

    def _fetch_and_open(self) -> Any:
        # A model in a store: fetched into this machine's model cache and checked against the
        # run's digest before it loads (a model this process holds already was checked then).
        if self.source is not None:
            self.model_path = self.scorer.model_path = self.source.local_path()
        return self.model_backend.load(self.model_path)

    def __getstate__(self) -> dict[str, Any]:
        # Beam pickles the handler to its workers; each loads (or finds) the model itself.
        # A model in a store travels as its URL, not as this machine's cache path.
        where = self.source.url if self.source is not None else self.model_path
        scorer = copy.copy(self.scorer)
        scorer.model_path = where
        return {**self.__dict__, "_held": None, "_loaded": None, "model_path": where,
                "scorer": scorer}

    def share_model_across_processes(self) -> bool:
        # model.options.share_across_processes: one copy per machine (or `model_copies`), served
        # from a process of its own to every worker process (Beam's multi_process_shared): for a
        # GPU that holds one copy of a large model, not one per SDK process.
        return bool(self.options.get("share_across_processes", False))

    def model_copies(self) -> int:
        return int(self.options.get("model_copies", 1))

    def run_inference(self, batch: Sequence[Prepared], model: LoadedModel,
                      inference_args: Optional[dict[str, Any]] = None) -> Iterable[PredictionResult]:
        infer = self.scorer.infer
        return [PredictionResult(item, infer(model, item)) for item in batch]

    def get_num_bytes(self, batch: Sequence[Prepared]) -> int:
        return sum(item.nbytes() for item in batch)

    def get_metrics_namespace(self) -> str:
        return "batchinfer"

    def batch_elements_kwargs(self) -> Mapping[str, Any]:
        # Elements are already large batches: one at a time.
        return {"min_batch_size": 1, "max_batch_size": 1}

    # -- the scorer, as callers outside Beam use it ----------------------------------------------
    def infer(self, model: LoadedModel, item: Prepared) -> Inference:
        """Score one prepared batch, isolating rows the model rejects (handlers/scorer.py)."""
        return self.scorer.infer(model, item)

    def sequence_inputs(self, model: LoadedModel) -> frozenset[str]:
        """The inputs that ``batch.tokens`` cuts to each call's longest row (asked once).

        Raises:
            SpecError: the choice cannot be made or made safely (tokens.sequence_inputs).
        """
        return self.scorer.sequence_inputs(model)


def handler_for(name: str, model_path: str, *, digest: str, device: str = "auto",
                options: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> BatchModelHandler:
    """The handler of registered backend ``name`` (:mod:`batchinfer.backends`): its backend
    class built as ``cls(device=…, options=…)``; ``kwargs`` as :class:`BatchModelHandler` takes
    them.

    Raises:
        SpecError: an option the backend does not take (when built outside a checked spec).
        ModelError: the backend is not in this version, or its library is missing (exit 5).
    """
    checked = backends.check_options(name, dict(options or {}))
    backend = backends.backend_class(name)(device=device, options=checked)
    return BatchModelHandler(backend, model_path, digest=digest, name=name, device=device,
                             options=checked, **kwargs)
