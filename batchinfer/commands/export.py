"""``batchinfer export``: convert a model for a faster backend, and prove it still agrees (SPEC §2).

``--to onnx`` turns a ``torch.export`` program (``.pt2``) into an ONNX model with PyTorch's
exporter (``torch.onnx.export(..., dynamo=True)``, which keeps the batch axis dynamic), then
runs both on sample inputs — rows of a job's input prepared exactly as a run prepares them
(``--sample JOB.yaml``), or else the program's own example inputs — and writes the ONNX file
only when every output agrees within ``ONNX_TOLERANCE``. The model is written to a scratch name
beside ``--out`` and renamed into place, so a failed export leaves nothing behind.

``--to tensorrt`` needs TensorRT and a CUDA device; where they are missing it exits 5 saying so.
"""
from __future__ import annotations

import logging
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..errors import ModelError, SpecError, one_line

ONNX_TOLERANCE = 1e-5
SAMPLE_ROWS = 1024


@dataclass
class ExportReport:
    out: Path
    inputs: dict[str, tuple]       # ONNX input name → shape (symbolic dims as strings)
    outputs: dict[str, tuple]
    sample: str                    # where the sample inputs came from
    rows: int
    max_abs_diff: dict[str, float]


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
        _require_tensorrt()
        raise ModelError("export --to tensorrt is not implemented in this version")  # pragma: no cover
    if to != "onnx":
        raise SpecError(f"export --to {to!r}: choose onnx or tensorrt")
    if fp16:
        raise SpecError("--fp16 applies to --to tensorrt only")
    if model.suffix != ".pt2":
        raise SpecError(f"export --to onnx takes a torch.export program (.pt2), not {model.name}")
    if not model.is_file():
        raise SpecError(f"no model file {model}")
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
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".onnx", dir=out.parent)
    os.close(handle)
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
        os.replace(scratch, out)
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


def _job_sample(job, input_names: list[str]) -> list[np.ndarray]:
    """Up to SAMPLE_ROWS valid rows of the job's first readable shard, preprocessed as a run
    would (validation, then the job's preprocessing)."""
    from ..io.shards import ShardReader, Unreadable, list_shards
    from .resolve import resolve_inputs
    from .validate import validated_batches

    schema, _, preprocessor = resolve_inputs(job)
    for shard in list_shards(job.spec.input.path):
        try:
            result = next(validated_batches(ShardReader(shard.url), schema, SAMPLE_ROWS,
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


def _require(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ModelError(f"export needs {module}: pip install 'batchinfer[torch]'") from None


def _require_tensorrt() -> None:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise ModelError("export --to tensorrt needs TensorRT and a CUDA GPU: install "
                         "'batchinfer[gpu]' on a machine with one") from None
