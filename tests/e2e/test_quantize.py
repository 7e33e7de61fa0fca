"""`batchinfer export MODEL.onnx --to onnx --quantize int8` (contract §2, §6 "Precision"): the
INT8 model is written only when the parity gate passes, its declaration carries the gate's
figures beside ``precision: int8``, and a run must declare that precision (exit 3 otherwise)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from factories import DS, mlp_reference, numeric_project, read_partition, run_cli

pytest.importorskip("onnxruntime.quantization")

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
    assert "parity   INT8 vs FP32 on 1000 rows of testjob's input (y: score): KL" in result.stdout
    return project / "models" / "q8.onnx"


def test_quantized_model_declares_its_figures_and_scores(project, quantized):
    record = json.loads(Path(f"{quantized}.quantization.json").read_text())
    assert record["precision"] == "int8" and record["quantization_method"] == "dynamic"
    assert 0 < record["parity_kl"] <= 0.01 and record["parity_rows"] == 1000
    assert 0 <= record["parity_flip_rate"] < 0.01 and record["parity_max_abs_diff"] > 0

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
                "source_model_sha256"):
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


@pytest.mark.parametrize("method", ["dynamic", "static"])
def test_a_failing_gate_writes_nothing(project, method):
    """Decisions that sit at the threshold: the FP32 median of the sample's scores, so rows on
    both sides of it lie within the quantization error and some flip; --max-flip-rate 0 refuses."""
    import pyarrow.parquet as pq

    table = pq.read_table(project / "data" / f"dt={DS}" / "part-00000.parquet")
    median = float(np.median(mlp_reference(
        np.stack([table.column(f"f{i}").to_numpy() for i in range(4)], axis=1))))
    result = run_cli(*EXPORT, "--out", "models/refused.onnx", "--method", method,
                     "--max-flip-rate", "0", "--threshold", repr(median), cwd=project)
    assert result.returncode == 5, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "parity check failed" in lines[0]
    assert f"decisions at threshold {median:g} (> --max-flip-rate 0)" in lines[0]
    assert "nothing written" in lines[0]
    assert not list((project / "models").glob("*refused*")), "a refused model left files behind"


@pytest.mark.parametrize("args, message", [
    (["--to", "onnx", "--max-flip-rate", "0.1"], "--max-flip-rate go with --quantize int8"),
    (["--to", "tensorrt", "--quantize", "int8"], "--quantize int8 goes with --to onnx"),
    (["--to", "onnx", "--quantize", "int8"], "needs --sample JOB.yaml"),
])
def test_quantize_usage_errors(tmp_path, args, message):
    (tmp_path / "model.onnx").write_bytes(b"not read")
    result = run_cli("export", "model.onnx", "--out", "x.onnx", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
