"""ONNX Runtime backend: CPU, CUDA and TensorRT execution providers (the model protocol of
handlers/protocol.py: ``load``, ``facts``, ``predict``).

``onnxruntime`` is imported only when a model is loaded. Session options come from the job's
``model.options``, whose keys and types the backend's entry in :mod:`batchinfer.backends`
declares (a typo is an error, not a silent default); their values are checked here.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from ..errors import ModelError, SpecError, one_line
from .protocol import ModelFacts, cast_input

# Rows per session.run on the CPU provider. A whole 65,536-row batch makes every intermediate
# activation of a 256-wide MLP 64 MB, which goes out to memory and back between layers; in
# 4,096-row calls it stays in cache. Measured here (bench/README.md): the bench MLP runs ~30%
# faster at 2,048-4,096 rows than at 65,536; a 64-wide MLP ~20% faster; a 1,024-wide one (bound
# by compute, not memory) within noise. GPU providers get the whole batch.
CPU_CHUNK_ROWS = 4096
_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_, "tensor(string)": np.object_,
}


# Beside a model that ``export --quantize int8`` wrote: how it was quantized, on what sample,
# and the parity gate's figures (contract §2). ``stamp`` copies it into the declaration.
QUANTIZATION_SUFFIX = ".quantization.json"


def quantization_facts(model_path: str) -> dict[str, str]:
    """The facts ``export --quantize`` recorded beside ``model_path`` ({} if none), as the
    declaration's strings.

    Raises:
        SpecError: the record is unreadable, or was written for other model bytes.
    """
    record = Path(model_path + QUANTIZATION_SUFFIX)
    if not record.is_file():
        return {}
    try:
        data = json.loads(record.read_text())
    except ValueError:
        raise SpecError(f"{record} is not valid JSON: export the model again") from None
    h = hashlib.sha256()
    with open(model_path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    if data.get("model_sha256") != h.hexdigest():
        raise SpecError(f"{record} was written for other bytes than {Path(model_path).name}'s "
                        f"(the model changed since export --quantize): export it again")
    return {str(k): str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in data.items() if isinstance(v, (str, int, float)) and k != "model_sha256"}


def _dim(value: Any) -> int | str | None:
    """An ONNX Runtime input dim: its size, its symbolic name (``dim_param``), or None when it
    has neither. ``unk__N`` names are made up by shape inference, one per dim, so they say
    nothing about which dims are equal: unnamed too."""
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and value and not value.startswith("unk__"):
        return value
    return None


def providers_for(device: str, options: dict[str, Any], model_path: str = "") -> tuple[list, str]:
    """The execution providers to ask for, and the device they give ("cpu", "cuda:0").

    With ``tensorrt: true`` (CUDA only) the TensorRT provider comes first; it builds an engine
    per input shape on first use, so its engines are cached in ``<model>.trt_cache/`` beside the
    model and reused by the next run (the model's digest does not cover the cache: the cache is
    keyed by the model's bytes inside ONNX Runtime)."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if options.get("providers"):
        wanted = list(options["providers"])
        missing = [p for p in wanted if p not in available]
        if missing:
            raise ModelError(f"execution providers {missing} are not available here "
                             f"(available: {available})")
        gpu = any(p in ("CUDAExecutionProvider", "TensorrtExecutionProvider") for p in wanted)
        return wanted, "cuda:0" if gpu else "cpu"
    has_cuda = "CUDAExecutionProvider" in available
    if (device == "cuda" or options.get("tensorrt")) and not has_cuda:
        what = "model.options.tensorrt is true" if options.get("tensorrt") else "model.device is cuda"
        raise ModelError(f"{what} but ONNX Runtime has no CUDA provider here: install "
                         f"onnxruntime-gpu (not beside onnxruntime) on a GPU machine, or set "
                         f"model.device: cpu")
    if device == "cpu" and options.get("tensorrt"):
        raise SpecError("model.options.tensorrt needs model.device cuda or auto, not cpu")
    if device in ("cuda", "auto") and has_cuda:
        providers: list = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        if options.get("tensorrt"):
            if "TensorrtExecutionProvider" not in available:
                raise ModelError("model.options.tensorrt is true but this ONNX Runtime has no "
                                 "TensorRT provider (it needs onnxruntime-gpu and TensorRT's "
                                 "libraries): pip install 'batchinfer[gpu]'")
            cache = f"{model_path}.trt_cache"
            providers.insert(0, ("TensorrtExecutionProvider", {
                "trt_engine_cache_enable": True, "trt_engine_cache_path": cache,
                "trt_timing_cache_enable": True, "trt_timing_cache_path": cache}))
        return providers, "cuda:0"
    return ["CPUExecutionProvider"], "cpu"


@dataclass
class OnnxModel:
    """A loaded model: the ``onnxruntime.InferenceSession`` and what every call asks of it."""

    session: Any
    inputs: list[tuple[str, Any]]    # each input's name and the numpy dtype it takes (or None)
    outputs: list[str]
    device: str
    io_binding: bool
    call_threads: int = 1


def cpu_call_threads(options: Mapping[str, Any]) -> int:
    """How many ``session.run`` calls a CPU session takes at once (``call_threads``).

    By default one per core the process may run on, each call on one intra-op thread: the bench
    MLP's 4,096-row calls then cost ~10 % less CPU than one call at a time on two threads (which
    wait for each other at every operator), and a thread that the pipeline's reading or writing
    takes a core from slows its own call only. A job that sets ``intra_op_num_threads`` alone
    keeps one call at a time, as before ``call_threads`` existed.

    Raises:
        SpecError: ``call_threads`` below 1.
    """
    if "call_threads" in options:
        threads = options["call_threads"]
        if threads < 1:
            raise SpecError(f"model.options.call_threads must be at least 1, not {threads}")
        return int(threads)
    if "intra_op_num_threads" in options:
        return 1
    return max(1, len(os.sched_getaffinity(0)))


class OnnxBackend:
    """Runs an ONNX model (a local ``.onnx`` file, external data beside it) with ONNX Runtime."""

    name = "onnxruntime"
    # ONNX Runtime guarantees that threads may call run() on one InferenceSession at once (its
    # TensorRT provider locks its own engine for it, onnxruntime#19301), and predict keeps nothing
    # between calls: the feed, and the IO binding, are made per call.
    thread_safe = True

    def __init__(self, *, device: str = "auto", options: Optional[Mapping[str, Any]] = None):
        self.device = device
        self.options = dict(options or {})

    @classmethod
    def build_facts(cls, model_path: str) -> dict[str, str]:
        # a quantized model declares its precision (int8), calibration sample and gate figures
        return quantization_facts(model_path)

    def load(self, path: str) -> OnnxModel:
        import onnxruntime as ort

        so = ort.SessionOptions()
        # ONNX Runtime writes its warnings (unused initializers, say) straight to stderr, around
        # the one line an error gets (contract §2); batchinfer's --debug turns them back on.
        so.log_severity_level = 2 if logging.getLogger("batchinfer").isEnabledFor(logging.DEBUG) else 3
        providers, device = providers_for(self.device, self.options, path)
        call_threads = cpu_call_threads(self.options) if device == "cpu" else 1
        if "intra_op_num_threads" in self.options:
            so.intra_op_num_threads = self.options["intra_op_num_threads"]
        elif call_threads > 1:
            so.intra_op_num_threads = 1   # each of the calls at once on a thread of its own
        if "inter_op_num_threads" in self.options:
            so.inter_op_num_threads = self.options["inter_op_num_threads"]
        if "enable_cpu_mem_arena" in self.options:
            so.enable_cpu_mem_arena = self.options["enable_cpu_mem_arena"]
        # ONNX Runtime's threads spin between runs by default. Between our runs the pipeline
        # decodes, validates and writes on the same cores (Arrow's and the writer's threads), so
        # spinning takes CPU from them: measured at 8M rows, ~25% more CPU for no gain in wall.
        so.add_session_config_entry("session.intra_op.allow_spinning",
                                    "1" if self.options.get("allow_spinning", False) else "0")
        level = self.options.get("graph_optimization_level", "all")
        so.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[level]
        try:
            session = ort.InferenceSession(path, sess_options=so, providers=providers)
        except Exception as exc:
            raise ModelError(f"ONNX Runtime cannot load {path}: {one_line(exc)}") from None
        gpu = session.get_providers()[:1] in (["CUDAExecutionProvider"], ["TensorrtExecutionProvider"])
        device = "cuda:0" if gpu else "cpu"
        wanted = self.options.get("io_binding")
        inputs = []
        for meta in session.get_inputs():
            want = _ORT_TYPES.get(meta.type)
            inputs.append((meta.name, want if want is not np.object_ else None))
        return OnnxModel(session, inputs, [o.name for o in session.get_outputs()], device,
                         device != "cpu" if wanted is None else bool(wanted),
                         call_threads if device == "cpu" else 1)

    def facts(self, model: OnnxModel) -> ModelFacts:
        session = model.session
        cpu = session.get_providers()[:1] == ["CPUExecutionProvider"]
        # An input of unknown rank reports [] (a scalar too): left out, so unknown.
        shapes = {i.name: tuple(_dim(d) for d in i.shape[1:]) for i in session.get_inputs() if i.shape}
        return ModelFacts(inputs=[name for name, _ in model.inputs], outputs=model.outputs,
                          input_shapes=shapes, device=model.device,
                          default_chunk_rows=CPU_CHUNK_ROWS if cpu else None,
                          call_threads=model.call_threads if cpu else 1)

    def predict(self, model: OnnxModel, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {}
        for name, want in model.inputs:
            value = inputs[name]
            if want is not None:
                value = cast_input(name, value, want)
            feed[name] = value
        names = model.outputs
        session = model.session
        if not model.io_binding:
            return dict(zip(names, session.run(names, feed)))
        # IO binding: inputs are copied to the device once, outputs are allocated by ONNX
        # Runtime on the provider's device and copied back once, instead of going through
        # run()'s per-call host staging.
        binding = session.io_binding()
        for name, value in feed.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for name in names:
            binding.bind_output(name)
        session.run_with_iobinding(binding)
        return dict(zip(names, binding.copy_outputs_to_cpu()))
