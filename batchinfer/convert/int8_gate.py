"""The INT8 gate of ``export --quantize int8`` (contract §2): what a quantized model must keep of
the FP32 model's answers on the sample (:class:`Gate`), which outputs each bound judges, and the
figures it is judged by (KL, flip rate, cosine)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, TypedDict

import numpy as np

from ..errors import ModelError, SpecError

MIN_COSINE = 0.99          # embeddings: each row's cosine with FP32 at least this
THRESHOLD = 0.5            # a thresholded score: the decision a flip changes


@dataclass(frozen=True, kw_only=True)
class Gate:
    """What a quantized model must keep of the FP32 model's answers on the sample (contract §2)."""

    max_flip_rate: float | None = None   # None: the flip rate is reported, not judged
    # None: the default bound (MIN_COSINE, THRESHOLD), which applies where an output is judged
    # by it; given, at least one output must be (else the option would be ignored: exit 2)
    min_cosine: float | None = None
    threshold: float | None = None
    embeddings: tuple[str, ...] = ()     # outputs judged by cosine (besides names with "embed")

    @property
    def cosine_bound(self) -> float:
        return MIN_COSINE if self.min_cosine is None else self.min_cosine

    @property
    def decision_threshold(self) -> float:
        return THRESHOLD if self.threshold is None else self.threshold


class GateFigures(TypedDict):
    """The gate's figures, as ``<out>.quantization.json`` declares them (the worst over outputs)."""

    parity_outputs: str            # "NAME: KIND; …", KIND score | class distribution | embedding
    parity_rows: int
    parity_kl: float
    parity_kl_limit: float
    parity_flip_rate: float
    parity_threshold: float
    parity_max_flip_rate: float | str   # "not judged" without --max-flip-rate
    parity_min_cosine: float
    parity_min_cosine_bound: float
    parity_max_abs_diff: float


def _gate(parity, want: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray], gate: Gate,
          where: str) -> GateFigures:
    """The gate's figures (the worst over outputs); raises ModelError naming the first figure
    past its bound."""
    kl = flip = 0.0
    cosine = 1.0
    kinds = []
    threshold = gate.decision_threshold
    for name, ref in want.items():
        ref, cand = np.asarray(ref), np.asarray(got[name])
        if ref.shape != cand.shape:
            raise ModelError(f"parity check failed: output {name} has shape {cand.shape} quantized, "
                             f"{ref.shape} in FP32; nothing written")
        kind = _judged_as(name, _row_size(ref), gate)
        if kind == "embedding":
            kinds.append(f"{name}: embedding")
            worst = _min_cosine(ref, cand)
            cosine = min(cosine, worst)
            if not worst >= gate.cosine_bound:
                raise ModelError(f"parity check failed: INT8 output {name} has minimum cosine "
                                 f"{worst:.6g} with FP32 (< {gate.cosine_bound:g}) on {where}; nothing "
                                 f"written (--keep-fp32 REGEX keeps the most sensitive nodes FP32)")
            continue
        value = parity.output_kl(ref, cand)
        kl = max(kl, value)
        if not value <= parity.KL_LIMIT:
            raise ModelError(f"parity check failed: INT8 output {name} has KL divergence {value:.3g} "
                             f"from FP32 (> {parity.KL_LIMIT:g}) on {where}; nothing written")
        if kind == "class distribution":
            kinds.append(f"{name}: class distribution")
            continue
        kinds.append(f"{name}: score")
        rate = float(np.mean((ref.reshape(-1) > threshold) != (cand.reshape(-1) > threshold)))
        flip = max(flip, rate)
        if gate.max_flip_rate is not None and not rate <= gate.max_flip_rate:
            raise ModelError(f"parity check failed: INT8 output {name} flips {rate:.3g} of decisions "
                             f"at threshold {threshold:g} (> --max-flip-rate "
                             f"{gate.max_flip_rate:g}) on {where}; nothing written")
    diff = max((parity.max_abs_diff(want[k], got[k]) for k in want), default=0.0)
    figures: GateFigures = {"parity_outputs": "; ".join(kinds), "parity_rows": len(next(iter(want.values()))),
                               "parity_kl": kl, "parity_kl_limit": parity.KL_LIMIT,
                               "parity_flip_rate": flip, "parity_threshold": threshold,
                               "parity_max_flip_rate": ("not judged" if gate.max_flip_rate is None
                                                        else gate.max_flip_rate),
                               "parity_min_cosine": cosine, "parity_min_cosine_bound": gate.cosine_bound,
                               "parity_max_abs_diff": diff}
    return figures


def _check_gate(gate: Gate) -> None:
    """Bounds the gate can judge by (exit 2 before any work): a cosine outside [-1, 1] or a share
    of rows outside [0, 1] is one no model meets (or every model does), and NaN fails every
    comparison, so each would decide for a reason no one meant."""
    if gate.min_cosine is not None and not -1.0 <= gate.min_cosine <= 1.0:
        raise SpecError(f"--min-cosine {gate.min_cosine:g}: a cosine lies in [-1, 1] (default "
                        f"{MIN_COSINE:g}: every embedding row keeps that cosine with FP32)")
    if gate.max_flip_rate is not None and not 0.0 <= gate.max_flip_rate <= 1.0:
        raise SpecError(f"--max-flip-rate {gate.max_flip_rate:g}: a share of rows lies in [0, 1] "
                        f"(0.01: at most 1% of a score's decisions flip)")
    if gate.threshold is not None and not math.isfinite(gate.threshold):
        raise SpecError(f"--threshold {gate.threshold:g}: choose a finite score, the decision's "
                        f"boundary (default {THRESHOLD:g})")


def _row_size(array: Any) -> int:
    """Values a row of an output: 1 for a score (``[N]``, ``[N, 1]``)."""
    shape = np.shape(array)
    return int(np.prod(shape[1:])) if len(shape) > 1 else 1


def _values_a_row(graph: Any) -> dict[str, int | None]:
    """Each graph output's values a row as its declared shape says (None: a symbolic or
    missing dim past the batch axis, known once it runs)."""
    sizes: dict[str, int | None] = {}
    for output in graph.output:
        tensor = output.type.tensor_type
        if not tensor.HasField("shape"):
            sizes[output.name] = None
            continue
        dims = list(tensor.shape.dim)[1:]
        known = all(d.HasField("dim_value") for d in dims)
        sizes[output.name] = int(np.prod([d.dim_value for d in dims])) if known else None
    return sizes


def _judged_as(name: str, row_size: int | None, gate: Gate) -> str | None:
    """How the gate judges output ``name`` (None: its row size is not known yet): a score by KL
    and flip rate, an embedding by cosine, another ``[N, K]`` output by the softmax KL rule."""
    if row_size is None:
        return None
    if row_size <= 1:
        return "score"
    return "embedding" if "embed" in name.lower() or name in gate.embeddings else "class distribution"


def _check_gate_applies(sizes: Mapping[str, int | None], gate: Gate, model: str, after: str = "") -> None:
    """Refuse (exit 2) a gate option that no output of ``model`` is judged by: ignored, it would
    let a model pass a bound it was never held to. ``sizes``: each output's values a row (None:
    not known yet, so an option it could take is let through, to be checked once it runs).

    Raises:
        SpecError: an ``--embedding`` that names no output, or a score (one value a row: its
            cosine with FP32 is its sign); a ``--min-cosine`` with no embedding output; a
            ``--max-flip-rate``/``--threshold`` with no score output.
    """
    kinds = {name: _judged_as(name, size, gate) for name, size in sizes.items()}
    outputs = ", ".join(f"{name}: {kind or 'shape known once it runs'}" for name, kind in kinds.items())
    for name in gate.embeddings:
        if name not in kinds:
            raise SpecError(f"--embedding {name}: {model} has no output {name} (its outputs: "
                            f"{', '.join(kinds)}){after}")
        if kinds[name] == "score":
            raise SpecError(f"--embedding {name}: {model}'s output {name} has one value a row (a "
                            f"score, judged by the KL rule and the flip rate), which no cosine "
                            f"judges: name an [N, K] output{after}")
    cosine = [name for name, kind in kinds.items() if kind == "embedding"
              or (kind is None and ("embed" in name.lower() or name in gate.embeddings))]
    if gate.min_cosine is not None and not cosine:
        raise SpecError(f"--min-cosine {gate.min_cosine:g}: no output of {model} is judged by cosine "
                        f"({outputs}): name an [N, K] embedding output with --embedding, or drop "
                        f"--min-cosine{after}")
    flags = ", ".join(f"{flag} {value:g}" for flag, value in (
        ("--max-flip-rate", gate.max_flip_rate), ("--threshold", gate.threshold)) if value is not None)
    if flags and not any(kind in ("score", None) for kind in kinds.values()):
        raise SpecError(f"{flags}: no output of {model} is a score ([N] or [N, 1]) ({outputs}): a "
                        f"flip rate counts a score's decisions; drop it{after}")


def _min_cosine(ref: np.ndarray, cand: np.ndarray) -> float:
    a = np.asarray(ref, np.float64).reshape(len(ref), -1)
    b = np.asarray(cand, np.float64).reshape(len(cand), -1)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    ok = norms > 0
    if not ok.any():
        return 1.0
    return float(np.min(np.sum(a[ok] * b[ok], axis=1) / norms[ok]))
