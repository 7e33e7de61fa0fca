"""``batchinfer export``: convert a model for a faster backend, and prove it still agrees (contract §2).

``--to onnx`` turns a ``torch.export`` program (``.pt2``) into an ONNX model with PyTorch's
exporter (``torch.onnx.export(..., dynamo=True)``, which keeps the batch axis dynamic), then
runs both on sample inputs — rows of a job's input prepared exactly as a run prepares them
(``--sample JOB.yaml``), or else the program's own example inputs — and writes the ONNX file
only when every output agrees within ``ONNX_TOLERANCE``.

Every export writes to a scratch name beside ``--out`` (its folder: the rename stays atomic) and
renames it into place only once parity holds, records first, so a failed export or a crash
leaves ``--out`` as it was, never part of a file. An ``--out`` that would replace what is not
the export's to replace — the model being exported, a stamped model, a declaration or record, a
folder — is refused before any work (both: :mod:`~batchinfer.convert.written`).

``--to tensorrt`` (:mod:`~batchinfer.convert.tensorrt_engine`) builds a TensorRT engine from an
``.onnx`` model with one optimisation profile
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
with ``<out>.quantization.json`` (precision, settings, how its sample was drawn and its digest,
the gate's figures: what ``stamp`` declares), only when its outputs on the job's rows stay
within the gate (:mod:`~batchinfer.convert.quantize`, its gate :mod:`~batchinfer.convert.int8_gate`).

Every sample of a job's rows is drawn from every readable shard of its input, seeded
(:mod:`~batchinfer.convert.samples`; ``--sample-rows``, ``--sample-seed``).
"""
from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelError, SpecError, one_line
from .samples import SampleSize, _job_sample
from .tensorrt_engine import _to_tensorrt
from .written import ExportReport, _check_out, _publish, _scratch, _shapes

ONNX_TOLERANCE = 1e-5


def export_model(model: str | Path, to: str, out: str | Path, *, fp16: bool = False,
                 sample_job=None, sample: SampleSize = SampleSize()) -> ExportReport:
    """Convert ``model``; see the module docstring.

    Args:
        sample_job: a loaded :class:`~batchinfer.spec.Job` whose input supplies sample rows.
        sample: how many rows, drawn with which seed, from every shard of its input.

    Raises:
        SpecError: a model or target this command does not convert.
        ModelError: a missing library or device, a failed conversion, or outputs that disagree
            (nothing is written then).
    """
    model, out = Path(model), Path(out)
    if to == "tensorrt":
        return _to_tensorrt(model, out, fp16, sample_job, sample)
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
        drawn = _job_sample(sample_job, _input_names(program), sample)
        arrays, where = drawn.arrays, drawn.where()
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


def _require(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ModelError(f"export needs {module}: pip install 'batchinfer[torch]'") from None
