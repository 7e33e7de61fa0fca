"""Per-row feature attributions (contract §6 "Explanations"): the methods, and what is kept of them.

:class:`ExplainPlan` is the job's ``explain`` section as plain data that travels to the workers.
:func:`explain_rows` attributes one batch's rows — the model's one 2-D input, position by
position — and :func:`grouped` sums the positions that came from one schema feature (every
method here is additive over positions, so the sum is that feature's attribution).

- ``permutation``: Shapley values with the baseline as the absent value, estimated over
  ``samples`` orderings of the positions drawn from ``seed`` (each second ordering the reverse of
  the one before: antithetic pairs halve the variance). One ordering walks the row from the
  baseline to ``x`` one position at a time; each position gets the change of the output it
  caused. It only calls the model (``LoadedModel.predict``), so it runs on every backend, and
  it is exact for a model additive in its positions (a linear model: ``w · (x - baseline)``),
  and complete by construction (the steps sum to ``f(x) - f(baseline)``). The same orderings
  serve every row, so a row's attribution depends only on the row, never on its batch.
- ``integrated_gradients`` and ``gradient_x_input``: the model's gradients (the torch backend's
  ``attribute`` hook, Captum's IntegratedGradients for the former).

**A row's attributions do not depend on its batch** (contract §5.4, §6 "Explanations"). The same
orderings and steps for every row are not enough: a model call's floating-point results depend on
the call's shape — the kernels a row count picks, and which elements fall in a vector loop's
scalar tail (a sigmoid or tanh there is computed by another routine) — and ``batch.rows``, the
explained fraction and a shard's length set that shape. So every call made here has the same
shape whatever the batch: the rows go in fixed-size groups (:func:`gradient_rows`,
``PERMUTATION_CHUNK_ROWS``), the last one padded with baseline rows (whose attributions are 0 and
are dropped), each group's size a multiple of 64 rows — whole vectors in every elementwise loop —
or a single row.

**Attributions are finite or the run stops**: a NaN is never complete (``abs(nan) > tol`` is
false, so it would pass the completeness check) and cannot be written or profiled, so a batch
with rows whose attributions or gap are not finite is refused (exit 4, :func:`check_finite`);
``f(baseline)`` not finite is the baseline's fault (exit 2).

Pure apart from the model calls; no clock, no unseeded randomness.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from ..errors import DataQualityError, SpecError

# Rows per group of permutation calls: one call holds rows × (positions + 1) rows of the input,
# the last group padded to it, so that every call has one shape (see the module docstring): a
# multiple of 64, calls of thousands of rows for a few positions, little padding for a small batch.
PERMUTATION_CHUNK_ROWS = 256
# Rows per gradient call: 64, whole vectors in every elementwise loop, few enough that a small
# batch's padding costs little (Captum's cost is per point: rows × steps); a row alone past
# GRADIENT_POINTS / 64 steps, where the backend would split a call of 64 rows into calls of
# other sizes (handlers/pytorch.py IG_POINTS).
GRADIENT_ROWS = 64
GRADIENT_POINTS = 65536


@dataclass(frozen=True, kw_only=True)
class ExplainPlan:
    """The job's ``explain`` section, resolved against the model, as its workers need it.

    Attributes:
        method: ``integrated_gradients`` | ``gradient_x_input`` | ``permutation``.
        input: the model input explained (its only one).
        output: the model output explained (one value per row).
        baseline: one value per input position, or None for zeros.
        steps, samples, seed: the method's parameters (0 where it has none).
        top_k: features kept per row, largest |attribution| first; None: all, in input order.
        fraction: the share of rows explained, chosen by ``_input_hash``.
        tolerance: how far a row's attributions may sum from ``f(x) - f(baseline)``.
        complete: whether the method has that property (the check applies).
        features: the feature names, one per group of positions; None: each position its own
            (``<input>[<i>]``, known from the first batch's width).
        groups: each input position's index in ``features`` (None: position i is feature i).
        declared: the declaration's ``explain`` value (canonical JSON).
    """

    method: str
    input: str
    output: str
    baseline: Optional[tuple[float, ...]] = None
    steps: int = 0
    samples: int = 0
    seed: int = 0
    top_k: Optional[int] = 5
    fraction: float = 1.0
    tolerance: float = 0.01
    complete: bool = False
    features: Optional[tuple[str, ...]] = None
    groups: Optional[tuple[int, ...]] = None
    declared: str = ""
    width: Optional[int] = None   # the input's positions, when the model declares them
    background: bool = False      # the baseline is explain.background's mean

    def known_names(self) -> tuple[str, ...]:
        """The feature names known before any batch (none for positions of unknown width)."""
        if self.features is not None:
            return self.features
        return self.names(self.width) if self.width is not None else ()

    @property
    def features_from(self) -> str:
        """``schema`` when the names are the schema's features, ``positions`` otherwise."""
        return "positions" if self.features is None else "schema"

    def names(self, width: int) -> tuple[str, ...]:
        """The feature names for an input ``width`` positions wide.

        Raises:
            SpecError: the declared mapping has another number of positions (exit 2).
        """
        if self.features is None:
            return tuple(f"{self.input}[{i}]" for i in range(width))
        positions = len(self.groups) if self.groups is not None else len(self.features)
        if positions != width:
            raise SpecError(f"explain: the preprocessing's INPUT_FEATURES names {positions} model-input "
                            f"positions but model input {self.input!r} has {width}: list one schema "
                            f"feature per position")
        return self.features

    @property
    def baseline_key(self) -> str:
        """The setting the baseline comes from, for messages."""
        return "explain.background" if self.background else "explain.baseline"

    def baseline_row(self, width: int, dtype: Any = None) -> np.ndarray:
        """The baseline as one row of ``width`` float64 values.

        Args:
            dtype: the model input's dtype: a floating one must hold every value (1e39 is
                finite but float32's infinity).

        Raises:
            SpecError: ``explain.baseline`` has another number of values, or values that are
                not finite in ``dtype`` (exit 2).
        """
        if self.baseline is None:
            return np.zeros(width, dtype=np.float64)
        if len(self.baseline) != width:
            raise SpecError(f"explain.baseline has {len(self.baseline)} values but model input "
                            f"{self.input!r} has {width} positions: give one per position, or zeros")
        base = np.asarray(self.baseline, dtype=np.float64)
        kind = np.dtype(dtype) if dtype is not None else base.dtype
        with np.errstate(over="ignore", invalid="ignore"):
            held = base.astype(kind) if kind.kind == "f" else base
        bad = np.flatnonzero(~np.isfinite(held))
        if bad.size:
            raise SpecError(f"{self.baseline_key}: value {float(base[bad[0]])!r} at position "
                            f"{bad[0]} is not a finite {kind.name} (model input {self.input!r}): "
                            f"give finite values the input's type holds")
        return base


@dataclass(frozen=True, kw_only=True)
class Attributions:
    """One batch's explained rows.

    Attributes:
        rows: indices (into the rows the model scored) of the rows explained, ascending.
        values: float64 ``[rows, positions]``: each position's attribution.
        baseline_value: ``f(baseline)``, the explained output at the baseline.
        incomplete: how many rows' attributions sum farther than the tolerance from
            ``f(x) - f(baseline)`` (0 for a method without that property).
        max_gap: the largest such distance in the batch (0.0 likewise).
    """

    rows: np.ndarray
    values: np.ndarray
    baseline_value: float
    incomplete: int = 0
    max_gap: float = 0.0
    hashes: Any = None        # the scored rows' _input_hash (pyarrow), when the sample needed it
    seconds: float = 0.0      # time spent explaining the batch


Predict = Callable[[np.ndarray], np.ndarray]   # rows of the input → the explained output, [n]


def explain_rows(plan: ExplainPlan, x: np.ndarray, predict: Predict,
                 gradients: Optional[Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]] = None
                 ) -> tuple[np.ndarray, float, np.ndarray]:
    """Attribute each row of ``x`` (``[n, d]``) to its positions.

    Args:
        predict: the model on rows of the input, the explained output as ``[n]`` float64.
        gradients: the backend's gradient method, ``(x, baseline row) → (attributions, gap)``
            where ``gap`` is each row's ``sum - (f(x) - f(baseline))`` (zeros when the method
            has no such property); needed by the gradient methods.

    Returns:
        (attributions ``[n, d]`` float64, ``f(baseline)``, each row's completeness gap ``[n]``).
    """
    x = np.asarray(x)
    base = plan.baseline_row(x.shape[1], x.dtype)
    baseline_value = float(predict(base[None, :].astype(x.dtype))[0])
    if not np.isfinite(baseline_value):
        raise SpecError(f"explain: the model's output {plan.output!r} at the baseline "
                        f"({plan.baseline_key}) is {baseline_value}, so no attribution can sum to "
                        f"f(x) - f(baseline): choose a baseline where the model is finite")
    if plan.method == "permutation":
        values = permutation(x, base, predict, plan.samples, plan.seed)
        gap = values.sum(axis=1) - (predict(x) - baseline_value)
    elif gradients is None:
        raise SpecError(f"explain.method {plan.method} needs the model's gradients, which this "
                        f"backend does not give: use method permutation")
    else:
        values, gap = in_groups(x, base, gradients, gradient_rows(plan.steps))
    check_finite(plan, values, gap)
    return values, baseline_value, gap


def check_finite(plan: ExplainPlan, values: np.ndarray, gap: np.ndarray) -> None:
    """Refuse a batch whose attributions or completeness gaps are not all finite.

    A NaN is never complete, yet ``abs(nan) > tolerance`` is false: counted, it would pass as
    complete; written, it would poison the mean |attribution| and the drift profile of
    ``_explanation`` (records refuse non-finite figures). The model's gradient is then not
    finite somewhere between the baseline and those rows (or its output, for permutation).

    Raises:
        DataQualityError: some rows' attributions or gaps are not finite (exit 4, nothing
            committed).
    """
    bad = ~(np.isfinite(values).all(axis=1) & np.isfinite(gap))
    if bad.any():
        what = "output" if plan.method == "permutation" else "gradient"
        raise DataQualityError(
            f"explanations: {int(bad.sum())} of {bad.size} explained rows of a batch have "
            f"attributions that are not finite (the model's {what} is not finite between "
            f"{plan.baseline_key} and those rows); nothing committed: choose another baseline "
            f"or explain.method")


def gradient_rows(steps: int) -> int:
    """Rows per gradient call for ``steps`` points per row (0: one point, gradient × input):
    ``GRADIENT_ROWS`` while their points fit ``GRADIENT_POINTS``, else 1. It depends on the
    declared steps alone, never on the batch."""
    return GRADIENT_ROWS if GRADIENT_ROWS * max(steps, 1) <= GRADIENT_POINTS else 1


def in_groups(x: np.ndarray, base: np.ndarray,
              gradients: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
              rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``gradients`` over ``x`` in calls of exactly ``rows`` rows, the last one padded with
    baseline rows, so that every call has one shape whatever ``x``'s length (the module
    docstring); their results are dropped."""
    n = x.shape[0]
    values, gaps = [], []
    for start in range(0, n, rows):
        group = padded(x[start:start + rows], base, rows)
        v, g = gradients(group, base)
        m = min(rows, n - start)
        values.append(np.asarray(v, dtype=np.float64).reshape(rows, -1)[:m])
        gaps.append(np.asarray(g, dtype=np.float64).reshape(rows)[:m])
    if not values:
        return np.zeros((0, x.shape[1])), np.zeros(0)
    return np.concatenate(values), np.concatenate(gaps)


def padded(rows: np.ndarray, base: np.ndarray, size: int) -> np.ndarray:
    """``rows`` followed by baseline rows up to ``size`` rows, in ``rows``' dtype."""
    if rows.shape[0] == size:
        return rows
    fill = np.broadcast_to(base.astype(rows.dtype), (size - rows.shape[0], rows.shape[1]))
    return np.concatenate([rows, fill])


def orderings(positions: int, samples: int, seed: int) -> np.ndarray:
    """``samples`` orderings of ``positions`` positions, from ``seed`` alone: each even one drawn,
    each odd one the reverse of the one before (antithetic pairs)."""
    rng = np.random.default_rng(seed)
    out = np.empty((samples, positions), dtype=np.int64)
    for s in range(samples):
        out[s] = out[s - 1][::-1] if s % 2 else rng.permutation(positions)
    return out


def permutation(x: np.ndarray, base: np.ndarray, predict: Predict, samples: int,
                seed: int) -> np.ndarray:
    """Shapley values by sampled orderings (see the module docstring), float64 ``[n, d]``.

    For each ordering the rows are walked from the baseline to themselves, one position at a
    time; the ``d + 1`` points of every row of a chunk go to the model in one call, the chunk
    padded with baseline rows to ``PERMUTATION_CHUNK_ROWS`` so that every call has one shape."""
    n, d = x.shape
    values = np.zeros((n, d), dtype=np.float64)
    orders = orderings(d, samples, seed)
    size = PERMUTATION_CHUNK_ROWS
    for start in range(0, n, size):
        rows = padded(x[start:start + size], base, size)
        m = min(size, n - start)
        for order in orders:
            # walk[k] = the rows with the first k positions of the ordering set to x
            walk = np.empty((d + 1, size, d), dtype=x.dtype)
            walk[0] = base.astype(x.dtype)
            for k, position in enumerate(order, start=1):
                walk[k] = walk[k - 1]
                walk[k][:, position] = rows[:, position]
            out = predict(walk.reshape((d + 1) * size, d)).reshape(d + 1, size)
            steps = np.diff(out[:, :m], axis=0)   # [d, m]: the change each position made
            values[start:start + m][:, order] += steps.T
    return values / samples


def grouped(values: np.ndarray, groups: Optional[tuple[int, ...]], features: int) -> np.ndarray:
    """Attributions by feature: the positions' values summed per group (``groups[i]``: position
    i's feature); unchanged without groups."""
    if groups is None:
        return values
    out = np.zeros((values.shape[0], features), dtype=np.float64)
    np.add.at(out.T, np.asarray(groups), values.T)
    return out


def top(values: np.ndarray, k: Optional[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``k`` largest |attribution| (ties: the lower position first) as (positions,
    values), ``[n, k]`` each; ``k`` None: every position in input order."""
    n, d = values.shape
    if k is None or k >= d:
        if k is None:
            order = np.broadcast_to(np.arange(d), (n, d))
        else:
            order = np.argsort(-np.abs(values), axis=1, kind="stable")
    else:
        order = np.argsort(-np.abs(values), axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(values, order, axis=1)


_HEX = np.zeros(256, dtype=np.uint64)   # an ASCII hex digit → its value
_HEX[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10, dtype=np.uint64)
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16, dtype=np.uint64)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16, dtype=np.uint64)
_NIBBLES = np.arange(60, -4, -4, dtype=np.uint64)   # each digit's shift, most significant first


def selected(hashes: Any, fraction: float) -> np.ndarray:
    """The rows explained, by their ``_input_hash`` (16 hex digits: a 64-bit number): a row is
    in when that number falls below ``fraction`` of 2**64 — the same rows on every rerun,
    whatever the batches. ``hashes``: the strings (a list, or a numpy array of them); read in
    numpy, digit by digit over the batch, not a Python ``int`` per row."""
    digits = np.asarray(hashes, dtype="S16")
    if fraction >= 1.0:
        return np.ones(digits.shape[0], dtype=bool)
    codes = np.frombuffer(digits.tobytes(), np.uint8).reshape(-1, 16)
    values = (_HEX[codes] << _NIBBLES).sum(axis=1, dtype=np.uint64)
    return values < np.uint64(int(fraction * 2**64))
