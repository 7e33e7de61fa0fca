"""Scoring one prepared batch on a loaded model: the policies, composed around ``predict``.

:class:`Scorer` is what ``BatchModelHandler.infer`` runs per batch. It holds no model and knows
no backend's code; it is made of parts, each of which lives in a module of its own:

- the inputs checked against the model's declared facts (names, and each input's shape past the
  rows), before any model call: preprocessing of the wrong width fails every row alike, and
  isolating them one by one would take a model call per row to say so;
- token ordering (handlers/tokens.py ``TokenOrder``): rows longest first for calls sized by
  tokens, put back in their places before anything leaves;
- row isolation (rows/isolation.py ``run_isolating``): the rows the model rejects split off;
- call planning (handlers/calls.py), the out-of-memory back-off (handlers/oom.py) and the batch
  contract (handlers/batch_contract.py) on every call;
- the untimed warm-up call, and the model's time without the time a call waited for another
  thread's (the call lock, handlers/loaded.py);
- calls at once: a model whose facts say ``call_threads`` > 1 (ONNX Runtime on the CPU) has a
  batch's calls made on that many threads, each call on one core, their outputs taken in order
  (what a call raises, out of memory included, is met as if the calls had been made in turn).

Per batch it makes the model calls and a fixed handful of Python calls around them; per call,
the slicing, the timing and the contract check; never a copy of the batch's arrays, except the
row order of calls sized by tokens.
"""
from __future__ import annotations

import functools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import numpy as np

from ..errors import PreprocessError
from ..rows.isolation import run_isolating
from . import tokens as token_calls
from .batch_contract import BatchContract
from .calls import Call, plan_calls
from .loaded import LoadedModel
from .oom import InjectedOutOfMemory, OutOfMemoryPolicy


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


class Scorer:
    """The per-batch policies of one handler (so one model), in one process; see the module
    docstring. It pickles with its handler to the workers (its limits and signatures are plain
    data).

    Args:
        model_path: the model file, for messages.
        chunk_rows: the job's rows per model call (``model.options.chunk_rows``); None: the
            model's default.
        tokens: the job's token sizing.
        oom: the out-of-memory policy (with the injected ``oom`` fault, if any).
        out_of_memory: whether an exception raised by ``predict`` means out of device memory
            (the backend's say; the injected fault always does).
        warm_up: make the process's first call once, untimed.
        served: the model is served from another process (``share_across_processes``): its
            calls wait for the lock there, inside the call as this process times it.
    """

    def __init__(self, *, model_path: str, chunk_rows: Optional[int], tokens: token_calls.TokenOrder,
                 oom: OutOfMemoryPolicy, out_of_memory: Callable[[BaseException], bool],
                 warm_up: bool = True, served: bool = False):
        self.model_path = model_path
        self.chunk_rows = chunk_rows
        self.tokens = tokens
        self.oom_policy = oom
        self.out_of_memory = out_of_memory
        self.warm_up = warm_up
        self.served = served
        self.batch_contract = BatchContract()   # each output's signature, from the first call
        self._warm = False                      # the untimed first call was made
        self._shapes: Optional[dict[str, tuple]] = None   # the model's, asked once

    def declared_shapes(self, model: LoadedModel) -> dict[str, tuple]:
        """The model's declared input shapes, asked once (the model is this scorer's for its
        lifetime)."""
        if self._shapes is None:
            self._shapes = dict(model.input_shapes())
        return self._shapes

    def sequence_inputs(self, model: LoadedModel) -> frozenset[str]:
        """The inputs that ``batch.tokens`` cuts to each call's longest row (asked once).

        Raises:
            SpecError: the choice cannot be made or made safely (tokens.sequence_inputs).
        """
        return self.tokens.sequences(model.input_names(), self.declared_shapes(model))

    def infer(self, model: LoadedModel, item: Prepared) -> Inference:
        """Score one prepared batch, isolating rows the model rejects."""
        if item.rows == 0:
            return Inference(ok_rows=np.zeros(0, np.int64), outputs={})
        names = model.input_names()
        inputs = self._as_inputs(names, item.features)
        self._check_shapes(model, inputs)
        tally = _Tally()
        policy = self.tokens
        lengths = policy.lengths(inputs)
        order = None
        sequences: frozenset[str] = frozenset()
        if policy.tokens and lengths is not None:
            sequences = policy.checked_sequences(inputs, names, self.declared_shapes(model))
            # Rows are scored longest first and put back in their places below (tokens.py).
            order = token_calls.longest_first(lengths)
            inputs = {k: v[order] for k, v in inputs.items()}
            lengths = lengths[order]
        by_tokens = lengths if order is not None else None

        def run(start: int, stop: int) -> dict[str, np.ndarray]:
            return self._run_calls(model, inputs, start, stop, tally, by_tokens, sequences)

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
            ok_rows, outputs, failed = policy.put_back(order, ok_rows, outputs, failed)
        return Inference(ok_rows=ok_rows, outputs=outputs, failed=failed,
                         compute_ms=tally.seconds * 1000.0, oom_backoffs=tally.oom_backoffs,
                         chunk_rows=tally.chunk_rows, warmup_ms=tally.warmup_seconds * 1000.0,
                         tokens=real_tokens, padded_tokens=tally.padded_tokens)

    # -- the inputs against the model's facts -------------------------------------------------
    def _as_inputs(self, names: list[str], features: Any) -> dict[str, np.ndarray]:
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

    def _check_shapes(self, model: LoadedModel, inputs: dict[str, np.ndarray]) -> None:
        """Each input's shape past the rows against the model's declared one.

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

    # -- the model calls ------------------------------------------------------------------------
    def _run_calls(self, model: LoadedModel, inputs: dict[str, np.ndarray], start: int, stop: int,
                   tally: _Tally, by_tokens: Optional[np.ndarray] = None,
                   sequences: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
        """``predict`` over rows ``[start, stop)``, in the calls :func:`plan_calls` plans: of
        ``chunk_rows`` rows, or, given ``by_tokens`` (the rows' lengths, longest first), of at
        most ``batch.tokens`` padded tokens, the ``sequences`` inputs cut to their longest row.
        A call that runs out of device memory is halved (handlers/oom.py) and the rest of the
        range planned again from its first row."""
        max_rows = self.chunk_rows or model.default_chunk_rows()
        mask = inputs.get(self.tokens.lengths_from)
        padded = mask.shape[1] if mask is not None and np.ndim(mask) == 2 else 0
        parts: list[dict[str, np.ndarray]] = []
        lo: Optional[int] = start
        while lo is not None:
            calls = self._plan(lo, start, stop, max_rows, padded, by_tokens)
            lo = self._make_calls(model, inputs, calls, tally, by_tokens, sequences, parts)
        tally.chunk_rows = 0 if by_tokens is not None else self.oom_policy.row_limit(max_rows or (stop - start))
        return parts[0] if len(parts) == 1 else _concat(parts)

    def _make_calls(self, model: LoadedModel, inputs: dict[str, np.ndarray], calls: list[Call],
                    tally: _Tally, by_tokens: Optional[np.ndarray], sequences: frozenset[str],
                    parts: list[dict[str, np.ndarray]]) -> Optional[int]:
        """The ``calls``, in order, their outputs appended to ``parts``; the first row of the
        call that ran out of device memory (the policy has halved the calls: plan again from
        it), or None when every call was made."""
        threads = 1 if self.served else model.call_threads()
        if threads > 1 and len(calls) > 1:
            if self.warm_up and not self._warm:   # the untimed first call, on its own
                if self._make_calls(model, inputs, calls[:1], tally, by_tokens, sequences, parts) is not None:
                    return calls[0][0]
                calls = calls[1:]
            return self._calls_at_once(model, inputs, calls, tally, by_tokens, sequences, parts, threads)
        for lo, hi, width in calls:
            made = functools.partial(self._predict, model,
                                     _call_inputs(inputs, lo, hi, width, by_tokens, sequences), hi - lo, tally)
            if not self._took(made, (lo, hi, width), tally, by_tokens, parts):
                return lo
        return None

    def _took(self, made: Callable[[], dict[str, np.ndarray]], call: Call, tally: _Tally,
              by_tokens: Optional[np.ndarray], parts: list[dict[str, np.ndarray]]) -> bool:
        """One call's outputs (``made()``: the call, or its future's result) held to the batch
        contract and appended to ``parts``; False when it ran out of device memory (the policy
        has halved the calls: plan again from its first row)."""
        lo, hi, width = call
        try:
            out = made()
        except Exception as exc:
            if not self._is_out_of_memory(exc):
                raise
            self.oom_policy.back_off(exc, hi - lo, width, by_tokens=by_tokens is not None)
            tally.oom_backoffs += 1
            return False
        self.batch_contract.check(out, hi - lo)
        parts.append(out)
        tally.padded_tokens += (hi - lo) * width
        return True

    def _calls_at_once(self, model: LoadedModel, inputs: dict[str, np.ndarray], calls: list[Call],
                       tally: _Tally, by_tokens: Optional[np.ndarray], sequences: frozenset[str],
                       parts: list[dict[str, np.ndarray]], threads: int) -> Optional[int]:
        """:meth:`_make_calls` with the calls made on ``threads`` threads at once (a thread-safe
        model that says so). Outputs are taken in the calls' order, so the first call that
        raised is met where a call-by-call run would have met it; the calls after it are
        cancelled or waited for, never left running. The model's time is the wall time of the
        calls together, not the sum of theirs."""
        def call(lo: int, hi: int, width: int) -> dict[str, np.ndarray]:
            self.oom_policy.before_call(hi - lo)
            return model.predict(_call_inputs(inputs, lo, hi, width, by_tokens, sequences))

        pool = _pool(threads)
        t0 = time.perf_counter()
        futures: list[Future] = [pool.submit(call, *c) for c in calls]
        try:
            for each, future in zip(calls, futures):
                if not self._took(future.result, each, tally, by_tokens, parts):
                    return each[0]
            return None
        finally:
            for future in futures:
                future.cancel()
            wait(futures)
            tally.seconds += time.perf_counter() - t0

    def _plan(self, lo: int, start: int, stop: int, max_rows: Optional[int], padded: int,
              by_tokens: Optional[np.ndarray]) -> list[Call]:
        """The calls for rows ``[lo, stop)`` of the range ``[start, stop)``, within the limits
        the out-of-memory policy has learnt."""
        if by_tokens is None:
            return plan_calls(lo, stop, rows=self.oom_policy.row_limit(max_rows or (stop - start)),
                              width=padded)
        return plan_calls(lo, stop, rows=max_rows, lengths=by_tokens,
                          tokens=self.oom_policy.token_limit(self.tokens.tokens or 0))

    def _predict(self, model: LoadedModel, chunk: dict[str, np.ndarray], rows: int,
                 tally: _Tally) -> dict[str, np.ndarray]:
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
        # the model's time: not the time the call waited for another thread's (call_lock). A
        # served model's calls wait in the process that serves it, inside the call as timed here.
        waited = 0.0 if self.served else model.waited_s()
        try:
            self.oom_policy.before_call(rows)
            return model.predict(chunk)
        finally:
            tally.seconds += time.perf_counter() - t0 - ((0.0 if self.served else model.waited_s()) - waited)

    def _is_out_of_memory(self, exc: BaseException) -> bool:
        return isinstance(exc, InjectedOutOfMemory) or self.out_of_memory(exc)


def _call_inputs(inputs: dict[str, np.ndarray], lo: int, hi: int, width: int,
                 by_tokens: Optional[np.ndarray], sequences: frozenset[str]) -> dict[str, np.ndarray]:
    """One call's inputs: rows ``[lo, hi)`` (views), sequences cut to ``width`` by tokens."""
    if by_tokens is None:
        return {k: v[lo:hi] for k, v in inputs.items()}
    return token_calls.call_inputs(inputs, lo, hi, sequences, width)


# The threads that make calls at once, one pool per size, shared by every scorer in the process
# (Beam's worker threads among them): a pool per scorer would start threads per handler copy,
# and a handler pickles to its workers (a pool does not).
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _forget_pools() -> None:
    # A forked child (the test suite's fork server, a multi-process runner) has none of the
    # parent's threads: a pool it inherited would queue calls that no thread ever runs.
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="batchinfer-call")
        return pool


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
