"""The base of every batchinfer model handler: Beam's ``ModelHandler`` over prepared batches.

A backend subclasses :class:`BatchModelHandler` (generic over its loaded model's type), names
itself in ``backend`` (its entry in :mod:`batchinfer.backends`: file suffixes, options) and
implements four hooks:

- ``open_model()``: load the model (called at most once per process and model while a handler
  holds it, see :func:`shared_model`);
- ``input_names(model)``, ``output_names(model)``: what it takes and gives, by name;
- ``predict(model, inputs)``: run it on a dict of input arrays, return a dict of output arrays.

Four more have defaults: ``device_used(model)`` ("cpu"), ``default_chunk_rows(model)`` (None:
the whole batch per call), ``input_shapes(model)`` (none known) and ``model_key()`` (backend,
digest, device, options). A backend whose ``predict`` may run in several threads at once on one
loaded model says so with ``thread_safe = True``; by default the calls are serialised (see
:func:`call_lock`). Every handler is
built the same way, ``cls(model_path, digest=…, device=…, options=…)``, with options already
checked against the backend's entry. Nothing calls a hook but through a
:class:`~batchinfer.handlers.loaded.LoadedModel` (:meth:`BatchModelHandler.loaded`), which binds
them to the model wherever it is.

Everything else lives here once, in parts: :meth:`BatchModelHandler.infer` checks a batch's
inputs against the model, orders rows for calls sized by tokens (handlers/tokens.py), isolates
the rows the model rejects (rows/isolation.py) and puts the rows back in their places; the calls
themselves are planned by handlers/calls.py, retried smaller by the out-of-memory policy
(handlers/oom.py) and their outputs held to the batch contract (handlers/batch_contract.py).
Elements are :class:`Prepared` batches of many rows (never one row), so Beam's ``BatchElements``
is told to pass them one at a time, and ``get_num_bytes`` sums array sizes instead of pickling
(pickling a batch was measured at ~34 ms).
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Hashable, Iterable, Mapping, Optional, Protocol, Sequence, TypeVar

import numpy as np

from .. import backends, faults
from ..beam_compat import ModelHandler, PredictionResult
from ..errors import ModelError, PreprocessError, SpecError
from ..rows.isolation import run_isolating
from . import tokens as token_calls
from .batch_contract import BatchContract
from .calls import Call, plan_calls
from .loaded import LoadedModel, LocalModel, ServedModel
from .oom import InjectedOutOfMemory, OutOfMemoryPolicy

ModelT = TypeVar("ModelT")


class Held:
    """A loaded model, as the handlers that loaded it hold it (the cache holds it weakly)."""

    __slots__ = ("model", "__weakref__")

    def __init__(self, model: Any):
        self.model = model


# The per-process model cache. A model stays in it while a handler that loaded it is alive:
# the driver's pre-flight load is reused by in-process workers (the driver's handler lives as
# long as the run), several handler instances never hold two copies, and a process that runs
# job after job (a backfill, an Airflow worker, a test session) does not keep every model it
# ever loaded — a GPU's memory would fill with models no run uses.
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


# One lock per loaded model in the process, for the backends whose ``predict`` is not thread-safe.
# Beam shares a worker's model between its threads: it unpickles a handler per thread and loads
# the model in one of them (its ``Shared``), so the other threads' handlers never load it and
# hold no Held; what every thread has is the model's key, which is also what makes the cache
# give two handlers one model. So the locks are kept by key, here, never on the handler (it
# pickles to the workers; a lock does not). A lock outlives its model (one per key a process
# loads, a few bytes): a model loaded again under its key, while threads still use a copy the
# cache let go, shares that copy's lock (over-cautious, never unguarded). Its own lock, not
# _models_lock, which is held while a model loads.
_call_locks: dict[Hashable, threading.Lock] = {}
_call_locks_lock = threading.Lock()


def call_lock(key: Hashable) -> threading.Lock:
    """The lock held around every ``predict`` on the model ``key`` names, in this process."""
    with _call_locks_lock:
        return _call_locks.setdefault(key, threading.Lock())


class ModelSource(Protocol):
    """A model in a store, as the run gives it to a handler (triple/model_cache.py): its URL, and
    the model file in this machine's model cache, fetched and checked against the run's digest."""

    @property
    def url(self) -> str: ...

    def local_path(self) -> str: ...


@dataclass
class Prepared:
    """One validated, preprocessed batch on its way to the model.

    Attributes:
        key: ``(shard index, batch index)``.
        rows: how many valid rows the features hold.
        features: one array (single-input model) or arrays by input name; axis 0 is rows.
        payload: whatever the writer needs later (ids, hashes, quarantine); opaque here.
    """

    key: tuple[int, int]
    rows: int
    features: Any
    payload: Any = None

    def nbytes(self) -> int:
        arrays = self.features.values() if isinstance(self.features, Mapping) else [self.features]
        return int(sum(getattr(a, "nbytes", 0) for a in arrays if a is not None))


@dataclass(kw_only=True)
class Inference:
    """A model's results for one :class:`Prepared` batch.

    Attributes:
        ok_rows: int64 indices (into the batch) of rows the model scored, ascending.
        outputs: output name → array over ``ok_rows`` (axis 0 aligned with it).
        failed: ``(row index, error)`` for rows the model rejected.
        compute_ms: model time for this batch, in milliseconds.
        oom_backoffs: times a model call ran out of device memory and its rows were retried in
            chunks half the size.
        chunk_rows: rows per model call the batch ended with (0 when calls are sized by tokens).
        tokens: real tokens of the scored rows, padded_tokens: tokens the model was fed, padding
            included (both 0 when the model has no lengths input, see handlers/tokens.py).
    """

    ok_rows: np.ndarray
    outputs: dict[str, np.ndarray]
    failed: list[tuple[int, str]] = field(default_factory=list)
    compute_ms: float = 0.0
    oom_backoffs: int = 0
    chunk_rows: int = 0
    warmup_ms: float = 0.0    # the untimed first call of this process, if this batch made it
    tokens: int = 0
    padded_tokens: int = 0
    # explain: the batch's attributions (handlers/explain.py Attributions), added by the
    # pipeline's Explain step after the model scored the batch; None without explain.
    explained: Any = None


@dataclass
class _Tally:
    """Accumulated over one batch's model calls."""

    seconds: float = 0.0
    oom_backoffs: int = 0
    chunk_rows: int = 0   # rows per model call in effect at the end
    warmup_seconds: float = 0.0
    padded_tokens: int = 0


class BatchModelHandler(ModelHandler[Prepared, PredictionResult, ModelT]):
    """Beam ``ModelHandler`` over :class:`Prepared` batches; subclass per backend.

    Args:
        model_path: the local model file (for a model in a store: its URL until it is fetched).
        digest: the model digest that was checked (part of the per-process cache key).
        source: a model in a store: :meth:`load_model` fetches it into the machine's model cache
            (verified against ``digest``) and loads it from there; None: ``model_path`` is local.
        device: ``auto`` | ``cpu`` | ``cuda`` (the job's ``model.device``).
        options: the job's ``model.options`` for this backend.
        tokens: the job's ``batch.tokens``: size model calls by padded tokens, longest rows
            first (handlers/tokens.py); None sizes them by rows.
        lengths_from: the input whose non-zero entries mark a row's real tokens.
        sequence_inputs: the inputs cut to each call's longest row with ``tokens`` (the job's
            ``batch.sequence_inputs``); None: the lengths input and the inputs the model
            declares alike (:func:`~batchinfer.handlers.tokens.sequence_inputs`).

    Raises:
        SpecError: an option the backend does not take (when built outside a checked spec).
    """

    backend: ClassVar[str] = ""   # the name in batchinfer.backends ("" for test doubles)
    warm_up: ClassVar[bool] = True  # one untimed call on the first chunk, see _predict
    # May threads call ``predict`` on one loaded model at the same time? Beam shares a worker's
    # model between its threads; False (the safe default for a backend that does not say)
    # serialises the calls with the model's call_lock (LocalModel.predict).
    thread_safe: ClassVar[bool] = False

    def __init__(self, model_path: str, *, digest: str, device: str = "auto",
                 options: Optional[Mapping[str, Any]] = None, tokens: Optional[int] = None,
                 lengths_from: str = "attention_mask",
                 sequence_inputs: Optional[Sequence[str]] = None,
                 source: Optional[ModelSource] = None):
        options = dict(options or {})
        if self.backend:
            options = backends.check_options(self.backend, options)
        super().__init__(min_batch_size=1, max_batch_size=1)
        self.model_path = model_path
        self.source = source
        self.digest = digest
        self.device = device
        self.options = options
        self.chunk_rows: Optional[int] = options.get("chunk_rows")
        self.tokens = tokens
        self.lengths_from = lengths_from
        self.listed_sequences = tuple(sequence_inputs) if sequence_inputs is not None else None
        # Asked of the model once (see input_shapes): each input's shape past the rows, and the
        # inputs cut like sequences with batch.tokens.
        self._shapes: Optional[dict[str, tuple]] = None
        self._sequences: Optional[frozenset[str]] = None
        self.batch_contract = BatchContract()   # each output's signature, from the first call
        # The smaller calls after an out-of-memory error, kept for this handler's batches; the
        # injected oom fault is read here, where the run builds its handlers, and pickles with
        # the handler to its workers.
        self.oom_policy = OutOfMemoryPolicy(faults.active().oom_rows())
        self._warm = False                # the untimed first call was made
        self._held: Optional[Held] = None  # the loaded model, while this handler lives

    # -- what a backend implements -----------------------------------------------------------
    def open_model(self) -> ModelT:
        """Load the model (once per process while a handler holds it: see :func:`shared_model`)."""
        raise NotImplementedError

    def input_names(self, model: ModelT) -> list[str]:
        """The model's inputs, by name (a single-input model gets the one array it is given)."""
        raise NotImplementedError

    def output_names(self, model: ModelT) -> list[str]:
        """The model's outputs, by name (they become prediction columns)."""
        raise NotImplementedError

    def predict(self, model: ModelT, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the model on one chunk of rows; every output has one entry per input row."""
        raise NotImplementedError

    # -- what a backend may override -----------------------------------------------------------
    def device_used(self, model: ModelT) -> str:
        """The device the loaded model runs on, as the manifest records it ("cpu", "cuda:0")."""
        return "cpu"

    def default_chunk_rows(self, model: ModelT) -> Optional[int]:
        """Rows per ``predict`` call when the job does not say; None = the whole batch."""
        return None

    def input_shapes(self, model: ModelT) -> dict[str, tuple]:
        """Each input's shape past the rows, as the model declares it: an int for a fixed size,
        a str naming a dynamic dim (ONNX's ``dim_param``, a torch.export symbol: inputs that share
        the name share the size), None for a dynamic dim without a name. An input left out (by
        default, every input) has an unknown shape and is not checked.

        Example: an ONNX model with inputs ``x [N, 8]`` and ``ids [N, L]`` → ``{"x": (8,),
        "ids": ("L",)}``."""
        return {}

    # Whether :meth:`attribute` gives gradient attributions (explain's gradient methods).
    gradients: ClassVar[bool] = False

    def attribute(self, model: ModelT, name: str, x: np.ndarray, baseline: np.ndarray,
                  output: str, method: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Gradient attributions of output ``output`` (one value per row) to input ``name``
        (``x``, ``[n, d]``), against ``baseline`` (one row): ``integrated_gradients`` in
        ``steps`` steps, or ``gradient_x_input`` (the gradient at ``x`` times ``x - baseline``).
        Returns ``(attributions [n, d] float64, gap [n])``, ``gap`` being each row's
        ``sum - (f(x) - f(baseline))`` (zeros for gradient × input, which has no such
        property). Only a backend with ``gradients = True`` implements it (handlers/explain.py)."""
        raise NotImplementedError

    def is_out_of_memory(self, exc: BaseException) -> bool:
        """True if ``exc``, raised by ``predict``, means the device ran out of memory: the rows
        are retried in smaller chunks instead of being blamed (handlers/oom.py)."""
        return False

    @classmethod
    def build_facts(cls, model_path: str) -> dict[str, str]:
        """What the model file was built for that the runtime must match (a TensorRT engine: the
        TensorRT version and GPU architecture); ``stamp`` adds them to the declaration."""
        return {}

    def runtime_facts(self) -> dict[str, str]:
        """The same facts of this machine, compared with the declaration before the model loads."""
        return {}

    def require(self, module: str) -> Any:
        """Import the backend's library, or exit 5 saying what to install."""
        import importlib

        try:
            return importlib.import_module(module)
        except ImportError:
            raise ModelError(f"backend {self.backend!r} needs {module}, which is not installed: "
                             f"{backends.get(self.backend).install}") from None

    def model_key(self) -> Hashable:
        """Identity of the loaded model for the per-process cache."""
        return (self.backend or type(self).__name__, self.digest, self.device,
                repr(sorted(self.options.items())))

    # -- Beam's ModelHandler -----------------------------------------------------------------
    def load_model(self) -> Any:
        self._held = shared_model(self.model_key(), self._fetch_and_open)
        model = self._held.model
        return ServedModel(self, model) if self.share_model_across_processes() else model

    def _fetch_and_open(self) -> ModelT:
        # A model in a store: fetched into this machine's model cache and checked against the
        # run's digest before it loads (a model this process holds already was checked then).
        if self.source is not None:
            self.model_path = self.source.local_path()
        return self.open_model()

    def __getstate__(self) -> dict[str, Any]:
        # Beam pickles the handler to its workers; each loads (or finds) the model itself.
        # A model in a store travels as its URL, not as this machine's cache path.
        where = self.source.url if self.source is not None else self.model_path
        return {**self.__dict__, "_held": None, "model_path": where}

    def share_model_across_processes(self) -> bool:
        # model.options.share_across_processes: one copy per machine (or `model_copies`), served
        # from a process of its own to every worker process (Beam's multi_process_shared): for a
        # GPU that holds one copy of a large model, not one per SDK process.
        return bool(self.options.get("share_across_processes", False))

    def model_copies(self) -> int:
        return int(self.options.get("model_copies", 1))

    def calls_lock(self) -> Optional[threading.Lock]:
        """What every ``predict`` on this handler's model holds: its :func:`call_lock`, or None
        for a thread-safe backend."""
        return None if self.thread_safe else call_lock(self.model_key())

    def loaded(self, model: Any) -> LoadedModel:
        """``model``, as :meth:`load_model` returned it, as a :class:`LoadedModel`: the hooks
        bound to it here, or the :class:`ServedModel` that a shared model is (then ``model`` may
        be Beam's proxy to it, in another process, and only names, numbers and arrays cross)."""
        if self.share_model_across_processes():
            return model
        return LocalModel(self, model)

    def run_inference(self, batch: Sequence[Prepared], model: Any,
                      inference_args: Optional[dict[str, Any]] = None) -> Iterable[PredictionResult]:
        return [PredictionResult(item, self.infer(model, item)) for item in batch]

    def get_num_bytes(self, batch: Sequence[Prepared]) -> int:
        return sum(item.nbytes() for item in batch)

    def get_metrics_namespace(self) -> str:
        return "batchinfer"

    def batch_elements_kwargs(self) -> Mapping[str, Any]:
        # Elements are already large batches: one at a time.
        return {"min_batch_size": 1, "max_batch_size": 1}

    # -- the shared machinery ----------------------------------------------------------------
    def infer(self, model: Any, item: Prepared) -> Inference:
        """Score one prepared batch, isolating rows the model rejects."""
        if item.rows == 0:
            return Inference(ok_rows=np.zeros(0, np.int64), outputs={})
        loaded = self.loaded(model)
        inputs = self._as_inputs(loaded, item.features)
        self._check_shapes(model, inputs)
        tally = _Tally()
        lengths = self._lengths(inputs)
        order = None
        sequences: frozenset[str] = frozenset()
        if self.tokens and lengths is not None:
            sequences = self._check_sequences(model, inputs)
            # Rows are scored longest first and put back in their places below (tokens.py).
            order = token_calls.longest_first(lengths)
            inputs = {k: v[order] for k, v in inputs.items()}
            lengths = lengths[order]
        by_tokens = lengths if order is not None else None

        def run(start: int, stop: int) -> dict[str, np.ndarray]:
            return self._run_calls(loaded, inputs, start, stop, tally, by_tokens, sequences)

        done, failed = run_isolating(item.rows, run)
        if not failed:
            outputs = done[0][2] if len(done) == 1 else _concat([r for _, _, r in done])
            ok_rows = np.arange(item.rows, dtype=np.int64)
        else:
            outputs = _concat([r for _, _, r in done]) if done else {}
            ok_rows = (np.concatenate([np.arange(s, e, dtype=np.int64) for s, e, _ in done])
                       if done else np.zeros(0, np.int64))
        real_tokens = int(lengths[ok_rows].sum()) if lengths is not None else 0
        if order is not None:
            ok_rows = order[ok_rows]
            back = np.argsort(ok_rows, kind="stable")
            ok_rows = ok_rows[back]
            outputs = {k: v[back] for k, v in outputs.items()}
            failed = sorted((int(order[row]), error) for row, error in failed)
        return Inference(ok_rows=ok_rows, outputs=outputs, failed=failed,
                         compute_ms=tally.seconds * 1000.0, oom_backoffs=tally.oom_backoffs,
                         chunk_rows=tally.chunk_rows, warmup_ms=tally.warmup_seconds * 1000.0,
                         tokens=real_tokens, padded_tokens=tally.padded_tokens)

    def _lengths(self, inputs: dict[str, np.ndarray]) -> Optional[np.ndarray]:
        """Each row's real tokens, if the model takes the lengths input (else None).

        Raises:
            PreprocessError: calls are sized by tokens and the lengths input is not
                ``[rows, length]`` (sizing them by rows instead would not be what was asked).
        """
        mask = inputs.get(self.lengths_from)
        if mask is None:
            return None
        if np.ndim(mask) != 2:
            if self.tokens:
                raise PreprocessError(
                    f"batch.tokens sizes model calls by the lengths in model input "
                    f"{self.lengths_from!r}, which the preprocessing returned as "
                    f"{list(np.shape(mask))}, not [rows, length]; nothing committed")
            return None
        return token_calls.sequence_lengths(mask)

    def declared_shapes(self, model: Any) -> dict[str, tuple]:
        """:meth:`input_shapes`, asked once (the model is this handler's for its lifetime)."""
        if self._shapes is None:
            self._shapes = dict(self.loaded(model).input_shapes())
        return self._shapes

    def sequence_inputs(self, model: Any) -> frozenset[str]:
        """The inputs that ``batch.tokens`` cuts to each call's longest row (asked once).

        Raises:
            SpecError: the choice cannot be made or made safely (tokens.sequence_inputs).
        """
        if self._sequences is None:
            try:
                self._sequences = token_calls.sequence_inputs(
                    self.lengths_from, self.loaded(model).input_names(),
                    self.declared_shapes(model), self.listed_sequences)
            except ValueError as exc:
                raise SpecError(f"batch.tokens: {exc}") from None
        return self._sequences

    def _check_shapes(self, model: Any, inputs: dict[str, np.ndarray]) -> None:
        """Each input's shape past the rows against the model's declared one, before any model
        call: preprocessing of the wrong width fails every row alike, and isolating them one by
        one would take a model call per row to say so.

        Raises:
            PreprocessError: an input of another rank, or another size on a fixed dim.
        """
        declared = self.declared_shapes(model)
        for name, value in inputs.items():
            want = declared.get(name)
            if want is None:
                continue
            have = np.shape(value)[1:]
            if len(have) != len(want) or any(isinstance(w, int) and w != h for w, h in zip(want, have)):
                shown = token_calls.shape_text
                raise PreprocessError(
                    f"preprocessing returned model input {name!r} of shape {shown(have)}; the "
                    f"model {self.model_path} takes {shown(want)}: make the preprocessing return "
                    f"what the model takes (or use the model it was written for); nothing committed")

    def _check_sequences(self, model: Any, inputs: dict[str, np.ndarray]) -> frozenset[str]:
        """The sequence inputs, each padded to the lengths input's length: a call cuts them all
        to one width, which must mean the same positions in each."""
        padded = np.shape(inputs[self.lengths_from])[1]
        sequences = self.sequence_inputs(model)
        for name in sorted(sequences):
            shape = np.shape(inputs[name])
            if len(shape) < 2 or shape[1] != padded:
                raise PreprocessError(
                    f"batch.tokens cuts sequence input {name!r} like {self.lengths_from!r}, but the "
                    f"preprocessing returned it as {list(shape)} beside {self.lengths_from!r} "
                    f"padded to {padded}: pad every sequence input to the same length (or leave "
                    f"{name!r} out of batch.sequence_inputs); nothing committed")
        return sequences

    def _as_inputs(self, model: LoadedModel, features: Any) -> dict[str, np.ndarray]:
        names = model.input_names()
        if isinstance(features, Mapping):
            missing = [n for n in names if n not in features]
            if missing:
                raise PreprocessError(f"preprocessing returned inputs {sorted(features)} but the "
                                      f"model needs {names}; nothing committed")
            return {n: features[n] for n in names}
        if len(names) != 1:
            raise PreprocessError(f"preprocessing returned one array but the model has inputs "
                                  f"{names}: return a mapping of input name to array; nothing "
                                  f"committed")
        return {names[0]: features}

    def _run_calls(self, model: LoadedModel, inputs: dict[str, np.ndarray], start: int, stop: int,
                   tally: "_Tally", by_tokens: Optional[np.ndarray] = None,
                   sequences: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
        """``predict`` over rows ``[start, stop)``, in the calls :func:`plan_calls` plans: of
        ``chunk_rows`` rows, or, given ``by_tokens`` (the rows' lengths, longest first), of at
        most ``batch.tokens`` padded tokens, the ``sequences`` inputs cut to their longest row.
        A call that runs out of device memory is halved (handlers/oom.py) and the rest of the
        range planned again from its first row."""
        max_rows = self.chunk_rows or model.default_chunk_rows()
        mask = inputs.get(self.lengths_from)
        padded = mask.shape[1] if mask is not None and np.ndim(mask) == 2 else 0
        parts: list[dict[str, np.ndarray]] = []
        lo: Optional[int] = start
        while lo is not None:
            calls = self._plan(lo, start, stop, max_rows, padded, by_tokens)
            lo = self._make_calls(model, inputs, calls, tally, by_tokens, sequences, parts)
        tally.chunk_rows = 0 if by_tokens is not None else self.oom_policy.row_limit(max_rows or (stop - start))
        return parts[0] if len(parts) == 1 else _concat(parts)

    def _make_calls(self, model: LoadedModel, inputs: dict[str, np.ndarray], calls: list[Call],
                    tally: "_Tally", by_tokens: Optional[np.ndarray], sequences: frozenset[str],
                    parts: list[dict[str, np.ndarray]]) -> Optional[int]:
        """The ``calls``, in order, their outputs appended to ``parts``; the first row of the
        call that ran out of device memory (the policy has halved the calls: plan again from
        it), or None when every call was made."""
        for lo, hi, width in calls:
            if by_tokens is None:
                chunk = {k: v[lo:hi] for k, v in inputs.items()}
            else:
                chunk = token_calls.call_inputs(inputs, lo, hi, sequences, width)
            try:
                out = self._predict(model, chunk, hi - lo, tally)
            except Exception as exc:
                if not self._is_out_of_memory(exc):
                    raise
                self.oom_policy.back_off(exc, hi - lo, width, by_tokens=by_tokens is not None)
                tally.oom_backoffs += 1
                return lo
            self.batch_contract.check(out, hi - lo)
            parts.append(out)
            tally.padded_tokens += (hi - lo) * width
        return None

    def _plan(self, lo: int, start: int, stop: int, max_rows: Optional[int], padded: int,
              by_tokens: Optional[np.ndarray]) -> list[Call]:
        """The calls for rows ``[lo, stop)`` of the range ``[start, stop)``, within the limits
        the out-of-memory policy has learnt."""
        if by_tokens is None:
            return plan_calls(lo, stop, rows=self.oom_policy.row_limit(max_rows or (stop - start)),
                              width=padded)
        return plan_calls(lo, stop, rows=max_rows, lengths=by_tokens,
                          tokens=self.oom_policy.token_limit(self.tokens or 0))

    def _predict(self, model: LoadedModel, chunk: dict[str, np.ndarray], rows: int,
                 tally: "_Tally") -> dict[str, np.ndarray]:
        """One timed model call (after the untimed warm-up call, the first time)."""
        if self.warm_up and not self._warm:
            # The first call pays for set-up (allocations, kernel selection, a CUDA context),
            # which is not the model's work: do it once, untimed, so compute_ms is honest.
            self._warm = True
            t_warm = time.perf_counter()
            try:
                self.oom_policy.before_call(rows)
                model.predict(chunk)
            except Exception as exc:
                if not self._is_out_of_memory(exc):
                    raise
            finally:
                tally.warmup_seconds += time.perf_counter() - t_warm
        t0 = time.perf_counter()
        waited = _waited(model)
        try:
            self.oom_policy.before_call(rows)
            return model.predict(chunk)
        finally:
            # the model's time: not the time the call waited for another thread's (call_lock)
            tally.seconds += time.perf_counter() - t0 - (_waited(model) - waited)

    def _is_out_of_memory(self, exc: BaseException) -> bool:
        return isinstance(exc, InjectedOutOfMemory) or self.is_out_of_memory(exc)


def _waited(model: LoadedModel) -> float:
    """Seconds the calls of ``model`` (one batch's, one thread's) have waited for its call lock.
    0 for a served model: it is every caller's, and its calls wait in the process that serves
    it, inside the call as this process times it."""
    return model.waited_s if isinstance(model, LocalModel) and not isinstance(model, ServedModel) else 0.0


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


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
