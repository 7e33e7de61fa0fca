"""End-to-end: bad data (quarantine, exit 4), usage errors (exit 2) and contract errors (exit 3).

contract §2 (exit codes, one-line errors), §1 (declaration checks), §4 (quarantine, shard cases),
§5.1 (accounting and thresholds). Everything is checked from the CLI's exit code, its output
and the files it leaves.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from factories import (
    DS,
    all_input_rows,
    kept_for_resume,
    make_mlp_onnx,
    make_shards,
    mlp_reference,
    numeric_project,
    one_line_error,
    read_partition,
    run_cli,
    snapshot,
    write_schema,
)

pytestmark = pytest.mark.slow

DS_MESSY = "2026-02-01"
PREP = "e2e_err_prep"
PREP_SOURCE = '''\
import numpy as np

COLUMNS = ("f0", "f1", "f2", "f3")


def transform(batch):
    return np.stack([batch.column(n).to_numpy(zero_copy_only=False) for n in COLUMNS],
                    axis=1).astype(np.float32)
'''
BROKEN_PREP = "e2e_broken_prep"
# Cells broken in shard 1 of the messy partition: row → {column: value}.
BAD_CELLS = {
    5: {"f1": 50.0},                              # out of range
    17: {"f2": float("nan")},                     # NaN in a non-nullable float
    33: {"id": None},                             # null id
    40: {"f0": -99.0, "f3": float("nan")},        # two columns fail
    41: {"f3": float("inf")},                     # infinite
}
# (column, check prefix) of the first failure of each bad row
FIRST_FAILURE = {5: ("f1", "in_range"), 17: ("f2", "not_nullable"), 33: ("id", "not_nullable"),
                 40: ("f0", "in_range"), 41: ("f3", "in_range")}
WRONG_TYPE_ROWS = 3


# -- helpers -----------------------------------------------------------------------------------

def copy_project(base: Path, target: Path) -> Path:
    shutil.copytree(base, target, ignore=shutil.ignore_patterns("out", "mlflow.db", "job_*.yaml"))
    return target


def write_variant(root: Path, name: str, change) -> str:
    """job_<name>.yaml: job.yaml with ``change(spec_dict)`` applied."""
    spec = yaml.safe_load((root / "job.yaml").read_text())
    change(spec)
    (root / f"job_{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return f"job_{name}.yaml"


def prep_hash(source: str, module: str = PREP, function: str = "transform") -> str:
    return hashlib.sha256(f"batchinfer-preprocess/1\n{module}:{function}\n{source}".encode()).hexdigest()


def json_value_matches(encoded, original) -> bool:
    """A `_values` JSON value against the original cell (floats as the spec encodes them)."""
    if original is None:
        return encoded is None
    if isinstance(original, float):
        special = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
        value = special.get(encoded, encoded) if isinstance(encoded, str) else encoded
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        if math.isnan(original):
            return math.isnan(value)
        return np.float32(value) == np.float32(original)
    return encoded == original and type(encoded) is type(original)


# -- the base project: stamped, with a preprocessing module -------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("base")
    (root / f"{PREP}.py").write_text(PREP_SOURCE)
    (root / f"{BROKEN_PREP}.py").write_text(
        "import e2e_no_such_module_anywhere\n\n\ndef transform(batch):\n    return None\n")
    numeric_project(root, shards=2, rows=500, preprocess=f"{PREP}:transform")
    return root


# -- bad rows, unreadable shards, wrong types, empty shards (one messy partition) ---------------

def write_messy_partition(root: Path) -> Path:
    folder = root / "data" / f"dt={DS_MESSY}"
    make_shards(folder, shards=2, rows=1000, seed=5)
    shard = folder / "part-00001.parquet"
    table = pq.read_table(shard)
    columns = {}
    for field in table.schema:
        values = table.column(field.name).to_pylist()
        for row, cells in BAD_CELLS.items():
            if field.name in cells:
                values[row] = cells[field.name]
        columns[field.name] = pa.array(values, field.type, from_pandas=False)
    pq.write_table(pa.table(columns), shard)
    # wrong column type: f0 holds strings
    pq.write_table(pa.table({"id": pa.array([1, 2, 3], pa.int64()),
                             "f0": pa.array(["0.5", "x", "1e3"]),
                             **{f"f{i}": pa.array([0.1, 0.2, 0.3], pa.float32()) for i in (1, 2, 3)}}),
                   folder / "part-00002.parquet")
    # zero rows
    pq.write_table(pa.table({"id": pa.array([], pa.int64()),
                             **{f"f{i}": pa.array([], pa.float32()) for i in range(4)}}),
                   folder / "part-00003.parquet")
    (folder / "part-00004.parquet").write_bytes(b"")                        # zero bytes
    (folder / "part-00005.parquet").write_bytes(b"not parquet at all\n" * 50)  # garbage
    return folder


@pytest.fixture(scope="module")
def messy(base):
    root = base
    folder = write_messy_partition(root)
    out = root / "out" / f"dt={DS_MESSY}"
    ds = ["--ds", DS_MESSY]
    two_bad_shards = ["--set", "quarantine.max_bad_shards=2"]
    strict_fraction = ["--set", "quarantine.max_bad_fraction=0.003"]   # 8 / 2003 ≈ 0.40 % bad
    r = {"root": root, "out": out, "shards": sorted(p.resolve() for p in folder.glob("*.parquet"))}
    runs = {}
    runs["default"] = run_cli("run", "job.yaml", *ds, cwd=root)
    runs["one_bad_shard"] = run_cli("run", "job.yaml", *ds, "--set", "quarantine.max_bad_shards=1",
                                    cwd=root)
    runs["fraction"] = run_cli("run", "job.yaml", *ds, *two_bad_shards, *strict_fraction, cwd=root)
    r["after_failed_runs"] = snapshot(out)
    r["failed_runs"] = runs
    r["nothing_after_failed"] = None
    try:   # committed nothing; kept its finished shards for a rerun (contract §5.3)
        r["kept"] = kept_for_resume(out)
    except AssertionError as exc:
        r["nothing_after_failed"] = str(exc)
    before = snapshot(root)
    r["validate_ok"] = run_cli("validate", "job.yaml", *ds, *two_bad_shards, cwd=root)
    r["validate_bad"] = run_cli("validate", "job.yaml", *ds, *two_bad_shards, *strict_fraction,
                                cwd=root)
    r["validate_wrote"] = snapshot(root) != before
    r["run"] = run_cli("run", "job.yaml", *ds, *two_bad_shards, cwd=root)
    return r


@pytest.fixture(scope="module")
def messy_part(messy):
    assert messy["run"].returncode == 0, messy["run"].stderr
    return read_partition(messy["out"])


def test_above_thresholds_exit_4_and_commit_nothing(messy):
    runs = messy["failed_runs"]
    for name, result in runs.items():
        assert result.returncode == 4, (name, result.stdout, result.stderr)
        one_line_error(result)
    assert "2 unreadable" in runs["default"].stderr
    assert "max 0" in runs["default"].stderr
    assert "max 1" in runs["one_bad_shard"].stderr
    assert "8 of 2003 rows" in runs["fraction"].stderr
    assert messy["nothing_after_failed"] is None, messy["nothing_after_failed"]
    # Every shard was finished (the unreadable ones too) before the commit step refused: all
    # kept. (The runs' --set differ, so none adopts another's: each scores again, and the last
    # commit's cleanup removes what they kept, test_under_thresholds_commits.)
    assert len(messy["kept"]) == 6, messy["kept"]


def test_under_thresholds_commits(messy, messy_part):
    assert "rows: 2003 in, 1995 scored, 8 quarantined; shards: 6 (2 unreadable)" in messy["run"].stdout
    _, _, manifest = messy_part
    assert manifest["totals"] == {"shards": 6, "rows_in": 2003, "rows_scored": 1995,
                                  "rows_quarantined": 8, "shards_unreadable": 2}


def test_shard_statuses(messy, messy_part):
    _, _, manifest = messy_part
    shards = manifest["shards"]
    assert [s["path"] for s in shards] == [str(p) for p in messy["shards"]]
    assert [s["status"] for s in shards] == ["scored", "scored", "quarantined", "empty",
                                             "unreadable", "unreadable"]
    for s in shards[4:]:
        assert s["rows_in"] is None
        assert s["rows_scored"] == s["rows_quarantined"] == 0
        assert s["files"] == []
        assert s["reason"]
    empty = shards[3]
    assert (empty["rows_in"], empty["rows_scored"], empty["rows_quarantined"]) == (0, 0, 0)
    wrong = shards[2]
    assert (wrong["rows_in"], wrong["rows_scored"], wrong["rows_quarantined"]) == (3, 0, 3)
    assert "f0" in wrong["reason"]
    for s in shards[:4]:
        assert s["rows_in"] == s["rows_scored"] + s["rows_quarantined"]
        assert s["sha256"] == hashlib.sha256(Path(s["path"]).read_bytes()).hexdigest()


def test_accounting_over_readable_shards(messy, messy_part):
    preds, quar, _ = messy_part
    pairs = (list(zip(preds["_source_shard"].to_pylist(), preds["_source_row"].to_pylist()))
             + list(zip(quar["_source_shard"].to_pylist(), quar["_source_row"].to_pylist())))
    assert len(pairs) == len(set(pairs))
    assert set(pairs) == all_input_rows(messy["shards"][:4])


def test_bad_rows_in_quarantine_with_reasons(messy, messy_part):
    _, quar, _ = messy_part
    shard1 = str(messy["shards"][1])
    rows = {r["_source_row"]: r for r in quar.to_pylist() if r["_source_shard"] == shard1}
    assert set(rows) == set(BAD_CELLS)
    original = pq.read_table(messy["shards"][1]).to_pylist()
    for row, (column, check) in FIRST_FAILURE.items():
        q = rows[row]
        assert q["_column"] == column, (row, q)
        assert q["_check"].startswith(check), (row, q)
        assert q["_reason"]
        assert q["_reasons"][0] == {"column": q["_column"], "check": q["_check"],
                                    "message": q["_reason"]}
        assert {r["column"] for r in q["_reasons"]} >= set(BAD_CELLS[row])
        values = json.loads(q["_values"])
        assert list(values) == ["id", "f0", "f1", "f2", "f3"]
        for name, cell in original[row].items():
            assert json_value_matches(values[name], cell), (row, name, values[name], cell)
    assert quar.schema.field("_source_row").type == pa.int64()


def test_wrong_type_shard_quarantined_whole(messy, messy_part):
    _, quar, _ = messy_part
    shard2 = str(messy["shards"][2])
    rows = [r for r in quar.to_pylist() if r["_source_shard"] == shard2]
    assert sorted(r["_source_row"] for r in rows) == list(range(WRONG_TYPE_ROWS))
    original = pq.read_table(messy["shards"][2]).to_pylist()
    for q in rows:
        assert q["_column"] == "f0" and q["_check"].startswith("dtype"), q
        values = json.loads(q["_values"])
        assert values["f0"] == original[q["_source_row"]]["f0"]
        assert values["id"] == original[q["_source_row"]]["id"]


def _validate_counts(stdout: str) -> Counter:
    counts = Counter()
    for line in stdout.splitlines():
        match = re.match(r"^\s+(\d+)\s+(.+?): (.+)$", line)
        if match and not line.strip().startswith("unreadable"):
            counts[(match[2], match[3])] += int(match[1])
    return counts


def test_validate_reports_counts_and_writes_nothing(messy, messy_part):
    _, quar, _ = messy_part
    ok, bad = messy["validate_ok"], messy["validate_bad"]
    assert ok.returncode == 0, (ok.stdout, ok.stderr)
    assert bad.returncode == 4, (bad.stdout, bad.stderr)
    one_line_error(bad, "validate")
    assert not messy["validate_wrote"], "validate wrote files"
    assert "6 shards, 2003 rows, 8 bad" in ok.stdout
    expected = Counter((c or "(row)", k) for c, k in zip(quar["_column"].to_pylist(),
                                                          quar["_check"].to_pylist()))
    assert _validate_counts(ok.stdout) == expected
    unreadable = [line for line in ok.stdout.splitlines() if line.strip().startswith("unreadable")]
    assert len(unreadable) == 2
    assert str(messy["shards"][4]) in ok.stdout and str(messy["shards"][5]) in ok.stdout
    assert _validate_counts(bad.stdout) == expected


# -- exit 2: usage and job-spec errors ---------------------------------------------------------

def _unknown_key(root):
    def change(spec):
        spec["output"]["compression"] = "zstd"
    return ["run", write_variant(root, "unknown", change), "--ds", DS], ["output.compression"]


def _missing_key(root):
    return ["run", write_variant(root, "missing", lambda s: s.pop("model")), "--ds", DS], \
        ["model", "missing"]


def _bad_value(root):
    def change(spec):
        spec["batch"] = {"rows": "lots"}
    return ["run", write_variant(root, "bad", change), "--ds", DS], ["batch.rows"]


def _set_unknown_key(root):
    return ["run", "job.yaml", "--ds", DS, "--set", "quarantine.max_bad_rows=3"], \
        ["quarantine.max_bad_rows"]


def _unknown_schema(root):
    return ["run", "job.yaml", "--ds", DS, "--set", "schema=feats@7"], ["feats@7", "feats@1"]


def _preprocess_import(root):
    return ["run", "job.yaml", "--ds", DS, "--set", f"preprocess={BROKEN_PREP}:transform"], \
        [BROKEN_PREP]


def _no_shards(root):
    return ["run", "job.yaml", "--ds", "2031-12-31"], ["no shard", "dt=2031-12-31"]


def _no_ds(root):
    return ["run", "job.yaml"], ["--ds"]


def _unset_env(root):
    return ["run", "job.yaml", "--ds", DS, "--set", "output.path=out/${E2E_SURELY_UNSET_VAR}/dt={ds}"], \
        ["E2E_SURELY_UNSET_VAR"]


@pytest.mark.parametrize("case", [_unknown_key, _missing_key, _bad_value, _set_unknown_key,
                                  _unknown_schema, _preprocess_import, _no_shards, _no_ds,
                                  _unset_env], ids=lambda f: f.__name__.strip("_"))
def test_usage_errors_exit_2(base, case, monkeypatch):
    monkeypatch.delenv("E2E_SURELY_UNSET_VAR", raising=False)
    args, needles = case(base)
    result = run_cli(*args, cwd=base)
    assert result.returncode == 2, (result.stdout, result.stderr)
    line = one_line_error(result)
    for needle in needles:
        assert needle in line, (needle, line)
    assert not (base / "out" / f"dt={DS}").exists()


def test_failure_inside_pipeline_is_one_line_exit_5(base, tmp_path):
    """A worker-side failure (here: the output folder cannot be created) is exit 5 and one
    line, not Beam's logged traceback."""
    root = copy_project(base, tmp_path / "p")
    out = root / "out" / f"dt={DS}"
    out.mkdir(parents=True)
    (out / "predictions").write_text("a file where a folder must go\n")
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=root)
    assert result.returncode == 5, (result.stdout, result.stderr)
    one_line_error(result)
    assert not (out / "_manifest.json").exists()


# -- exit 3: contract ---------------------------------------------------------------------------

def _contract_failure(root: Path, *args: str) -> str:
    result = run_cli("run", "job.yaml", "--ds", DS, *args, cwd=root)
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert not (root / "out").exists(), "a contract failure must stop before any work"
    return one_line_error(result)


def _declared(root: Path) -> dict:
    return json.loads((root / "models" / "model.onnx.batchinfer.json").read_text())


def test_missing_declaration_exit_3(base, tmp_path):
    root = copy_project(base, tmp_path / "p")
    (root / "models" / "model.onnx.batchinfer.json").unlink()
    line = _contract_failure(root)
    assert "declaration" in line and "stamp" in line


def test_model_bytes_changed_exit_3(base, tmp_path):
    root = copy_project(base, tmp_path / "p")
    declared = _declared(root)
    make_mlp_onnx(root / "models" / "model.onnx", seed=1)    # valid ONNX, other weights
    found = hashlib.sha256((root / "models" / "model.onnx").read_bytes()).hexdigest()
    assert found != declared["model_digest"]
    line = _contract_failure(root)
    assert "model_digest" in line
    assert declared["model_digest"] in line and found in line


def test_schema_new_version_exit_3(base, tmp_path):
    root = copy_project(base, tmp_path / "p")
    write_schema(root / "schemas", version=2, low=-20, high=20)
    line = _contract_failure(root, "--set", "schema=feats@2")
    assert "schema_version" in line and "feats@1" in line and "feats@2" in line


def test_preprocess_edited_exit_3(base, tmp_path):
    root = copy_project(base, tmp_path / "p")
    declared = _declared(root)
    assert declared["preprocess_hash"] == prep_hash(PREP_SOURCE)       # contract §1 formula
    edited = PREP_SOURCE + "# tuned\n"
    (root / f"{PREP}.py").write_text(edited)
    line = _contract_failure(root)
    assert "preprocess_hash" in line
    assert declared["preprocess_hash"] in line and prep_hash(edited) in line


def test_spec_model_version_differs_exit_3(base, tmp_path):
    root = copy_project(base, tmp_path / "p")
    line = _contract_failure(root, "--set", "model.version=model:2")
    assert "model:1" in line and "model:2" in line


def test_committed_partition_other_triple(base, tmp_path):
    root = copy_project(base, tmp_path / "p")
    out = root / "out" / f"dt={DS}"
    first = run_cli("run", "job.yaml", "--ds", DS, cwd=root)
    assert first.returncode == 0, first.stderr
    old = json.loads((out / "_manifest.json").read_text())
    # a new model, properly stamped: the job is consistent, but the partition has another triple
    make_mlp_onnx(root / "models" / "model.onnx", seed=1)
    stamp = run_cli("stamp", "models/model.onnx", "--job", "job.yaml", "--model-version", "model:2",
                    cwd=root)
    assert stamp.returncode == 0, stamp.stderr
    before = snapshot(out)
    conflict = run_cli("run", "job.yaml", "--ds", DS, cwd=root)
    assert conflict.returncode == 3, (conflict.stdout, conflict.stderr)
    line = one_line_error(conflict)
    assert "--overwrite" in line
    assert old["triple"]["model_digest"] in line and _declared(root)["model_digest"] in line
    assert snapshot(out) == before, "a refused run changed the committed partition"

    over = run_cli("run", "job.yaml", "--ds", DS, "--overwrite", cwd=root)
    assert over.returncode == 0, over.stderr
    preds, quar, new = read_partition(out)
    assert new["attempt"] != old["attempt"]
    assert new["triple"]["model_version"] == "model:2"
    assert new["triple"]["model_digest"] == _declared(root)["model_digest"] != old["triple"]["model_digest"]
    for kind in ("predictions", "quarantine", "_tmp"):
        assert not (out / kind / old["attempt"]).exists()
    listed = {f["path"] for s in new["shards"] for f in s["files"]}
    on_disk = {str(p.relative_to(out)) for kind in ("predictions", "quarantine")
               for p in (out / kind).rglob("*") if p.is_file()}
    assert on_disk == listed
    assert set(preds["_model_digest"].to_pylist()) == {new["triple"]["model_digest"]}
    assert set(preds["_model_version"].to_pylist()) == {"model:2"}
    # the new model's predictions
    tables = {s["path"]: pq.read_table(s["path"]) for s in new["shards"]}
    x = np.stack([np.array([tables[s][f][r].as_py() for s, r in
                            zip(preds["_source_shard"].to_pylist(), preds["_source_row"].to_pylist())],
                           dtype=np.float32) for f in ("f0", "f1", "f2", "f3")], axis=1)
    assert np.max(np.abs(preds["y"].to_numpy() - mlp_reference(x, seed=1))) <= 1e-5
    assert new["totals"]["rows_scored"] == 1000 and quar.num_rows == 0
