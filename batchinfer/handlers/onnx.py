"""ONNX Runtime backend: CPU, CUDA and TensorRT execution providers.

``onnxruntime`` is imported only when a model is loaded. Session options come from the job's
``model.options``, whose keys and types the backend's entry in :mod:`batchinfer.backends`
declares (a typo is an error, not a silent default); their values are checked here.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np

from ..errors import ModelError, PreprocessError, SpecError, one_line
from .base import BatchModelHandler

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


def providers_for(device: str, options: dict[str, Any]) -> tuple[list[str], str]:
    """The execution providers to ask for, and the device they give ("cpu", "cuda:0")."""
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
    if device == "cuda" and not has_cuda:
        raise ModelError("model.device is cuda but ONNX Runtime has no CUDA provider here: install "
                         "onnxruntime-gpu (not beside onnxruntime) or set model.device: cpu")
    if device in ("cuda", "auto") and has_cuda:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"], "cuda:0"
    return ["CPUExecutionProvider"], "cpu"


GRAPH_LEVELS = ("disable", "basic", "extended", "all")


class OnnxModelHandler(BatchModelHandler[Any]):
    """Runs an ONNX model (a local ``.onnx`` file, external data beside it) with ONNX Runtime;
    the loaded model is an ``onnxruntime.InferenceSession``."""

    backend = "onnxruntime"

    def __init__(self, model_path: str, *, digest: str, device: str = "auto",
                 options: Optional[dict[str, Any]] = None):
        super().__init__(model_path, digest=digest, device=device, options=options)
        level = self.options.get("graph_optimization_level", "all")
        if level not in GRAPH_LEVELS:
            raise SpecError(f"model.options.graph_optimization_level: {level!r} is not one of "
                            f"{', '.join(GRAPH_LEVELS)}")

    def open_model(self) -> Any:
        import onnxruntime as ort

        so = ort.SessionOptions()
        # ONNX Runtime writes its warnings (unused initializers, say) straight to stderr, around
        # the one line an error gets (SPEC §2); batchinfer's --debug turns them back on.
        so.log_severity_level = 2 if logging.getLogger("batchinfer").isEnabledFor(logging.DEBUG) else 3
        if "intra_op_num_threads" in self.options:
            so.intra_op_num_threads = self.options["intra_op_num_threads"]
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
        providers, _ = providers_for(self.device, self.options)
        try:
            return ort.InferenceSession(self.model_path, sess_options=so, providers=providers)
        except Exception as exc:
            raise ModelError(f"ONNX Runtime cannot load {self.model_path}: {one_line(exc)}") from None

    def default_chunk_rows(self, model: Any) -> Optional[int]:
        return CPU_CHUNK_ROWS if model.get_providers()[:1] == ["CPUExecutionProvider"] else None

    def device_used(self, model: Any) -> str:
        gpu = model.get_providers()[:1] in (["CUDAExecutionProvider"], ["TensorrtExecutionProvider"])
        return "cuda:0" if gpu else "cpu"

    def input_names(self, model: Any) -> list[str]:
        return [i.name for i in model.get_inputs()]

    def output_names(self, model: Any) -> list[str]:
        return [o.name for o in model.get_outputs()]

    def predict(self, model: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {}
        for meta in model.get_inputs():
            value = inputs[meta.name]
            want = _ORT_TYPES.get(meta.type)
            if want is not None and want is not np.object_ and value.dtype != want:
                # float64 → float32 is what users mean; float → int64 would truncate token ids
                # or counts without a word, so only casts within a kind are made.
                if not np.can_cast(value.dtype, want, casting="same_kind"):
                    raise PreprocessError(
                        f"preprocessing returned {value.dtype} for model input {meta.name!r}, "
                        f"which takes {np.dtype(want).name}: return {np.dtype(want).name} (a "
                        f"cast from {value.dtype} could change values); nothing committed")
                value = value.astype(want)
            feed[meta.name] = value
        names = self.output_names(model)
        return dict(zip(names, model.run(names, feed)))
