"""The sample an export is checked on: rows of a job's input, prepared exactly as a run prepares
them (``--sample JOB.yaml``), and the ONNX model and sample job that ``--to tensorrt`` and
``--quantize`` need."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..errors import SpecError

SAMPLE_ROWS = 1024


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



def _check_onnx_input(model: Path, sample_job: Any, mode: str, why_sample: str) -> None:
    """An ONNX model file and a sample job, as ``export MODE`` needs them (exit 2 otherwise)."""
    if model.suffix.lower() != ".onnx":
        raise SpecError(f"export {mode} takes an ONNX model (.onnx), not {model.name}")
    if not model.is_file():
        raise SpecError(f"no model file {model}")
    if sample_job is None:
        raise SpecError(f"export {mode} needs --sample JOB.yaml: {why_sample}")
