"""``export --to tensorrt``: a TensorRT engine built from an ONNX model, with one optimisation
profile whose batch axis runs from 1 to the sample job's ``batch.rows``, checked against ONNX
Runtime FP32 on CPU (FP32 within ``GPU_TOLERANCE``; ``--fp16`` and QDQ INT8 by the KL rule of
``parity.KL_LIMIT``); written with ``<engine>.build.json`` only when parity holds."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..errors import ModelError, SpecError, one_line
from .samples import SampleSize, _check_onnx_input, _job_sample
from .written import ExportReport, _check_out, _publish, _scratch

GPU_TOLERANCE = 1e-4


def _onnx_fp16(onnx_bytes: bytes) -> bytes:
    """The model with FP16 weights and activations, FP32 inputs and outputs."""
    try:
        import onnx
        from onnxconverter_common import float16
    except ImportError:
        raise ModelError("export --to tensorrt --fp16 with TensorRT 11 needs onnxconverter-common: "
                         "pip install 'batchinfer[gpu]'") from None
    converted = float16.convert_float_to_float16(onnx.load_from_string(onnx_bytes), keep_io_types=True)
    return converted.SerializeToString()


def _require_tensorrt() -> Any:
    try:
        import tensorrt
        import torch
    except ImportError:
        raise ModelError("export --to tensorrt needs TensorRT and a CUDA GPU: install "
                         "'batchinfer[gpu]' on a machine with one") from None
    if not torch.cuda.is_available():
        raise ModelError("export --to tensorrt needs a CUDA GPU and this machine has none")
    return tensorrt

def _to_tensorrt(model: Path, out: Path, fp16: bool, sample_job, sample: SampleSize = SampleSize()) -> ExportReport:
    _check_onnx_input(model, sample_job, "--to tensorrt", "its batch.rows sizes the engine's "
                      "profile and its rows check parity")
    _check_out(model, out)
    int8 = _quantized(model)   # a QDQ model: TensorRT's explicit quantization (checked first)
    trt = _require_tensorrt()
    import onnxruntime as ort

    from ..handlers.base import Prepared, handler_for
    from ..handlers.tensorrt import BUILD_SUFFIX, _here

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    drawn = _job_sample(sample_job, names, sample)
    feed = {n: np.asarray(a, dtype=np.float32) if np.asarray(a).dtype == np.float64 else a
            for n, a in zip(names, drawn.arrays)}
    rows = int(sample_job.spec.batch.rows)
    engine = _build_engine(trt, model, feed, rows, fp16, int8)
    scratch, built = _scratch(out, out.suffix or ".engine"), None
    try:
        Path(scratch).write_bytes(engine)
        handler = handler_for("tensorrt", scratch, digest=f"export-{os.getpid()}", device="cuda")
        loaded = handler.load_model()
        n = len(next(iter(feed.values())))
        got = handler.infer(loaded, Prepared(key=(0, 0), rows=n, features=dict(feed)))
        want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
        from .. import parity

        compared = parity.compare(want, got.outputs)
        diffs = {k: d for k, (_, d) in compared.items()}
        kls = {k: kl for k, (kl, _) in compared.items()}
        where = drawn.where()
        if fp16 or int8:
            # an INT8 engine is compared with ONNX Runtime running the same QDQ model (which
            # `export --quantize` already held to FP32 by its gate)
            worst = max(kls, key=lambda k: kls[k])
            if not kls[worst] <= parity.KL_LIMIT:
                raise ModelError(f"parity check failed: {'INT8' if int8 else 'FP16'} output {worst} "
                                 f"has KL divergence {kls[worst]:.3g} from "
                                 f"{'the QDQ model' if int8 else 'FP32'} (> {parity.KL_LIMIT:g}; max abs diff "
                                 f"{diffs[worst]:.3g}) on {where}; nothing written")
        else:
            worst = max(diffs, key=lambda k: diffs[k])
            if not diffs[worst] <= GPU_TOLERANCE:
                raise ModelError(f"parity check failed: output {worst} differs by up to "
                                 f"{diffs[worst]:.3g} (> {GPU_TOLERANCE:g}) on {where}; nothing written")
        facts = _here()
        build = Path(str(out) + BUILD_SUFFIX)
        built = _scratch(build)
        Path(built).write_text(
            json.dumps({**facts, "fp16": fp16, "precision": "int8" if int8 else "fp16" if fp16 else "fp32",
                        "max_batch": rows, "source": model.name}, indent=2) + "\n")
        _publish(built, build)
        _publish(scratch, out)
        shapes = {n: tuple(v.shape) for n, v in feed.items()}
        return ExportReport(out, shapes, {k: tuple(v.shape) for k, v in got.outputs.items()}, where,
                            n, diffs, kls if fp16 or int8 else None,
                            reference="ONNX Runtime (the QDQ model)" if int8 else "ONNX Runtime FP32")
    finally:
        for left in (scratch, built):
            if left is not None and os.path.exists(left):
                os.unlink(left)


def _quantized(model: Path) -> bool:
    """Whether ``model`` is a static QDQ model (QuantizeLinear/DequantizeLinear nodes), which
    TensorRT builds by explicit quantization: the scales are the model's, no calibration.

    Raises:
        SpecError: a dynamically quantized model (DynamicQuantizeLinear, MatMulInteger), which
            TensorRT does not take.
    """
    import onnx

    try:
        ops = {node.op_type for node in onnx.load(str(model), load_external_data=False).graph.node}
    except Exception as exc:
        raise SpecError(f"{model} is not a readable ONNX model: {one_line(exc)}") from None
    if ops & {"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger"}:
        raise SpecError(f"{model.name} is dynamically quantized, which TensorRT does not build: "
                        f"export the FP32 model with --quantize int8 --method static (QDQ) for it")
    return "QuantizeLinear" in ops and "DequantizeLinear" in ops


def _build_engine(trt, model: Path, feed: Mapping[str, np.ndarray], max_rows: int, fp16: bool,
                  int8: bool = False) -> bytes:
    """A serialized engine whose one profile takes 1..max_rows rows (optimised for max_rows)."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    onnx_bytes = model.read_bytes()
    # TensorRT 10 lowers precision with a builder flag; TensorRT 11 builds every network strongly
    # typed (the flag is gone), so there the model itself is converted to FP16 first, its inputs
    # and outputs kept FP32 so that a run feeds and reads the same arrays.
    weakly_typed_fp16 = hasattr(trt.BuilderFlag, "FP16")
    if fp16 and not weakly_typed_fp16:
        onnx_bytes = _onnx_fp16(onnx_bytes)
    if not parser.parse(onnx_bytes):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ModelError(f"TensorRT cannot parse {model.name}: {errors[:300]}")
    config = builder.create_builder_config()
    if hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)   # FP32 means FP32: TF32 would miss 1e-4 parity
    if fp16 and weakly_typed_fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    if int8 and hasattr(trt.BuilderFlag, "INT8"):
        # TensorRT 10 builds a network with Q/DQ layers by explicit quantization once INT8 is
        # allowed; TensorRT 11's strongly typed networks take the Q/DQ types as they are.
        config.set_flag(trt.BuilderFlag.INT8)
    profile = builder.create_optimization_profile()
    for name, value in feed.items():
        rest = tuple(value.shape[1:])
        profile.set_shape(name, (1, *rest), (max_rows, *rest), (max_rows, *rest))
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ModelError(f"TensorRT could not build an engine from {model.name} (see its log above)")
    return bytes(serialized)
