"""How close a reduced-precision model's outputs are to the reference's (docs/contract.md §
"Parity"): pure numpy, used by ``export --to tensorrt --fp16``, the conformance suite and
``bench/gpu_check.py``.

FP16 and BF16 change every output a little; what matters is whether the *distribution* of
predictions moves. So, per output:

- a scalar output (``[N]`` or ``[N, 1]``): the KL divergence KL(P‖Q) between histograms of the
  reference (P) and the candidate (Q) over ``HISTOGRAM_BINS`` equal bins spanning the
  reference's range (candidate values outside it are counted in the end bins), each bin's
  probability smoothed by ``EPSILON`` so an empty bin is not infinite;
- an output of K > 1 values per row (``[N, K]``, logits): the mean over rows of
  KL(softmax(reference row) ‖ softmax(candidate row)).

A candidate passes when every output's KL is ≤ ``KL_LIMIT``; the max absolute difference is
reported beside it, never judged (one row's outlier is the histogram's business).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

# Few enough that a bin is wider than bf16's step on a probability (~0.004 near 0.5): with
# 100 bins bf16's rounding alone moves mass between neighbouring bins (measured: KL 0.03 at 100
# bins, 0.0014 at 32, for the same 20,000 predictions).
HISTOGRAM_BINS = 32
EPSILON = 1e-6
KL_LIMIT = 0.01


def histogram_kl(reference: np.ndarray, candidate: np.ndarray, bins: int = HISTOGRAM_BINS) -> float:
    """KL(P‖Q) of the two value distributions over bins fixed by the reference's range."""
    ref = np.asarray(reference, np.float64).reshape(-1)
    cand = np.asarray(candidate, np.float64).reshape(-1)
    ref, cand = ref[np.isfinite(ref)], cand[np.isfinite(cand)]
    if ref.size == 0 or cand.size == 0:
        return 0.0 if ref.size == cand.size else float("inf")
    lo, hi = float(ref.min()), float(ref.max())
    if hi <= lo:  # a constant output: any spread in the candidate is a change
        hi = lo + 1e-12
    edges = np.linspace(lo, hi, bins + 1)
    p = np.histogram(np.clip(ref, lo, hi), edges)[0].astype(np.float64)
    q = np.histogram(np.clip(cand, lo, hi), edges)[0].astype(np.float64)
    p = p / p.sum() + EPSILON
    q = q / q.sum() + EPSILON
    p, q = p / p.sum(), q / q.sum()
    return float(np.sum(p * np.log(p / q)))


def softmax_kl(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Mean over rows of KL(softmax(reference) ‖ softmax(candidate)); rows are logits."""
    ref = np.asarray(reference, np.float64).reshape(len(reference), -1)
    cand = np.asarray(candidate, np.float64).reshape(len(candidate), -1)
    keep = np.isfinite(ref).all(axis=1) & np.isfinite(cand).all(axis=1)
    if not keep.any():
        return 0.0
    log_p = _log_softmax(ref[keep])
    log_q = _log_softmax(cand[keep])
    return float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), axis=1)))


def output_kl(reference: np.ndarray, candidate: np.ndarray) -> float:
    """The KL this module defines for one output, by its shape."""
    reference, candidate = np.asarray(reference), np.asarray(candidate)
    if reference.shape != candidate.shape:
        raise ValueError(f"shapes differ: {reference.shape} vs {candidate.shape}")
    per_row = int(np.prod(reference.shape[1:])) if reference.ndim > 1 else 1
    return histogram_kl(reference, candidate) if per_row == 1 else softmax_kl(reference, candidate)


def max_abs_diff(reference: np.ndarray, candidate: np.ndarray) -> float:
    ref = np.asarray(reference, np.float64)
    cand = np.asarray(candidate, np.float64)
    both = np.isfinite(ref) & np.isfinite(cand)
    return float(np.max(np.abs(ref[both] - cand[both]))) if both.any() else 0.0


def compare(reference: Mapping[str, np.ndarray],
            candidate: Mapping[str, np.ndarray]) -> dict[str, tuple[float, float]]:
    """Output name → (KL, max abs diff) for every output of the reference."""
    return {name: (output_kl(reference[name], candidate[name]),
                   max_abs_diff(reference[name], candidate[name])) for name in reference}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
