"""End-to-end: `explain:` (contract §6 "Explanations"), driven through the CLI.

Linear models, whose true attributions are known — ``w · (x − baseline)`` — are explained by every
method (gradient × input and integrated gradients on the torch backend, permutation Shapley values
on ONNX Runtime and torch) and held to them; reruns give the same bytes of attribution, whatever
batch a row falls in; the declaration carries the method and its parameters (another one: exit
3); completeness is counted and gates the run (exit 4), and attributions that are not finite stop
it (exit 4); what cannot be explained — a setting that is not a finite number in its range among
them — is refused before any work (exit 2).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import artefacts
import numpy as np
import pyarrow.parquet as pq
import pytest

from batchinfer.rows.columns import EXPLAINED
from factories import (
    DS,
    make_shards,
    one_line_error,
    read_partition,
    run_cli,
    save_onnx,
    snapshot,
    write_job,
    write_schema,
)

torch = pytest.importorskip("torch")
pytest.importorskip("captum")

pytestmark = pytest.mark.slow

W = np.array([0.5, -2.0, 1.25, 3.0], dtype=np.float32)
B = 0.25
FEATURES = ["f0", "f1", "f2", "f3"]
BASELINE = [0.5, -0.5, 1.0, 0.0]
ROWS = 300

# torch.export programs: linear (x @ W + B), logistic (sigmoid of it) and kinked (|f0| + x @ W + B,
# its |f0| as sqrt(f0²), whose gradient is not finite where f0 is 0), out [N, 1] named "y".
MAKE_PROGRAMS = textwrap.dedent(f'''\
    import sys
    import torch

    class Linear(torch.nn.Module):
        def __init__(self, squash):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor({W.tolist()}).reshape(4, 1))
            self.squash = squash

        def forward(self, x):
            y = x @ self.w + {B}
            return torch.sigmoid(3.0 * y) if self.squash else y

    class Kinked(Linear):
        # |f0| as sqrt(f0²) beside the linear part: its gradient is 0/0 (NaN) where f0 is 0
        def forward(self, x):
            return torch.sqrt(x[:, :1] * x[:, :1]) + x @ self.w + {B}

    for name, model in (("linear", Linear(False)), ("logistic", Linear(True)),
                        ("kinked", Kinked(False))):
        program = torch.export.export(model.eval(), (torch.randn(8, 4),),
                                      dynamic_shapes=({{0: torch.export.Dim("batch")}},))
        torch.export.save(program, f"{{sys.argv[1]}}/{{name}}.pt2")
    ''')


def _programs(folder: Path) -> None:
    made = subprocess.run([sys.executable, "-c", MAKE_PROGRAMS, str(folder)], capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr


@pytest.fixture(scope="module")
def programs() -> Path:
    return artefacts.cached("explain-linear", _programs, packages=artefacts.TORCH_EXPORT,
                            sources=["tests/e2e/test_e2e_explain.py"])


def linear_onnx(path: Path, w: np.ndarray = W) -> Path:
    """x @ w + B as ONNX: ``w`` of [positions] (output [N, 1]) or [positions, K] (output [N, K])."""
    from onnx import TensorProto, helper, numpy_helper

    w = w.reshape(w.shape[0], -1)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", w.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", w.shape[1]])],
        [numpy_helper.from_array(w.astype(np.float32), "w"),
         numpy_helper.from_array(np.array([B], np.float32), "b")])
    return save_onnx(graph, path)


def project(root: Path, model: Path, explain: dict, *, backend: str = "torch",
            stamp: bool = True, preprocess: str | None = None, **sections) -> Path:
    write_schema(root / "schemas")
    make_shards(root / "data" / f"dt={DS}", shards=2, rows=ROWS)
    target = root / "models" / model.name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(model.read_bytes())
    write_job(root, extra={"explain": explain, "model": {"uri": f"models/{model.name}",
                                                         "backend": backend, "device": "cpu"}},
              preprocess=preprocess, **sections)
    if stamp:
        stamped = run_cli("stamp", f"models/{model.name}", "--job", "job.yaml", "--model-version",
                          "lin:1", cwd=root)
        assert stamped.returncode == 0, stamped.stderr
    return root


def scored(root: Path, *args: str):
    result = run_cli("run", "job.yaml", "--ds", DS, *args, cwd=root)
    assert result.returncode == 0, result.stderr
    predictions, _, manifest = read_partition(root / "out" / f"dt={DS}")
    return predictions, manifest


def inputs(predictions) -> np.ndarray:
    """Each scored row's features, read back from its shard by (_source_shard, _source_row)."""
    rows = []
    cache: dict[str, object] = {}
    for shard, row in zip(predictions.column("_source_shard").to_pylist(),
                          predictions.column("_source_row").to_pylist()):
        table = cache.setdefault(shard, pq.read_table(shard))
        rows.append([table.column(f)[row].as_py() for f in FEATURES])   # type: ignore[attr-defined]
    return np.array(rows, dtype=np.float64)


def as_vectors(explanations: list) -> np.ndarray:
    """``top_k: all`` lists in input order → [rows, features]; checks the names."""
    for entry in explanations:
        assert [e["feature"] for e in entry] == FEATURES
    return np.array([[e["attribution"] for e in entry] for entry in explanations])


@pytest.mark.parametrize("method, baseline, tolerance", [
    ("gradient_x_input", "zeros", 1e-5),
    ("integrated_gradients", BASELINE, 1e-4),
    ("permutation", BASELINE, 1e-5),
])
def test_torch_methods_find_the_true_attributions_of_a_linear_model(programs, tmp_path, method,
                                                                   baseline, tolerance):
    root = project(tmp_path / "p", programs / "linear.pt2",
                   {"method": method, "baseline": baseline, "top_k": "all"})
    predictions, manifest = scored(root)
    x = inputs(predictions)
    base = np.zeros(4) if baseline == "zeros" else np.array(baseline)
    got = as_vectors(predictions.column("_explanation").to_pylist())
    np.testing.assert_allclose(got, W.astype(np.float64) * (x - base), atol=tolerance)
    np.testing.assert_allclose(predictions.column("_explanation_baseline").to_numpy(),
                               float(base @ W + B), atol=1e-5)
    schema = pq.read_schema(root / "out" / f"dt={DS}" / manifest["shards"][0]["files"][0]["path"])
    meta = json.loads(schema.metadata[b"batchinfer.explain"])
    assert meta["features_from"] == "schema" and meta["features"] == FEATURES
    for declared in EXPLAINED:   # the types rows/columns.py declares (Parquet calls items "element")
        assert str(schema.field(declared.name).type).replace("<element: ", "<item: ") == declared.type
    assert meta["declared"]["method"] == method
    # the column sits beside the predictions, before the audit columns
    names = predictions.column_names
    assert names[0] == "id" and names[2:4] == ["_explanation", "_explanation_baseline"]
    assert names[4] == "_source_shard" and meta["output"] == names[1]   # torch names it "add"
    metrics = json.loads((root / "out" / f"dt={DS}" / "_metrics.json").read_text())["metrics"]
    assert metrics["explain_rows"] == 2 * ROWS and metrics["explain_incomplete_rows"] == 0
    assert metrics["explain_max_completeness_gap"] < 1e-4
    # f3 and f1 weigh most: the top features by mean |attribution|, in the report too
    assert metrics["explain_mean_abs.f3"] > metrics["explain_mean_abs.f1"] > metrics["explain_mean_abs.f0"]
    report = (root / "out" / f"dt={DS}" / "report.html").read_text()
    assert "top features by mean |attribution|" in report
    section = report[report.index("top features by mean"):]
    assert section.index(">f3<") < section.index(">f1<") < section.index(">f0<")


def test_permutation_on_onnx_keeps_the_top_features_and_reruns_bit_identical(tmp_path):
    model = linear_onnx(tmp_path / "lin.onnx")
    root = project(tmp_path / "p", model, {"method": "permutation", "top_k": 2, "samples": 4,
                                           "seed": 7}, backend="onnxruntime")
    first, _ = scored(root)
    x = inputs(first)
    truth = W.astype(np.float64) * x
    explanations = first.column("_explanation").to_pylist()
    for row, entry in zip(truth, explanations):
        order = np.argsort(-np.abs(row), kind="stable")[:2]
        assert [e["feature"] for e in entry] == [FEATURES[i] for i in order]
        np.testing.assert_allclose([e["attribution"] for e in entry], row[order], atol=1e-5)
    again, _ = scored(root, "--overwrite")
    assert again.column("_explanation").to_pylist() == explanations   # bit for bit
    assert again.column("_explanation_baseline").equals(first.column("_explanation_baseline"))


# Five model-input positions from four features: f3 twice (its raw value and a copy).
PREP = textwrap.dedent('''\
    import numpy as np

    {mapping}

    def transform(batch):
        x = np.stack([batch.column(f).to_numpy() for f in ("f0", "f1", "f2", "f3", "f3")], axis=1)
        return x.astype(np.float32)
    ''')
W5 = np.array([0.5, -2.0, 1.25, 3.0, -1.0], dtype=np.float32)


@pytest.mark.parametrize("mapping", [True, False])
def test_feature_names_come_from_the_preprocessings_input_features(tmp_path, mapping):
    model = linear_onnx(tmp_path / "lin5.onnx", W5)
    root = tmp_path / "p"
    root.mkdir()
    declared = 'INPUT_FEATURES = ["f0", "f1", "f2", "f3", "f3"]' if mapping else ""
    (root / "prep.py").write_text(PREP.format(mapping=declared))
    project(root, model, {"method": "permutation", "top_k": "all"}, backend="onnxruntime",
            preprocess="prep:transform")
    predictions, manifest = scored(root)
    x = inputs(predictions)
    explanations = predictions.column("_explanation").to_pylist()
    first = root / "out" / f"dt={DS}" / manifest["shards"][0]["files"][0]["path"]
    meta = json.loads(pq.read_schema(first).metadata[b"batchinfer.explain"])
    if mapping:   # f3's two positions summed: (3.0 - 1.0) * f3
        assert meta["features_from"] == "schema" and meta["features"] == FEATURES
        want = x * np.array([0.5, -2.0, 1.25, 2.0])
        np.testing.assert_allclose(as_vectors(explanations), want, atol=1e-5)
    else:
        names = [f"x[{i}]" for i in range(5)]
        assert meta["features_from"] == "positions" and meta["features"] == names
        assert all([e["feature"] for e in entry] == names for entry in explanations)
        got = np.array([[e["attribution"] for e in entry] for entry in explanations])
        np.testing.assert_allclose(got, x[:, [0, 1, 2, 3, 3]] * W5, atol=1e-5)


def test_a_challenger_is_explained_too_and_diff_compares_the_explanations(tmp_path):
    champion = linear_onnx(tmp_path / "lin.onnx")
    # the challenger weighs f0 most: its top feature differs wherever |6 f0| beats the others
    other = linear_onnx(tmp_path / "other.onnx", np.array([6.0, -2.0, 1.25, 3.0], np.float32))
    root = project(tmp_path / "p", champion, {"method": "permutation", "top_k": 2},
                   backend="onnxruntime")
    (root / "models" / "other.onnx").write_bytes(other.read_bytes())
    import yaml

    spec = yaml.safe_load((root / "job.yaml").read_text())
    spec["model"]["challengers"] = [{"name": "c", "uri": "models/other.onnx", "backend": "onnxruntime",
                                     "device": "cpu"}]
    (root / "job.yaml").write_text(yaml.safe_dump(spec))
    stamped = run_cli("stamp", "models/other.onnx", "--job", "job.yaml", "--challenger", "c",
                      "--model-version", "other:1", cwd=root)
    assert stamped.returncode == 0, stamped.stderr
    _, manifest = scored(root)
    (challenger,) = manifest["challengers"]
    assert json.loads(challenger["model_options"]["explain"])["method"] == "permutation"
    files = [f["path"] for s in challenger["shards"] for f in s["files"]]
    table = pq.read_table(root / "out" / f"dt={DS}" / files[0])
    x = inputs(table)
    truth = x * np.array([6.0, -2.0, 1.25, 3.0])
    for row, entry in zip(truth, table.column("_explanation").to_pylist()):
        order = np.argsort(-np.abs(row), kind="stable")[:2]
        assert [e["feature"] for e in entry] == [FEATURES[i] for i in order]
    result = run_cli("diff", f"out/dt={DS}", "--challenger", "c", "--json", cwd=root)
    assert result.returncode == 0, result.stderr
    compared = json.loads(result.stdout)["explanations"]
    assert compared["rows"] == 2 * ROWS
    assert 0.0 < compared["top1_agreement"] < 1.0
    assert compared["top_features_a"][0] == "f3" and compared["top_features_b"][0] == "f0"
    text = run_cli("diff", f"out/dt={DS}", "--challenger", "c", cwd=root)
    assert "explanations: top feature agrees" in text.stdout


def test_drift_of_why_fails_the_run_while_the_predictions_have_not_moved(tmp_path):
    import pyarrow as pa
    import yaml

    model = linear_onnx(tmp_path / "lin.onnx")
    root = project(tmp_path / "p", model, {"method": "permutation", "top_k": "all", "samples": 2},
                   backend="onnxruntime")
    scored(root)
    made = run_cli("profile", "job.yaml", "--ds", DS, "--out", "base.json", cwd=root)
    assert made.returncode == 0, made.stderr
    base = json.loads((root / "base.json").read_text())["columns"]
    assert {f"_explanation.{f}" for f in FEATURES} <= set(base)
    # Another day: -2 f1 and 3 f3 trade their spreads (3 g and 2 h for standard normal g, h),
    # so y = w·x + b has the same distribution but f1, not f3, now drives the scores.
    rng = np.random.default_rng(11)
    day = "2026-01-16"
    folder = root / "data" / f"dt={day}"
    folder.mkdir(parents=True)
    for s in range(2):
        g = np.clip(rng.standard_normal((ROWS, 4)), -3, 3)
        cols = {"id": np.arange(s * ROWS, (s + 1) * ROWS, dtype=np.int64),
                "f0": g[:, 0], "f1": -1.5 * g[:, 1], "f2": g[:, 2], "f3": (2 / 3) * g[:, 3]}
        pq.write_table(pa.table({k: (v if k == "id" else v.astype(np.float32)) for k, v in cols.items()}),
                       folder / f"part-{s:05d}.parquet")
    spec = yaml.safe_load((root / "job.yaml").read_text())
    spec["monitor"] = {"baseline": "base.json", "warn": {"psi": 0.15}, "fail": {"psi": 0.3}}
    (root / "job.yaml").write_text(yaml.safe_dump(spec))
    result = run_cli("run", "job.yaml", "--ds", day, cwd=root)
    assert result.returncode == 4, result.stderr
    line = one_line_error(result)
    assert "_explanation.f1" in line and "_explanation.f3" in line
    (kept,) = (root / "out" / f"dt={day}" / "_drift").glob("*.json")
    drifts = {d["column"]: d for d in json.loads(kept.read_text())["drift"]}
    for column in ("_explanation.f1", "_explanation.f3"):   # measured, not missing from the run
        assert drifts[column]["level"] == "fail" and drifts[column]["psi"] > 0.3, drifts[column]
    assert drifts["_explanation.f0"]["psi"] < 0.15   # f0's part did not change
    assert drifts["y"]["level"] == "ok"   # the scores themselves did not move


def test_fraction_explains_the_rows_their_input_hash_picks(tmp_path):
    model = linear_onnx(tmp_path / "lin.onnx")
    root = project(tmp_path / "p", model, {"method": "permutation", "fraction": 0.3},
                   backend="onnxruntime")
    predictions, _ = scored(root)
    hashes = predictions.column("_input_hash").to_pylist()
    picked = [int(h, 16) < int(0.3 * 2**64) for h in hashes]
    explained = [e is not None for e in predictions.column("_explanation").to_pylist()]
    assert explained == picked and 0.2 < np.mean(picked) < 0.4
    baseline = predictions.column("_explanation_baseline").to_pylist()
    assert [b is not None for b in baseline] == picked


def test_another_method_or_parameter_is_a_contract_mismatch(programs, tmp_path):
    root = project(tmp_path / "p", programs / "linear.pt2",
                   {"method": "integrated_gradients", "steps": 16})
    sidecar = json.loads((root / "models" / "linear.pt2.batchinfer.json").read_text())
    assert json.loads(sidecar["explain"]) == {"baseline": "zeros", "fraction": 1.0,
                                              "method": "integrated_gradients", "steps": 16,
                                              "top_k": 5}
    other = run_cli("run", "job.yaml", "--ds", DS, "--set", "explain.steps=32", cwd=root)
    assert other.returncode == 3, other.stderr
    assert "was stamped with" in one_line_error(other) and '"steps":16' in other.stderr
    without = run_cli("run", "job.yaml", "--ds", DS, "--set", "explain=null", cwd=root)
    assert without.returncode == 3 and "the job's explain is (none)" in without.stderr
    assert not (root / "out" / f"dt={DS}").exists()


def test_a_model_stamped_without_explain_refuses_a_run_with_it(programs, tmp_path):
    root = project(tmp_path / "p", programs / "linear.pt2", {"method": "gradient_x_input"},
                   stamp=False)
    job = root / "job.yaml"
    import yaml

    spec = yaml.safe_load(job.read_text())
    explain = spec.pop("explain")
    job.write_text(yaml.safe_dump(spec))
    assert run_cli("stamp", "models/linear.pt2", "--job", "job.yaml", "--model-version", "lin:1",
                   cwd=root).returncode == 0
    spec["explain"] = explain
    job.write_text(yaml.safe_dump(spec))
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=root)
    assert result.returncode == 3 and "(no explain)" in one_line_error(result)


def test_completeness_is_counted_and_fails_the_run_above_its_threshold(programs, tmp_path):
    # One integration step on a sigmoid is far from complete: most rows miss a tight tolerance.
    root = project(tmp_path / "p", programs / "logistic.pt2",
                   {"method": "integrated_gradients", "steps": 1, "tolerance": 1e-4,
                    "max_incomplete_fraction": 0.05})
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=root)
    assert result.returncode == 4, result.stderr
    line = one_line_error(result)
    assert "explained rows" in line and "explain.tolerance" in line
    assert not (root / "out" / f"dt={DS}" / "_manifest.json").exists()
    # the same rows under a threshold they meet commit, the count in the metrics
    loose = run_cli("run", "job.yaml", "--ds", DS, "--set", "explain.max_incomplete_fraction=1.0",
                    cwd=root)
    assert loose.returncode == 0, loose.stderr
    metrics = json.loads((root / "out" / f"dt={DS}" / "_metrics.json").read_text())["metrics"]
    assert 0.05 * 2 * ROWS < metrics["explain_incomplete_rows"] <= 2 * ROWS
    assert metrics["explain_max_completeness_gap"] > 1e-4


@pytest.mark.parametrize("change, message", [
    ({"batch": {"rows": 100, "tokens": 512}}, "attributions per token are not supported"),
    ({"model": {"uri": "models/lin.onnx", "backend": "onnxruntime"}}, "only the torch backend"),
    ({"explain": {"method": "permutation", "steps": 3}}, "explain.steps is a parameter of "
                                                         "integrated_gradients"),
    ({"explain": {"method": "permutation", "baseline": [0.0, 1.0]}}, "explain.baseline has 2 values"),
    ({"explain": {"method": "permutation", "output": "z"}}, "explain.output 'z' is not an output"),
])
def test_what_cannot_be_explained_is_refused_before_any_work(tmp_path, change, message):
    model = linear_onnx(tmp_path / "lin.onnx")
    root = project(tmp_path / "p", model, {"method": "gradient_x_input"}, backend="onnxruntime",
                   stamp=False)
    import yaml

    spec = yaml.safe_load((root / "job.yaml").read_text())
    spec.update(change)
    spec.setdefault("explain", {"method": "gradient_x_input"})
    (root / "job.yaml").write_text(yaml.safe_dump(spec))
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=root)
    if result.returncode == 3:   # the declaration is checked first: stamp, then run
        stamped = run_cli("stamp", "models/lin.onnx", "--job", "job.yaml", "--model-version",
                          "lin:1", cwd=root)
        result = run_cli("run", "job.yaml", "--ds", DS, cwd=root) if stamped.returncode == 0 else stamped
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert not (root / "out").exists()


@pytest.fixture(scope="module")
def permutation_project(tmp_path_factory) -> Path:
    """A stamped permutation job on ONNX Runtime, for settings given by --set alone."""
    folder = tmp_path_factory.mktemp("settings")
    return project(folder / "p", linear_onnx(folder / "lin.onnx"), {"method": "permutation"},
                   backend="onnxruntime")


@pytest.mark.parametrize("setting, key", [
    ("explain.baseline=[.nan, 0.0, 0.0, 0.0]", "explain.baseline[0]"),
    ("explain.baseline=[0.0, -.inf, 0.0, 0.0]", "explain.baseline[1]"),
    ("explain.baseline=[]", "explain.baseline"),
    ("explain.tolerance=.nan", "explain.tolerance"),
    ("explain.tolerance=.inf", "explain.tolerance"),
    ("explain.tolerance=-0.5", "explain.tolerance"),
    ("explain.fraction=.nan", "explain.fraction"),
    ("explain.fraction=1.5", "explain.fraction"),
    ("explain.max_incomplete_fraction=.inf", "explain.max_incomplete_fraction"),
    ("explain.max_incomplete_fraction=-0.1", "explain.max_incomplete_fraction"),
    ("explain.samples=0", "explain.samples"),
    ("explain.seed=-1", "explain.seed"),
    ("explain.seed=18446744073709551616", "explain.seed"),
])
def test_a_non_finite_or_out_of_range_explain_setting_is_refused_by_every_command(
        permutation_project, setting, key):
    # contract §6 "Explanations": every numeric explain setting is a finite number in its range,
    # checked with the spec: exit 2 before any work, one line naming the key
    root = permutation_project
    before = snapshot(root)
    for command in (("stamp", "models/lin.onnx", "--job", "job.yaml", "--model-version", "lin:1"),
                    ("plan", "job.yaml", "--ds", DS), ("run", "job.yaml", "--ds", DS)):
        result = run_cli(*command, "--set", setting, cwd=root)
        assert result.returncode == 2, (command, result.stderr)
        line = one_line_error(result, command[0])
        assert key in line, line
    assert not (root / "out").exists()
    assert snapshot(root) == before   # the declaration is not rewritten either


def test_stamp_refuses_a_background_no_run_could_use(tmp_path):
    # the background's mean is the baseline: what a run would refuse (exit 2) is not declared
    model = linear_onnx(tmp_path / "lin.onnx")
    root = project(tmp_path / "p", model, {"method": "permutation", "background": "background.parquet"},
                   backend="onnxruntime", stamp=False)
    (root / "background.parquet").write_bytes(b"not parquet")
    result = run_cli("stamp", "models/lin.onnx", "--job", "job.yaml", "--model-version", "lin:1",
                     cwd=root)
    assert result.returncode == 2, result.stderr
    assert "explain.background" in one_line_error(result, "stamp")
    assert not (root / "models" / "lin.onnx.batchinfer.json").exists()


def _by_row(table) -> dict[tuple[str, int], bytes]:
    """Each row's ``_explanation`` (names and float64 attributions) and
    ``_explanation_baseline`` as bytes, by (_source_shard, _source_row)."""
    keys = zip(table.column("_source_shard").to_pylist(), table.column("_source_row").to_pylist())
    rows = zip(table.column("_explanation").to_pylist(),
               table.column("_explanation_baseline").to_pylist())
    return {key: ("|".join(e["feature"] for e in entry).encode()
                  + np.array([e["attribution"] for e in entry], dtype=np.float64).tobytes()
                  + np.float64(at_base).tobytes())
            for key, (entry, at_base) in zip(keys, rows)}


@pytest.mark.parametrize("method, parameters", [("integrated_gradients", {"steps": 24}),
                                                ("permutation", {"samples": 4})])
def test_a_rows_attributions_do_not_depend_on_its_batch(programs, tmp_path, method, parameters):
    # contract §5.4 and §6 "Explanations": a row's attributions are the same bytes whatever
    # batch.rows, chunking or worker process put it with (a sigmoid: computed by another routine
    # in a vector loop's tail, where a batch's shape puts other rows)
    root = project(tmp_path / "p", programs / "logistic.pt2",
                   {"method": method, "baseline": BASELINE, "top_k": "all", **parameters})
    runs = {"29": ("--set", "batch.rows=29"), "600": ("--set", "batch.rows=600"),
            "64-workers": ("--set", "batch.rows=64", *MULTI_PROCESS)}
    explained, seconds = {}, {}
    for name, sets in runs.items():
        result = run_cli("run", "job.yaml", "--ds", DS, *sets, "--set", f"output.path=out-{name}",
                         cwd=root, timeout=600)
        assert result.returncode == 0, result.stderr
        table, _, _ = read_partition(root / f"out-{name}")
        explained[name] = _by_row(table)
        metrics = json.loads((root / f"out-{name}" / "_metrics.json").read_text())["metrics"]
        seconds[name] = round(metrics["stage_seconds_explain"], 3)
    print(f"{method}: stage_seconds_explain by run: {seconds}")
    reference = explained["600"]
    assert len(reference) == 2 * ROWS
    for name, rows in explained.items():
        differ = [key for key in reference if rows.get(key) != reference[key]]
        assert not differ, f"{len(differ)} of {len(reference)} rows differ with {name}"


@pytest.mark.parametrize("method", ["integrated_gradients", "gradient_x_input"])
def test_non_finite_attributions_fail_the_run_naming_them(programs, tmp_path, method):
    # |f0|'s gradient is 0/0 where f0 = 0, the baseline's too: those rows' attributions are NaN,
    # never complete and not written; exit 4, nothing committed (not a damaged scratch record)
    import pyarrow as pa

    root = project(tmp_path / "p", programs / "kinked.pt2", {"method": method})
    shard = sorted((root / "data" / f"dt={DS}").glob("*.parquet"))[0]
    table = pq.read_table(shard)
    f0 = table.column("f0").to_numpy().copy()
    f0[[3, 50, 51]] = 0.0
    pq.write_table(table.set_column(table.column_names.index("f0"), "f0",
                                    pa.array(f0, pa.float32())), shard)
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=root)
    assert result.returncode == 4, result.stderr
    line = one_line_error(result)
    assert "3 of" in line and "not finite" in line, line
    assert not (root / "out" / f"dt={DS}" / "_manifest.json").exists()


def test_an_output_of_several_values_per_row_is_refused(tmp_path):
    model = linear_onnx(tmp_path / "two.onnx", np.stack([W, -W], axis=1))
    root = project(tmp_path / "p", model, {"method": "permutation"}, backend="onnxruntime")
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=root)
    assert result.returncode == 2, result.stderr
    assert "has 2 values per row: explain explains one score per row" in one_line_error(result)
    assert not (root / "out" / f"dt={DS}" / "_manifest.json").exists()


def test_a_run_killed_after_a_shard_resumes_with_the_same_explanations(tmp_path):
    import forkserver

    model = linear_onnx(tmp_path / "lin.onnx")
    root = project(tmp_path / "p", model, {"method": "permutation", "top_k": 3, "fraction": 0.5},
                   backend="onnxruntime")
    done = run_cli("run", "job.yaml", "--ds", DS, "--set", "output.path=whole", cwd=root)
    assert done.returncode == 0, done.stderr
    whole, _, _ = read_partition(root / "whole")
    killed = forkserver.shared().run("run", "job.yaml", "--ds", DS, cwd=root, fault="shard_done",
                                     track=False)
    assert killed.returncode != 0 and not (root / "out" / f"dt={DS}" / "_manifest.json").exists()
    resumed, manifest = scored(root)
    by_attempt = {s["scored_by"] for s in manifest["shards"]}
    assert len(by_attempt) == 2 and manifest["attempt"] in by_attempt   # one shard adopted
    key = ["_source_shard", "_source_row"]
    a, b = whole.sort_by([(k, "ascending") for k in key]), resumed.sort_by([(k, "ascending") for k in key])
    assert a.column("_explanation").to_pylist() == b.column("_explanation").to_pylist()
    metrics = json.loads((root / "out" / f"dt={DS}" / "_metrics.json").read_text())["metrics"]
    assert metrics["explain_rows"] == sum(e is not None for e in a.column("_explanation").to_pylist())


MULTI_PROCESS = ("--set", "runner.options.direct_num_workers=2",
                 "--set", "runner.options.direct_running_mode=multi_processing")


@pytest.mark.parametrize("backend, explain, share", [
    ("onnxruntime", {"method": "permutation", "top_k": "all"}, False),
    ("torch", {"method": "gradient_x_input", "top_k": "all"}, True),   # through the served model's proxy
])
def test_worker_processes_write_the_explanations_one_process_writes(programs, tmp_path, backend,
                                                                    explain, share):
    model = linear_onnx(tmp_path / "lin.onnx") if backend == "onnxruntime" else programs / "linear.pt2"
    root = project(tmp_path / "p", model, explain, backend=backend)
    here, _ = scored(root)
    sets = [*MULTI_PROCESS, "--set", "output.path=multi"]
    if share:
        sets += ["--set", "model.options.share_across_processes=true"]
    result = run_cli("run", "job.yaml", "--ds", DS, *sets, cwd=root, timeout=600)
    assert result.returncode == 0, result.stderr
    there, _, _ = read_partition(root / "multi")
    key = [(k, "ascending") for k in ("_source_shard", "_source_row")]
    assert (here.sort_by(key).column("_explanation").to_pylist()
            == there.sort_by(key).column("_explanation").to_pylist())


def test_mlflow_gets_the_top_features_by_mean_attribution(tmp_path):
    from mlflow.tracking import MlflowClient

    model = linear_onnx(tmp_path / "lin.onnx")
    root = project(tmp_path / "p", model, {"method": "permutation", "top_k": 2},
                   backend="onnxruntime")
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=root, track=True)
    assert result.returncode == 0, result.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("testjob").experiment_id])
    means = {k.split(".", 1)[1]: v for k, v in run.data.metrics.items() if k.startswith("explain_mean_abs.")}
    assert sorted(means, key=means.get, reverse=True)[:2] == ["f3", "f1"]
    assert run.data.metrics["explain_rows"] == 2 * ROWS


@pytest.mark.parametrize("method", ["permutation", "integrated_gradients"])
def test_a_background_sample_is_the_baseline_and_versioned_with_the_model(programs, tmp_path, method):
    import pyarrow as pa

    model = linear_onnx(tmp_path / "lin.onnx") if method == "permutation" else programs / "linear.pt2"
    root = tmp_path / "p"
    # the background: rows of the schema, one of them bad (quarantined, so left out of the mean)
    rng = np.random.default_rng(5)
    sample = rng.normal(1.0, 0.5, (50, 4)).astype(np.float32)
    sample[7, 2] = 99.0   # outside the schema's [-10, 10]
    root.mkdir()
    table = pa.table({"id": np.arange(50, dtype=np.int64), **{f: sample[:, i] for i, f in enumerate(FEATURES)}})
    pq.write_table(table, root / "background.parquet")
    mean = np.delete(sample, 7, axis=0).astype(np.float64).mean(axis=0)
    project(root, model, {"method": method, "background": "background.parquet", "top_k": "all"},
            backend="onnxruntime" if method == "permutation" else "torch")
    sidecar = json.loads((root / "models" / f"{model.name}.batchinfer.json").read_text())
    assert json.loads(sidecar["explain"])["baseline"] == "background"
    digest = __import__("hashlib").sha256((root / "background.parquet").read_bytes()).hexdigest()
    assert sidecar["explain_background_sha256"] == digest
    predictions, _ = scored(root)
    x = inputs(predictions)
    np.testing.assert_allclose(as_vectors(predictions.column("_explanation").to_pylist()),
                               W.astype(np.float64) * (x - mean), atol=1e-4)
    np.testing.assert_allclose(predictions.column("_explanation_baseline").to_numpy(),
                               mean @ W + B, atol=1e-4)
    # another background: the model explains against another baseline than it was stamped with
    pq.write_table(table.slice(0, 20), root / "background.parquet")
    again = run_cli("run", "job.yaml", "--ds", DS, "--overwrite", cwd=root)
    assert again.returncode == 3 and "explain.background" in one_line_error(again)
