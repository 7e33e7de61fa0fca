"""``export --to onnx --quantize int8``: an ONNX model quantized with ONNX Runtime (static QDQ
for numeric inputs, dynamic for token ids; SmoothQuant first with ``--smooth``) and written, with
``<out>.quantization.json`` (precision, settings, the sample: how it was drawn and its digest,
the gate's figures: what ``stamp`` declares), only when its outputs on the job's rows pass the
gate (:mod:`batchinfer.convert.int8_gate`). The sample is drawn from every shard of the
partition (:mod:`batchinfer.convert.samples`)."""
from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import ModelError, SpecError, one_line
from .int8_gate import Gate, _check_gate, _check_gate_applies, _gate, _row_size, _values_a_row
from .samples import JobSample, SampleSize, _check_onnx_input, _job_sample
from .written import ExportReport, _arrays_sha256, _check_out, _file_sha256, _publish, _scratch, _shapes

METHODS = ("auto", "static", "dynamic")   # auto: dynamic (the default)
QUANTIZE_ROWS = 4096       # sample rows the gate compares on (by default: export --sample-rows)
CALIBRATION_ROWS = 512     # of which the first ones calibrate a static quantization
STATIC_OPS = ("MatMul", "Gemm", "Conv")   # what static quantization turns into INT8
DYNAMIC_OPS = ("MatMul", "Gemm", "Conv", "Attention")   # and dynamic quantization
# ONNX Runtime's integer compute ops (QOperator format; the QLinear* ops besides)
INTEGER_OPS = ("MatMulInteger", "ConvInteger", "QGemm", "QAttention", "DynamicQuantizeMatMul",
               "MatMulIntegerToFloat", "DynamicQuantizeLSTM")
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear")


def quantize_model(model: str | Path, out: str | Path, sample_job, *, method: str = METHODS[0],
                   gate: Gate = Gate(), keep_fp32: Sequence[str] = (),
                   smooth: float | None = None, sample: SampleSize = SampleSize(QUANTIZE_ROWS)) -> ExportReport:
    """``export MODEL.onnx --to onnx --quantize int8``: ONNX Runtime's INT8 quantization of
    ``model``, calibrated on (and compared with FP32 on) the sample job's rows prepared as a run
    prepares them, written with ``<out>.quantization.json`` only when the gate passes.
    ``sample``: its rows and seed (drawn from every shard: convert/samples.py; the record says how).

    ``method``:

    - **dynamic** (``auto``'s choice): the weights of MatMul/Gemm/attention ops in INT8 (per
      channel), each batch's activation range computed as it runs. Only the ops that carry the
      compute: an embedding table's Gather stays FP32 (quantizing it saves memory, not time, and
      cost MiniLM 0.003 of its minimum cosine). It fits every model type here:
      a transformer's activations (attention scores, layer norms) range widely from one input to
      the next, so ranges fixed on a few hundred rows clip others (ONNX Runtime's own advice for
      transformers), and on numeric-feature MLPs it kept the answers far better than static did
      (tests' MLPs with 4-32 features: KL 0.0004-0.004 dynamic, 0.006-0.20 static, same rows).
    - **static** (``--method static``): QDQ, per-channel INT8 weights and INT8 activations of
      MatMul/Gemm/Conv with MinMax ranges calibrated on the first ``CALIBRATION_ROWS`` sample
      rows (shuffled: from every shard). No range is computed at run time, and a QDQ model is
      what TensorRT's explicit quantization builds from (``export --to tensorrt`` of the QDQ
      file: TensorRT reads the Q/DQ scales instead of calibrating, and its INT8 engine is then
      gated as FP16's is). The same gate decides whether it ships.

    ``keep_fp32``: regular expressions; the quantizable nodes whose names match one stay FP32
    (mixed precision, for the nodes a model's answers are most sensitive to: all-MiniLM-L6-v2
    passes the 0.99 cosine bound with its value projections and FFN output layers kept FP32,
    bench/README.md). A pattern that matches no quantizable node is an error, not a no-op; so
    are patterns that keep every one (the file would be the FP32 model).

    The record says ``precision: int8`` of what is in the file: the INT8 compute nodes of the
    written graph are counted (``quantization_int8_nodes``, by op in ``quantization_int8_ops``),
    and a quantization that left none (ONNX Runtime skips a MatMul with no constant weight) is
    exit 2, nothing written.

    Both models score the sample as a run scores it: through the onnxruntime backend's handler
    with the job's ``batch`` (``batch.tokens``: rows sorted by length, calls of at most that many
    padded tokens, each cut to its longest row), on the CPU. A transformer's 4,096 rows in one
    call would be padded to the longest and its attention scores would not fit in memory.

    The gate, per output, on every sample row (the calibration rows among them): a score
    (``[N]``/``[N, 1]``) passes by the KL rule of contract §6 and, with ``max_flip_rate``, by
    the share of rows whose decision (``> threshold``) flips; an embedding (``[N, K]`` named
    with "embed", or in ``gate.embeddings``) by its rows' minimum cosine with FP32; a class
    distribution or logits (other ``[N, K]``) by the softmax KL rule.

    Every option is applied or refused (exit 2, before any work): a bound outside its range, an
    ``--embedding`` that names no output or a score, a ``--min-cosine`` no output is judged by,
    a ``--max-flip-rate``/``--threshold`` of a model with no score, a ``--smooth`` that would
    smooth no quantized MatMul (:func:`_check_gate_applies`; where an output's shape is known
    only once it runs, the same check refuses it then, before anything is written).

    Raises:
        SpecError: not an ONNX model, no ``--sample``, an unknown method, an option that cannot
            apply, an ``--out`` that is not the export's to replace, nothing quantized.
        ModelError: quantization failed, or the gate refused the model (nothing written).
    """
    model, out = Path(model), Path(out)
    method, quantizable, kept = _checked(model, out, sample_job, method, gate, keep_fp32, smooth)
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    drawn = _job_sample(sample_job, names, sample)
    feed = {n: np.asarray(a, dtype=np.float32) if np.asarray(a).dtype == np.float64 else np.asarray(a)
            for n, a in zip(names, drawn.arrays)}
    calibration = ({n: a[:CALIBRATION_ROWS] for n, a in feed.items()}
                   if method == "static" or smooth is not None else {})
    settings = _write_int8(model, out, sample_job, method, calibration, kept, smooth)
    if keep_fp32:
        settings["quantization_kept_fp32"] = f"{'|'.join(keep_fp32)} ({len(kept)} nodes)"
    scratch = settings.pop("_scratch")
    try:
        settings.update(_int8_settings(scratch, model, method, quantizable, kept))
        return _judge_and_publish(model, out, scratch, session, sample_job, drawn, feed, calibration,
                                  gate, {"precision": "int8", "quantization_method": method, **settings})
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


def _write_int8(model: Path, out: Path, sample_job: Any, method: str, calibration: Mapping[str, np.ndarray],
                kept: Sequence[str], smooth: float | None) -> dict[str, Any]:
    """The quantized model in a scratch file beside ``out`` (``settings["_scratch"]``), smoothed
    first with ``smooth``; the settings its record declares."""
    out.parent.mkdir(parents=True, exist_ok=True)
    source, smoothing = (_smoothed(model, out, calibration, sample_job, smooth) if smooth is not None
                         else (str(model), {}))
    try:
        settings = _quantize(Path(source), out, method, calibration if method == "static" else {}, kept)
    finally:
        if source != str(model):
            os.unlink(source)
    settings.update(smoothing)
    return settings


def _checked(model: Path, out: Path, sample_job: Any, method: str, gate: Gate, keep_fp32: Sequence[str],
             smooth: float | None) -> tuple[str, list[str], list[str]]:
    """Every option applied or refused before any work (exit 2): the method ``auto`` stands for,
    the nodes it quantizes and those ``keep_fp32`` keeps FP32."""
    _check_onnx_input(model, sample_job, "--quantize", "the job's own rows calibrate the model "
                      "and check its parity")
    _check_out(model, out)
    if method not in METHODS:
        raise SpecError(f"--method {method!r}: choose {', '.join(METHODS[:-1])} or {METHODS[-1]}")
    _check_gate(gate)
    if smooth is not None and not 0.0 < smooth < 1.0:
        raise SpecError(f"--smooth {smooth:g}: choose an alpha between 0 and 1 (0.7 for MiniLM)")
    proto = _onnx_model(model)
    graph = proto.graph
    if method == "auto":
        method = "dynamic"
    quantizable = _quantizable(graph, model, method)
    kept = _kept_fp32(model, method, keep_fp32, quantizable)   # names nothing, or all: exit 2
    _check_gate_applies(_values_a_row(graph), gate, model.name)
    if smooth is not None:
        _check_smoothable(proto, model, smooth, kept)
    return method, quantizable, kept


def _judge_and_publish(model: Path, out: Path, scratch: str, session: Any, sample_job: Any,
                       drawn: JobSample, feed: Mapping[str, np.ndarray],
                       calibration: Mapping[str, np.ndarray], gate: Gate,
                       settings: dict[str, Any]) -> ExportReport:
    """Both models score the sample as a run would; the gate judges; the record, then the model
    (``scratch``), renamed into place only when it passes."""
    from .. import parity
    from ..handlers.onnx import QUANTIZATION_SUFFIX

    rows = len(next(iter(feed.values())))
    want = _score_as_a_run(str(model), feed, sample_job, "FP32")
    try:
        got = _score_as_a_run(scratch, feed, sample_job, "quantized")
    except ModelError as exc:
        raise ModelError(f"the quantized model does not run: {exc.message}") from None
    where = drawn.where()
    # shapes the graph left symbolic are known now: an option they make moot is still exit 2
    _check_gate_applies({k: _row_size(v) for k, v in want.items()}, gate, model.name,
                        "; nothing written")
    figures = _gate(parity, want, got, gate, where)
    facts: dict[str, Any] = {
        **settings,
        "calibration_rows": len(next(iter(calibration.values()))) if calibration else 0,
        "calibration_sha256": _arrays_sha256(calibration) if calibration else "none (dynamic)",
        **drawn.facts(),
        "sample_sha256": _arrays_sha256(feed),
        "source_model_sha256": _file_sha256(model), **figures,
        "model_sha256": _file_sha256(Path(scratch))}
    # the record first: it names the model's sha256, so one left beside other bytes (a
    # crash between the renames) is refused by stamp, never taken for theirs
    record = Path(str(out) + QUANTIZATION_SUFFIX)
    written = _scratch(record)
    try:
        Path(written).write_text(json.dumps(facts, indent=2) + "\n")
        _publish(written, record)
        _publish(scratch, out)
    finally:
        if os.path.exists(written):
            os.unlink(written)
    diffs = {k: parity.max_abs_diff(want[k], got[k]) for k in want}
    kls = {k: parity.output_kl(want[k], got[k]) for k in want}
    return ExportReport(out, _shapes(session.get_inputs()), _shapes(session.get_outputs()),
                        where, rows, diffs, kls, reference="ONNX Runtime FP32", gate=figures)


def _onnx_model(model: Path) -> Any:
    """``model`` as an ONNX ModelProto, without its external data (names, ops, shapes and
    initializer dims are enough).

    Raises:
        SpecError: not a readable ONNX model.
    """
    import onnx

    try:
        return onnx.load(str(model), load_external_data=False)
    except Exception as exc:
        raise SpecError(f"{model} is not a readable ONNX model: {one_line(exc)}") from None


def _quantizable(graph: Any, model: Path, method: str) -> list[str]:
    """The names of the nodes ``method`` quantizes in ``graph``.

    Raises:
        SpecError: an already quantized model (its INT8 nodes would be counted as this export's,
            and quantizing twice compounds the error), or one with no node to quantize.
    """
    ops = DYNAMIC_OPS if method == "dynamic" else STATIC_OPS
    found = _int8_nodes(graph)
    present = {n.op_type for n in _nodes(graph)} & set(QDQ_OPS)
    if found or present:
        what = ", ".join(f"{op} {n}" for op, n in sorted(found.items())) or "/".join(sorted(present))
        raise SpecError(f"{model.name} is already quantized ({what}): --quantize int8 takes the "
                        f"FP32 model it came from")
    nodes = [n.name for n in graph.node if n.op_type in ops]
    if not nodes:
        raise SpecError(f"{model.name} has no {'/'.join(ops)} node for {method} quantization to "
                        f"quantize: its INT8 version would be the FP32 model")
    return nodes


def _kept_fp32(model: Path, method: str, patterns: Sequence[str],
               nodes: Sequence[str] | None = None) -> list[str]:
    """The quantizable nodes of ``model`` (``nodes``: their names, read from ``model`` if not
    given) whose names match one of ``patterns`` (``re.search``).

    Raises:
        SpecError: a pattern that is not a regular expression, or matches no quantizable node
            (a typo, or a model exported with other node names, would otherwise quantize all);
            patterns that keep every node (nothing would be quantized: the FP32 model, stamped
            int8).
    """
    import re

    if not patterns:
        return []
    ops = DYNAMIC_OPS if method == "dynamic" else STATIC_OPS
    if nodes is None:
        nodes = [n.name for n in _onnx_model(model).graph.node if n.op_type in ops]
    kept: list[str] = []
    for pattern in patterns:
        try:
            found = [name for name in nodes if re.search(pattern, name)]
        except re.error as exc:
            raise SpecError(f"--keep-fp32 {pattern!r} is not a regular expression: {exc}") from None
        if not found:
            raise SpecError(f"--keep-fp32 {pattern!r} matches none of {model.name}'s {len(nodes)} "
                            f"{'/'.join(ops)} nodes (e.g. {nodes[0] if nodes else 'none'!s})")
        kept += [name for name in found if name not in kept]
    if all(name in kept for name in nodes):
        raise SpecError(f"--keep-fp32 {' '.join(map(repr, patterns))} keeps all {len(nodes)} of "
                        f"{model.name}'s {'/'.join(ops)} nodes FP32: nothing would be quantized "
                        f"(the file would be the FP32 model); keep fewer nodes FP32")
    return kept


def _check_smoothable(proto: Any, model: Path, alpha: float, kept: Sequence[str]) -> None:
    """``--smooth`` where it changes a quantized node: a model with no MatMul of an activation by
    a weight, or one whose every such MatMul is kept FP32 (smoothing is the same function in
    FP32, so it would change nothing), is exit 2 before calibration."""
    from . import smoothing

    matmuls = [node.name for nodes in smoothing.smoothable(proto).values() for node in nodes]
    if not matmuls:
        raise SpecError(f"--smooth: {model.name} has no MatMul of an activation by a weight to smooth")
    if all(name in kept for name in matmuls):
        raise SpecError(f"--smooth {alpha:g}: --keep-fp32 keeps all {len(matmuls)} MatMuls it would "
                        f"smooth FP32, so it changes no quantized node: drop --smooth or keep "
                        f"fewer nodes FP32")


def _nodes(graph: Any) -> Any:
    """Every node of ``graph``, those of its subgraphs (If, Loop, Scan bodies) too."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from _nodes(attribute.g)
            for subgraph in attribute.graphs:
                yield from _nodes(subgraph)


def _int8_nodes(graph: Any) -> dict[str, int]:
    """The compute nodes of ``graph`` that run in INT8, counted by op type: ONNX Runtime's
    integer ops (``INTEGER_OPS``, ``QLinear*``: the QOperator format) and, in a QDQ model, the
    MatMul/Gemm/Conv/Attention nodes that read a DequantizeLinear's output (what ONNX Runtime
    and TensorRT run as integer kernels). Q/DQ nodes alone are not compute: a model whose only
    quantized tensors feed FP32 ops has none."""
    nodes = list(_nodes(graph))
    dequantized = {name for n in nodes if n.op_type == "DequantizeLinear" for name in n.output}
    counts: dict[str, int] = {}
    for node in nodes:
        if (node.op_type in INTEGER_OPS or node.op_type.startswith("QLinear")
                or (node.op_type in DYNAMIC_OPS and dequantized.intersection(node.input))):
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _int8_settings(scratch: str, model: Path, method: str, quantizable: Sequence[str],
                   kept: Sequence[str]) -> dict[str, Any]:
    """What the quantized file ``scratch`` holds in INT8, counted from its graph, as the record
    states it: the record's ``precision: int8`` is a fact about the file, not about the command.

    Raises:
        SpecError: no INT8 compute node (nothing written: stamped, the FP32 model would pass
            for INT8).
    """
    counts = _int8_nodes(_onnx_model(Path(scratch)).graph)
    if not counts:
        ops = DYNAMIC_OPS if method == "dynamic" else STATIC_OPS
        others = f" ({len(kept)} kept FP32)" if kept else ""
        raise SpecError(f"ONNX Runtime quantized none of {model.name}'s {len(quantizable)} "
                        f"{'/'.join(ops)} nodes{others} ({method}: a MatMul with no constant weight "
                        f"stays FP32, for one): the file would be the FP32 model; nothing written")
    return {"quantization_int8_nodes": sum(counts.values()),
            "quantization_int8_ops": ", ".join(f"{op} {n}" for op, n in sorted(counts.items()))}


def _handler(model: str, job: Any, what: str) -> tuple[Any, Any]:
    """The onnxruntime backend's handler for ONNX model ``model`` with the job's ``batch``, on
    the CPU, and the model it loaded."""
    from ..handlers.base import handler_for

    batch = job.spec.batch
    handler = handler_for("onnxruntime", model, digest=f"export-{what}-{os.getpid()}", device="cpu",
                          tokens=batch.tokens, lengths_from=batch.lengths_from,
                          sequence_inputs=batch.sequence_inputs)
    return handler, handler.load_model()


def _score_as_a_run(model: str, feed: Mapping[str, np.ndarray], job: Any, what: str) -> dict[str, np.ndarray]:
    """The outputs of ONNX model ``model`` on ``feed``, scored as the job's run scores (the
    onnxruntime handler, the job's ``batch``), on the CPU.

    Raises:
        ModelError: the model does not load, or rejects a row.
    """
    from ..errors import BatchInferError
    from ..handlers.base import Prepared

    rows = len(next(iter(feed.values())))
    try:
        handler, loaded = _handler(model, job, what)
        result = handler.infer(loaded, Prepared(key=(0, 0), rows=rows, features=dict(feed)))
    except BatchInferError:
        raise
    except Exception as exc:
        raise ModelError(f"the {what} model does not run: {one_line(exc)}") from None
    if result.failed:
        row, error = result.failed[0]
        raise ModelError(f"the {what} model rejects {len(result.failed)} of the sample's rows "
                         f"(row {row}: {error})")
    return dict(result.outputs)


def _smoothed(model: Path, out: Path, calibration: Mapping[str, np.ndarray], job: Any,
              alpha: float) -> tuple[str, dict[str, Any]]:
    """``model`` smoothed for quantization (convert/smoothing.py), calibrated on
    ``calibration`` scored in the job's calls, in a scratch file beside ``out``; its path and
    the settings to record."""
    import onnx

    from . import smoothing

    graph = onnx.load(str(model))
    batch = job.spec.batch
    sequences: frozenset[str] = frozenset()
    if batch.tokens and batch.lengths_from in calibration:
        handler, loaded = _handler(str(model), job, "FP32")
        sequences = handler.sequence_inputs(loaded)
    maxima = smoothing.activation_maxima(graph, calibration, tokens=batch.tokens,
                                         lengths_from=batch.lengths_from, sequences=sorted(sequences))
    smoothed, count = smoothing.smooth(graph, maxima, alpha)
    if not count:
        raise SpecError(f"--smooth: {model.name} has no MatMul of an activation by a weight to smooth")
    handle, scratch = tempfile.mkstemp(prefix=f".{out.name}.smooth.", suffix=".onnx", dir=out.parent)
    os.close(handle)
    try:
        onnx.save(smoothed, scratch)
    except BaseException:
        os.unlink(scratch)
        raise
    return scratch, {"quantization_smoothquant_alpha": alpha, "quantization_smoothquant_matmuls": count}


def _quantize(model: Path, out: Path, method: str, calibration: Mapping[str, np.ndarray],
              kept_fp32: Sequence[str] = ()) -> dict[str, Any]:
    """Quantize ``model`` into a scratch file beside ``out``, the nodes ``kept_fp32`` left
    FP32; the settings used (and the scratch file's path under ``_scratch``)."""
    try:
        import onnx
        from onnxruntime.quantization import (
            CalibrationDataReader,
            CalibrationMethod,
            QuantFormat,
            QuantType,
            quantize_dynamic,
            quantize_static,
        )
    except ImportError:
        raise ModelError("export --quantize needs onnxruntime's quantization tools (onnxruntime "
                         ">= 1.16 with onnx): pip install 'batchinfer[cpu]'") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".onnx", dir=out.parent)
    os.close(handle)
    settings: dict[str, Any] = {"quantization_weight_type": "int8", "quantization_per_channel": True}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if method == "dynamic":
                # DefaultTensorType: the type of outputs shape inference cannot tell (those of
                # the transformer optimizer's fused com.microsoft ops), else quantization fails.
                quantize_dynamic(str(model), scratch, weight_type=QuantType.QInt8, per_channel=True,
                                 op_types_to_quantize=list(DYNAMIC_OPS), nodes_to_exclude=list(kept_fp32),
                                 extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
                settings.update(quantization_format="QOperator (dynamic activation ranges)",
                                quantization_op_types=",".join(DYNAMIC_OPS))
            else:
                class Reader(CalibrationDataReader):
                    """The calibration rows, in 128-row batches."""

                    def __init__(self) -> None:
                        n = len(next(iter(calibration.values())))
                        self._batches = iter([{k: v[i:i + 128] for k, v in calibration.items()}
                                              for i in range(0, n, 128)])

                    def get_next(self):
                        return next(self._batches, None)

                # Only the ops that carry the compute take INT8 in and out; the rest (Add,
                # Relu, Sigmoid, Softmax) stays FP32: a quantized sigmoid has 256 output levels,
                # which alone moves a score's histogram by KL ~0.01 (measured on tests' MLP).
                quantize_static(str(model), scratch, Reader(), quant_format=QuantFormat.QDQ,
                                op_types_to_quantize=list(STATIC_OPS), nodes_to_exclude=list(kept_fp32),
                                per_channel=True, activation_type=QuantType.QInt8,
                                weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax)
                settings.update(quantization_format="QDQ", quantization_activation_type="int8",
                                quantization_op_types=",".join(STATIC_OPS),
                                quantization_calibrate_method="MinMax")
    except Exception as exc:
        os.unlink(scratch)
        raise ModelError(f"cannot quantize {model.name} ({method}): {one_line(exc)}") from None
    settings["_scratch"] = scratch
    return settings
