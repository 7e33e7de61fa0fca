"""PyTorch backend: ``torch.export`` programs (``.pt2``) on CPU or CUDA.

A ``.pt2`` file is a serialized ``ExportedProgram`` (``torch.export.save``): a graph of ATen
operators and its weights, loaded with ``torch.export.load`` — no pickled Python objects and no
model class to import, which is why it is the PyTorch format batchinfer accepts (pickle-based
``.pt``/``.pth`` stay refused, contract §5.6).

Inputs are the program's positional inputs by name (``graph_signature.user_inputs``); outputs
are named as PyTorch's ONNX exporter names them (``graph_signature.user_outputs``, e.g.
``sigmoid``), so a program and its ``batchinfer export --to onnx`` twin give the same prediction
columns and a job moves between backends by changing ``model.uri`` and ``model.backend`` only.

``model.options.precision`` (``fp32`` | ``fp16`` | ``bf16``) runs the program under
``torch.autocast``. Precision changes predictions, so it is declared: ``stamp`` records it and a
run with another precision is a contract mismatch (exit 3). Reduced-precision outputs come back
as float32, so a column's type does not depend on the precision.

On CUDA each chunk's inputs are copied into pinned host buffers that are allocated once and
reused, sent to the device with non-blocking copies on the handler's own stream, and the outputs
copied back on the same stream before it is synchronised. The buffers and the stream are the
model's, shared by the threads that share the model, so the calls on one model take turns
(``thread_safe = False``). (Overlapping the next chunk's copy
with the current chunk's compute is left out until it is measured on a GPU: at the bench model's
sizes a chunk's copy is a small part of its time.)

``torch`` is imported only here, when a job with ``backend: torch`` loads its model.
"""
from __future__ import annotations

import os
import sys
import warnings
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

import numpy as np

from ..errors import ModelError, ModelFileError, SpecError, one_line
from .protocol import ModelFacts, cast_input, require

# Rows per call on CPU, as for ONNX Runtime: intermediate activations stay in cache. Measured on
# the bench MLP (32-256-256-1), one 65,536-row batch in calls of 1,024 / 4,096 / 16,384 / 65,536
# rows: 302 / 196 / 251 / 383 ms.
CPU_CHUNK_ROWS = 4096
# Points (rows × integration steps) per attribution call: a batch's worth of one model call.
IG_POINTS = 65536


@dataclass
class TorchModel:
    """A loaded program: the callable module, where it runs, and its I/O."""

    module: Any
    device: Any                      # torch.device
    inputs: list[str]
    outputs: list[str]
    input_dtypes: dict[str, Any]     # numpy dtype each input takes (None: unknown, passed as is)
    autocast: Any                    # torch dtype, or None for fp32
    stream: Any = None               # torch.cuda.Stream on CUDA
    pinned: dict[str, Any] = field(default_factory=dict)   # input name → reusable pinned buffer
    shapes: dict[str, tuple] = field(default_factory=dict)  # input name → shape past the rows


class TorchBackend:
    """Runs a ``torch.export`` program (the model protocol of handlers/protocol.py); see the
    module docstring."""

    name = "torch"
    # Not thread-safe on CUDA: every call stages its inputs in the model's one set of pinned
    # buffers and runs on its one stream, so a second thread would overwrite a buffer that a
    # non-blocking copy is still reading and synchronise on the other's work. On CPU the program's
    # forward keeps no state, but each call already runs on every core (intra-op threads), so
    # taking turns costs little there: the calls are serialised on both (sharing.call_lock).
    thread_safe = False

    def __init__(self, *, device: str = "auto", options: Optional[Mapping[str, Any]] = None):
        self.device = device
        self.options = dict(options or {})

    @property
    def precision(self) -> str:
        return self.options.get("precision", "fp32")   # the choices are checked by the registry

    def load(self, path: str) -> TorchModel:
        if not zipfile.is_zipfile(path):
            # Not the format at all: the same bytes fail on every retry (exit 2). A zip that
            # torch refuses may be a version skew or the device, so it stays a runtime failure.
            raise ModelFileError(f"{path} is not a torch.export program (torch.export.save "
                                 f"writes a zip archive): point model.uri at a .pt2 it wrote")
        with _passive_openmp():
            torch = require(self.name, "torch")
        device = _device(torch, self.device)
        if "intra_op_num_threads" in self.options and self.options["intra_op_num_threads"] > 0:
            torch.set_num_threads(self.options["intra_op_num_threads"])
        if self.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ModelError(f"model.options.precision is bf16 but {torch.cuda.get_device_name(device)} "
                             f"does not support bfloat16: use fp16 or fp32")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                program = torch.export.load(path)
                if device.type != "cpu":
                    from torch.export.passes import move_to_device_pass

                    program = move_to_device_pass(program, device)
                module = program.module()
        except Exception as exc:
            raise ModelError(f"torch cannot load {path} as a torch.export program: "
                             f"{one_line(exc)}") from None
        signature = program.graph_signature
        inputs = list(signature.user_inputs)
        outputs = list(signature.user_outputs)
        dtypes = {}
        shapes = {}
        for node in program.graph.nodes:
            if node.op == "placeholder" and node.name in inputs:
                value = node.meta.get("val")
                dtypes[node.name] = _numpy_dtype(torch, value.dtype) if value is not None else None
                if value is not None and len(value.shape) >= 1:
                    # An int is a size the program was exported with fixed; a SymInt a dynamic
                    # dim, named by its symbol (shared by inputs torch.export found equal).
                    shapes[node.name] = tuple(d if isinstance(d, int) else str(d)
                                              for d in value.shape[1:])
        autocast = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[self.precision]
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        return TorchModel(module, device, inputs, outputs, dtypes, autocast, stream, shapes=shapes)

    def facts(self, model: TorchModel) -> ModelFacts:
        device = model.device
        return ModelFacts(inputs=model.inputs, outputs=model.outputs, input_shapes=model.shapes,
                          device=f"cuda:{device.index or 0}" if device.type == "cuda" else "cpu",
                          default_chunk_rows=CPU_CHUNK_ROWS if device.type == "cpu" else None)

    def is_out_of_memory(self, exc: BaseException) -> bool:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # what the failed call held goes back before the retry
            return True
        return False

    def predict(self, model: TorchModel, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        args = [self._tensor(torch, model, name, inputs[name]) for name in model.inputs]
        with torch.inference_mode():
            if model.stream is None:
                return self._outputs(torch, model, self._call(torch, model, args))
            with torch.cuda.stream(model.stream):
                results = self._call(torch, model, args)
                host = [r.to("cpu", non_blocking=True) for r in results]
            model.stream.synchronize()
            return self._outputs(torch, model, host)

    gradients = True

    def attribute(self, model: TorchModel, name: str, x: np.ndarray, baseline: np.ndarray,
                  output: str, method: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Integrated gradients (Captum's ``IntegratedGradients``, Gauss-Legendre steps, its
        convergence delta as the gap) or gradient × (input − baseline), in chunks of rows that
        keep ``rows × steps`` near one batch's worth of points; see handlers/protocol.py."""
        import torch

        if len(model.inputs) != 1:
            raise SpecError(f"explain attributes a model with one input; this one takes "
                            f"{model.inputs}")
        index = model.outputs.index(output)

        def forward(t):
            out = self._call(torch, model, [t])[index].reshape(t.shape[0], -1)
            if out.shape[1] != 1:
                raise SpecError(f"explain.output {output!r} has {out.shape[1]} values per row: "
                                f"explain explains one score per row")
            return out[:, 0].float()

        if method == "integrated_gradients":
            try:
                from captum.attr import IntegratedGradients
            except ImportError:
                raise ModelError("explain.method integrated_gradients needs captum, which is not "
                                 "installed: pip install 'batchinfer[explain]'") from None
            explainer = IntegratedGradients(forward)
        chunk = max(1, IG_POINTS // max(steps, 1)) if method == "integrated_gradients" else IG_POINTS
        values, gaps = [], []
        for start in range(0, x.shape[0], chunk):
            # A plain synchronous copy, not _tensor's pinned staging on the model's stream: the
            # attribution runs on the current stream, and needs a tensor of its own to grad.
            xt = torch.tensor(self._cast(model, name, x[start:start + chunk]), device=model.device)
            bt = torch.as_tensor(baseline, dtype=xt.dtype, device=xt.device).expand_as(xt)
            with torch.enable_grad():
                if method == "integrated_gradients":
                    attr, delta = explainer.attribute(xt, baselines=bt, n_steps=steps,
                                                      method="gausslegendre",
                                                      return_convergence_delta=True)
                    gap = delta
                else:
                    xt.requires_grad_(True)
                    (grad,) = torch.autograd.grad(forward(xt).sum(), xt)
                    attr = grad * (xt - bt)
                    gap = torch.zeros(xt.shape[0])
            values.append(attr.detach().double().cpu().numpy())
            gaps.append(gap.detach().double().cpu().numpy())
        return np.concatenate(values), np.concatenate(gaps)

    # -- helpers ----------------------------------------------------------------------------
    def _call(self, torch, model: TorchModel, args: list) -> list:
        if model.autocast is None:
            out = model.module(*args)
        else:
            with torch.autocast(device_type=model.device.type, dtype=model.autocast):
                out = model.module(*args)
        flat, _ = torch.utils._pytree.tree_flatten(out)
        if len(flat) != len(model.outputs):
            raise ModelError(f"the program returned {len(flat)} tensors but declares outputs "
                             f"{model.outputs}; nothing committed")
        return flat

    def _outputs(self, torch, model: TorchModel, tensors: list) -> dict[str, np.ndarray]:
        result = {}
        for name, tensor in zip(model.outputs, tensors):
            if tensor.dtype in (torch.float16, torch.bfloat16):
                tensor = tensor.float()
            result[name] = tensor.detach().cpu().numpy()
        return result

    def _cast(self, model: TorchModel, name: str, value: np.ndarray) -> np.ndarray:
        want = model.input_dtypes.get(name)
        if want is not None:
            value = cast_input(name, value, want)
        return np.ascontiguousarray(value)

    def _tensor(self, torch, model: TorchModel, name: str, value: np.ndarray):
        value = self._cast(model, name, value)
        with warnings.catch_warnings():
            # Arrow hands out read-only arrays; torch warns that writing through them would be
            # undefined. Nothing writes to an input.
            warnings.simplefilter("ignore", UserWarning)
            host = torch.from_numpy(value)
        if model.stream is None:
            return host
        # Flat, so that a call of another shape reuses it (calls sized by tokens change the
        # sequence length every call); pinning memory costs far more than copying into it.
        buffer = model.pinned.get(name)
        if buffer is None or buffer.numel() < host.numel() or buffer.dtype != host.dtype:
            buffer = torch.empty(host.numel(), dtype=host.dtype, pin_memory=True)
            model.pinned[name] = buffer
        staged = buffer[: host.numel()].view(host.shape)
        staged.copy_(host)
        with torch.cuda.stream(model.stream):
            return staged.to(model.device, non_blocking=True)


@contextmanager
def _passive_openmp() -> Iterator[None]:
    """``OMP_WAIT_POLICY=PASSIVE`` while torch is first imported, unless the user set it.

    torch's OpenMP threads busy-wait between calls by default; beside the pipeline's own threads
    (Arrow, the writer) that starves them. Measured on 2 cores with the machine busy: the bench
    MLP's 4,096-row call took 37-40 ms spinning, 9-11 ms passive (ONNX Runtime: 8 ms, its
    spinning off too). OpenMP (the libgomp torch ships) reads the variable once, when the library
    loads at ``import torch`` (checked with ``OMP_DISPLAY_ENV``, which it prints then): so it is
    set for the import only, and the process's environment — which child processes inherit — is
    left as it was. Once torch is imported there is nothing left to set.
    """
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


def _device(torch, wanted: str):
    """The torch device for ``model.device`` (``auto``: CUDA when torch sees one)."""
    if wanted == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if wanted == "cuda":
        why = ("this torch was built without CUDA" if torch.version.cuda is None
               else "torch sees no CUDA device")
        raise ModelError(f"model.device is cuda but {why} (torch {torch.__version__}): run on a GPU "
                         f"machine with a CUDA build of torch, or set model.device: cpu")
    return torch.device("cpu")


def _numpy_dtype(torch, dtype) -> Any:
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:   # bfloat16 and friends have no numpy type: pass the array as it is
        return None
