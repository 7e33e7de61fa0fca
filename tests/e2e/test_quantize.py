"""`batchinfer export MODEL.onnx --to onnx --quantize int8` (contract §2, §6 "Precision"): the
INT8 model is written only when the parity gate passes, its declaration carries the gate's
figures beside ``precision: int8``, and a run must declare that precision (exit 3 otherwise)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from factories import DS, mlp_reference, numeric_project, one_line_error, read_partition, run_cli, save_onnx, snapshot

pytest.importorskip("onnxruntime.quantization")
pytestmark = pytest.mark.slow   # CLI runs, as in every e2e module (the sample: tests/unit/test_export_sample.py)

EXPORT = ("export", "models/model.onnx", "--to", "onnx", "--quantize", "int8",
          "--sample", "job.yaml", "--ds", DS)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("quantize")
    numeric_project(folder, shards=2, rows=1000)
    return folder


@pytest.fixture(scope="module")
def quantized(project) -> Path:
    result = run_cli(*EXPORT, "--out", "models/q8.onnx", cwd=project)
    assert result.returncode == 0, result.stderr
    assert ("parity   INT8 vs FP32 on 2000 rows of testjob's input, from 2 of 2 shards (y: score): KL"
            in result.stdout)
    return project / "models" / "q8.onnx"


def test_quantized_model_declares_its_figures_and_scores(project, quantized):
    record = json.loads(Path(f"{quantized}.quantization.json").read_text())
    assert record["precision"] == "int8" and record["quantization_method"] == "dynamic"
    assert 0 < record["parity_kl"] <= 0.01 and record["parity_rows"] == 2000
    assert 0 <= record["parity_flip_rate"] < 0.01 and record["parity_max_abs_diff"] > 0
    # the sample: drawn from both shards, 1,000 rows each (the default 4,096 is more than there are)
    assert record["sample_method"] == "stratified" and record["sample_seed"] == 0
    assert record["sample_rows"] == 2000 and record["sample_shards"] == 2
    assert record["sample_partition_shards"] == 2 and record["sample_partition_rows"] == 2000
    assert record["sample"].startswith("2000 rows of testjob's input, from 2 of 2 shards")
    # what is in the file: its two MatMuls run as MatMulInteger (counted from its graph)
    import onnx

    ops = [n.op_type for n in onnx.load(str(quantized)).graph.node]
    assert ops.count("MatMulInteger") == 2 and "MatMul" not in ops
    assert record["quantization_int8_nodes"] == 2
    assert record["quantization_int8_ops"] == "MatMulInteger 2"
    # renamed into place from a private scratch file, yet as readable as a plain write makes it
    plain = project / "models" / "a-plain-write"
    plain.write_text("")
    mode = plain.stat().st_mode & 0o777
    plain.unlink()
    assert {quantized.stat().st_mode & 0o777, Path(f"{quantized}.quantization.json").stat().st_mode & 0o777} == {mode}

    model = ["--set", "model.uri=models/q8.onnx"]
    # stamping the INT8 file for a job that says fp32 (the default) is refused: the file is int8
    refused = run_cli("stamp", "models/q8.onnx", "--job", "job.yaml", "--model-version", "m:1-int8",
                      *model, cwd=project)
    assert refused.returncode == 2 and "computes in precision int8" in refused.stderr
    int8 = [*model, "--set", "model.options.precision=int8"]
    done = run_cli("stamp", "models/q8.onnx", "--job", "job.yaml", "--model-version", "m:1-int8",
                   *int8, cwd=project)
    assert done.returncode == 0, done.stderr
    declared = json.loads(Path(f"{quantized}.batchinfer.json").read_text())
    assert declared["precision"] == "int8"
    for key in ("parity_kl", "parity_flip_rate", "sample_sha256", "quantization_method",
                "source_model_sha256", "quantization_int8_nodes", "sample_rows", "sample_shards",
                "sample_partition_shards", "sample_seed", "sample_method"):
        assert declared[key] == str(record[key]), key

    # a run that does not declare int8 is a contract mismatch, before any work
    mismatch = run_cli("run", "job.yaml", "--ds", DS, *model, cwd=project)
    assert mismatch.returncode == 3, mismatch.stderr
    assert "model.options.precision is fp32 but the model was stamped for int8" in mismatch.stderr
    assert not (project / "out" / f"dt={DS}" / "_manifest.json").exists()

    run = run_cli("run", "job.yaml", "--ds", DS, *int8, cwd=project)
    assert run.returncode == 0, run.stderr
    predictions, _, manifest = read_partition(project / "out" / f"dt={DS}")
    assert manifest["model_options"] == {"precision": "int8"}
    assert manifest["triple"]["model_version"] == "m:1-int8"
    metrics = json.loads((project / "out" / f"dt={DS}" / "_metrics.json").read_text())
    assert metrics["params"]["model.options.precision"] == "int8"
    assert metrics["params"]["model.parity_kl"] == declared["parity_kl"]
    assert metrics["params"]["model.sample_rows"] == "2000"
    assert metrics["params"]["model.sample_shards"] == "2"
    scores = predictions.column("y").to_numpy()
    assert predictions.num_rows == 2000 and np.all((scores > 0) & (scores < 1))


def test_fp32_run_of_an_old_declaration_is_unchanged(project):
    """The FP32 model was stamped without precision in the job: its declaration means fp32 and
    the manifest records it (a declaration written before precision was declared means fp32)."""
    sidecar = project / "models" / "model.onnx.batchinfer.json"
    declared = json.loads(sidecar.read_text())
    declared.pop("precision", None)             # as stamped before precision was declared
    sidecar.write_text(json.dumps(declared))
    out = ["--set", "output.path=out-fp32/dt={ds}"]
    run = run_cli("run", "job.yaml", "--ds", DS, *out, cwd=project)
    assert run.returncode == 0, run.stderr
    _, _, manifest = read_partition(project / "out-fp32" / f"dt={DS}")
    assert manifest["model_options"] == {"precision": "fp32"}
    bf16 = run_cli("run", "job.yaml", "--ds", DS, *out, "--set", "model.options.precision=bf16",
                   cwd=project)
    assert bf16.returncode == 3 and "stamped for fp32" in bf16.stderr


# static: seed 2 draws a sample on which its KL passes (0.0057; at the default seed 0.0132, at 1
# 0.041: MinMax ranges of 512 rows move with the rows), so that the flip rate is what refuses
@pytest.mark.parametrize("method, seed", [("dynamic", []), ("static", ["--sample-seed", "2"])])
def test_a_failing_gate_writes_nothing(project, method, seed):
    """Decisions that sit at the threshold: the FP32 median of the sample's scores, so rows on
    both sides of it lie within the quantization error and some flip; --max-flip-rate 0 refuses."""
    median = _median(project)
    result = run_cli(*EXPORT, "--out", "models/refused.onnx", "--method", method, *seed,
                     "--max-flip-rate", "0", "--threshold", repr(median), cwd=project)
    assert result.returncode == 5, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "parity check failed" in lines[0]
    assert f"decisions at threshold {median:g} (> --max-flip-rate 0)" in lines[0]
    assert "nothing written" in lines[0]
    assert not list((project / "models").glob("*refused*")), "a refused model left files behind"


def test_a_failing_gate_leaves_an_existing_out_as_it_was(project):
    """The INT8 model is written beside --out and renamed into place only once the gate passes:
    a refused export leaves the file already at --out (an earlier, unstamped export) as it was."""
    previous = project / "models" / "previous.onnx"
    previous.write_bytes(b"an earlier export")
    try:
        before = snapshot(project / "models")
        result = run_cli(*EXPORT, "--out", "models/previous.onnx", "--max-flip-rate", "0",
                         "--threshold", repr(_median(project)), cwd=project)
        assert result.returncode == 5, result.stderr
        assert "parity check failed" in one_line_error(result, "export")
        assert previous.read_bytes() == b"an earlier export"
        assert snapshot(project / "models") == before, "a refused export changed --out's folder"
    finally:
        previous.unlink()


def test_the_gate_samples_every_shard_not_the_first(tmp_path):
    """Eight shards: the first holds rows whose scores lie far from the threshold, the seven
    after it rows within 0.002 of it. What the gate sampled before (the first rows of the first
    shard: here, that shard whole) passes --max-flip-rate 0; the partition, sampled from every
    shard, refuses: INT8 flips some of the later shards' decisions."""
    numeric_project(tmp_path, shards=1, rows=10)
    data = tmp_path / "data" / f"dt={DS}"
    for old in data.iterdir():
        old.unlink()
    x = np.clip(np.random.default_rng(1).standard_normal((400_000, 4)), -3, 3).astype(np.float32)
    scores = mlp_reference(x)
    threshold = float(np.median(scores))
    far, near = x[np.abs(scores - threshold) > 0.05][:1000], x[np.abs(scores - threshold) < 0.002]
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = 0
    for s, rows in enumerate([far] + [near[i * 200:(i + 1) * 200] for i in range(7)]):
        pq.write_table(pa.table({"id": np.arange(first, first + len(rows), dtype=np.int64),
                                 **{f"f{i}": rows[:, i] for i in range(4)}}), data / f"part-{s:05d}.parquet")
        first += len(rows)
    gate = ("--max-flip-rate", "0", "--threshold", repr(threshold))
    head = run_cli(*EXPORT, "--out", "models/head.onnx", *gate,
                   "--set", "input.path=data/dt={ds}/part-00000.parquet", cwd=tmp_path)
    assert head.returncode == 0, head.stderr
    assert f"flip rate 0 at {threshold:g}" in head.stdout
    assert "on 1000 rows of testjob's input, from 1 of 1 shards" in head.stdout
    whole = run_cli(*EXPORT, "--out", "models/whole.onnx", *gate, cwd=tmp_path)
    assert whole.returncode == 5, whole.stderr
    line = one_line_error(whole, "export")
    assert "INT8 output y flips" in line and f"at threshold {threshold:g} (> --max-flip-rate 0)" in line
    assert "on 2400 rows of testjob's input, from 8 of 8 shards; nothing written" in line
    assert not list((tmp_path / "models").glob("whole*"))


def test_sample_rows_and_seed_are_honoured_and_recorded(project):
    """1,200 of the partition's 2,000 rows (at a few hundred the KL rule's 32-bin histograms are
    noisy enough to refuse: 0.011 at 300 rows)."""
    result = run_cli(*EXPORT, "--out", "models/small.onnx", "--sample-rows", "1200", "--sample-seed", "7",
                     cwd=project)
    assert result.returncode == 0, result.stderr
    assert "on 1200 rows of testjob's input, from 2 of 2 shards (y: score)" in result.stdout
    record = json.loads((project / "models" / "small.onnx.quantization.json").read_text())
    assert record["parity_rows"] == record["sample_rows"] == 1200 and record["sample_seed"] == 7
    assert record["sample_shards"] == 2 and record["sample_partition_rows"] == 2000
    again = run_cli(*EXPORT, "--out", "models/small2.onnx", "--sample-rows", "1200", "--sample-seed", "7",
                    cwd=project)
    other = run_cli(*EXPORT, "--out", "models/small3.onnx", "--sample-rows", "1200", cwd=project)
    assert again.returncode == other.returncode == 0, (again.stderr, other.stderr)
    digest = {name: json.loads((project / "models" / f"{name}.onnx.quantization.json").read_text())["sample_sha256"]
              for name in ("small", "small2", "small3")}
    assert digest["small"] == digest["small2"] != digest["small3"]   # same seed same rows; seed 0 others
    for name in ("small", "small2", "small3"):
        for path in (project / "models").glob(f"{name}.onnx*"):
            path.unlink()


def _median(project: Path) -> float:
    """The FP32 median of the first shard's scores: rows on both sides of it flip under INT8."""
    import pyarrow.parquet as pq

    table = pq.read_table(project / "data" / f"dt={DS}" / "part-00000.parquet")
    return float(np.median(mlp_reference(
        np.stack([table.column(f"f{i}").to_numpy() for i in range(4)], axis=1))))


def _symlink(project: Path, elsewhere: Path) -> str:
    (elsewhere / "link.onnx").symlink_to(project / "models" / "model.onnx")
    return str(elsewhere / "link.onnx")


def _hard_link(project: Path, elsewhere: Path) -> str:
    (elsewhere / "hard.onnx").hardlink_to(project / "models" / "model.onnx")
    return str(elsewhere / "hard.onnx")


def _stamped(project: Path, elsewhere: Path) -> str:
    """Another model with a declaration beside it (a copy of the source's, as stamp wrote it)."""
    (elsewhere / "stamped.onnx").write_bytes(b"another model's bytes")
    (elsewhere / "stamped.onnx.batchinfer.json").write_bytes(
        (project / "models" / "model.onnx.batchinfer.json").read_bytes())
    return str(elsewhere / "stamped.onnx")


@pytest.mark.parametrize("out, why", [
    (lambda project, elsewhere: "models/model.onnx", "the model being exported"),
    (lambda project, elsewhere: "./models/../models//model.onnx", "the model being exported"),
    (lambda project, elsewhere: str(project / "models" / "model.onnx"), "the model being exported"),
    (_symlink, "the model being exported"),
    (_hard_link, "the model being exported"),
    (lambda project, elsewhere: "models/model.onnx.batchinfer.json", "a declaration"),
    (lambda project, elsewhere: "models/model.onnx.quantization.json", "a quantization record"),
    (_stamped, "a stamped model"),
    (lambda project, elsewhere: str(elsewhere), "a folder"),
], ids=["source", "relative", "absolute", "symlink", "hard-link", "declaration", "record",
        "stamped", "folder"])
def test_an_out_that_would_replace_a_model_or_a_record_is_refused(project, tmp_path, out, why):
    """--out resolved (symlinks, `..`, hard links) to the source, to another stamped model, to a
    declaration or a record, or to a folder: exit 2 before any work, every file as it was."""
    target = out(project, tmp_path)
    source = (project / "models" / "model.onnx").read_bytes()
    before, around = snapshot(project / "models"), snapshot(tmp_path)
    result = run_cli(*EXPORT, "--out", target, cwd=project)
    assert result.returncode == 2, result.stderr
    line = one_line_error(result, "export")
    assert f"--out {Path(target)} resolves to " in line and why in line, line
    assert "choose another --out" in line or "name a file" in line, line
    assert (project / "models" / "model.onnx").read_bytes() == source
    assert snapshot(project / "models") == before and snapshot(tmp_path) == around


def test_keep_fp32_of_every_node_is_refused(project):
    """`--keep-fp32 '.*'` keeps every node FP32: the file would be the FP32 model, so stamping it
    int8 would be a lie. Exit 2 before any work."""
    before = snapshot(project / "models")
    result = run_cli(*EXPORT, "--out", "models/never.onnx", "--keep-fp32", ".*", cwd=project)
    assert result.returncode == 2, result.stderr
    line = one_line_error(result, "export")
    assert "--keep-fp32 '.*' keeps all 2 of model.onnx's" in line
    assert "nothing would be quantized" in line
    assert snapshot(project / "models") == before


@pytest.fixture(scope="module")
def odd_models(project) -> None:
    """Models beside the MLP in models/, each made for an option that cannot apply to it:

    - ``embedder``: one output, ``vec`` [N, 8], not named *embed* (judged by cosine only with
      --embedding vec);
    - ``gram``: a MatMul of two activations, no constant weight (ONNX Runtime leaves it FP32);
    - ``mixed``: MatMul ``dense`` (x by a weight: what --smooth smooths), then ``gram`` (its
      output by x transposed);
    - ``plain``: no MatMul/Gemm/Conv at all.
    """
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32), "w")
    x = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])]
    y = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])]
    score = [helper.make_node("ReduceMean", ["g"], ["r"], axes=[1], keepdims=1, name="mean"),
             helper.make_node("Sigmoid", ["r"], ["y"], name="score")]
    transpose = helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0], name="t")
    graphs = {
        "embedder": helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["vec"], name="project")], "embedder", x,
            [helper.make_tensor_value_info("vec", TensorProto.FLOAT, ["N", 8])], [w]),
        "gram": helper.make_graph(
            [transpose, helper.make_node("MatMul", ["x", "xt"], ["g"], name="gram"), *score],
            "gram", x, y),
        "mixed": helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["h"], name="dense"),
             helper.make_node("Transpose", ["h"], ["ht"], perm=[1, 0], name="t"),
             helper.make_node("MatMul", ["h", "ht"], ["g"], name="gram"), *score],
            "mixed", x, y, [w]),
        "plain": helper.make_graph(
            [helper.make_node("ReduceMean", ["x"], ["g"], axes=[1], keepdims=1, name="mean0"),
             helper.make_node("Identity", ["g"], ["g2"], name="same"),
             helper.make_node("Sigmoid", ["g2"], ["y"], name="score")], "plain", x, y),
    }
    for name, graph in graphs.items():
        save_onnx(graph, project / "models" / f"{name}.onnx")


def test_a_model_that_onnx_runtime_does_not_quantize_is_refused(project, odd_models):
    """A MatMul of two activations (no constant weight): ONNX Runtime's dynamic quantization
    leaves it FP32, so the written model would hold no INT8 node. The count is taken from the
    quantized graph, and none is exit 2 with nothing written (not a record saying int8)."""
    before = snapshot(project / "models")
    result = run_cli("export", "models/gram.onnx", *EXPORT[2:], "--out", "models/never.onnx",
                     cwd=project)
    assert result.returncode == 2, result.stderr
    line = one_line_error(result, "export")
    assert "ONNX Runtime quantized none of gram.onnx's 1 MatMul/Gemm/Conv/Attention nodes" in line
    assert "nothing written" in line
    assert snapshot(project / "models") == before


@pytest.mark.parametrize("model, args, message", [
    ("model", ["--min-cosine", "1.5"], "--min-cosine 1.5: a cosine lies in [-1, 1]"),
    ("model", ["--min-cosine", "-1.5"], "--min-cosine -1.5: a cosine lies in [-1, 1]"),
    ("model", ["--min-cosine", "nan"], "--min-cosine nan: a cosine lies in [-1, 1]"),
    ("model", ["--max-flip-rate", "1.5"], "--max-flip-rate 1.5: a share of rows lies in [0, 1]"),
    ("model", ["--max-flip-rate", "-0.1"], "--max-flip-rate -0.1: a share of rows lies in [0, 1]"),
    ("model", ["--max-flip-rate", "nan"], "--max-flip-rate nan: a share of rows lies in [0, 1]"),
    ("model", ["--threshold", "nan"], "--threshold nan: choose a finite score"),
    ("model", ["--threshold", "inf"], "--threshold inf: choose a finite score"),
    ("model", ["--smooth", "nan"], "--smooth nan: choose an alpha between 0 and 1"),
    # the case: a cosine bound for an [N, 1] score, which cosine cannot judge
    ("model", ["--embedding", "y", "--min-cosine", "1"],
     "--embedding y: model.onnx's output y has one value a row (a score, judged by the KL rule"),
    ("model", ["--embedding", "y"], "--embedding y: model.onnx's output y has one value a row"),
    ("model", ["--min-cosine", "0.999"],
     "--min-cosine 0.999: no output of model.onnx is judged by cosine (y: score)"),
    ("model", ["--embedding", "nosuch"], "--embedding nosuch: model.onnx has no output nosuch (its outputs: y)"),
    ("embedder", ["--min-cosine", "0.999"],
     "--min-cosine 0.999: no output of embedder.onnx is judged by cosine (vec: class distribution)"),
    ("embedder", ["--max-flip-rate", "0.1"],
     "--max-flip-rate 0.1: no output of embedder.onnx is a score ([N] or [N, 1]) "
     "(vec: class distribution)"),
    ("embedder", ["--threshold", "0.3"], "no output of embedder.onnx is a score"),
    ("embedder", ["--embedding", "vec", "--threshold", "0.3"], "no output of embedder.onnx is a score"),
    ("gram", ["--smooth", "0.5"], "--smooth: gram.onnx has no MatMul of an activation by a weight"),
    ("mixed", ["--smooth", "0.5", "--keep-fp32", "^dense$"],
     "--smooth 0.5: --keep-fp32 keeps all 1 MatMuls it would smooth FP32, so it changes no "
     "quantized node"),
    ("plain", [], "plain.onnx has no MatMul/Gemm/Conv/Attention node for dynamic quantization"),
    ("q8", [], "q8.onnx is already quantized (MatMulInteger 2): --quantize int8 takes the FP32 model"),
])
def test_options_and_models_that_cannot_apply_are_refused(project, odd_models, quantized, model, args, message):
    """Every gate option is applied or refused: a bound out of its range, or one that no output
    of the model is judged by, is exit 2 before any work (it would be ignored otherwise); so is a
    --smooth that smooths no quantized MatMul, and a model with nothing to quantize, or already
    quantized (its INT8 nodes would be counted as this export's)."""
    before = snapshot(project / "models")
    result = run_cli("export", f"models/{model}.onnx", *EXPORT[2:], "--out", "models/never.onnx",
                     *args, cwd=project)
    assert result.returncode == 2, result.stderr
    line = one_line_error(result, "export")
    assert message in line, line
    assert snapshot(project / "models") == before


def test_embedding_names_an_output_for_the_cosine_bound(project, odd_models):
    """With --embedding vec, --min-cosine judges vec (a bound no INT8 model meets: exit 5)."""
    result = run_cli("export", "models/embedder.onnx", *EXPORT[2:], "--out", "models/never.onnx",
                     "--embedding", "vec", "--min-cosine", "1", cwd=project)
    assert result.returncode == 5, result.stderr
    line = one_line_error(result, "export")
    assert "INT8 output vec has minimum cosine" in line and "(< 1)" in line
    assert not list((project / "models").glob("*never*"))


@pytest.mark.parametrize("args, message", [
    (["--to", "onnx", "--max-flip-rate", "0.1"], "--max-flip-rate go with --quantize int8"),
    # given at their defaults, they are still given: not silently dropped without --quantize
    (["--to", "onnx", "--method", "auto"], "--method go with --quantize int8"),
    (["--to", "onnx", "--threshold", "0.5", "--min-cosine", "0.99"],
     "--threshold, --min-cosine go with --quantize int8"),
    (["--to", "tensorrt", "--quantize", "int8"], "--quantize int8 goes with --to onnx"),
    (["--to", "onnx", "--quantize", "int8"], "needs --sample JOB.yaml"),
    (["--to", "onnx", "--sample-rows", "0"], "argument --sample-rows: 0: give at least 1 row"),
    (["--to", "onnx", "--sample-rows", "-3"], "argument --sample-rows: -3: give at least 1 row"),
    (["--to", "onnx", "--sample-rows", "1.5"], "argument --sample-rows: '1.5' is not a whole number of rows"),
    (["--to", "onnx", "--sample-rows", "many"], "argument --sample-rows: 'many' is not a whole number"),
    (["--to", "onnx", "--sample-seed", "-1"], "argument --sample-seed: -1: choose a seed from 0"),
    (["--to", "onnx", "--sample-seed", "x"], "argument --sample-seed: 'x' is not a whole number"),
    (["--to", "onnx", "--quantize", "int8", "--sample-rows", "10"], "--sample-rows goes with --sample JOB.yaml"),
    (["--to", "onnx", "--sample-rows", "10", "--sample-seed", "1"],
     "--sample-rows, --sample-seed go with --sample JOB.yaml"),
])
def test_quantize_usage_errors(tmp_path, args, message):
    (tmp_path / "model.onnx").write_bytes(b"not read")
    result = run_cli("export", "model.onnx", "--out", "x.onnx", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


# -- the text job's model: all-MiniLM-L6-v2, judged by cosine ---------------------------------
# Marked slow (end-to-end runs of the CLI, seconds each): these took about 20 s of the
# `-m "not slow"` dev loop, which the MiniLM model's copy and its two quantizations dominate.

# The recipe bench/README.md measured on bench/embeddings.py's documents: SmoothQuant at 0.7, then
# dynamic INT8 of every MatMul but the FFN output layers of the first and last encoder layers.
MINILM_RECIPE = ("--smooth", "0.7", "--keep-fp32", r"layer\.[05]/output/dense")
MINILM_WORDS = ("batch inference embeds every document once and records what it ran under the "
                "model schema and preprocessing versions night after night for search").split()


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> Path:
    """The text job with its prepared FP32 model (tests/artefacts.py: exported once per
    versions) and 40 short documents: few, so that the gate's two models run in seconds."""
    pytest.importorskip("torch")
    for package in ("onnxscript", "sentence_transformers", "tokenizers", "all_minilm_l6_v2"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
    import artefacts
    import pyarrow as pa
    import pyarrow.parquet as pq

    job = artefacts.minilm_job(tmp_path_factory.mktemp("minilm") / "job")
    rng = np.random.default_rng(5)
    texts = [" ".join(rng.choice(MINILM_WORDS, size=int(rng.integers(2, 40)))) for _ in range(38)]
    texts += ["", "Съешь же ещё этих мягких французских булок 🙂"]
    docs = job.parent / "documents"
    docs.mkdir()
    pq.write_table(pa.table({"doc_id": [f"d{i:03d}" for i in range(len(texts))], "text": texts}),
                   docs / "part-0.parquet")
    return job


def _minilm_export(job: Path, out: str, *extra: str):
    return run_cli("export", "model/all-MiniLM-L6-v2.onnx", "--to", "onnx", "--quantize", "int8",
                   "--out", out, "--sample", "job.yaml", *extra,
                   "--set", f"input.path={job.parent / 'documents'}",
                   "--set", f"output.path={job.parent / 'out'}", cwd=job, timeout=600,
                   env={"HF_HUB_OFFLINE": "1"})


def test_minilm_int8_passes_the_cosine_gate_and_runs(minilm):
    """At the default bound (0.99) the recipe passes, judged as an embedding by cosine; the INT8
    model then runs the job (token-sized calls) and its embeddings keep that cosine with FP32's."""
    result = _minilm_export(minilm, "model/q8.onnx", *MINILM_RECIPE)
    assert result.returncode == 0, result.stderr
    assert "(sentence_embedding: embedding): min cosine 0.99" in result.stdout
    assert "(≥ 0.99)" in result.stdout and "KL" not in result.stdout
    record = json.loads((minilm / "model" / "q8.onnx.quantization.json").read_text())
    assert record["parity_outputs"] == "sentence_embedding: embedding"
    assert 0.99 <= record["parity_min_cosine"] < 1.0 and record["parity_min_cosine_bound"] == 0.99
    assert record["parity_rows"] == 40 and record["calibration_rows"] == 40
    assert record["quantization_smoothquant_alpha"] == 0.7
    assert record["quantization_smoothquant_matmuls"] == 36          # 6 layers x 6 MatMuls
    assert record["quantization_kept_fp32"] == r"layer\.[05]/output/dense (2 nodes)"
    assert record["quantization_int8_nodes"] == 34
    import onnx

    ops = [n.op_type for n in onnx.load(str(minilm / "model" / "q8.onnx")).graph.node]
    assert ops.count("MatMulInteger") == 34 and "DynamicQuantizeLinear" in ops

    env = {"HF_HUB_OFFLINE": "1"}
    where = ["--set", f"input.path={minilm.parent / 'documents'}"]
    int8 = [*where, "--set", "model.uri=model/q8.onnx", "--set", "model.options.precision=int8",
            "--set", "model.version=all-MiniLM-L6-v2:1-int8"]   # its own version in the triple
    for model, extra in (("model/q8.onnx", int8), ("model/all-MiniLM-L6-v2.onnx", where)):
        stamped = run_cli("stamp", model, "--job", "job.yaml", *extra, "--set", "output.path=unused",
                          cwd=minilm, env=env)
        assert stamped.returncode == 0, stamped.stderr
    embeddings = {}
    for name, extra in (("int8", int8), ("fp32", where)):
        out = minilm.parent / f"out-{name}"
        run = run_cli("run", "job.yaml", *extra, "--set", f"output.path={out}", cwd=minilm, env=env,
                      timeout=600)
        assert run.returncode == 0, run.stderr
        predictions, _, manifest = read_partition(out)
        assert manifest["model_options"] == {"precision": name}
        flat = predictions.column("embedding").combine_chunks().flatten().to_numpy()
        embeddings[name] = flat.reshape(-1, 384).astype(np.float64)
    a, b = embeddings["int8"], embeddings["fp32"]
    cosines = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert len(cosines) == 40 and cosines.min() >= 0.99 and np.abs(a - b).max() > 0


def test_minilm_impossible_cosine_bound_refuses_and_writes_nothing(minilm):
    result = _minilm_export(minilm, "model/refused.onnx", *MINILM_RECIPE, "--min-cosine", "0.999999")
    assert result.returncode == 5, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "parity check failed" in lines[0]
    assert "INT8 output sentence_embedding has minimum cosine" in lines[0]
    assert "with FP32 (< 0.999999) on 40 rows" in lines[0] and "nothing written" in lines[0]
    assert not [p.name for p in (minilm / "model").iterdir() if "refused" in p.name], \
        "a refused model (or its smoothed scratch) left files behind"


@pytest.mark.parametrize("args, message", [
    (["--keep-fp32", "node_MatMul_"], "--keep-fp32 'node_MatMul_' matches none of all-MiniLM-L6-v2.onnx's"),
    (["--keep-fp32", "layer.(0"], "--keep-fp32 'layer.(0' is not a regular expression"),
    (["--smooth", "1.5"], "--smooth 1.5: choose an alpha between 0 and 1"),
])
def test_minilm_quantize_options_that_cannot_apply_are_usage_errors(minilm, args, message):
    """A --keep-fp32 that names no node would quantize everything it meant to keep (the dynamo
    exporter's node names are node_MatMul_N): exit 2 before any model work."""
    result = _minilm_export(minilm, "model/never.onnx", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert not [p.name for p in (minilm / "model").iterdir() if "never" in p.name]
