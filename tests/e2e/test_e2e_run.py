"""End-to-end: `python -m batchinfer run/plan/inspect` on generated data, checked from the files.

contract §2 (CLI), §4 (output layout, audit columns, manifest), §5.1 (accounting), §5.3 (reruns).
Each CLI run costs seconds, so module-scoped fixtures run the commands once and many tests
assert on what they left behind.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factories import (
    DS,
    all_input_rows,
    make_shards,
    mlp_reference,
    numeric_project,
    one_line_error,
    read_partition,
    run_cli,
    save_onnx,
    snapshot,
    write_job,
    write_schema,
)

pytestmark = pytest.mark.slow

DS2 = "2026-01-16"   # a second partition of the same job (same bytes as DS)
DS3 = "2026-01-17"   # never scored: plan / dry-run / spec errors only
BATCH = 400          # rows per batch: 1000-row shards → batches of 400, 400, 200
FEATURES = ["f0", "f1", "f2", "f3"]
SCHEMA_COLUMNS = ["id", *FEATURES]
# Injected into shard 1 of the main partition: (row, column, value).
MAIN_BAD = [(7, "f0", 100.0), (512, "f3", float("nan"))]

MANIFEST_KEYS = {"manifest_version", "job", "ds", "attempt", "triple", "job_spec_sha256",
                 "runner", "device", "backend", "model_options", "started_at", "finished_at",
                 "mlflow_run_id", "totals", "shards"}
TRIPLE_KEYS = {"model_version", "model_digest", "schema_version", "preprocess_hash"}
TOTALS_KEYS = {"shards", "rows_in", "rows_scored", "rows_quarantined", "shards_unreadable"}
SHARD_KEYS = {"path", "sha256", "rows_in", "rows_scored", "rows_quarantined", "status",
              "reason", "files", "scored_by"}
FILE_KEYS = {"path", "rows", "sha256"}
RFC3339_UTC = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|\+00:00)$")


# -- helpers -----------------------------------------------------------------------------------

def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def inject(path: Path, bad: list[tuple[int, str, object]]) -> None:
    """Rewrite a factories shard with some cells replaced, keeping its Arrow types."""
    table = pq.read_table(path)
    columns = {}
    for field in table.schema:
        values = table.column(field.name).to_pylist()
        for row, column, value in bad:
            if column == field.name:
                values[row] = value
        columns[field.name] = pa.array(values, field.type, from_pandas=False)
    pq.write_table(pa.table(columns), path)


def shard_files(project: Path, ds: str) -> list[Path]:
    return sorted((project / "data" / f"dt={ds}").resolve().glob("*.parquet"))


def input_table(shards: list[Path]) -> dict[str, pa.Table]:
    return {str(p): pq.read_table(p) for p in shards}


def rows_of(tables: dict[str, pa.Table], shard: list[str], row: list[int]) -> pa.Table:
    """The input rows named by (_source_shard, _source_row) pairs, in that order."""
    parts = []
    for name in dict.fromkeys(shard):
        idx = np.array([r for s, r in zip(shard, row) if s == name], dtype=np.int64)
        parts.append(tables[name].take(pa.array(idx)))
    table = pa.concat_tables(parts)
    # back to the pairs' order
    order = sorted(range(len(shard)), key=lambda i: list(dict.fromkeys(shard)).index(shard[i]))
    inverse = np.empty(len(order), dtype=np.int64)
    inverse[np.array(order, dtype=np.int64)] = np.arange(len(order))
    return table.take(pa.array(inverse))


def features_of(table: pa.Table) -> np.ndarray:
    return np.stack([table.column(c).to_numpy().astype(np.float32) for c in FEATURES], axis=1)


# -- the main partition: one job, scored for two dates, rerun, inspected, planned ---------------

@pytest.fixture(scope="module")
def main(tmp_path_factory):
    root = tmp_path_factory.mktemp("main")
    numeric_project(root, shards=3, rows=1000, batch={"rows": BATCH})
    data = root / "data"
    inject(data / f"dt={DS}" / "part-00001.parquet", MAIN_BAD)
    shutil.copytree(data / f"dt={DS}", data / f"dt={DS2}")
    shutil.copytree(data / f"dt={DS}", data / f"dt={DS3}")
    out = root / "out" / f"dt={DS}"
    r = {"root": root, "out": out, "out2": root / "out" / f"dt={DS2}"}

    r["run"] = run_cli("run", "job.yaml", "--ds", DS, cwd=root)
    assert r["run"].returncode == 0, r["run"].stderr
    r["before_rerun"] = snapshot(out)
    r["manifest_bytes"] = (out / "_manifest.json").read_bytes()
    r["rerun"] = run_cli("run", "job.yaml", "--ds", DS, cwd=root)
    r["after_rerun"] = snapshot(out)
    r["manifest_bytes_after"] = (out / "_manifest.json").read_bytes()

    r["run2"] = run_cli("run", "job.yaml", "--ds", DS2, cwd=root)
    assert r["run2"].returncode == 0, r["run2"].stderr
    r["inspect"] = run_cli("inspect", str(out), cwd=root)

    r["before_plan"] = snapshot(root)
    r["plan"] = run_cli("plan", "job.yaml", "--ds", DS3, cwd=root)
    r["after_plan"] = snapshot(root)
    r["dry"] = run_cli("run", "job.yaml", "--ds", DS3, "--dry-run", cwd=root)
    r["after_dry"] = snapshot(root)
    return r


@pytest.fixture(scope="module")
def part(main):
    preds, quar, manifest = read_partition(main["out"])
    return preds, quar, manifest


def test_run_reports_totals(main):
    out = main["run"].stdout
    assert "committed" in out
    assert "rows: 3000 in, 2998 scored, 2 quarantined; shards: 3 (0 unreadable)" in out


def test_accounting_every_row_exactly_once(main, part):
    preds, quar, manifest = part
    shards = shard_files(main["root"], DS)
    pairs = (list(zip(preds["_source_shard"].to_pylist(), preds["_source_row"].to_pylist()))
             + list(zip(quar["_source_shard"].to_pylist(), quar["_source_row"].to_pylist())))
    assert len(pairs) == len(set(pairs)), "a row appears twice"
    assert set(pairs) == all_input_rows(shards)
    # the injected rows, and only they, are in quarantine
    assert set(zip(quar["_source_shard"].to_pylist(), quar["_source_row"].to_pylist())) == {
        (str(shards[1]), row) for row, _, _ in MAIN_BAD}


def test_accounting_manifest_counts(main, part):
    preds, quar, manifest = part
    shards = shard_files(main["root"], DS)
    assert [s["path"] for s in manifest["shards"]] == [str(p) for p in shards]
    for entry, path in zip(manifest["shards"], shards):
        assert entry["rows_in"] == pq.ParquetFile(path).metadata.num_rows
        assert entry["rows_in"] == entry["rows_scored"] + entry["rows_quarantined"]
        assert entry["sha256"] == sha256_file(path)
        assert entry["status"] == "scored"
        scored = sum(f["rows"] for f in entry["files"] if f["path"].startswith("predictions/"))
        quarantined = sum(f["rows"] for f in entry["files"] if f["path"].startswith("quarantine/"))
        assert (scored, quarantined) == (entry["rows_scored"], entry["rows_quarantined"])
    totals = manifest["totals"]
    for key in ("rows_in", "rows_scored", "rows_quarantined"):
        assert totals[key] == sum(s[key] for s in manifest["shards"])
    assert totals["shards"] == len(manifest["shards"]) == 3
    assert totals["shards_unreadable"] == 0
    assert (totals["rows_scored"], totals["rows_quarantined"]) == (preds.num_rows, quar.num_rows)
    assert totals == {"shards": 3, "rows_in": 3000, "rows_scored": 2998, "rows_quarantined": 2,
                      "shards_unreadable": 0}


def test_manifest_files_match_disk(main, part):
    _, _, manifest = part
    out = main["out"]
    listed = set()
    for shard in manifest["shards"]:
        for f in shard["files"]:
            path = out / f["path"]
            assert path.is_file(), f["path"]
            assert sha256_file(path) == f["sha256"], f["path"]
            assert pq.ParquetFile(path).metadata.num_rows == f["rows"]
            assert re.fullmatch(rf"(predictions|quarantine)/{re.escape(manifest['attempt'])}/"
                                r"part-\d{5}-\d{5}\.parquet", f["path"])
            listed.add(f["path"])
    on_disk = {str(p.relative_to(out)) for kind in ("predictions", "quarantine")
               for p in (out / kind).rglob("*") if p.is_file()}
    assert on_disk == listed, "files that the manifest does not list"
    assert not (out / "_tmp").exists()


def test_parity_with_onnxruntime_and_reference(main, part):
    import onnxruntime as ort

    preds, _, _ = part
    tables = input_table(shard_files(main["root"], DS))
    rows = rows_of(tables, preds["_source_shard"].to_pylist(), preds["_source_row"].to_pylist())
    assert rows.column("id").to_pylist() == preds["id"].to_pylist()
    x = features_of(rows)
    session = ort.InferenceSession(str(main["root"] / "models" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    direct = session.run(None, {"x": x})[0][:, 0]
    got = preds["y"].to_numpy()
    assert got.shape == direct.shape == (2998,)
    assert np.max(np.abs(got.astype(np.float64) - direct)) <= 1e-6
    assert np.max(np.abs(got - mlp_reference(x))) <= 1e-5


def test_audit_column_types(main, part):
    _, _, manifest = part
    files = [f["path"] for s in manifest["shards"] for f in s["files"]
             if f["path"].startswith("predictions/")]
    assert files
    for path in files:
        schema = pq.read_schema(main["out"] / path)
        assert schema.names == ["id", "y", "_source_shard", "_source_row", "_input_hash",
                                "_model_version", "_model_digest", "_schema_version",
                                "_preprocess_hash", "_inference_id", "_compute_ms"]
        assert schema.field("id").type == pa.int64()
        assert schema.field("y").type == pa.float32()
        assert schema.field("_source_shard").type == pa.string()
        assert schema.field("_source_row").type == pa.int64()
        assert schema.field("_input_hash").type == pa.string()
        assert schema.field("_inference_id").type == pa.string()
        assert schema.field("_compute_ms").type == pa.float64()
        for name in ("_model_version", "_model_digest", "_schema_version", "_preprocess_hash"):
            t = schema.field(name).type
            assert pa.types.is_dictionary(t) and t.value_type == pa.string(), (name, t)


def test_input_hash(main, part):
    from batchinfer.rows.hashing import row_hashes

    preds, _, _ = part
    hashes = preds["_input_hash"].to_pylist()
    assert all(re.fullmatch(r"[0-9a-f]{16}", h) for h in hashes)
    tables = input_table(shard_files(main["root"], DS))
    rows = rows_of(tables, preds["_source_shard"].to_pylist(), preds["_source_row"].to_pylist())
    assert row_hashes(rows, SCHEMA_COLUMNS).to_pylist() == hashes
    # one hash per distinct row (the data has no duplicate rows)
    assert len(set(hashes)) == len(hashes)


def test_inference_id_per_batch(main, part):
    _, _, manifest = part
    seen = set()
    for shard_no, shard in enumerate(manifest["shards"]):
        for f in shard["files"]:
            if not f["path"].startswith("predictions/"):
                continue
            table = pq.read_table(main["out"] / f["path"])
            ids = set(table["_inference_id"].to_pylist())
            assert len(ids) == 1, f"{f['path']}: one batch, several inference ids"
            assert len(set(table["_compute_ms"].to_pylist())) == 1
            assert table["_compute_ms"][0].as_py() >= 0
            batch_no = int(f["path"][-13:-8])
            assert int(f["path"][-19:-14]) == shard_no
            # the file holds exactly the valid rows of that batch of `batch.rows` rows
            rows = np.asarray(table["_source_row"].to_pylist())
            assert (rows // BATCH == batch_no).all()
            seen |= ids
    batches = sum(1 for s in manifest["shards"] for f in s["files"]
                  if f["path"].startswith("predictions/"))
    assert batches == 9                       # 3 shards x (400, 400, 200)
    assert len(seen) == batches, "inference ids repeat across batches"


def test_triple_columns_match_manifest_and_sidecar(main, part):
    preds, _, manifest = part
    sidecar = json.loads((main["root"] / "models" / "model.onnx.batchinfer.json").read_text())
    assert {k: sidecar[k] for k in TRIPLE_KEYS} == manifest["triple"]
    assert manifest["triple"]["model_version"] == "model:1"
    assert manifest["triple"]["schema_version"] == "feats@1"
    assert manifest["triple"]["model_digest"] == sha256_file(main["root"] / "models" / "model.onnx")
    assert manifest["triple"]["preprocess_hash"] == hashlib.sha256(
        ("batchinfer-preprocess/1\ndefault-float32\n" + ",".join(FEATURES)).encode()).hexdigest()
    for key, value in manifest["triple"].items():
        assert set(preds[f"_{key}"].to_pylist()) == {value}, key


def test_manifest_keys_and_times(part):
    _, _, manifest = part
    assert set(manifest) == MANIFEST_KEYS
    assert manifest["manifest_version"] == 1
    assert manifest["job"] == "testjob" and manifest["ds"] == DS
    assert manifest["runner"] == "direct" and manifest["device"] == "cpu"
    assert manifest["backend"] == "onnxruntime" and manifest["model_options"] == {"precision": "fp32"}
    assert set(manifest["triple"]) == TRIPLE_KEYS
    assert set(manifest["totals"]) == TOTALS_KEYS
    for shard in manifest["shards"]:
        assert set(shard) == SHARD_KEYS
        for f in shard["files"]:
            assert set(f) == FILE_KEYS
    assert re.fullmatch(r"[0-9a-f]{64}", manifest["job_spec_sha256"])
    stamps = []
    for key in ("started_at", "finished_at"):
        assert RFC3339_UTC.match(manifest[key]), manifest[key]
        moment = datetime.fromisoformat(manifest[key].replace("Z", "+00:00"))
        assert moment.utcoffset().total_seconds() == 0
        stamps.append(moment)
    assert stamps[0] <= stamps[1] <= datetime.now(timezone.utc)


def test_two_partitions_share_job_spec_sha256(main, part):
    _, _, first = part
    preds2, quar2, second = read_partition(main["out2"])
    assert second["ds"] == DS2 and first["ds"] == DS
    assert second["job_spec_sha256"] == first["job_spec_sha256"]
    assert second["triple"] == first["triple"]
    assert second["attempt"] != first["attempt"]
    assert second["totals"] == first["totals"]
    # same bytes in, same predictions and hashes out (determinism), different shard URLs
    preds1, _, _ = part
    assert preds2["y"].to_pylist() == preds1["y"].to_pylist()
    assert preds2["_input_hash"].to_pylist() == preds1["_input_hash"].to_pylist()
    assert all(f"dt={DS2}" in s for s in preds2["_source_shard"].to_pylist())


def test_rerun_is_a_noop(main):
    rerun = main["rerun"]
    assert rerun.returncode == 0, rerun.stderr
    assert "already committed" in rerun.stdout
    assert main["after_rerun"] == main["before_rerun"]
    assert main["manifest_bytes_after"] == main["manifest_bytes"]


def test_inspect_summarises(main, part):
    _, _, manifest = part
    result = main["inspect"]
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert manifest["attempt"] in out
    for value in manifest["triple"].values():
        assert value in out
    assert "3000 in, 2998 scored, 2 quarantined" in out
    assert "shards by status: scored 3" in out
    n_files = sum(len(s["files"]) for s in manifest["shards"])
    assert f"files: {n_files} (3000 rows)" in out


def test_plan_prints_and_writes_nothing(main, part):
    _, _, manifest = part
    result = main["plan"]
    assert result.returncode == 0, result.stderr
    for path in shard_files(main["root"], DS3):
        assert str(path) in result.stdout
    for value in manifest["triple"].values():
        assert value in result.stdout
    assert main["after_plan"] == main["before_plan"]
    assert not (main["root"] / "out" / f"dt={DS3}").exists()


def test_dry_run_writes_nothing(main):
    result = main["dry"]
    assert result.returncode == 0, result.stderr
    assert "dry run" in result.stdout
    assert main["after_dry"] == main["before_plan"]
    assert not (main["root"] / "out" / f"dt={DS3}").exists()


# -- output mapping, [N, K] outputs, two outputs, a multi-input model ---------------------------

PREP_SOURCE = '''\
"""Feeds the two-input test model: a = (f0, f1), b = (2 * f2, f3)."""
import numpy as np

ASSETS = []


def transform(batch):
    col = {n: batch.column(n).to_numpy(zero_copy_only=False).astype(np.float32)
           for n in ("f0", "f1", "f2", "f3")}
    a = np.stack([col["f0"], col["f1"]], axis=1)
    b = np.stack([col["f2"] * np.float32(2), col["f3"]], axis=1)
    return {"a": np.ascontiguousarray(a), "b": np.ascontiguousarray(b)}
'''
PREP_MODULE = "e2e_multi_prep"


def _multi_weights():
    rng = np.random.default_rng(7)
    wa = rng.standard_normal((2, 1)).astype(np.float32)
    wb = rng.standard_normal((2, 1)).astype(np.float32)
    ea = rng.standard_normal((2, 3)).astype(np.float32)
    eb = rng.standard_normal((2, 3)).astype(np.float32)
    return wa, wb, ea, eb


def make_multi_model(path: Path) -> None:
    """Inputs a, b [N, 2]; outputs y = sigmoid(a@wa + b@wb) [N, 1] and emb = a@ea + b@eb [N, 3]."""
    from onnx import TensorProto, helper, numpy_helper

    wa, wb, ea, eb = _multi_weights()
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "wa"], ["ya"]),
         helper.make_node("MatMul", ["b", "wb"], ["yb"]),
         helper.make_node("Add", ["ya", "yb"], ["ys"]),
         helper.make_node("Sigmoid", ["ys"], ["y"]),
         helper.make_node("MatMul", ["a", "ea"], ["ma"]),
         helper.make_node("MatMul", ["b", "eb"], ["mb"]),
         helper.make_node("Add", ["ma", "mb"], ["emb"])],
        "two_in_two_out",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 2]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1]),
         helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(wa, "wa"), numpy_helper.from_array(wb, "wb"),
         numpy_helper.from_array(ea, "ea"), numpy_helper.from_array(eb, "eb")])
    save_onnx(graph, path)


def multi_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    wa, wb, ea, eb = (w.astype(np.float64) for w in _multi_weights())
    x = x.astype(np.float32).astype(np.float64)
    a = x[:, :2]
    b = np.stack([x[:, 2] * 2, x[:, 3]], axis=1)
    y = 1 / (1 + np.exp(-(a @ wa + b @ wb)))[:, 0]
    return y, a @ ea + b @ eb


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi")
    write_schema(root / "schemas")
    for ds in (DS, DS2, DS3):
        make_shards(root / "data" / f"dt={ds}", shards=2, rows=500, seed=3)
    make_multi_model(root / "models" / "model.onnx")
    # CRLF on disk: the preprocess hash is over the source with LF line endings (contract §1)
    (root / f"{PREP_MODULE}.py").write_bytes(PREP_SOURCE.replace("\n", "\r\n").encode())
    write_job(root, name="multijob", preprocess=f"{PREP_MODULE}:transform")
    stamp = run_cli("stamp", "models/model.onnx", "--job", "job.yaml", "--model-version", "multi:1",
                    cwd=root)
    assert stamp.returncode == 0, stamp.stderr
    r = {"root": root}
    r["plain"] = run_cli("run", "job.yaml", "--ds", DS, cwd=root)
    r["mapped"] = run_cli("run", "job.yaml", "--ds", DS2, "--set",
                          "output.predictions={y: score, emb: vec}", cwd=root)
    r["unknown"] = run_cli("run", "job.yaml", "--ds", DS3, "--set",
                           "output.predictions={nope: score}", cwd=root)
    return r


def _check_multi_values(root: Path, ds: str, preds: pa.Table, y_col: str, emb_col: str) -> None:
    tables = input_table(shard_files(root, ds))
    rows = rows_of(tables, preds["_source_shard"].to_pylist(), preds["_source_row"].to_pylist())
    y_ref, emb_ref = multi_reference(features_of(rows))
    assert np.max(np.abs(preds[y_col].to_numpy() - y_ref)) <= 1e-5
    emb = np.asarray(preds[emb_col].to_pylist(), dtype=np.float64)
    assert emb.shape == (preds.num_rows, 3)
    assert np.max(np.abs(emb - emb_ref)) <= 1e-5


def test_two_outputs_two_columns_and_fixed_size_list(multi):
    result = multi["plain"]
    assert result.returncode == 0, result.stderr
    preds, quar, manifest = read_partition(multi["root"] / "out" / f"dt={DS}")
    assert manifest["totals"]["rows_scored"] == 1000 and quar.num_rows == 0
    assert "y" in preds.column_names and "emb" in preds.column_names
    assert preds.schema.field("y").type == pa.float32()
    assert preds.schema.field("emb").type == pa.list_(pa.float32(), 3)
    assert pa.types.is_fixed_size_list(preds.schema.field("emb").type)
    _check_multi_values(multi["root"], DS, preds, "y", "emb")


def test_output_predictions_mapping_renames(multi):
    result = multi["mapped"]
    assert result.returncode == 0, result.stderr
    preds, _, _ = read_partition(multi["root"] / "out" / f"dt={DS2}")
    assert "score" in preds.column_names and "vec" in preds.column_names
    assert "y" not in preds.column_names and "emb" not in preds.column_names
    assert preds.schema.field("score").type == pa.float32()
    assert preds.schema.field("vec").type == pa.list_(pa.float32(), 3)
    _check_multi_values(multi["root"], DS2, preds, "score", "vec")
    # job_spec_sha256 covers the spec after --set
    _, _, plain = read_partition(multi["root"] / "out" / f"dt={DS}")
    _, _, mapped = read_partition(multi["root"] / "out" / f"dt={DS2}")
    assert mapped["job_spec_sha256"] != plain["job_spec_sha256"]
    assert mapped["triple"] == plain["triple"]


def test_output_predictions_unknown_output_exits_2(multi):
    result = multi["unknown"]
    assert result.returncode == 2, (result.stdout, result.stderr)
    line = one_line_error(result)
    assert "nope" in line
    out = multi["root"] / "out" / f"dt={DS3}"
    assert not (out / "_manifest.json").exists()
    assert not [p for p in out.rglob("*") if p.is_file()] if out.exists() else True


def test_multi_input_preprocess_hash_is_spec_formula(multi):
    assert multi["plain"].returncode == 0, multi["plain"].stderr
    _, _, manifest = read_partition(multi["root"] / "out" / f"dt={DS}")
    expected = hashlib.sha256(
        f"batchinfer-preprocess/1\n{PREP_MODULE}:transform\n".encode() + PREP_SOURCE.encode()
    ).hexdigest()
    assert manifest["triple"]["preprocess_hash"] == expected
    sidecar = json.loads((multi["root"] / "models" / "model.onnx.batchinfer.json").read_text())
    assert sidecar["preprocess_hash"] == expected
    assert manifest["triple"]["model_version"] == "multi:1"
