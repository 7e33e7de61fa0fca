"""TensorRT backend: serialized engines (``.engine`` / ``.plan``) with the TensorRT >= 10 API.

An engine is compiled for one TensorRT version and one GPU architecture; loaded anywhere else it
fails to deserialize or, worse, runs kernels tuned for another chip. So its build facts — the
TensorRT version and the GPU's compute capability — are part of the model's declaration
(``stamp`` records them from the ``<engine>.build.json`` that ``batchinfer export --to tensorrt``
writes, or from this machine), and a run on another runtime or GPU exits 5 before any work,
naming both (``runtime_facts``, checked by the run before the engine is touched).

Per model copy: one execution context, one CUDA stream, and device buffers for every I/O
tensor allocated once at the optimisation profile's maximum shape and reused for every call
(named I/O tensors, ``set_input_shape`` + ``set_tensor_address`` + ``execute_async_v3``). The
profile's max batch is the model-call chunk (``model.options.chunk_rows`` can lower it), and the
batch axis is dynamic between the profile's min and max. CUDA memory and streams come from
torch, which the ``gpu`` extra installs beside TensorRT.

The threads of a worker share one model copy, and with it that context, its buffers and its
stream: their calls take turns (``thread_safe = False``, the lock of handlers/sharing.py), as in
Beam's TensorRT handler. A context per thread (with its own buffers and stream) would let calls
overlap on the GPU, but each context holds its own activation memory and buffers at the
profile's maximum, so the memory grows with the number of SDK threads per process, for a
gain nobody has measured: left out until it is measured on a GPU.

Nothing here has run on this project's CI machines (no GPU, no TensorRT): the conformance
suite's ``tensorrt`` cases and ``bench/gpu_check.sh`` run it where both are present.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from ..errors import ModelError, SpecError, one_line
from .protocol import ModelFacts, cast_input, require

BUILD_SUFFIX = ".build.json"   # beside the engine: what export --to tensorrt built it with


@dataclass
class TrtModel:
    engine: Any
    context: Any
    stream: Any                       # torch.cuda.Stream
    inputs: list[str]
    outputs: list[str]
    dtypes: dict[str, Any]            # tensor name → numpy dtype
    buffers: dict[str, Any]           # tensor name → torch device tensor at the profile's max shape
    max_batch: int
    device: str
    shapes: dict[str, tuple] = field(default_factory=dict)   # input → declared shape past the rows
    path: str = ""                    # the engine file, for messages


class TensorRTBackend:
    """Runs a serialized TensorRT engine (the model protocol of handlers/protocol.py); see the
    module docstring."""

    name = "tensorrt"
    # Not thread-safe: predict sets the input shapes and the tensor addresses on the model's one
    # execution context and stages through its one set of device buffers on its one stream;
    # calls take turns (sharing.call_lock), as Beam's own TensorRT handler holds a lock around
    # execution. See the module docstring for why not a context per thread.
    thread_safe = False

    def __init__(self, *, device: str = "auto", options: Optional[Mapping[str, Any]] = None):
        self.device = device
        self.options = dict(options or {})

    @classmethod
    def build_facts(cls, model_path: str) -> dict[str, str]:
        built = Path(model_path + BUILD_SUFFIX)
        if built.is_file():
            data = json.loads(built.read_text())
            return {"tensorrt_version": str(data["tensorrt_version"]),
                    "compute_capability": str(data["compute_capability"]),
                    "precision": str(data.get("precision") or ("fp16" if data.get("fp16") else "fp32"))}
        # an engine built elsewhere (trtexec, say): stamped where it was built, it runs there
        return _here()

    def runtime_facts(self) -> dict[str, str]:
        return _here()

    def load(self, path: str) -> TrtModel:
        trt = require(self.name, "tensorrt")
        torch = require(self.name, "torch")
        if not torch.cuda.is_available():
            raise ModelError("backend tensorrt needs a CUDA GPU and this machine has none (torch "
                             "sees no CUDA device)")
        logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(Path(path).read_bytes())
        if engine is None:
            raise ModelError(f"TensorRT {trt.__version__} cannot deserialize {path} (an "
                             f"engine built by another TensorRT version or for another GPU?)")
        context = engine.create_execution_context()
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if n not in inputs]
        dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}
        # The network's shapes: -1 for a dim the optimisation profile leaves dynamic (unnamed).
        shapes = {n: tuple(int(d) if d >= 0 else None for d in tuple(engine.get_tensor_shape(n))[1:])
                  for n in inputs}
        # the profile's max shape for every input; outputs follow from the inputs' shapes
        max_batch = None
        for name in inputs:
            _, _, largest = engine.get_tensor_profile_shape(name, 0)
            context.set_input_shape(name, tuple(largest))
            max_batch = largest[0] if max_batch is None else min(max_batch, largest[0])
        device = torch.device("cuda", torch.cuda.current_device())
        buffers = {}
        for name in names:
            shape = tuple(context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise ModelError(f"{path}: tensor {name!r} has no fixed shape at the "
                                 f"profile's maximum ({shape})")
            buffers[name] = torch.empty(shape, dtype=_torch_dtype(torch, dtypes[name]), device=device)
        return TrtModel(engine, context, torch.cuda.Stream(device), inputs, outputs, dtypes, buffers,
                        int(max_batch or 1), f"cuda:{device.index}", shapes, path)

    def facts(self, model: TrtModel) -> ModelFacts:
        return ModelFacts(inputs=model.inputs, outputs=model.outputs, input_shapes=model.shapes,
                          device=model.device, default_chunk_rows=model.max_batch)

    def is_out_of_memory(self, exc: BaseException) -> bool:
        return "out of memory" in str(exc).lower()

    def predict(self, model: TrtModel, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        rows = len(next(iter(inputs.values())))
        if rows > model.max_batch:   # chunk_rows set above the engine's profile: the job's mistake
            raise SpecError(f"{rows} rows per call exceed the engine's profile (max batch "
                             f"{model.max_batch}): lower model.options.chunk_rows or rebuild the "
                             f"engine with `batchinfer export --to tensorrt`")
        context = model.context
        with torch.cuda.stream(model.stream):
            for name in model.inputs:
                value = np.ascontiguousarray(cast_input(name, inputs[name], model.dtypes[name]))
                device = _front(model.buffers[name], value.shape)
                device.copy_(torch.from_numpy(value), non_blocking=True)
                context.set_input_shape(name, tuple(value.shape))
                context.set_tensor_address(name, device.data_ptr())
            views = {}
            for name in model.outputs:
                shape = tuple(context.get_tensor_shape(name))
                views[name] = _front(model.buffers[name], shape)
                context.set_tensor_address(name, views[name].data_ptr())
            if not context.execute_async_v3(model.stream.cuda_stream):
                raise ModelError(f"TensorRT failed to run {model.path} on {rows} rows")
            host = {name: view.to("cpu", non_blocking=True) for name, view in views.items()}
        model.stream.synchronize()
        return {name: tensor.numpy() for name, tensor in host.items()}


def _front(buffer: Any, shape: tuple) -> Any:
    """A contiguous ``shape`` view of the front of ``buffer`` (allocated at the profile's max
    shape): a call may be smaller on any axis — fewer rows, or a shorter sequence when calls
    are sized by tokens — and TensorRT reads a dense tensor of the call's shape at the address."""
    return buffer.view(-1)[: int(np.prod(shape))].view(shape)


def _here() -> dict[str, str]:
    """This machine's TensorRT version and GPU compute capability."""
    try:
        import tensorrt as trt
        import torch
    except ImportError as exc:
        raise ModelError(f"backend tensorrt needs {exc.name}, which is not installed: pip install "
                         f"'batchinfer[gpu]' on a machine with an NVIDIA GPU") from None
    if not torch.cuda.is_available():
        raise ModelError("backend tensorrt needs a CUDA GPU and this machine has none (torch sees "
                         "no CUDA device)")
    try:
        major, minor = torch.cuda.get_device_capability()
    except Exception as exc:
        raise ModelError(f"cannot read the GPU's compute capability: {one_line(exc)}") from None
    return {"tensorrt_version": trt.__version__, "compute_capability": f"{major}.{minor}"}


def _torch_dtype(torch, dtype: np.dtype):
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
