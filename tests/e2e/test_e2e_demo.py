"""End-to-end: `python -m batchinfer demo` writes, stamps and scores the credit-risk demo
(contract §2 `demo`), and a second `demo` is a no-op (contract §4, §5.3)."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from factories import all_input_rows, read_partition, run_cli

pytestmark = pytest.mark.slow

ROWS = 12_000
SHARDS = 6          # what `demo` writes


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from batchinfer.demo import DEMO_DS

    tmp = tmp_path_factory.mktemp("demo")
    folder = tmp / "demo"
    r = {"folder": folder, "out": folder / "out" / f"dt={DEMO_DS}",
         "data": folder / "data" / f"dt={DEMO_DS}"}
    r["first"] = run_cli("demo", "--dir", str(folder), "--rows", str(ROWS), cwd=tmp)
    assert r["first"].returncode == 0, (r["first"].stdout, r["first"].stderr)
    r["before"] = snapshot(r["out"])
    r["manifest"] = (r["out"] / "_manifest.json").read_bytes()
    r["second"] = run_cli("demo", "--dir", str(folder), "--rows", str(ROWS), cwd=tmp)
    r["after"] = snapshot(r["out"])
    r["manifest_after"] = (r["out"] / "_manifest.json").read_bytes()
    return r


def expected_bad_rows(data: Path) -> dict[tuple[str, int], object]:
    """(shard path, row) → BadRow, as the demo breaks them: rows wrap modulo the shard size."""
    from batchinfer.demo.train import BAD_ROWS

    shard_rows = ROWS // SHARDS
    shards = sorted(p.resolve() for p in data.glob("*.parquet"))
    assert len(shards) == SHARDS
    return {(str(shards[b.shard]), b.row % shard_rows): b for b in BAD_ROWS if b.shard < SHARDS}


def test_demo_scores_and_summarises(demo):
    out = demo["first"].stdout
    assert "batchinfer demo: 12,000 rows in 6 shards" in out
    preds, quar, manifest = read_partition(demo["out"])
    bad = expected_bad_rows(demo["data"])
    assert len(bad) == 5
    assert f"{ROWS - len(bad):,} scored, {len(bad):,} quarantined" in out
    assert manifest["totals"] == {"shards": SHARDS, "rows_in": ROWS, "rows_scored": ROWS - len(bad),
                                  "rows_quarantined": len(bad), "shards_unreadable": 0}
    assert manifest["triple"]["model_version"] == "credit_risk:1"
    assert manifest["triple"]["schema_version"] == "credit_features@1"
    assert "default_probability" in preds.column_names
    probs = preds["default_probability"].to_pylist()
    assert all(0.0 <= p <= 1.0 for p in probs)
    shards = sorted(p.resolve() for p in demo["data"].glob("*.parquet"))
    pairs = (list(zip(preds["_source_shard"].to_pylist(), preds["_source_row"].to_pylist()))
             + list(zip(quar["_source_shard"].to_pylist(), quar["_source_row"].to_pylist())))
    assert len(pairs) == len(set(pairs)) and set(pairs) == all_input_rows(shards)
    for shard in manifest["shards"]:
        for f in shard["files"]:
            data = (demo["out"] / f["path"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == f["sha256"]


def test_demo_explains_a_tenth_of_its_scores_in_the_schemas_features(demo):
    preds, _, _ = read_partition(demo["out"])
    explained = [e for e in preds["_explanation"].to_pylist() if e is not None]
    assert 0.05 * preds.num_rows < len(explained) < 0.15 * preds.num_rows
    features = {e["feature"] for entry in explained for e in entry}
    assert all(len(entry) == 5 for entry in explained) and "grade" in features
    assert not any("=" in f for f in features)   # one-hot columns summed into their feature
    assert "  why          " in demo["first"].stdout


def test_demo_bad_rows_are_quarantined(demo):
    _, quar, _ = read_partition(demo["out"])
    bad = expected_bad_rows(demo["data"])
    got = {(r["_source_shard"], r["_source_row"]): r for r in quar.to_pylist()}
    assert set(got) == set(bad)
    for key, row in got.items():
        broken = bad[key]
        assert row["_column"] == broken.column, (key, row["_reason"])
        values = json.loads(row["_values"])
        value = values[broken.column]
        if broken.value is None:
            assert value is None
        elif isinstance(broken.value, float) and math.isnan(broken.value):
            assert value == "NaN"
        else:
            assert value == broken.value
        original = pq.read_table(key[0]).slice(key[1], 1).to_pylist()[0]
        assert values["customer_id"] == original["customer_id"]


def test_second_demo_is_a_noop(demo):
    second = demo["second"]
    assert second.returncode == 0, (second.stdout, second.stderr)
    assert "already committed" in second.stdout
    assert demo["after"] == demo["before"]
    assert demo["manifest_after"] == demo["manifest"]


@pytest.mark.parametrize("rows", ["20000", "0", "-6"])
def test_demo_rows_not_a_multiple_of_six_is_a_usage_error(tmp_path, rows):
    result = run_cli("demo", "--dir", str(tmp_path / "d"), "--rows", rows, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "give a positive multiple of 6" in lines[0]
    assert not (tmp_path / "d").exists()


def test_demo_prepares_the_nightly_job(demo):
    """What README's "Nightly with Airflow" needs (tests/e2e/test_airflow.py runs it): each date's
    features with its marker, models:/credit_risk/1 registered once (two demos ran) and stamped
    like the demo's model file, and the variables in demo/nightly.env."""
    from batchinfer.demo.nightly import NIGHTLY_DATES
    from batchinfer.io.tracking import mlflow_client
    from batchinfer.triple.contract import PARTS, declaration_from_tags

    folder = demo["folder"]
    assert "  nightly      . " in demo["first"].stdout and "  nightly      . " in demo["second"].stdout
    shards = {p.name: p.read_bytes() for p in demo["data"].glob("*.parquet")}
    for ds in NIGHTLY_DATES:
        partition = folder / "features" / f"dt={ds}"
        assert {p.name: p.read_bytes() for p in partition.glob("*.parquet")} == shards
        assert (partition / "_SUCCESS").read_bytes() == b""
    env = dict(line.removeprefix("export ").split("=", 1) for line in
               (folder / "nightly.env").read_text().splitlines() if line.startswith("export "))
    store = f"sqlite:///{folder.resolve()}/mlflow.db"
    assert env == {"CREDIT_FEATURES_URL": str((folder / "features").resolve()),
                   "CREDIT_SCORES_URL": str((folder / "scores").resolve()),
                   "CREDIT_TRACKING_URI": store,
                   "AIRFLOW_HOME": str((folder / "airflow").resolve()),
                   "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    [version] = mlflow_client(store).search_model_versions("name = 'credit_risk'")
    assert str(version.version) == "1"
    sidecar = json.loads((folder / "models" / "credit_risk.onnx.batchinfer.json").read_text())
    declared = declaration_from_tags(version.tags)
    assert {k: declared[k] for k in PARTS} == {k: sidecar[k] for k in PARTS}
