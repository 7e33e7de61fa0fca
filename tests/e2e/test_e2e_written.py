"""What one job writes, held to what the writer of commit f694606 wrote (before it was made of
parts, pipeline/writer/): a champion with ``explain`` (sampled, top 2), drift statistics against a
baseline, rows quarantined before the model, and two challengers — one that rejects rows
(non-finite outputs: only counted), one another model.

Each Parquet file is described canonically: its path (the attempt id as ``<attempt>``), its Arrow
schema with its metadata, its Parquet encoding (per column: physical type, encodings,
compression, whether it has statistics and their min/max) and its values, column by column (a
sha256 of each, ``_inference_id``'s attempt replaced; ``_compute_ms``, a measured time, by its
count only); ``_profile.json``'s statistics and the manifest's shard entries beside them, without
their sha256 (files carry measured times) or ids. Everything else is deterministic, so a change
of one column, type, order, encoding choice, file name or statistic fails here.

``tests/e2e/written_f694606.json`` was made by this test at f694606 (``BATCHINFER_WRITE_EXPECTED=1``
writes it anew: only for a change of the contract, docs/contract.md §4). One edit since, by hand:
``_input_hash`` stored without Snappy (issue 35, rows/columns.py), its chunks' compression only.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from factories import DS, make_mlp_onnx, numeric_project, run_cli, save_onnx, spoil_rows

pytestmark = pytest.mark.slow

EXPECTED = Path(__file__).with_name("written_f694606.json")
EXPLAIN = {"method": "permutation", "top_k": 2, "samples": 4, "seed": 7, "fraction": 0.5}
CHALLENGERS = [{"uri": "models/other.onnx", "device": "cpu"},
               {"uri": "models/sqrt.onnx", "device": "cpu"}]


def make_sqrt_onnx(path: Path) -> Path:
    """y = sqrt(f0 + 1.5), shape [N, 1]: non-finite where f0 < -1.5 (rows it rejects)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    pick = np.array([[1.0], [0.0], [0.0], [0.0]], dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "pick"], ["f0"]),
         helper.make_node("Add", ["f0", "shift"], ["g"]),
         helper.make_node("Sqrt", ["g"], ["y"])],
        "sqrt",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(pick, "pick"),
         numpy_helper.from_array(np.array([1.5], dtype=np.float32), "shift")])
    return save_onnx(graph, path)


def _cli(root: Path, *args: str) -> None:
    result = run_cli(*args, cwd=root)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """The committed output of the job (its baseline profiled from a first run of the champion)."""
    root = tmp_path_factory.mktemp("written")
    numeric_project(root, shards=2, rows=500, batch={"rows": 200})
    for shard, rows in ((0, [3, 250]), (1, [0, 199, 499])):
        spoil_rows(root / "data" / f"dt={DS}" / f"part-{shard:05d}.parquet", rows)
    _cli(root, "run", "job.yaml", "--ds", DS, "--set", "output.path=first")
    _cli(root, "profile", "job.yaml", "--ds", DS, "--set", "output.path=first", "--out",
         "baseline.json")
    make_mlp_onnx(root / "models" / "other.onnx", seed=5)
    make_sqrt_onnx(root / "models" / "sqrt.onnx")
    spec = yaml.safe_load((root / "job.yaml").read_text())
    spec["model"]["challengers"] = CHALLENGERS
    spec["explain"] = EXPLAIN
    spec["monitor"] = {"baseline": "baseline.json", "warn": {"psi": 10.0}}
    (root / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    for model, version in (("model", "model:1"), ("other", "other:1"), ("sqrt", "sqrt:1")):
        _cli(root, "stamp", f"models/{model}.onnx", "--job", "job.yaml", "--model-version", version)
    _cli(root, "run", "job.yaml", "--ds", DS)
    return root / "out" / f"dt={DS}"


def _plain(value, names: dict[str, str]):
    """``value`` with this run's own names (attempt id, folder) replaced by placeholders."""
    if isinstance(value, str):
        for name, placeholder in names.items():
            value = value.replace(name, placeholder)
        return value
    if isinstance(value, list):
        return [_plain(v, names) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v, names) for k, v in value.items()}
    return value


def _values(column: pa.ChunkedArray, names: dict[str, str]) -> str:
    text = json.dumps(_plain(column.to_pylist(), names), sort_keys=True, allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _stat(value):
    return value if isinstance(value, (int, float, str, type(None))) else repr(value)


def describe_file(path: Path, names: dict[str, str]) -> dict:
    """One Parquet file, canonically (see the module's docstring)."""
    meta = pq.ParquetFile(path).metadata
    table = pq.read_table(path)
    chunks = []
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            stats = chunk.statistics if chunk.is_stats_set else None
            chunks.append({
                "column": chunk.path_in_schema, "physical": chunk.physical_type,
                "encodings": sorted(chunk.encodings), "compression": chunk.compression,
                "dictionary_page": chunk.has_dictionary_page,
                "statistics": None if stats is None else {
                    "min_max": stats.has_min_max,
                    "min": _stat(stats.min) if stats.has_min_max and chunk.path_in_schema != "_compute_ms" else None,
                    "max": _stat(stats.max) if stats.has_min_max and chunk.path_in_schema != "_compute_ms" else None,
                    "nulls": stats.null_count}})
    schema_meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()
                   if k != b"ARROW:schema"}
    return {"rows": meta.num_rows, "row_groups": meta.num_row_groups,
            "created_by": meta.created_by, "format_version": meta.format_version,
            "schema": [f"{f.name}: {f.type} nullable={f.nullable}" for f in table.schema],
            "arrow_schema": b"ARROW:schema" in (table.schema.metadata or {}),
            "metadata": _plain(schema_meta, names), "chunks": _plain(chunks, names),
            "values": {name: (_values(table.column(name), names) if name != "_compute_ms"
                              else table.num_rows)
                       for name in table.column_names}}


def describe(out: Path) -> dict:
    manifest = json.loads((out / "_manifest.json").read_text())
    names = {manifest["attempt"]: "<attempt>", str(out.parents[1].resolve()): "<root>"}
    files = {_plain(str(path.relative_to(out)), names): describe_file(path, names)
             for path in sorted(out.rglob("*.parquet"))}
    profile = json.loads((out / "_profile.json").read_text())

    def entries(shards: list[dict]) -> list:
        measured = {"sha256", "scored_by", "seconds", "compute_ms"}
        return [_plain({k: (v if k != "files" else [[f["path"], f["rows"]] for f in v])
                        for k, v in sorted(s.items()) if k not in measured}, names)
                for s in shards]

    return {"files": files, "profile_columns": profile.get("columns"),
            "shards": entries(manifest["shards"]),
            "challengers": {c["name"]: entries(c["shards"]) for c in manifest.get("challengers", [])}}


def test_the_job_writes_what_f694606_wrote(written):
    got = describe(written)
    if os.environ.get("BATCHINFER_WRITE_EXPECTED"):
        EXPECTED.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    expected = json.loads(EXPECTED.read_text())
    assert sorted(got["files"]) == sorted(expected["files"])
    for name, described in expected["files"].items():
        assert got["files"][name] == described, name
    assert got == expected
