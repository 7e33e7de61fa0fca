"""Challenger models (contract §6 "Challengers"), driven through the CLI and checked from the files.

One job, three challengers beside the champion (a small MLP):
- ``other``: the same architecture with other weights (a genuinely different model);
- ``twin``: a copy of the champion's file stamped as another version (same bytes: its
  predictions must be the champion's, and diff must say rank correlation 1 and zero diffs);
- ``sqrt``: ``sqrt(f0 + 1.5)``, NaN wherever f0 < -1.5: it rejects those rows, which must not
  quarantine them nor change anything the champion commits.
The main partition is compared with a run of the same job without challengers.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from scipy import stats

from factories import (
    DS,
    check_partition,
    make_mlp_onnx,
    mlp_reference,
    numeric_project,
    one_line_error,
    read_partition,
    run_cli,
    save_onnx,
    snapshot,
)

pytestmark = pytest.mark.slow

ROWS, SHARDS, BATCH = 700, 3, 300
BAD = {(1, 5), (1, 600), (2, 0)}   # (shard, row) made invalid (f1 out of range): quarantined
CHALLENGERS = [
    {"uri": "models/other.onnx", "backend": "onnxruntime", "device": "cpu"},   # name: other
    {"name": "twin", "uri": "models/twin/model.onnx", "device": "cpu"},
    {"uri": "models/sqrt.onnx", "device": "cpu"},
]
EXEMPT = {"_inference_id", "_compute_ms"}


def make_sqrt_onnx(path: Path) -> Path:
    """y = sqrt(f0 + 1.5), shape [N, 1]: non-finite where f0 < -1.5."""
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


def set_challengers(folder: Path, challengers: list[dict]) -> None:
    spec = yaml.safe_load((folder / "job.yaml").read_text())
    spec["model"]["challengers"] = challengers
    (folder / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def stamp(folder: Path, model: str, version: str) -> None:
    result = run_cli("stamp", model, "--job", "job.yaml", "--model-version", version, cwd=folder)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("challengers")
    numeric_project(root, shards=SHARDS, rows=ROWS, batch={"rows": BATCH})
    for shard, row in BAD:
        path = root / "data" / f"dt={DS}" / f"part-{shard:05d}.parquet"
        table = pq.read_table(path)
        f1 = table["f1"].to_numpy().copy()
        f1[row] = 99.0
        pq.write_table(table.set_column(2, "f1", pa.array(f1, pa.float32())), path)
    make_mlp_onnx(root / "models" / "other.onnx", seed=5)
    (root / "models" / "twin").mkdir()
    shutil.copyfile(root / "models" / "model.onnx", root / "models" / "twin" / "model.onnx")
    make_sqrt_onnx(root / "models" / "sqrt.onnx")
    stamp(root, "models/other.onnx", "model:2")
    stamp(root, "models/twin/model.onnx", "model:1-twin")
    stamp(root, "models/sqrt.onnx", "sqrt:1")
    return root


@pytest.fixture(scope="module")
def scored(template, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("scored") / "p"
    shutil.copytree(template, root)
    solo = run_cli("run", "job.yaml", "--ds", DS, "--set", "output.path=solo", cwd=root)
    assert solo.returncode == 0, solo.stderr
    set_challengers(root, CHALLENGERS)
    run = run_cli("run", "job.yaml", "--ds", DS, cwd=root, track=True)
    assert run.returncode == 0, run.stderr
    out = root / "out" / f"dt={DS}"
    shards = sorted((root / "data" / f"dt={DS}").resolve().glob("*.parquet"))
    return {"root": root, "out": out, "solo": root / "solo", "shards": shards,
            "manifest": json.loads((out / "_manifest.json").read_text())}


def challenger_table(out: Path, entry: dict) -> pa.Table:
    tables = [pq.read_table(out / f["path"]) for s in entry["shards"] for f in s["files"]]
    return pa.concat_tables(tables)


def canonical(table: pa.Table) -> pa.Table:
    table = table.drop_columns([c for c in table.column_names if c in EXEMPT])
    columns = {}
    for name in table.column_names:
        col = table[name].combine_chunks()
        columns[name] = col.cast(col.type.value_type) if pa.types.is_dictionary(col.type) else col
    return pa.table(columns).sort_by([("_source_shard", "ascending"), ("_source_row", "ascending")])


def by_name(manifest: dict) -> dict[str, dict]:
    return {c["name"]: c for c in manifest["challengers"]}


def diff_json(cwd: Path, *args: str) -> dict:
    result = run_cli("diff", *args, "--json", cwd=cwd)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# -- the manifest and the files ------------------------------------------------------------------

def test_the_manifest_lists_each_challenger_with_its_triple_and_files(scored):
    out, manifest = scored["out"], scored["manifest"]
    champion = manifest["triple"]
    listed = by_name(manifest)
    assert list(listed) == ["other", "twin", "sqrt"]   # the spec's order; default names from stems
    root = scored["root"]
    for name, version, model in (("other", "model:2", "models/other.onnx"),
                                 ("twin", "model:1-twin", "models/twin/model.onnx"),
                                 ("sqrt", "sqrt:1", "models/sqrt.onnx")):
        entry = listed[name]
        assert entry["triple"] == {
            "model_version": version,
            "model_digest": hashlib.sha256((root / model).read_bytes()).hexdigest(),
            "schema_version": champion["schema_version"],
            "preprocess_hash": champion["preprocess_hash"]}
        assert (entry["backend"], entry["device"], entry["model_options"]) == (
            "onnxruntime", "cpu", {"precision": "fp32"})
        assert [s["path"] for s in entry["shards"]] == [s["path"] for s in manifest["shards"]]
        for shard, champ in zip(entry["shards"], manifest["shards"]):
            files = shard["files"]
            assert sum(f["rows"] for f in files) == shard["rows_scored"]
            for f in files:
                assert f["path"].startswith(f"challengers/{name}/{manifest['attempt']}/part-")
                assert hashlib.sha256((out / f["path"]).read_bytes()).hexdigest() == f["sha256"]
                assert pq.read_metadata(out / f["path"]).num_rows == f["rows"]
            # it was given exactly the rows the champion's model was given
            assert shard["rows_scored"] + shard["rows_rejected"] == champ["rows_scored"]
        assert entry["rows_scored"] == sum(s["rows_scored"] for s in entry["shards"])
        assert entry["rows_rejected"] == sum(s["rows_rejected"] for s in entry["shards"])
        assert entry["compute_ms"] > 0
    # nothing under challengers/ that the manifest does not list
    on_disk = {str(p.relative_to(out)) for p in (out / "challengers").rglob("*") if p.is_file()}
    assert on_disk == {f["path"] for c in manifest["challengers"] for s in c["shards"]
                       for f in s["files"]}


def test_challenger_files_have_the_champions_columns_its_triple_and_line_up(scored):
    out, manifest = scored["out"], scored["manifest"]
    preds, _, _ = read_partition(out)
    champion = canonical(preds)
    for entry in manifest["challengers"]:
        table = challenger_table(out, entry)
        assert table.column_names == preds.column_names
        assert table.schema == preds.schema
        for part, value in entry["triple"].items():
            assert set(table[f"_{part}"].to_pylist()) == {value}
        mine = canonical(table)
        keys = set(zip(mine["_source_shard"].to_pylist(), mine["_source_row"].to_pylist()))
        assert len(keys) == mine.num_rows
        theirs = dict(zip(zip(champion["_source_shard"].to_pylist(),
                              champion["_source_row"].to_pylist()),
                          zip(champion["id"].to_pylist(), champion["_input_hash"].to_pylist())))
        assert keys <= set(theirs)   # only rows the champion scored (none quarantined)
        for shard, row, id_, input_hash in zip(mine["_source_shard"].to_pylist(),
                                               mine["_source_row"].to_pylist(),
                                               mine["id"].to_pylist(),
                                               mine["_input_hash"].to_pylist()):
            assert theirs[(shard, row)] == (id_, input_hash)
    twin = canonical(challenger_table(out, by_name(manifest)["twin"]))
    assert twin["y"].equals(champion["y"])    # same bytes, same predictions, bit for bit


def test_a_challenger_rejecting_rows_changes_nothing_of_the_champion(scored):
    out, manifest = scored["out"], scored["manifest"]
    preds, quar, _ = check_partition(out, scored["shards"])
    solo_preds, solo_quar, solo = check_partition(scored["solo"], scored["shards"])
    assert manifest["totals"] == solo["totals"]
    assert manifest["totals"]["rows_quarantined"] == len(BAD)
    assert canonical(preds).equals(canonical(solo_preds))
    assert canonical(quar).sort_by("_source_row").drop_columns(["_source_shard"]).equals(
        canonical(solo_quar).sort_by("_source_row").drop_columns(["_source_shard"]))
    sqrt = by_name(manifest)["sqrt"]
    # the rows the champion scored (ids are unique across shards): count those with f0 < -1.5
    wanted = set(preds["id"].to_pylist())
    inputs = pa.concat_tables([pq.read_table(p) for p in scored["shards"]])
    expected = sum(1 for i, x in zip(inputs["id"].to_pylist(), inputs["f0"].to_pylist())
                   if i in wanted and x + np.float32(1.5) < 0)
    assert expected > 0
    assert sqrt["rows_rejected"] == expected
    assert sqrt["rows_scored"] == preds.num_rows - expected
    assert "non-finite model output in y" in next(s["reason"] for s in sqrt["shards"] if s["reason"])


def test_metrics_name_each_challenger(scored):
    metrics = json.loads((scored["out"] / "_metrics.json").read_text())["metrics"]
    sqrt = by_name(scored["manifest"])["sqrt"]
    assert metrics["challenger.sqrt.rows_rejected"] == sqrt["rows_rejected"]
    assert metrics["challenger.twin.rows_scored"] == by_name(scored["manifest"])["twin"]["rows_scored"]
    assert metrics["challenger.other.compute_ms"] > 0


def test_inspect_and_the_report_list_the_challengers(scored):
    result = run_cli("inspect", str(scored["out"]), cwd=scored["root"])
    assert result.returncode == 0, result.stderr
    assert "challenger sqrt: sqrt:1" in result.stdout
    assert "rejected" in result.stdout
    report = (scored["out"] / "report.html").read_text()
    assert "<h2>Challengers</h2>" in report and "<code>sqrt:1</code>" in report


# -- diff ----------------------------------------------------------------------------------------

def test_diff_of_a_restamped_copy_is_rank_one_and_zero(scored):
    report = diff_json(scored["root"], str(scored["out"]), "--challenger", "twin")
    assert report["identical"] is False   # another model version: the triple differs
    assert set(report["triple_differs"]) == {"model_version"}
    assert report["b"]["challenger"] == "twin"
    assert report["columns"]["y"] == {"differ": 0, "max_abs_diff": 0.0}
    assert report["scores"]["y"]["spearman"] == 1.0
    assert report["scores"]["y"]["abs_diff"] == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    assert report["top_movers"]["y"] == []
    assert report["labels"]["id"]["agreement"] == 1.0


def test_diff_figures_match_an_independent_computation(scored):
    out = scored["out"]
    report = diff_json(scored["root"], str(out), "--challenger", "other", "--top", "5")
    preds, _, manifest = read_partition(out)
    a = canonical(preds)
    b = canonical(challenger_table(out, by_name(manifest)["other"]))
    assert a["_source_row"].equals(b["_source_row"]) and a["_source_shard"].equals(b["_source_shard"])
    x = a["y"].to_numpy().astype(np.float64)
    y = b["y"].to_numpy().astype(np.float64)
    score = report["scores"]["y"]
    assert score["rows"] == x.size == report["rows"]["scored_both"]
    assert score["spearman"] == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    gap = np.abs(x - y)
    assert score["abs_diff"] == pytest.approx(
        {"p50": np.quantile(gap, 0.5), "p90": np.quantile(gap, 0.9), "p99": np.quantile(gap, 0.99),
         "max": gap.max()}, abs=1e-15)
    top = np.argsort(-gap, kind="stable")[:5]
    movers = report["top_movers"]["y"]
    assert [m["id"] for m in movers] == a["id"].to_numpy()[top].tolist()
    for m, i in zip(movers, top):
        assert (m["a"], m["b"], m["abs_diff"]) == pytest.approx((x[i], y[i], gap[i]))
        assert (m["_source_shard"], m["_source_row"]) == (a["_source_shard"][int(i)].as_py(),
                                                          a["_source_row"][int(i)].as_py())
    text = run_cli("diff", str(out), "--challenger", "other", "--top", "2", cwd=scored["root"])
    assert text.returncode == 0, text.stderr
    assert f"score y: spearman {score['spearman']:.6g}" in text.stdout
    assert text.stdout.count("  moved ") == 2


def test_diff_counts_rows_a_challenger_rejected_as_scored_only_by_the_champion(scored):
    report = diff_json(scored["root"], str(scored["out"]), "--challenger", "sqrt")
    sqrt = by_name(scored["manifest"])["sqrt"]
    assert report["rows"]["scored_only_a"] == sqrt["rows_rejected"]
    assert report["rows"]["scored_only_b"] == 0
    assert report["b"]["totals"]["rows_quarantined"] == sqrt["rows_rejected"]


def test_diff_of_an_unknown_challenger_exits_2(scored):
    result = run_cli("diff", str(scored["out"]), "--challenger", "nope", cwd=scored["root"])
    assert result.returncode == 2
    assert "has no challenger 'nope' (its challengers: other, twin, sqrt)" in one_line_error(result, "diff")


# -- before any work -----------------------------------------------------------------------------

@pytest.fixture
def project(template, tmp_path) -> Path:
    root = tmp_path / "p"
    shutil.copytree(template, root)
    return root


def test_a_challenger_with_another_declaration_exits_3_before_any_work(project):
    sidecar = project / "models" / "other.onnx.batchinfer.json"
    declared = json.loads(sidecar.read_text())
    declared["preprocess_hash"] = "0" * 64
    sidecar.write_text(json.dumps(declared))
    set_challengers(project, CHALLENGERS)
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=project)
    assert result.returncode == 3
    line = one_line_error(result)
    assert "challenger other: contract mismatch" in line and "preprocess_hash declared 0000" in line
    assert not (project / "out").exists()


@pytest.mark.parametrize("challengers, message", [
    ([{"uri": "models/other.onnx"}, {"uri": "elsewhere/other.onnx"}], "two challengers are named 'other'"),
    ([{"uri": "models/other.onnx", "name": "../up"}], "name '../up' is not a safe folder name"),
    ([{"uri": "models/other.onnx", "colour": "red"}], "unknown key 'model.challengers.0.colour'"),
])
def test_bad_challenger_specs_exit_2(project, challengers, message):
    set_challengers(project, challengers)
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=project)
    assert result.returncode == 2
    assert message in one_line_error(result)
    assert not (project / "out").exists()


def test_a_challenger_with_other_output_names_exits_2_before_any_work(project):
    make_mlp_onnx(project / "models" / "named.onnx", seed=2, output_name="score")
    stamp(project, "models/named.onnx", "named:1")
    set_challengers(project, [{"uri": "models/named.onnx", "device": "cpu"}])
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=project)
    assert result.returncode == 2
    assert "challenger named: its outputs ['score'] are not the champion's ['y']" in one_line_error(result)
    assert not (project / "out").exists()
    mapped = run_cli("run", "job.yaml", "--ds", DS, "--set", "output.predictions={score: y}",
                     cwd=project)
    assert mapped.returncode == 2   # mapped: the champion has no output `score`
    assert "output.predictions names ['score']" in one_line_error(mapped)


def test_a_challenger_that_breaks_the_batch_contract_exits_5_and_commits_nothing(project):
    from onnx import TensorProto, helper

    graph = helper.make_graph(  # one number for the whole batch
        [helper.make_node("ReduceSum", ["x"], ["y"], keepdims=1)], "sum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])])
    save_onnx(graph, project / "models" / "sum.onnx")
    stamp(project, "models/sum.onnx", "sum:1")
    set_challengers(project, [{"uri": "models/sum.onnx", "device": "cpu"}])
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=project)
    assert result.returncode == 5
    assert "breaks the batch contract" in one_line_error(result)
    out = project / "out" / f"dt={DS}"
    assert not (out / "_manifest.json").exists()
    assert not (out / "challengers").exists() or not any((out / "challengers").rglob("*.parquet"))


# -- commits and reruns --------------------------------------------------------------------------

def test_a_crash_leaves_no_challenger_file_committed_and_the_rerun_commits_them(project):
    import forkserver

    set_challengers(project, CHALLENGERS[:2])
    out = project / "out" / f"dt={DS}"
    server = forkserver.shared()
    for fault in ("write:4", "before_commit"):
        killed = server.run("run", "job.yaml", "--ds", DS, cwd=project, fault=fault, track=False)
        assert killed.returncode not in (0, 2, 3, 4, 5), killed.stderr
        assert not (out / "_manifest.json").exists()
    assert any((out / "challengers").rglob("*.parquet"))   # the crashed attempts' debris
    rerun = run_cli("run", "job.yaml", "--ds", DS, cwd=project)
    assert rerun.returncode == 0, rerun.stderr
    manifest = json.loads((out / "_manifest.json").read_text())
    listed = {f["path"] for c in manifest["challengers"] for s in c["shards"] for f in s["files"]}
    on_disk = {str(p.relative_to(out)) for p in (out / "challengers").rglob("*") if p.is_file()}
    assert on_disk == listed and listed
    assert {p.name for p in (out / "challengers").iterdir()} == {"other", "twin"}
    # The run killed before its commit had finished every shard, challengers included: the
    # rerun adopted them (contract §5.3 "Resume"), their files where that attempt wrote them.
    scored_by = {s["path"]: s["scored_by"] for s in manifest["shards"]}
    assert manifest["attempt"] not in scored_by.values()
    assert all(f["path"].split("/")[2] == scored_by[s["path"]]
               for c in manifest["challengers"] for s in c["shards"] for f in s["files"])


def test_a_rerun_with_other_challengers_needs_overwrite(project):
    set_challengers(project, CHALLENGERS[:1])
    first = run_cli("run", "job.yaml", "--ds", DS, cwd=project)
    assert first.returncode == 0, first.stderr
    assert run_cli("run", "job.yaml", "--ds", DS, cwd=project).returncode == 0   # a no-op
    set_challengers(project, CHALLENGERS[1:2])
    again = run_cli("run", "job.yaml", "--ds", DS, cwd=project)
    assert again.returncode == 3
    assert ("committed without challenger twin as this run declares it (committed: other;"
            in one_line_error(again))
    replaced = run_cli("run", "job.yaml", "--ds", DS, "--overwrite", cwd=project)
    assert replaced.returncode == 0, replaced.stderr
    out = project / "out" / f"dt={DS}"
    manifest = json.loads((out / "_manifest.json").read_text())
    assert [c["name"] for c in manifest["challengers"]] == ["twin"]
    assert {p.name for p in (out / "challengers").iterdir()} == {"twin"}   # other's files went


def test_a_one_off_comparison_leaves_the_nightly_run_a_no_op(project):
    """An analyst compares a challenger on a committed date (`--set model.challengers=… --overwrite`);
    the nightly job, which has no challengers, must then find the partition committed (exit 0,
    nothing changed, the comparison kept), not exit 3 (which the DAG does not retry)."""
    out = project / "out" / f"dt={DS}"
    nightly = run_cli("run", "job.yaml", "--ds", DS, cwd=project)
    assert nightly.returncode == 0, nightly.stderr
    one_off = run_cli("run", "job.yaml", "--ds", DS, "--overwrite", "--set",
                      "model.challengers=[{uri: models/other.onnx, device: cpu}]", cwd=project)
    assert one_off.returncode == 0, one_off.stderr
    before = snapshot(out)
    again = run_cli("run", "job.yaml", "--ds", DS, cwd=project)
    assert again.returncode == 0, again.stderr
    assert "already committed" in again.stdout
    assert snapshot(out) == before   # nothing changed: the challenger's files and entry stay
    assert [c["name"] for c in json.loads((out / "_manifest.json").read_text())["challengers"]] == ["other"]
    # the same challenger asked for again is committed too
    same = run_cli("run", "job.yaml", "--ds", DS, "--set",
                   "model.challengers=[{uri: models/other.onnx, device: cpu}]", cwd=project)
    assert same.returncode == 0, same.stderr
    assert snapshot(out) == before
    # a challenger the partition lacks, or the same name with another triple: still exit 3
    lacking = run_cli("run", "job.yaml", "--ds", DS, "--set",
                      "model.challengers=[{uri: models/other.onnx, device: cpu}, "
                      "{uri: models/sqrt.onnx, device: cpu}]", cwd=project)
    assert lacking.returncode == 3
    assert ("committed without challenger sqrt as this run declares it (committed: other;"
            in one_line_error(lacking))
    stamp(project, "models/other.onnx", "model:2b")   # the same file, another version
    restamped = run_cli("run", "job.yaml", "--ds", DS, "--set",
                        "model.challengers=[{uri: models/other.onnx, device: cpu}]", cwd=project)
    assert restamped.returncode == 3
    assert "without challenger other as this run declares it" in one_line_error(restamped)
    assert snapshot(out) == before


def test_a_challenger_with_outputs_named_otherwise_maps_them_to_the_champions_columns(project):
    """A challenger's model says `sigmoid` where the champion's says `y` (a torch export, say):
    its own `predictions` mapping writes its output into the champion's column."""
    make_mlp_onnx(project / "models" / "torchy.onnx", output_name="sigmoid")   # the champion's weights
    stamp(project, "models/torchy.onnx", "torchy:1")
    mapped = "[{uri: models/torchy.onnx, device: cpu, predictions: {sigmoid: y}}]"
    result = run_cli("run", "job.yaml", "--ds", DS, "--set", f"model.challengers={mapped}",
                     cwd=project)
    assert result.returncode == 0, result.stderr
    out = project / "out" / f"dt={DS}"
    preds, _, manifest = read_partition(out)
    table = challenger_table(out, by_name(manifest)["torchy"])
    assert table.column_names == preds.column_names   # the champion's columns, in their order
    assert "sigmoid" not in table.column_names
    assert canonical(table)["y"].equals(canonical(preds)["y"])   # the same weights, bit for bit


@pytest.mark.parametrize("predictions, message", [
    ("{nope: y}", "challenger torchy: its predictions names ['nope'], which the model does not output "
                  "(its outputs: ['sigmoid'])"),
    ("{sigmoid: probability}", "challenger torchy: its predictions map to the columns ['probability'], "
                               "not to the champion's prediction columns ['y'] (the same names in the "
                               "same order): map them with the challenger's predictions: {sigmoid: y}"),
])
def test_a_challenger_mapping_to_other_columns_exits_2_before_any_work(project, predictions, message):
    make_mlp_onnx(project / "models" / "torchy.onnx", output_name="sigmoid")
    stamp(project, "models/torchy.onnx", "torchy:1")
    result = run_cli("run", "job.yaml", "--ds", DS, "--set",
                     f"model.challengers=[{{uri: models/torchy.onnx, predictions: {predictions}}}]",
                     cwd=project)
    assert result.returncode == 2
    assert message in one_line_error(result)
    assert not (project / "out").exists()


def test_a_challenger_maps_onto_the_champions_mapped_columns(project):
    """With `output.predictions` the champion's columns are the mapped names: a challenger maps
    its own output onto those (`{sigmoid: probability}` where the champion maps `{y: probability}`)."""
    make_mlp_onnx(project / "models" / "torchy.onnx", seed=4, output_name="sigmoid")
    stamp(project, "models/torchy.onnx", "torchy:1")
    result = run_cli("run", "job.yaml", "--ds", DS, "--set", "output.predictions={y: probability}",
                     "--set", "model.challengers=[{uri: models/torchy.onnx, device: cpu, "
                              "predictions: {sigmoid: probability}}]", cwd=project)
    assert result.returncode == 0, result.stderr
    out = project / "out" / f"dt={DS}"
    preds, _, manifest = read_partition(out)
    table = challenger_table(out, by_name(manifest)["torchy"])
    assert table.column_names == preds.column_names and "probability" in table.column_names
    inputs = pa.concat_tables([pq.read_table(p) for p in sorted((project / "data" / f"dt={DS}").glob("*.parquet"))])
    row_of = {i: n for n, i in enumerate(inputs["id"].to_pylist())}
    rows = [row_of[i] for i in table["id"].to_pylist()]
    x = np.stack([inputs[f"f{k}"].to_numpy()[rows] for k in range(4)], axis=1)
    assert table["probability"].to_numpy() == pytest.approx(mlp_reference(x, seed=4), abs=1e-6)


def test_stamp_a_challenger_by_name_and_without_the_other_models(project):
    make_mlp_onnx(project / "models" / "v3.onnx", seed=3)
    set_challengers(project, [{"name": "v3", "uri": "models/v3.onnx", "version": "model:3",
                               "device": "cpu"},
                              {"name": "later", "uri": "models/not_yet.onnx"}])
    stamped = run_cli("stamp", "models/v3.onnx", "--job", "job.yaml", "--challenger", "v3",
                      cwd=project)
    assert stamped.returncode == 0, stamped.stderr   # the missing challenger's file is not needed
    declared = json.loads((project / "models" / "v3.onnx.batchinfer.json").read_text())
    assert declared["model_version"] == "model:3"   # the challenger's version, not the champion's
    unknown = run_cli("stamp", "models/v3.onnx", "--job", "job.yaml", "--challenger", "v4",
                      cwd=project)
    assert unknown.returncode == 2
    assert "no challenger 'v4' (its challengers: v3, later)" in one_line_error(unknown, "stamp")
    set_challengers(project, [{"name": "v3", "uri": "models/v3.onnx", "device": "cpu"}])
    run = run_cli("run", "job.yaml", "--ds", DS, cwd=project)
    assert run.returncode == 0, run.stderr
