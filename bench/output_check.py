"""A peer's output against batchinfer's, on the same data in the same round (bench/README.md,
"The output check"): no program is timed as a win that skipped rows, wrote some twice or
scored something else.

Tabular (``run.py``): the rows are joined on ``id`` — every id batchinfer wrote present exactly
once in the peer's output, none besides — and the largest absolute difference of ``score`` is
held to :data:`MAX_ABS_DIFF`. Text (``embeddings.py``): the same on ``doc_id``, and the smallest
cosine between the two embeddings of a document is held to :data:`MIN_COSINE`.

batchinfer's files are the manifest's ``predictions/`` files (what its commit vouches for);
a peer's, every ``*.parquet`` under its output folder (Spark's ``part-*``, Daft's and Ray's
uuid names), or ``part-*`` for Beam's WriteToParquet, which writes no suffix.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

MAX_ABS_DIFF = 1e-5
MIN_COSINE = 0.9999


def batchinfer_files(out: Path) -> list[Path]:
    """The prediction files batchinfer's manifest lists, in its order."""
    manifest = json.loads((out / "_manifest.json").read_text())
    return [out / f["path"] for s in manifest["shards"] for f in s["files"]
            if f["path"].startswith("predictions/")]


def peer_files(out: Path, pattern: str = "*.parquet") -> list[Path]:
    return sorted(p for p in out.rglob(pattern) if p.is_file() and not p.name.startswith("."))


def read_columns(files: list[Path], id_column: str, value_column: str):
    """``(ids, values)``: ids as one numpy array, values ``[rows]`` or ``[rows, dim]`` float64."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = [pq.read_table(f, columns=[id_column, value_column]) for f in files]
    if not tables:
        return np.array([], dtype=np.int64), np.array([], dtype=np.float64)
    table = pa.concat_tables(tables)
    ids = table.column(id_column).to_numpy()
    values = table.column(value_column).combine_chunks()
    if pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type) \
            or pa.types.is_large_list(values.type):
        flat = values.flatten().to_numpy()
        return ids, flat.reshape(len(ids), -1).astype(np.float64)
    return ids, values.to_numpy().astype(np.float64)


def align(reference_ids: np.ndarray, candidate_ids: np.ndarray) -> dict:
    """Where each reference id is in the candidate: ``{"index", "missing", "duplicates",
    "extra"}``; ``index`` is usable only when the three counts are 0."""
    if reference_ids.dtype.kind in "iu" and candidate_ids.dtype.kind in "iu" and len(reference_ids) \
            and reference_ids.min() >= 0 and reference_ids.max() < 4 * len(reference_ids):
        return _align_dense(reference_ids, candidate_ids)
    ref_order = np.argsort(reference_ids, kind="stable")
    cand_order = np.argsort(candidate_ids, kind="stable")
    ref_sorted = reference_ids[ref_order]
    cand_sorted = candidate_ids[cand_order]
    cand_unique, cand_counts = np.unique(cand_sorted, return_counts=True)
    duplicates = int((cand_counts > 1).sum()) + int(len(ref_sorted) - len(np.unique(ref_sorted)))
    present = np.isin(ref_sorted, cand_unique)
    missing = int((~present).sum())
    extra = int((~np.isin(cand_unique, ref_sorted)).sum())
    index = None
    if not (missing or duplicates or extra) and len(ref_sorted) == len(cand_sorted):
        # both sorted and the same set of unique ids: the k-th of one is the k-th of the other
        index = np.empty(len(ref_order), dtype=np.int64)
        index[ref_order] = cand_order
    return {"index": index, "missing": missing, "duplicates": duplicates, "extra": extra}


def _align_dense(reference_ids: np.ndarray, candidate_ids: np.ndarray) -> dict:
    """``align`` for small non-negative integer ids (make_data's 0..rows-1): counts by
    ``bincount``, linear in the rows, where sorting 32M ids twice would take seconds."""
    size = int(reference_ids.max()) + 1
    inside = (candidate_ids >= 0) & (candidate_ids < size)
    ref_counts = np.bincount(reference_ids, minlength=size)
    cand_counts = np.bincount(candidate_ids[inside], minlength=size)
    duplicates = int((cand_counts > 1).sum()) + int((ref_counts > 1).sum())
    missing = int(((ref_counts > 0) & (cand_counts == 0)).sum())
    extra = int((~inside).sum()) + int(((ref_counts == 0) & (cand_counts > 0)).sum())
    index = None
    if not (missing or duplicates or extra):
        where = np.empty(size, dtype=np.int64)
        where[candidate_ids] = np.arange(len(candidate_ids))
        index = where[reference_ids]
    return {"index": index, "missing": missing, "duplicates": duplicates, "extra": extra}


def compare(reference: tuple, candidate: tuple, kind: str, min_cosine: float = MIN_COSINE) -> dict:
    """The check's record (what results.json keeps): ``ok``, the row counts and the figure.

    Args:
        reference: batchinfer's ``(ids, values)``.
        candidate: the peer's ``(ids, values)``.
        kind: ``"score"`` (max abs diff ≤ MAX_ABS_DIFF) or ``"embedding"`` (min cosine ≥
            ``min_cosine``, MIN_COSINE unless given).
    """
    (ref_ids, ref_values), (cand_ids, cand_values) = reference, candidate
    found = align(ref_ids, cand_ids)
    record = {"reference_rows": int(len(ref_ids)), "rows": int(len(cand_ids)),
              "missing": found["missing"], "duplicates": found["duplicates"], "extra": found["extra"]}
    if found["index"] is None or len(ref_ids) == 0:
        return {**record, "ok": False, "reason": "rows differ" if len(ref_ids) else "no reference rows"}
    matched = cand_values[found["index"]]
    if kind == "score":
        worst = float(np.abs(matched - ref_values).max())
        return {**record, "max_abs_diff": worst, "bound": MAX_ABS_DIFF, "ok": bool(worst <= MAX_ABS_DIFF)}
    norms = np.linalg.norm(matched, axis=1) * np.linalg.norm(ref_values, axis=1)
    cosine = (matched * ref_values).sum(1) / np.where(norms == 0, 1.0, norms)
    worst = float(cosine.min())
    return {**record, "min_cosine": worst, "median_cosine": float(np.median(cosine)),
            "bound": min_cosine, "ok": bool(worst >= min_cosine)}

