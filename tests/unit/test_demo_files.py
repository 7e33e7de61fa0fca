"""The credit-risk demo: package data, the repository's copy of it, and what write_demo writes."""
from __future__ import annotations

import ast
import importlib.util
import math
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchinfer.demo import DEMO_DS, train, write_demo

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE_FILES = REPO / "batchinfer" / "demo" / "files"


def _load_module(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """P(score of a random positive > score of a random negative), ties counted half."""
    labels = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    negatives = np.sort(scores[~labels])
    positives = scores[labels]
    below = np.searchsorted(negatives, positives, side="left")
    not_above = np.searchsorted(negatives, positives, side="right")
    return float(np.mean(below + 0.5 * (not_above - below)) / len(negatives))


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, pathlib.Path]:
    folder = tmp_path_factory.mktemp("demo")
    paths = write_demo(folder)
    return {"folder": folder, **paths}


@pytest.fixture(scope="module")
def schema_module(demo):
    return _load_module(demo["folder"] / "schemas" / "credit_features" / "v1.py", "demo_v1")


@pytest.fixture(scope="module")
def preprocess(demo):
    return _load_module(demo["folder"] / "credit_preprocess.py", "demo_credit_preprocess")


@pytest.fixture(scope="module")
def shards(demo) -> list[pa.Table]:
    return [pq.read_table(path) for path in sorted(demo["data"].glob("*.parquet"))]


# --- package data and the repository's copy ---------------------------------------------------


def test_repository_schema_and_preprocess_are_the_package_data():
    """One source: the repository's job uses the demo's package data through symbolic links."""
    for repo_path, package_path in (("schemas/credit_features/v1.py", "schemas/credit_features/v1.py"),
                                    ("pipelines/credit_risk/credit_preprocess.py", "credit_preprocess.py")):
        assert (REPO / repo_path).is_symlink(), repo_path
        assert (REPO / repo_path).resolve() == (PACKAGE_FILES / package_path).resolve()


def test_package_data_has_no_python_packages():
    # files/ is data copied out, never imported as batchinfer.demo.files.
    assert not list(PACKAGE_FILES.rglob("__init__.py"))


def test_demo_job_spec():
    spec = yaml.safe_load((PACKAGE_FILES / "job.yaml").read_text())
    assert spec == {
        "name": "credit_risk_demo",
        "input": {"path": "data/dt={ds}/*.parquet"},
        "schema": "credit_features@1",
        "schemas": {"root": "schemas"},
        "preprocess": "credit_preprocess:transform",
        "model": {
            "uri": "models/credit_risk.onnx",
            "backend": "onnxruntime",
            "device": "auto",
            "version": "credit_risk:1",
        },
        "output": {
            "path": "out/dt={ds}",
            "id_columns": ["customer_id"],
            "predictions": {"probability": "default_probability"},
        },
        "quarantine": {"max_bad_fraction": 0.01, "max_bad_shards": 0},
        "batch": {"rows": 65536},
        "explain": {"method": "permutation", "samples": 4, "top_k": 5, "fraction": 0.1},
        "tracking": {"uri": "sqlite:///mlflow.db", "experiment": "credit_risk_demo"},
    }


def test_repository_job_is_the_demo_job_pointed_at_production():
    demo_spec = yaml.safe_load((PACKAGE_FILES / "job.yaml").read_text())
    repo_spec = yaml.safe_load((REPO / "pipelines/credit_risk/job.yaml").read_text())
    expected = {**demo_spec, "name": "credit_risk_nightly"}
    expected["input"] = {"path": "${CREDIT_FEATURES_URL}/dt={ds}/*.parquet"}
    expected["schemas"] = {"root": "../../schemas"}
    expected["model"] = {**demo_spec["model"], "uri": "models:/credit_risk/1"}
    expected["output"] = {**demo_spec["output"], "path": "${CREDIT_SCORES_URL}/dt={ds}"}
    expected["tracking"] = {"uri": "${CREDIT_TRACKING_URI}", "experiment": "credit_risk_nightly"}
    assert repo_spec == expected
    # The schema root resolves from the job's folder to the repository's schemas/.
    root = (REPO / "pipelines/credit_risk" / repo_spec["schemas"]["root"]).resolve()
    assert (root / "credit_features" / "v1.py").is_file()


# --- write_demo ------------------------------------------------------------------------------


def test_write_demo_layout(demo):
    folder = demo["folder"]
    assert demo["job"] == folder / "job.yaml"
    assert demo["model"] == folder / "models" / "credit_risk.onnx"
    assert demo["data"] == folder / "data" / f"dt={DEMO_DS}"
    assert DEMO_DS == "2026-01-31"
    for copied in ["job.yaml", "schemas/credit_features/v1.py", "credit_preprocess.py"]:
        assert (folder / copied).read_bytes() == (PACKAGE_FILES / copied).read_bytes()
    assert sorted(p.name for p in demo["data"].iterdir()) == [
        f"part-{i:05d}.parquet" for i in range(6)
    ]


def test_write_demo_is_deterministic(demo, tmp_path):
    again = write_demo(tmp_path / "again")
    first = {p.relative_to(demo["folder"]): p for p in demo["folder"].rglob("*") if p.is_file()}
    second = {p.relative_to(tmp_path / "again"): p for p in (tmp_path / "again").rglob("*")
              if p.is_file()}
    assert sorted(first) == sorted(second)
    for relative, path in first.items():
        assert path.read_bytes() == second[relative].read_bytes(), relative
    assert again["model"].read_bytes() == demo["model"].read_bytes()


def test_write_demo_rejects_uneven_shards(tmp_path):
    with pytest.raises(ValueError, match="multiple"):
        write_demo(tmp_path, rows=1001, shards=6)
    assert not any(tmp_path.iterdir())  # nothing written


# --- data against the schema -----------------------------------------------------------------


def test_shards_have_the_schema_columns_and_arrow_types(shards, schema_module):
    assert len(shards) == 6
    for table in shards:
        assert table.num_rows == 20_000
        assert table.column_names == list(schema_module.SCHEMA.columns)
        assert table.schema.remove_metadata() == train.ARROW_SCHEMA
        assert {str(t) for t in table.schema.types} == {"int64", "double", "string", "bool"}
    ids = pa.concat_tables(shards)["customer_id"].to_numpy()
    assert len(np.unique(ids)) == len(ids)


def test_schema_module_shape(schema_module):
    import pandera.polars as pa_polars

    assert isinstance(schema_module.SCHEMA, pa_polars.DataFrameSchema)
    assert schema_module.SCHEMA.strict is True
    columns = list(schema_module.SCHEMA.columns)
    assert columns[0] == "customer_id"
    assert schema_module.FEATURES == columns[1:]
    assert 20 <= len(columns) <= 30
    nullable = {name for name, col in schema_module.SCHEMA.columns.items() if col.nullable}
    assert nullable == {"employment_years", "delinquencies_2y", "months_since_last_delinquency"}


def test_exactly_the_deliberately_bad_rows_fail_the_schema(shards, schema_module):
    import pandera.polars as pa_polars
    import polars as pl

    failures = set()
    for shard, table in enumerate(shards):
        try:
            schema_module.SCHEMA.validate(pl.from_arrow(table), lazy=True)
        except pa_polars.errors.SchemaErrors as error:
            cases = error.failure_cases
            assert cases["index"].null_count() == 0  # row-level failures only
            failures |= {(shard, row, column) for row, column in
                         cases.select("index", "column").iter_rows()}
    expected = {(bad.shard, bad.row % 20_000, bad.column) for bad in train.BAD_ROWS}
    assert failures == expected
    assert len({(shard, row) for shard, row, _ in failures}) == 5
    assert 5 / 120_000 < 0.01  # well inside quarantine.max_bad_fraction


def test_bad_rows_values(shards):
    assert shards[1]["age"][1234].as_py() == -3
    assert shards[2]["annual_income"][4321].as_py() is None
    assert shards[3]["home_ownership"][15_000].as_py() == "CASTLE"
    assert math.isnan(shards[4]["debt_to_income"][777].as_py())
    assert shards[4]["interest_rate"][19_999].as_py() == 300.0


def test_generated_data_is_plausible(shards):
    table = pa.concat_tables(shards)
    for column in ["employment_years", "delinquencies_2y", "months_since_last_delinquency"]:
        assert 0 < table[column].null_count < table.num_rows
    _, labels = train.generate(20_000, np.random.default_rng(11))
    assert 0.05 < labels.mean() < 0.25


# --- preprocessing -----------------------------------------------------------------------------


def test_input_features_name_the_schema_feature_of_each_model_input_column(preprocess, schema_module):
    assert len(preprocess.INPUT_FEATURES) == len(preprocess.OUTPUT_COLUMNS)
    assert set(preprocess.INPUT_FEATURES) <= set(schema_module.FEATURES)
    for column, feature in zip(preprocess.OUTPUT_COLUMNS, preprocess.INPUT_FEATURES):
        source = {"term_60": "term_months", "employment_years_missing": "employment_years",
                  "delinquencies_2y_missing": "delinquencies_2y",
                  "no_delinquency_on_file": "months_since_last_delinquency"}.get(column, column)
        source = "state" if source.startswith("region=") else source.split("=")[0]
        assert feature == source, column


def test_preprocess_module_is_self_contained(preprocess):
    source = (PACKAGE_FILES / "credit_preprocess.py").read_text()
    tree = ast.parse(source)
    assert ast.get_docstring(tree)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported <= {"numpy", "pyarrow", "__future__"}
    assert preprocess.ASSETS == []
    assert callable(preprocess.transform)


def _valid_rows(table: pa.Table, rows: int) -> pa.RecordBatch:
    batch = table.combine_chunks().to_batches()[0]
    return batch.slice(0, rows)


def test_preprocess_output_shape_and_dtype(preprocess, shards):
    # One default batch of 65 536 rows, from shards 0 and 5, which have no bad rows.
    table = pa.concat_tables([shards[0], shards[5], shards[0], shards[5]])
    batch = table.slice(0, 65_536).combine_chunks().to_batches()[0]
    features = preprocess.transform(batch)
    assert isinstance(features, np.ndarray)
    assert features.dtype == np.float32
    assert features.shape == (65_536, len(preprocess.OUTPUT_COLUMNS))
    assert features.flags.c_contiguous
    assert np.isfinite(features).all()
    assert np.array_equal(features, preprocess.transform(batch))  # deterministic


def test_preprocess_is_independent_of_batching(preprocess, shards):
    batch = _valid_rows(shards[0], 5_000)
    whole = preprocess.transform(batch)
    pieces = np.concatenate(
        [preprocess.transform(batch.slice(start, 777)) for start in range(0, 5_000, 777)]
    )
    assert np.array_equal(whole, pieces)


def _reference_row(preprocess, row: dict) -> list[float]:
    """What transform must give for one row, spelled out plainly."""
    values = []
    for name, (kind, mean, scale) in preprocess.NUMERIC.items():
        x = row[name] if row[name] is not None else preprocess.IMPUTE[name]
        x = math.log1p(x) if kind == "log1p" else float(x)
        values.append((x - mean) / scale)
    values += [
        float(row["term_months"] == 60),
        float(row["has_cosigner"]),
        float(row["employment_years"] is None),
        float(row["delinquencies_2y"] is None),
        float(row["months_since_last_delinquency"] is None),
    ]
    for name, categories in preprocess.CATEGORIES.items():
        values += [float(row[name] == category) for category in categories]
    region = preprocess.STATE_REGION.get(row["state"])
    values += [float(region == r) for r in preprocess.REGIONS]
    return values


def test_preprocess_matches_the_reference(preprocess, shards):
    batch = _valid_rows(shards[0], 400)
    features = preprocess.transform(batch)
    expected = np.array([_reference_row(preprocess, row) for row in batch.to_pylist()],
                        dtype=np.float32)
    np.testing.assert_allclose(features, expected, rtol=1e-6, atol=1e-6)
    # The sample covers the nulls being imputed.
    for column in ["employment_years", "delinquencies_2y", "months_since_last_delinquency"]:
        assert batch.column(column).null_count > 0


def test_preprocess_one_hot_groups(preprocess, shards):
    batch = _valid_rows(shards[5], 20_000)
    features = preprocess.transform(batch)
    names = preprocess.OUTPUT_COLUMNS
    for prefix in ["grade=", "home_ownership=", "loan_purpose=", "region="]:
        group = [j for j, name in enumerate(names) if name.startswith(prefix)]
        assert np.array_equal(features[:, group].sum(axis=1), np.ones(len(batch)))
    # An unseen category or state gives all zeros in its group, not an error.
    odd = pa.RecordBatch.from_pylist(
        [{**batch.slice(0, 1).to_pylist()[0], "grade": "Z", "state": "XX"}], schema=batch.schema
    )
    row = preprocess.transform(odd)[0]
    for prefix in ["grade=", "region="]:
        assert all(row[j] == 0 for j, name in enumerate(names) if name.startswith(prefix))


# --- the model ---------------------------------------------------------------------------------


def test_model_graph(demo, preprocess):
    import onnx

    model = onnx.load(str(demo["model"]))
    onnx.checker.check_model(model)
    assert model.producer_name == "batchinfer-demo"
    assert model.doc_string
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    (features,) = model.graph.input
    (probability,) = model.graph.output
    assert features.name == "features" and probability.name == "probability"
    dims = features.type.tensor_type.shape.dim
    assert dims[0].dim_param and dims[1].dim_value == len(preprocess.OUTPUT_COLUMNS)
    assert features.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    out_dims = probability.type.tensor_type.shape.dim
    assert out_dims[0].dim_param and out_dims[1].dim_value == 1
    assert {n.op_type for n in model.graph.node} == {"MatMul", "Add", "Relu", "Sigmoid"}


def test_model_scores_held_out_data(demo, preprocess):
    import onnxruntime as ort

    session = ort.InferenceSession(str(demo["model"]), providers=["CPUExecutionProvider"])
    table, labels = train.generate(20_000, np.random.default_rng(2026))
    features = preprocess.transform(table.combine_chunks().to_batches()[0])
    (probability,) = session.run(["probability"], {"features": features})
    assert probability.dtype == np.float32 and probability.shape == (20_000, 1)
    assert ((probability > 0) & (probability < 1)).all()
    auc = _auc(labels, probability)
    assert auc > 0.7
    assert train.auc(labels, probability) == pytest.approx(auc, abs=1e-12)


def test_model_scores_the_demo_partition(demo, preprocess, shards):
    import onnxruntime as ort

    session = ort.InferenceSession(str(demo["model"]), providers=["CPUExecutionProvider"])
    features = preprocess.transform(_valid_rows(shards[0], 20_000))
    (probability,) = session.run(None, {"features": features})
    assert np.isfinite(probability).all()
    assert 0.03 < probability.mean() < 0.3
