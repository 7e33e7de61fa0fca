"""SmoothQuant before INT8 (``export --quantize int8 --smooth ALPHA``): move the activations'
outlier channels into the weights, so that quantizing both loses less.

Dynamic INT8 quantizes each MatMul's activation input with one scale for the whole tensor. A
transformer's hidden states have a few channels tens of times larger than the rest (seen in
every layer of all-MiniLM-L6-v2), so that one scale leaves the other channels a handful of INT8
levels. SmoothQuant (Xiao et al., 2023) divides activation channel k by ``s_k`` and multiplies
row k of the weight by it — the same product in exact arithmetic — with

    s_k = max|X_k| ** alpha / max|W_k,:| ** (1 - alpha)

over calibration rows, which evens the channels out at the weights' expense (the weights are
quantized per output channel, and their rows are smooth to begin with). Here the division is a
``Mul`` node on the activation, inserted before the MatMuls that read it (one per input tensor,
shared by the MatMuls that share it, e.g. query/key/value), not folded into the op before it: in
a post-LayerNorm transformer that output also feeds the residual connection, which must not
change. FP32 outputs of the smoothed model equal the original's to float rounding (1.5e-7 on
MiniLM); the parity gate compares the INT8 model with the original FP32 model all the same.

Measured on MiniLM and 600 of bench/embeddings.py's documents (bench/README.md): alpha 0.7 took
the minimum cosine of full dynamic INT8 from ~0.970 to 0.983; 0.5 made it worse (0.947), 0.8-0.9
too (0.972, 0.964).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import ModelError, one_line
from ..handlers.calls import plan_calls
from ..handlers.tokens import call_inputs, longest_first, sequence_lengths

SCALE_RANGE = (1e-2, 1e2)   # a channel's factor: clipped, so an all-zero channel stays finite


def smoothable(model: Any) -> dict[str, list[Any]]:
    """Activation tensor → the MatMul nodes that multiply it by a constant weight (``B`` an
    initializer of rank 2), in graph order."""
    constants = {t.name: t for t in model.graph.initializer if len(t.dims) == 2}
    found: dict[str, list[Any]] = {}
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in constants and node.input[0] not in constants:
            found.setdefault(node.input[0], []).append(node)
    return found


def activation_maxima(model: Any, feed: Mapping[str, np.ndarray], *, tokens: int | None,
                      lengths_from: str, sequences: Sequence[str]) -> dict[str, np.ndarray]:
    """Each smoothable activation's per-channel max |value| over ``feed``'s rows, the model run
    in the calls a run makes (``tokens``: longest rows first, calls of at most that many padded
    tokens, the ``sequences`` inputs cut to each call's longest row; else 256-row calls).

    Raises:
        ModelError: the model does not run on the rows.
    """
    import onnx
    import onnxruntime as ort

    tensors = list(smoothable(model))
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    for name in tensors:
        if name not in known:
            probe.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    try:
        session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ModelError(f"cannot calibrate the smoothing: {one_line(exc)}") from None
    names = [i.name for i in session.get_inputs()]
    inputs = {n: np.asarray(feed[n]) for n in names}
    rows = len(next(iter(inputs.values())))
    mask = inputs.get(lengths_from)
    if tokens and mask is not None and np.ndim(mask) == 2:
        lengths = sequence_lengths(mask)
        order = longest_first(lengths)
        inputs = {k: v[order] for k, v in inputs.items()}
        calls = plan_calls(0, rows, rows=None, lengths=lengths[order], tokens=tokens)
    else:
        calls = plan_calls(0, rows, rows=256)
    wanted = [o.name for o in session.get_outputs() if o.name in set(tensors)]
    maxima: dict[str, np.ndarray] = {}
    for lo, hi, width in calls:
        chunk = call_inputs(inputs, lo, hi, sequences, width) if width else {k: v[lo:hi] for k, v in inputs.items()}
        try:
            values = session.run(wanted, chunk)
        except Exception as exc:
            raise ModelError(f"cannot calibrate the smoothing: {one_line(exc)}") from None
        for name, value in zip(wanted, values):
            flat = np.abs(np.asarray(value, np.float32)).reshape(-1, value.shape[-1]).max(axis=0)
            maxima[name] = np.maximum(maxima[name], flat) if name in maxima else flat
    return maxima


def smooth(model: Any, maxima: Mapping[str, np.ndarray], alpha: float) -> tuple[Any, int]:
    """A copy of ``model`` with each activation in ``maxima`` divided by its channels' factors
    (a ``Mul`` before the MatMuls that read it) and those MatMuls' weight rows multiplied by
    them; and how many MatMuls were smoothed. Pure: ``model`` is not changed."""
    import onnx
    from onnx import numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    weights = {t.name: t for t in out.graph.initializer}
    users = smoothable(out)
    nodes = list(out.graph.node)
    inserted: list[tuple[int, Any]] = []
    smoothed = 0
    for tensor, matmuls in users.items():
        if tensor not in maxima:
            continue
        arrays = [numpy_helper.to_array(weights[n.input[1]]) for n in matmuls]
        if any(a.shape[0] != len(maxima[tensor]) for a in arrays):
            continue   # a weight that does not multiply this tensor's last axis
        w_max = np.max([np.abs(a).max(axis=1) for a in arrays], axis=0)
        scale = (np.maximum(maxima[tensor], 1e-5) ** alpha) / (np.maximum(w_max, 1e-5) ** (1.0 - alpha))
        scale = np.clip(scale, *SCALE_RANGE).astype(np.float32)
        inverse = f"{tensor}_smoothquant_inverse"
        out.graph.initializer.append(numpy_helper.from_array((1.0 / scale).astype(np.float32), inverse))
        smoothed_name = f"{tensor}_smoothquant"
        mul = onnx.helper.make_node("Mul", [tensor, inverse], [smoothed_name],
                                    name=f"{tensor.strip('/')}_smoothquant")
        for node, array in zip(matmuls, arrays):
            # a weight shared by two MatMuls on different inputs would be scaled twice: copy it
            name = f"{node.input[1]}_smoothquant_{smoothed}"
            out.graph.initializer.append(numpy_helper.from_array((array * scale[:, None]).astype(array.dtype), name))
            node.input[0], node.input[1] = smoothed_name, name
            smoothed += 1
        inserted.append((min(nodes.index(n) for n in matmuls), mul))
    for index, mul in sorted(inserted, key=lambda item: item[0], reverse=True):
        nodes.insert(index, mul)   # before the first MatMul that reads it: still topological
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    used = {i for n in out.graph.node for i in n.input}
    keep = [t for t in out.graph.initializer if t.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep)
    return out, smoothed
