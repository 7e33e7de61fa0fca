"""``batchinfer export``: convert a model for a faster backend, and prove it still agrees (contract §2).

``--to onnx`` turns a ``torch.export`` program (``.pt2``) into an ONNX model with PyTorch's
exporter (``torch.onnx.export(..., dynamo=True)``, which keeps the batch axis dynamic), then
runs both on sample inputs — rows of a job's input prepared exactly as a run prepares them
(``--sample JOB.yaml``), or else the program's own example inputs — and writes the ONNX file
only when every output agrees within ``ONNX_TOLERANCE``.

Every export writes to a scratch name beside ``--out`` (its folder: the rename stays atomic) and
renames it into place only once parity holds, records first (:func:`_publish`), so a failed
export or a crash leaves ``--out`` as it was, never part of a file. An ``--out`` that would
replace what is not the export's to replace — the model being exported, a stamped model, a
declaration or record, a folder — is refused before any work (:func:`_check_out`).

``--to tensorrt`` builds a TensorRT engine from an ``.onnx`` model with one optimisation profile
whose batch axis runs from 1 to the sample job's ``batch.rows`` (so a run's batches fit), runs
it on the job's sample rows through the tensorrt backend and compares it with ONNX Runtime FP32
on CPU: an FP32 engine (TF32 off) must agree within ``GPU_TOLERANCE``; an ``--fp16`` engine
passes when every output's KL divergence is ≤ ``parity.KL_LIMIT`` (batchinfer/parity.py), its
max abs diff reported. The engine and ``<engine>.build.json`` (TensorRT version, GPU compute
capability: what ``stamp`` declares) are written only when parity holds. It needs TensorRT and
a CUDA device; where they are missing it exits 5 saying so. A static QDQ model (``--quantize
int8 --method static``) builds an INT8 engine by TensorRT's explicit quantization (its Q/DQ
scales, no calibration), judged by the KL rule against ONNX Runtime running the QDQ model.

``--to onnx --quantize int8`` of an ``.onnx`` model quantizes it with ONNX Runtime and writes it,
with ``<out>.quantization.json`` (precision, settings, sample digest, the gate's figures: what
``stamp`` declares), only when its outputs on the job's rows stay within the gate
(:func:`quantize_model`).
"""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import ModelError, SpecError, one_line

ONNX_TOLERANCE = 1e-5
GPU_TOLERANCE = 1e-4
SAMPLE_ROWS = 1024


@dataclass
class ExportReport:
    out: Path
    inputs: dict[str, tuple]       # ONNX input name → shape (symbolic dims as strings)
    outputs: dict[str, tuple]
    sample: str                    # where the sample inputs came from
    rows: int
    max_abs_diff: dict[str, float]
    kl: dict[str, float] | None = None   # --fp16: each output's KL divergence from FP32
    reference: str = "torch"             # what the export was compared with
    gate: dict[str, Any] | None = None   # --quantize: the gate's figures (as declared)


def _check_out(model: Path, out: Path) -> None:
    """Refuse (exit 2, before any work) an ``--out`` that is not the export's to replace: the
    model being exported (it would be replaced by its own conversion, the FP32 original lost), a
    stamped model (its declaration beside it vouches for the bytes there; a run would find
    others), a declaration or a record that sits beside a model, or a folder. Symlinks, ``..``
    and hard links name the same file: compared resolved, by inode where both exist."""
    from ..handlers.onnx import QUANTIZATION_SUFFIX
    from ..handlers.tensorrt import BUILD_SUFFIX
    from ..triple.contract import SIDECAR_SUFFIX

    resolved = out.resolve()
    records = {SIDECAR_SUFFIX: "a declaration", QUANTIZATION_SUFFIX: "a quantization record",
               BUILD_SUFFIX: "a build record"}
    record = next((what for suffix, what in records.items()
                   if out.name.endswith(suffix) or resolved.name.endswith(suffix)), None)
    declared = next((d for d in (Path(f"{resolved}{SIDECAR_SUFFIX}"), Path(f"{out}{SIDECAR_SUFFIX}"))
                     if d.exists()), None)
    todo = "choose another --out"
    if _same_file(out, model):
        why = "the model being exported (the export would replace its own source)"
    elif record is not None:
        why = f"{record} (batchinfer's file beside a model, not a model)"
    elif out.is_dir():
        why, todo = "a folder", f"name a file in it (e.g. {out / model.name})"
    elif declared is not None:
        why = f"a stamped model (its declaration {declared.name} is beside it)"
        todo += ", or remove the model and its declaration first to replace it"
    else:
        return
    raise SpecError(f"--out {out} resolves to {resolved}, {why}: {todo}")


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: one inode where both exist (a hard link, a
    symlink, another spelling on a case-insensitive disk), else one resolved path."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def _scratch(target: Path, suffix: str = "") -> str:
    """A new empty hidden file beside ``target``: in its folder, so that renaming it onto
    ``target`` is one atomic step on the same disk."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.close(handle)
    return scratch


def _publish(scratch: str, target: Path) -> None:
    """Rename ``scratch`` onto ``target``: ``target`` then holds either what it held or all of
    the new file, never part of one. mkstemp made ``scratch`` private (0600); it takes the
    permissions a plain write would have given it (0666 less the umask), so the model is as
    readable as one copied there."""
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(scratch, 0o666 & ~umask)
    os.replace(scratch, target)


def export_model(model: str | Path, to: str, out: str | Path, *, fp16: bool = False,
                 sample_job=None) -> ExportReport:
    """Convert ``model``; see the module docstring.

    Args:
        sample_job: a loaded :class:`~batchinfer.spec.Job` whose input supplies sample rows.

    Raises:
        SpecError: a model or target this command does not convert.
        ModelError: a missing library or device, a failed conversion, or outputs that disagree
            (nothing is written then).
    """
    model, out = Path(model), Path(out)
    if to == "tensorrt":
        return _to_tensorrt(model, out, fp16, sample_job)
    if to != "onnx":
        raise SpecError(f"export --to {to!r}: choose onnx or tensorrt")
    if fp16:
        raise SpecError("--fp16 applies to --to tensorrt only")
    if model.suffix != ".pt2":
        raise SpecError(f"export --to onnx takes a torch.export program (.pt2), not {model.name}")
    if not model.is_file():
        raise SpecError(f"no model file {model}")
    _check_out(model, out)
    torch = _require("torch")
    _require("onnxscript")
    if not logging.getLogger("batchinfer").isEnabledFor(logging.DEBUG):  # i.e. without --debug
        # the exporter's notes about optional packages (torchvision ops it skips)
        torch._logging.set_logs(onnx=logging.ERROR)
    try:
        program = torch.export.load(str(model))
    except Exception as exc:
        raise ModelError(f"torch cannot load {model}: {one_line(exc)}") from None
    if sample_job is not None:
        arrays = _job_sample(sample_job, _input_names(program))
        where = f"rows of {sample_job.spec.name}'s input"
    else:
        arrays, where = _example_inputs(program), "the program's example inputs"
    return _to_onnx(torch, program, arrays, where, out)


def _to_onnx(torch, program, arrays: list[np.ndarray], where: str, out: Path) -> ExportReport:
    import onnxruntime as ort

    args = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)
    with torch.no_grad():
        expected = program.module()(*args)
    expected = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    scratch = _scratch(out, ".onnx")
    try:
        try:
            with warnings.catch_warnings():  # deprecation notes from inside torch
                warnings.simplefilter("ignore")
                torch.onnx.export(program, args, scratch, dynamo=True, external_data=False,
                                  verbose=False)
            session = ort.InferenceSession(scratch, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ModelError(f"cannot convert to ONNX: {one_line(exc)}") from None
        names = [i.name for i in session.get_inputs()]
        if len(names) != len(arrays):
            raise ModelError(f"the ONNX model takes inputs {names}, the program {len(arrays)}")
        got = session.run(None, dict(zip(names, arrays)))
        diffs = {}
        for meta, want, have in zip(session.get_outputs(), expected, got):
            want = want.detach().cpu().numpy()
            if want.shape != have.shape:
                raise ModelError(f"parity check failed: output {meta.name} has shape {have.shape} "
                                 f"in ONNX, {want.shape} in torch; nothing written")
            diffs[meta.name] = float(np.max(np.abs(want.astype(np.float64) - have))) if want.size else 0.0
        worst = max(diffs, key=lambda name: diffs[name]) if diffs else None
        if worst is not None and not diffs[worst] <= ONNX_TOLERANCE:
            raise ModelError(f"parity check failed: output {worst} differs by up to "
                             f"{diffs[worst]:.3g} (> {ONNX_TOLERANCE:g}) on {where}; nothing written")
        report = ExportReport(out, _shapes(session.get_inputs()), _shapes(session.get_outputs()),
                              where, len(arrays[0]) if arrays and np.ndim(arrays[0]) else 0, diffs)
        _publish(scratch, out)
        return report
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


def _shapes(metas) -> dict[str, tuple]:
    return {m.name: tuple(m.shape) for m in metas}


def _example_inputs(program) -> list[np.ndarray]:
    example = getattr(program, "example_inputs", None)
    args = example[0] if example else None
    if not args:
        raise SpecError("the program carries no example inputs: give --sample JOB.yaml")
    return [a.detach().cpu().numpy() for a in args]


def _input_names(program) -> list[str]:
    try:
        return list(program.graph_signature.user_inputs)
    except Exception:  # an older program format: positional order only
        return []


def _job_sample(job, input_names: list[str], rows: int = SAMPLE_ROWS) -> list[np.ndarray]:
    """Up to ``rows`` valid rows of the job's first readable shard, preprocessed as a run
    would (validation, then the job's preprocessing)."""
    from ..app.input_validation import validated_batches
    from ..app.resolve import list_job_input, resolve_inputs
    from ..io.shards import ShardReader, Unreadable

    schema, _, preprocessor = resolve_inputs(job)
    for shard in list_job_input(job).shards:
        try:
            result = next(validated_batches(ShardReader(shard.url), schema, rows,
                                            shard.url), None)
        except Unreadable:
            continue
        valid = result.valid if result is not None else None
        if valid is not None and valid.num_rows:
            features = preprocessor(valid)
            if isinstance(features, Mapping):  # by the program's input names when they match
                names = input_names if set(input_names) <= set(features) else list(features)
                return [np.asarray(features[n]) for n in names]
            return [np.asarray(features)]
    raise SpecError(f"no valid rows in {job.display(job.spec.input.path)} to sample")


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


def _require(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ModelError(f"export needs {module}: pip install 'batchinfer[torch]'") from None


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



def _check_onnx_input(model: Path, sample_job: Any, mode: str, why_sample: str) -> None:
    """An ONNX model file and a sample job, as ``export MODE`` needs them (exit 2 otherwise)."""
    if model.suffix.lower() != ".onnx":
        raise SpecError(f"export {mode} takes an ONNX model (.onnx), not {model.name}")
    if not model.is_file():
        raise SpecError(f"no model file {model}")
    if sample_job is None:
        raise SpecError(f"export {mode} needs --sample JOB.yaml: {why_sample}")

def _to_tensorrt(model: Path, out: Path, fp16: bool, sample_job) -> ExportReport:
    _check_onnx_input(model, sample_job, "--to tensorrt", "its batch.rows sizes the engine's "
                      "profile and its rows check parity")
    _check_out(model, out)
    int8 = _quantized(model)   # a QDQ model: TensorRT's explicit quantization (checked first)
    trt = _require_tensorrt()
    import onnxruntime as ort

    from ..handlers.base import Prepared
    from ..handlers.tensorrt import BUILD_SUFFIX, TensorRTModelHandler, _here

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    arrays = _job_sample(sample_job, names)
    feed = {n: np.asarray(a, dtype=np.float32) if np.asarray(a).dtype == np.float64 else a
            for n, a in zip(names, arrays)}
    rows = int(sample_job.spec.batch.rows)
    engine = _build_engine(trt, model, feed, rows, fp16, int8)
    scratch, built = _scratch(out, out.suffix or ".engine"), None
    try:
        Path(scratch).write_bytes(engine)
        handler = TensorRTModelHandler(scratch, digest=f"export-{os.getpid()}", device="cuda")
        loaded = handler.load_model()
        n = len(next(iter(feed.values())))
        got = handler.infer(loaded, Prepared(key=(0, 0), rows=n, features=dict(feed)))
        want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
        from .. import parity

        compared = parity.compare(want, got.outputs)
        diffs = {k: d for k, (_, d) in compared.items()}
        kls = {k: kl for k, (kl, _) in compared.items()}
        where = f"rows of {sample_job.spec.name}'s input"
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


# -- export --to onnx --quantize int8 ----------------------------------------------------------

QUANTIZE_ROWS = 4096       # sample rows the gate compares on
CALIBRATION_ROWS = 512     # of which the first ones calibrate a static quantization
MIN_COSINE = 0.99          # embeddings: each row's cosine with FP32 at least this
THRESHOLD = 0.5            # a thresholded score: the decision a flip changes
STATIC_OPS = ("MatMul", "Gemm", "Conv")   # what static quantization turns into INT8
DYNAMIC_OPS = ("MatMul", "Gemm", "Conv", "Attention")   # and dynamic quantization
# ONNX Runtime's integer compute ops (QOperator format; the QLinear* ops besides)
INTEGER_OPS = ("MatMulInteger", "ConvInteger", "QGemm", "QAttention", "DynamicQuantizeMatMul",
               "MatMulIntegerToFloat", "DynamicQuantizeLSTM")
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear")


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


def quantize_model(model: str | Path, out: str | Path, sample_job, *, method: str = "auto",
                   gate: Gate = Gate(), keep_fp32: Sequence[str] = (),
                   smooth: float | None = None) -> ExportReport:
    """``export MODEL.onnx --to onnx --quantize int8``: ONNX Runtime's INT8 quantization of
    ``model``, calibrated on (and compared with FP32 on) the sample job's rows prepared as a run
    prepares them, written with ``<out>.quantization.json`` only when the gate passes.

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
      rows. No range is computed at run time, and a QDQ model is what TensorRT's explicit
      quantization builds from (``export --to tensorrt`` of the QDQ file: TensorRT reads the
      Q/DQ scales instead of calibrating, and its INT8 engine is then gated as FP16's is). The
      same gate decides whether it ships.

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
    _check_onnx_input(model, sample_job, "--quantize", "the job's own rows calibrate the model "
                      "and check its parity")
    _check_out(model, out)
    if method not in ("auto", "static", "dynamic"):
        raise SpecError(f"--method {method!r}: choose auto, static or dynamic")
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
    import onnxruntime as ort

    from .. import parity
    from ..handlers.onnx import QUANTIZATION_SUFFIX

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    arrays = _job_sample(sample_job, names, QUANTIZE_ROWS)
    feed = {n: np.asarray(a, dtype=np.float32) if np.asarray(a).dtype == np.float64 else np.asarray(a)
            for n, a in zip(names, arrays)}
    rows = len(next(iter(feed.values())))
    calibration = ({n: a[:CALIBRATION_ROWS] for n, a in feed.items()}
                   if method == "static" or smooth is not None else {})
    out.parent.mkdir(parents=True, exist_ok=True)
    source, smoothing = (_smoothed(model, out, calibration, sample_job, smooth) if smooth is not None
                         else (str(model), {}))
    try:
        settings = _quantize(Path(source), out, method, calibration if method == "static" else {}, kept)
    finally:
        if source != str(model):
            os.unlink(source)
    settings.update(smoothing)
    if keep_fp32:
        settings["quantization_kept_fp32"] = f"{'|'.join(keep_fp32)} ({len(kept)} nodes)"
    scratch, written = settings.pop("_scratch"), None
    try:
        settings.update(_int8_settings(scratch, model, method, quantizable, kept))
        want = _score_as_a_run(str(model), feed, sample_job, "FP32")
        try:
            got = _score_as_a_run(scratch, feed, sample_job, "quantized")
        except ModelError as exc:
            raise ModelError(f"the quantized model does not run: {exc.message}") from None
        where = f"{rows} rows of {sample_job.spec.name}'s input"
        # shapes the graph left symbolic are known now: an option they make moot is still exit 2
        _check_gate_applies({k: _row_size(v) for k, v in want.items()}, gate, model.name,
                            "; nothing written")
        figures = _gate(parity, want, got, gate, where)
        facts: dict[str, Any] = {
            "precision": "int8", "quantization_method": method, **settings,
            "calibration_rows": len(next(iter(calibration.values()))) if calibration else 0,
            "calibration_sha256": _arrays_sha256(calibration) if calibration else "none (dynamic)",
            "sample": f"the first rows of {sample_job.spec.name}'s input, prepared as a run prepares them",
            "sample_sha256": _arrays_sha256(feed),
            "source_model_sha256": _file_sha256(model), **figures,
            "model_sha256": _file_sha256(Path(scratch))}
        # the record first: it names the model's sha256, so one left beside other bytes (a
        # crash between the renames) is refused by stamp, never taken for theirs
        record = Path(str(out) + QUANTIZATION_SUFFIX)
        written = _scratch(record)
        Path(written).write_text(json.dumps(facts, indent=2) + "\n")
        _publish(written, record)
        _publish(scratch, out)
        diffs = {k: parity.max_abs_diff(want[k], got[k]) for k in want}
        kls = {k: parity.output_kl(want[k], got[k]) for k in want}
        return ExportReport(out, _shapes(session.get_inputs()), _shapes(session.get_outputs()),
                            where, rows, diffs, kls, reference="ONNX Runtime FP32",
                            gate=figures)
    finally:
        for left in (scratch, written):
            if left is not None and os.path.exists(left):
                os.unlink(left)


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
    from ..handlers.onnx import OnnxModelHandler

    batch = job.spec.batch
    handler = OnnxModelHandler(model, digest=f"export-{what}-{os.getpid()}", device="cpu",
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


def _gate(parity, want: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray], gate: Gate,
          where: str) -> dict[str, Any]:
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
    figures: dict[str, Any] = {"parity_outputs": "; ".join(kinds), "parity_rows": len(next(iter(want.values()))),
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


def _arrays_sha256(arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over each array's name, dtype, shape and bytes, in name order."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name} {a.dtype.str} {list(a.shape)}\n".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
