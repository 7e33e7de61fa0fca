"""`batchinfer export` (contract §2): a torch.export program (.pt2) to ONNX with a parity check,
driven through the CLI; the exported model then scores a partition like any ONNX model."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import artefacts
import numpy as np
import pytest

from factories import DS, numeric_project, read_partition, run_cli

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

pytestmark = pytest.mark.slow

MAKE_PROGRAM = textwrap.dedent('''\
    import sys
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.hidden = torch.nn.Linear(4, 16)
            self.out = torch.nn.Linear(16, 1)

        def forward(self, x):
            return torch.sigmoid(self.out(torch.relu(self.hidden(x))))

    example = (torch.randn(8, 4),)
    program = torch.export.export(Net().eval(), example,
                                  dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, sys.argv[1])
    ''')
# Outputs of ~1e6 from a 4,096-term sum (test_export_that_disagrees_writes_nothing).
DISAGREEING = (MAKE_PROGRAM
               .replace("return torch.sigmoid(self.out(torch.relu(self.hidden(x))))",
                        "return self.out(torch.relu(self.hidden(x))) * 1e6")
               .replace("Linear(4, 16)", "Linear(4, 4096)").replace("Linear(16, 1)", "Linear(4096, 1)"))


def make_program(code: str, path: Path) -> None:
    """``code`` (:data:`MAKE_PROGRAM` or a variant) run in a fresh interpreter writes ``path``."""
    made = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr


def _net(folder: Path) -> None:
    make_program(MAKE_PROGRAM, folder / "net.pt2")


def _big(folder: Path) -> None:
    make_program(DISAGREEING, folder / "big.pt2")


def cached_program(build, name: str) -> Path:
    """A program of this file's, made once for these versions of torch (tests/artefacts.py)."""
    return artefacts.cached(f"export-{name}", build, packages=artefacts.TORCH_EXPORT,
                            sources=["tests/e2e/test_export.py"]) / f"{name}.pt2"


@pytest.fixture(scope="module")
def program() -> Path:
    return cached_program(_net, "net")


def test_export_to_onnx_checks_parity_and_scores(program, tmp_path):
    project = tmp_path / "p"
    numeric_project(project, shards=2, rows=300, stamp=False)
    out = project / "models" / "net.onnx"
    result = run_cli("export", str(program), "--to", "onnx", "--out", str(out),
                     "--sample", "job.yaml", "--ds", DS, cwd=project, timeout=600)
    assert result.returncode == 0, result.stderr
    assert out.is_file()
    assert "parity   max |torch - onnx|" in result.stdout and "rows of testjob's input" in result.stdout

    import onnxruntime as ort

    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert isinstance(session.get_inputs()[0].shape[0], str)  # the batch axis stayed dynamic
    x = np.random.default_rng(1).standard_normal((1000, 4)).astype(np.float32)
    program_module = torch.export.load(str(program)).module()
    with torch.no_grad():
        want = program_module(torch.from_numpy(x)).numpy()
    got = session.run(None, {session.get_inputs()[0].name: x})[0]
    assert np.max(np.abs(want - got)) <= 1e-5

    # the exported model is an ordinary ONNX model for a job
    out_name = session.get_outputs()[0].name
    for args in (["stamp", "models/net.onnx", "--job", "job.yaml", "--model-version", "net:1"],
                 ["run", "job.yaml", "--ds", DS, "--set", "model.uri=models/net.onnx",
                  "--set", f"output.predictions={{{out_name}: score}}"]):
        if args[0] == "stamp":
            args += ["--set", "model.uri=models/net.onnx"]
        done = run_cli(*args, cwd=project)
        assert done.returncode == 0, done.stderr
    predictions, _, manifest = read_partition(project / "out" / f"dt={DS}")
    assert manifest["triple"]["model_version"] == "net:1"
    assert predictions.num_rows == 600
    scores = predictions.column("score").to_numpy()
    assert np.all((scores > 0) & (scores < 1))


def test_export_without_sample_uses_the_example_inputs(program, tmp_path):
    out = tmp_path / "net.onnx"
    result = run_cli("export", str(program), "--to", "onnx", "--out", str(out), cwd=tmp_path,
                     timeout=600)
    assert result.returncode == 0, result.stderr
    assert "the program's example inputs (8 rows)" in result.stdout
    assert out.is_file()


@pytest.mark.parametrize("args, code, message", [
    (["--to", "onnx"], 2, "takes a torch.export program (.pt2), not model.onnx"),
    (["--to", "coreml"], 2, "choose onnx or tensorrt"),
    (["--to", "onnx", "--fp16"], 2, "--fp16 applies to --to tensorrt only"),
])
def test_export_usage_errors(tmp_path, args, code, message):
    (tmp_path / "model.onnx").write_bytes(b"not used")
    result = run_cli("export", "model.onnx", "--out", "x.onnx", *args, cwd=tmp_path)
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert not (tmp_path / "x.onnx").exists()


def test_export_to_tensorrt_without_a_gpu_says_so(program, tmp_path):
    pytest.importorskip("torch")
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    numeric_project(tmp_path, shards=1, rows=50)
    result = run_cli("export", "models/model.onnx", "--to", "tensorrt", "--out", "x.engine",
                     "--sample", "job.yaml", "--ds", DS, cwd=tmp_path)
    assert result.returncode == 5
    assert "needs TensorRT and a CUDA GPU" in result.stderr
    assert not (tmp_path / "x.engine").exists() and not (tmp_path / "x.engine.build.json").exists()
    # what is wrong with the command comes first: an engine is built from ONNX, for a job
    result = run_cli("export", str(program), "--to", "tensorrt", "--out", "x.engine", cwd=tmp_path)
    assert result.returncode == 2 and "takes an ONNX model (.onnx), not net.pt2" in result.stderr
    result = run_cli("export", "models/model.onnx", "--to", "tensorrt", "--out", "x.engine", cwd=tmp_path)
    assert result.returncode == 2 and "needs --sample JOB.yaml" in result.stderr


def test_export_that_disagrees_writes_nothing(tmp_path):
    """Outputs of ~1e6 from a 4,096-term sum: torch's and ONNX Runtime's kernels round it
    differently, by far more than 1e-5, so the parity check must refuse the model."""
    assert DISAGREEING.count("4096") == 2  # a 4,096-term sum: no two BLAS kernels round it alike
    program = tmp_path / "big.pt2"
    shutil.copy(cached_program(_big, "big"), program)
    result = run_cli("export", str(program), "--to", "onnx", "--out", "big.onnx", cwd=tmp_path,
                     timeout=600)
    assert result.returncode == 5, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "parity check failed" in lines[0] and "nothing written" in lines[0]
    assert not list(tmp_path.glob("*.onnx")) and not list(tmp_path.glob(".big.onnx*"))


def test_export_refuses_an_out_that_is_its_source_or_a_stamped_model(program, tmp_path):
    """--out that resolves to the program itself (`..`, a symlink) or to a stamped model: exit 2
    before any work, the file as it was (an ONNX export would otherwise replace it)."""
    numeric_project(tmp_path, shards=1, rows=50)
    shutil.copy(program, tmp_path / "net.pt2")
    (tmp_path / "alias.pt2").symlink_to(tmp_path / "net.pt2")
    source, stamped = (tmp_path / "net.pt2").read_bytes(), (tmp_path / "models" / "model.onnx").read_bytes()
    for out, why in (("net.pt2", "the model being exported"),
                     ("models/../net.pt2", "the model being exported"),
                     ("alias.pt2", "the model being exported"),
                     ("models/model.onnx", "a stamped model"),
                     ("models/model.onnx.batchinfer.json", "a declaration")):
        result = run_cli("export", "net.pt2", "--to", "onnx", "--out", out, cwd=tmp_path, timeout=600)
        assert result.returncode == 2, (out, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and f"--out {Path(out)} resolves to {tmp_path.resolve()}" in lines[0]
        assert why in lines[0] and "choose another --out" in lines[0], lines[0]
    assert (tmp_path / "net.pt2").read_bytes() == source
    assert (tmp_path / "models" / "model.onnx").read_bytes() == stamped
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()], "a scratch file was left behind"


def test_export_to_tensorrt_refuses_an_out_that_is_its_source(tmp_path):
    """What --out names is checked before TensorRT or a GPU is looked for: exit 2 here too."""
    numeric_project(tmp_path, shards=1, rows=50)
    source = (tmp_path / "models" / "model.onnx").read_bytes()
    for out, why in (("models/model.onnx", "the model being exported"),
                     ("models/model.onnx.build.json", "a build record"),
                     ("models/model.onnx.batchinfer.json", "a declaration")):
        result = run_cli("export", "models/model.onnx", "--to", "tensorrt", "--out", out,
                         "--sample", "job.yaml", "--ds", DS, cwd=tmp_path)
        assert result.returncode == 2, (out, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and f"--out {out} resolves to " in lines[0] and why in lines[0]
    assert (tmp_path / "models" / "model.onnx").read_bytes() == source
    assert not (tmp_path / "models" / "model.onnx.build.json").exists()
