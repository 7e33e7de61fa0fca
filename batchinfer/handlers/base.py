"""The base of every batchinfer model handler: Beam's ``ModelHandler`` over prepared batches.

A backend subclasses :class:`BatchModelHandler` (generic over its loaded model's type), names
itself in ``backend`` (its entry in :mod:`batchinfer.backends`: file suffixes, options) and
implements four hooks:

- ``open_model()``: load the model (called at most once per process and model, see
  :func:`shared_model`);
- ``input_names(model)``, ``output_names(model)``: what it takes and gives, by name;
- ``predict(model, inputs)``: run it on a dict of input arrays, return a dict of output arrays.

Four more have defaults: ``device_used(model)`` ("cpu"), ``default_chunk_rows(model)`` (None:
the whole batch per call), ``input_shapes(model)`` (none known) and ``model_key()`` (backend,
digest, device, options). Every handler is
built the same way, ``cls(model_path, digest=…, device=…, options=…)``, with options already
checked against the backend's entry.

Everything else — feeding Arrow-prepared features in chunks, isolating rows the model rejects,
the batch contract on outputs, timing — lives here once. Elements are :class:`Prepared` batches of
many rows (never one row), so Beam's ``BatchElements`` is told to pass them one at a time, and
``get_num_bytes`` sums array sizes instead of pickling (pickling a batch was measured at ~34 ms).
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Hashable, Iterable, Mapping, Optional, Sequence, TypeVar

import numpy as np

from .. import backends
from ..beam_compat import ModelHandler, PredictionResult
from ..errors import ModelError, PreprocessError, SpecError, one_line
from ..rows.isolation import run_isolating
from . import tokens as token_calls

log = logging.getLogger("batchinfer")

ModelT = TypeVar("ModelT")

_models: dict[Any, Any] = {}
_models_lock = threading.Lock()


def shared_model(key: Any, load: Callable[[], Any]) -> Any:
    """Load a model once per process: the driver's pre-flight load is reused by in-process
    workers, and several handler instances never hold two copies."""
    with _models_lock:
        if key not in _models:
            _models[key] = load()
        return _models[key]


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


@dataclass
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


@dataclass
class _Tally:
    """Accumulated over one batch's model calls."""

    seconds: float = 0.0
    oom_backoffs: int = 0
    chunk_rows: int = 0   # rows per model call in effect at the end
    warmup_seconds: float = 0.0
    padded_tokens: int = 0


class ServedModel:
    """A loaded model with the backend's hooks bound to it, for ``share_across_processes``.

    Beam serves the object :meth:`BatchModelHandler.load_model` returns from one process and
    hands every worker a proxy to it, which pickles whatever a method takes or returns. A
    backend's own model (an ONNX Runtime session, a torch module) answers with objects that do
    not pickle (``NodeArg``); this answers every hook with plain data.
    """

    def __init__(self, handler: "BatchModelHandler", model: Any):
        self._handler = handler
        self._model = model

    def input_names(self) -> list[str]:
        return list(self._handler.input_names(self._model))

    def output_names(self) -> list[str]:
        return list(self._handler.output_names(self._model))

    def input_shapes(self) -> dict[str, tuple]:
        return dict(self._handler.input_shapes(self._model))

    def default_chunk_rows(self) -> Optional[int]:
        return self._handler.default_chunk_rows(self._model)

    def device_used(self) -> str:
        return self._handler.device_used(self._model)

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._handler.predict(self._model, inputs)


def slice_features(features: Any, start: int, stop: int) -> Any:
    if isinstance(features, Mapping):
        return {k: v[start:stop] for k, v in features.items()}
    return features[start:stop]


class BatchModelHandler(ModelHandler[Prepared, PredictionResult, ModelT]):
    """Beam ``ModelHandler`` over :class:`Prepared` batches; subclass per backend.

    Args:
        model_path: the local model file.
        digest: the model digest that was checked (part of the per-process cache key).
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
    warm_up: ClassVar[bool] = True  # one untimed call on the first chunk, see _run_chunked

    def __init__(self, model_path: str, *, digest: str, device: str = "auto",
                 options: Optional[Mapping[str, Any]] = None, tokens: Optional[int] = None,
                 lengths_from: str = "attention_mask",
                 sequence_inputs: Optional[Sequence[str]] = None):
        options = dict(options or {})
        if self.backend:
            options = backends.check_options(self.backend, options)
        super().__init__(min_batch_size=1, max_batch_size=1)
        self.model_path = model_path
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
        # Each output's shape past the rows and its dtype, from the first call (see _check_outputs).
        self._signature: dict[str, tuple] = {}
        self._warm = False                      # the untimed first call was made
        self._oom_limit: Optional[int] = None   # rows per call after an out-of-memory back-off
        self._oom_tokens: Optional[int] = None  # the same, for calls sized by tokens

    # -- what a backend implements -----------------------------------------------------------
    def open_model(self) -> ModelT:
        """Load the model (once per process: see :meth:`load_model`)."""
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

    def is_out_of_memory(self, exc: BaseException) -> bool:
        """True if ``exc``, raised by ``predict``, means the device ran out of memory: the rows
        are retried in smaller chunks instead of being blamed (see :meth:`_run_chunked`)."""
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
        model = shared_model(self.model_key(), self.open_model)
        return ServedModel(self, model) if self.share_model_across_processes() else model

    def share_model_across_processes(self) -> bool:
        # model.options.share_across_processes: one copy per machine (or `model_copies`), served
        # from a process of its own to every worker process (Beam's multi_process_shared): for a
        # GPU that holds one copy of a large model, not one per SDK process.
        return bool(self.options.get("share_across_processes", False))

    def model_copies(self) -> int:
        return int(self.options.get("model_copies", 1))

    def ask(self, model: Any, hook: str, *args: Any) -> Any:
        """Call the backend hook ``hook`` (``input_names``, ``predict``, …) on ``model``: directly,
        or through the :class:`ServedModel` that a shared model is (then ``model`` may be Beam's
        proxy to it, in another process, and only names, numbers and arrays cross)."""
        if self.share_model_across_processes():
            return getattr(model, hook)(*args)
        return getattr(self, hook)(model, *args)

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
            return Inference(np.zeros(0, np.int64), {}, [], 0.0)
        inputs = self._as_inputs(model, item.features)
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
            return self._run_chunked(model, inputs, start, stop, tally, by_tokens, sequences)

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
        return Inference(ok_rows, outputs, failed, tally.seconds * 1000.0, tally.oom_backoffs,
                         tally.chunk_rows, tally.warmup_seconds * 1000.0, real_tokens,
                         tally.padded_tokens)

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
            self._shapes = dict(self.ask(model, "input_shapes"))
        return self._shapes

    def sequence_inputs(self, model: Any) -> frozenset[str]:
        """The inputs that ``batch.tokens`` cuts to each call's longest row (asked once).

        Raises:
            SpecError: the choice cannot be made or made safely (tokens.sequence_inputs).
        """
        if self._sequences is None:
            try:
                self._sequences = token_calls.sequence_inputs(
                    self.lengths_from, self.ask(model, "input_names"), self.declared_shapes(model),
                    self.listed_sequences)
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

    def _as_inputs(self, model: Any, features: Any) -> dict[str, np.ndarray]:
        names = self.ask(model, "input_names")
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

    def _run_chunked(self, model: Any, inputs: dict[str, np.ndarray], start: int, stop: int,
                     tally: "_Tally", by_tokens: Optional[np.ndarray] = None,
                     sequences: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
        """``predict`` over rows ``[start, stop)`` in chunks, halving the chunk and retrying the
        same rows when the device runs out of memory (the smaller chunk is kept for the rest of
        the process's batches: the next batch would run out of memory just the same).

        Chunks hold ``chunk_rows`` rows, or, given ``by_tokens`` (the rows' lengths, longest
        first), at most ``batch.tokens`` padded tokens each, the ``sequences`` inputs cut to
        their longest row."""
        max_rows = self.chunk_rows or self.ask(model, "default_chunk_rows")
        step = max_rows or (stop - start)
        if self._oom_limit is not None:
            step = min(step, self._oom_limit)
        mask = inputs.get(self.lengths_from)
        padded = mask.shape[1] if mask is not None and np.ndim(mask) == 2 else 0
        parts = []
        lo = start
        while lo < stop:
            if by_tokens is not None:
                budget = min(self.tokens or 0, self._oom_tokens or sys.maxsize)
                hi, width = token_calls.next_call(by_tokens, lo, stop, budget, max_rows)
                chunk = token_calls.call_inputs(inputs, lo, hi, sequences, width)
            else:
                hi = min(lo + step, stop)
                width = padded
                chunk = {k: v[lo:hi] for k, v in inputs.items()}
            if self.warm_up and not self._warm:
                # The first call pays for set-up (allocations, kernel selection, a CUDA context),
                # which is not the model's work: do it once, untimed, so _compute_ms is honest.
                self._warm = True
                t_warm = time.perf_counter()
                try:
                    self.ask(model, "predict", chunk)
                except Exception as exc:
                    if not self.is_out_of_memory(exc):
                        raise
                finally:
                    tally.warmup_seconds += time.perf_counter() - t_warm
            t0 = time.perf_counter()
            try:
                out = self.ask(model, "predict", chunk)
            except Exception as exc:
                if not self.is_out_of_memory(exc):
                    raise
                if hi - lo == 1:
                    raise ModelError(f"the model runs out of device memory on a single row "
                                     f"({one_line(exc)}); nothing committed") from None
                step = (hi - lo) // 2
                if by_tokens is not None:
                    self._oom_tokens = step * width
                else:
                    self._oom_limit = step
                tally.oom_backoffs += 1
                log.warning("out of device memory at %d rows per model call; retrying the same "
                            "rows at %d", hi - lo, step)
                continue
            finally:
                tally.seconds += time.perf_counter() - t0
            self._check_outputs(out, hi - lo)
            parts.append(out)
            tally.padded_tokens += (hi - lo) * width
            lo = hi
        tally.chunk_rows = step if by_tokens is None else 0
        return parts[0] if len(parts) == 1 else _concat(parts)

    def _check_outputs(self, out: Mapping[str, Any], rows: int) -> None:
        """The batch contract: each output has one entry per input row, and the same shape past
        the rows and the same dtype on every call.

        Neither is a row's fault. A model that sums over the batch would "fit" at one row per
        call if its rows were isolated, and commit meaningless scores; an output whose width
        changes between calls would give a partition whose files disagree on the column's type.
        So the run fails (exit 5) on the first call that shows it.
        """
        for name, value in out.items():
            shape = np.shape(value)
            if shape[:1] != (rows,):
                raise ModelError(
                    f"the model breaks the batch contract: output {name!r} has shape "
                    f"{list(shape)} for {rows} input rows (its first dimension must be the "
                    f"number of rows); nothing committed")
            signature = (shape[1:], np.asarray(value).dtype.str)
            first = self._signature.setdefault(name, signature)
            if first != signature:
                raise ModelError(
                    f"the model breaks the batch contract: output {name!r} was "
                    f"{_describe(first)} per row and is now {_describe(signature)}; every call "
                    f"must give the same shape and type; nothing committed")


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


def _describe(signature: tuple) -> str:
    shape, dtype = signature
    return f"{np.dtype(dtype).name} {list(shape)}"


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
