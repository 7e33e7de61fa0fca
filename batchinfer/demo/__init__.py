"""The credit-risk demo that ``batchinfer demo`` writes and scores.

:func:`write_demo` lays out a complete, self-contained job folder: the job file, the
``credit_features@1`` schema, the preprocessing module, one partition of synthetic Parquet data
and an ONNX model trained on the spot (see :mod:`batchinfer.demo.train`). The job file, schema
and preprocessing module are package data, copied byte for byte, so this works from an
installed wheel; the data and model are generated deterministically from ``seed``. Stamping
and scoring are left to the caller (:mod:`batchinfer.demo.walkthrough`); the nightly DAG's
demo is :mod:`batchinfer.demo.nightly`.

Like the CLI, it sits on top: may import ``commands``, ``spec``, ``triple`` and the core.

Example:
    >>> paths = write_demo(pathlib.Path("demo"))          # doctest: +SKIP
    >>> paths["job"]                                      # doctest: +SKIP
    PosixPath('demo/job.yaml')
"""
from __future__ import annotations

import importlib.resources
import pathlib

DEMO_DS = "2026-01-31"
DEMO_ROWS = 120_000   # rows in all, over 6 shards

# Package data copied as is, as (path under files/, path under the demo folder).
_COPIED = (
    ("job.yaml", "job.yaml"),
    ("schemas/credit_features/v1.py", "schemas/credit_features/v1.py"),
    ("credit_preprocess.py", "credit_preprocess.py"),
)
MODEL_PATH = "models/credit_risk.onnx"


def _package_file(relative: str):
    resource = importlib.resources.files("batchinfer.demo") / "files"
    for part in relative.split("/"):
        resource = resource / part
    return resource


def write_demo(
    folder: pathlib.Path, *, rows: int = DEMO_ROWS, shards: int = 6, seed: int = 0
) -> dict[str, pathlib.Path]:
    """Writes the demo job, schema, preprocessing module, data and model under ``folder``.

    The same arguments always give the same bytes. Existing files are overwritten.

    Args:
        folder: where to write; created if missing.
        rows: rows in the partition ``data/dt=2026-01-31``; a multiple of ``shards``.
        shards: number of Parquet shards, ``part-00000.parquet`` onwards, of equal size.
        seed: seeds both the data and the model's training.

    Returns:
        ``{"job": job file, "model": ONNX model, "data": the partition's folder}``.

    Raises:
        ValueError: if ``rows`` is not a positive multiple of ``shards``.
    """
    import pyarrow.parquet as pq

    from batchinfer.demo import train

    folder = pathlib.Path(folder)
    parts = train.demo_shards(rows, shards, seed)  # validates rows/shards before writing
    for source, target in _COPIED:
        path = folder / target
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_package_file(source).read_bytes())

    data = folder / "data" / f"dt={DEMO_DS}"
    data.mkdir(parents=True, exist_ok=True)
    for index, part in enumerate(parts):
        pq.write_table(part, data / f"part-{index:05d}.parquet", compression="zstd")

    model_proto, _ = train.train_demo_model(seed)
    model = folder / MODEL_PATH
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_bytes(model_proto.SerializeToString(deterministic=True))
    return {"job": folder / "job.yaml", "model": model, "data": data}
