"""Where a backend cannot run — no GPU, no TensorRT, another TensorRT or GPU than the engine
was built for — a run exits 5 with one line saying what is missing and how to install it,
before any work; and checking a job never imports a model runtime."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import artefacts
import pytest

from factories import DS, numeric_project, one_line_error, run_cli

pytestmark = pytest.mark.slow

RUNTIMES = ("torch", "tensorrt", "onnxruntime")


def _linear(folder: Path) -> None:
    """A torch.export program of a linear layer, 4 features → 1 (made once, tests/artefacts.py)."""
    import torch

    batch = torch.export.Dim("batch")
    exported = torch.export.export(torch.nn.Linear(4, 1).eval(), (torch.randn(8, 4),),
                                   dynamic_shapes=({0: batch},))
    torch.export.save(exported, str(folder / "model.pt2"))


def _backend(folder: Path, backend: str, model: str, device: str = "auto") -> None:
    job = folder / "job.yaml"
    text = job.read_text().replace("backend: onnxruntime", f"backend: {backend}")
    text = text.replace("uri: models/model.onnx", f"uri: {model}").replace("device: cpu", f"device: {device}")
    job.write_text(text)


def _engine(folder: Path, facts: dict) -> None:
    (folder / "models" / "model.engine").write_bytes(b"not really an engine" * 100)
    (folder / "models" / "model.engine.build.json").write_text(json.dumps(facts))
    _backend(folder, "tensorrt", "models/model.engine", "cuda")
    stamped = run_cli("stamp", "models/model.engine", "--job", "job.yaml", "--model-version", "m:1", cwd=folder)
    assert stamped.returncode == 0, stamped.stderr


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_tensorrt_without_tensorrt_says_what_to_install(tmp_path):
    numeric_project(tmp_path, shards=1, rows=50)
    _engine(tmp_path, {"tensorrt_version": "10.13.0", "compute_capability": "9.0"})
    declared = json.loads((tmp_path / "models" / "model.engine.batchinfer.json").read_text())
    assert declared["tensorrt_version"] == "10.13.0" and declared["compute_capability"] == "9.0"
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path)
    assert result.returncode == 5, result.stderr
    line = one_line_error(result)
    assert "backend tensorrt needs tensorrt, which is not installed" in line
    assert "pip install 'batchinfer[gpu]'" in line
    assert not (tmp_path / "out").exists()


def test_torch_on_cuda_without_a_gpu_exits_5(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    numeric_project(tmp_path, shards=1, rows=50)
    program = tmp_path / "models" / "model.pt2"
    made = artefacts.cached("linear-program", _linear, packages=artefacts.TORCH_EXPORT)
    shutil.copy(made / "model.pt2", program)
    _backend(tmp_path, "torch", "models/model.pt2", "cuda")
    assert run_cli("stamp", "models/model.pt2", "--job", "job.yaml", "--model-version", "m:1",
                   cwd=tmp_path).returncode == 0
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path)
    assert result.returncode == 5, result.stderr
    line = one_line_error(result)
    assert "model.device is cuda but" in line and "set model.device: cpu" in line
    assert not (tmp_path / "out").exists()
    # the same job on device auto falls back to the CPU and says so in the manifest
    text = (tmp_path / "job.yaml").read_text().replace("device: cuda", "device: auto")
    (tmp_path / "job.yaml").write_text(text)
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / f"dt={DS}" / "_manifest.json").read_text())
    assert manifest["device"] == "cpu" and manifest["backend"] == "torch"


def test_onnxruntime_tensorrt_provider_on_cpu_is_a_spec_error(tmp_path):
    numeric_project(tmp_path, shards=1, rows=50)
    result = run_cli("run", "job.yaml", "--ds", DS, "--set", "model.options.tensorrt=true", cwd=tmp_path)
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("ONNX Runtime has CUDA here")
    assert result.returncode == 5, result.stderr
    assert "model.options.tensorrt is true but ONNX Runtime has no CUDA provider" in one_line_error(result)
    assert not (tmp_path / "out").exists()


def test_plan_validate_and_the_cli_start_import_no_model_runtime(tmp_path):
    """``plan`` and ``validate`` of a torch job and an ONNX job, and the CLI's start (``--help``),
    load none of torch, TensorRT and ONNX Runtime (contract §3: checking a job is cheap, and
    works on a machine without the backend)."""
    numeric_project(tmp_path / "onnx", shards=1, rows=50)
    numeric_project(tmp_path / "torch", shards=1, rows=50, stamp=False)
    (tmp_path / "torch" / "models" / "model.pt2").write_bytes(b"a program")
    _backend(tmp_path / "torch", "torch", "models/model.pt2")
    numeric_project(tmp_path / "trt", shards=1, rows=50, stamp=False)
    _backend(tmp_path / "trt", "tensorrt", "models/model.engine")
    (tmp_path / "trt" / "models" / "model.engine").write_bytes(b"an engine")
    code = (
        "import sys, os\n"
        "from batchinfer import cli\n"
        "codes = []\n"
        "for folder in sys.argv[1:]:\n"
        "    os.chdir(folder)\n"
        "    codes.append(cli.main(['plan', 'job.yaml', '--ds', '" + DS + "']))\n"
        "    codes.append(cli.main(['validate', 'job.yaml', '--ds', '" + DS + "']))\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('CODES', codes)\n"
        f"print('LOADED', sorted(n for n in {RUNTIMES!r} if n in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code, *(str(tmp_path / n) for n in ("onnx", "torch", "trt"))],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout, out.stdout
    # the ONNX job plans cleanly; the unstamped ones fail their contract check, still without
    # loading a runtime: validate needs no declaration
    assert "CODES [0, 0, 3, 0, 3, 0]" in out.stdout, out.stdout + out.stderr
