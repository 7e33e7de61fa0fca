"""One conformance suite that every backend runs (the handler contract, docs/contract.md §3).

The models are ``torch.export`` programs made here, turned into ONNX by ``batchinfer export``
(the CLI, so its result is conformance-tested too). The reference is ONNX Runtime on CPU, itself
checked against float64 numpy. Each backend × device × precision must give:

- the reference's predictions: CPU within 1e-5, GPU fp32 within 1e-4, fp16/bf16 by the KL rule
  (``batchinfer.parity``);
- bit-identical predictions when run again on the same device;
- the right rows at 1 row, odd sizes and more rows than one model call takes;
- multi-input, multi-output and ``[N, K]`` outputs, by name.

The checks themselves are the conformance kit's (``batchinfer.testing``), which a backend from
outside the repository runs on its own handler; tests/conformance/test_kit.py runs the kit's
suite on a numpy backend and shows it failing on broken ones.

GPU cases are marked ``gpu`` and skipped, with the reason, where no CUDA device or backend
package is present; ``bench/gpu_check.sh`` runs them on a GPU machine.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import artefacts
import numpy as np
import pytest
from _pytest.mark import KeywordMatcher, MarkMatcher
from _pytest.mark.expression import Expression
from outcomes import OUTCOMES, gpu_check_cpu_selection

from batchinfer.testing import (
    check_a_bad_row_stays_in_its_row,
    check_bit_identical_reruns,
    check_distribution,
    check_out_of_memory_loses_no_row,
    check_predictions,
    check_rows_do_not_depend_on_their_neighbours,
    check_threads_sharing_a_model,
    score,
)
from factories import DS, make_shards, read_partition, run_cli, write_job, write_schema

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

HERE_CUDA = torch.cuda.is_available()


def _ort_cuda() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


def _gpu(reason_ok: bool, why: str):
    return [pytest.mark.gpu, pytest.mark.skipif(not reason_ok, reason=why)]


# id → (backend, device, options, tolerance: a float for max abs diff, or "kl")
BACKENDS = {
    "onnxruntime-cpu": pytest.param(("onnxruntime", "cpu", {}, 1e-5), id="onnxruntime-cpu"),
    "onnxruntime-cpu-iobinding": pytest.param(("onnxruntime", "cpu", {"io_binding": True}, 1e-5),
                                              id="onnxruntime-cpu-iobinding"),
    "torch-cpu": pytest.param(("torch", "cpu", {}, 1e-5), id="torch-cpu"),
    "torch-cpu-bf16": pytest.param(("torch", "cpu", {"precision": "bf16"}, "kl"), id="torch-cpu-bf16"),
    "torch-cpu-fp16": pytest.param(("torch", "cpu", {"precision": "fp16"}, "kl"), id="torch-cpu-fp16"),
    "torch-cuda": pytest.param(("torch", "cuda", {}, 1e-4), id="torch-cuda",
                               marks=_gpu(HERE_CUDA, "no CUDA device visible to torch")),
    "torch-cuda-bf16": pytest.param(("torch", "cuda", {"precision": "bf16"}, "kl"), id="torch-cuda-bf16",
                                    marks=_gpu(HERE_CUDA, "no CUDA device visible to torch")),
    "onnxruntime-cuda": pytest.param(("onnxruntime", "cuda", {}, 1e-4), id="onnxruntime-cuda",
                                     marks=_gpu(HERE_CUDA and _ort_cuda(),
                                                "onnxruntime-gpu or a CUDA device is missing")),
    "tensorrt": pytest.param(("tensorrt", "cuda", {}, 1e-4), id="tensorrt",
                             marks=_gpu(HERE_CUDA and importlib.util.find_spec("tensorrt") is not None,
                                        "TensorRT or a CUDA device is missing")),
}


class MLP(torch.nn.Module):
    """x [N, 4] → sigmoid score [N, 1]."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.hidden = torch.nn.Linear(4, 32)
        self.out = torch.nn.Linear(32, 1)

    def forward(self, x):
        return torch.sigmoid(self.out(torch.relu(self.hidden(x))))


class TwoInTwoOut(torch.nn.Module):
    """x [N, 4], z [N, 2] → score [N] and logits [N, 3]."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a = torch.nn.Linear(4, 16)
        self.b = torch.nn.Linear(16, 3)

    def forward(self, x, z):
        logits = self.b(torch.relu(self.a(x)) + z.sum(dim=1, keepdim=True))
        return torch.sigmoid(logits[:, 0]), logits


def _numpy(model: torch.nn.Module, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """float64 reference of the models above."""
    p = {k: v.detach().numpy().astype(np.float64) for k, v in model.state_dict().items()}
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    x = arrays[0].astype(np.float64)
    if isinstance(model, MLP):
        h = np.maximum(x @ p["hidden.weight"].T + p["hidden.bias"], 0)
        return [sig(h @ p["out.weight"].T + p["out.bias"])]
    z = arrays[1].astype(np.float64)
    hidden = np.maximum(x @ p["a.weight"].T + p["a.bias"], 0) + z.sum(1, keepdims=True)
    logits = hidden @ p["b.weight"].T + p["b.bias"]
    return [sig(logits[:, 0]), logits]


MODELS = {"mlp": MLP, "multi": TwoInTwoOut}
SIZES = [1, 7, 4097]


def _inputs(name: str, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + rows)
    x = rng.standard_normal((rows, 4)).astype(np.float32)
    if name == "mlp":
        return {"x": x}
    return {"x": x, "z": rng.standard_normal((rows, 2)).astype(np.float32)}


def _export_models(folder: Path) -> None:
    """Each model of :data:`MODELS` as ``<name>.pt2``, then exported by the CLI to ``<name>.onnx``."""
    for name, cls in MODELS.items():
        example = tuple(torch.from_numpy(a) for a in _inputs(name, 8).values())
        batch = torch.export.Dim("batch")
        program = torch.export.export(cls().eval(), example, dynamic_shapes=tuple({0: batch} for _ in example))
        pt2 = folder / f"{name}.pt2"
        torch.export.save(program, str(pt2))
        onnx = folder / f"{name}.onnx"
        result = run_cli("export", str(pt2), "--to", "onnx", "--out", str(onnx), cwd=folder, timeout=600)
        assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def models() -> dict[str, dict]:
    """name → {"pt2", "onnx", "module"}: each program saved, then exported by the CLI; built
    once for these versions of torch, ONNX and this file and exporter (tests/artefacts.py).
    The modules are seeded: the one here is the one the program was exported from."""
    folder = artefacts.cached("conformance-models", _export_models, packages=artefacts.TORCH_EXPORT,
                              sources=["tests/conformance/test_backends.py", "batchinfer.convert.export",
                                       "batchinfer.convert.written", "batchinfer.convert.samples"])
    return {name: {"pt2": folder / f"{name}.pt2", "onnx": folder / f"{name}.onnx", "module": cls().eval()}
            for name, cls in MODELS.items()}


def _handler(kind: tuple, model: dict, chunk_rows: int | None = None):
    from batchinfer.handlers.base import handler_for

    backend, device, options, _ = kind
    options = dict(options)
    if chunk_rows:
        options["chunk_rows"] = chunk_rows
    path = {"onnxruntime": model["onnx"], "torch": model["pt2"], "tensorrt": model.get("engine")}[backend]
    if path is None:
        pytest.skip("no TensorRT engine was built for this model")
    return handler_for(backend, str(path), digest=f"{path.name}-{sorted(options.items())}", device=device,
                       options=options)


def _reference(model: dict, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model["onnx"]), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, inputs)))


@pytest.mark.parametrize("name", MODELS)
def test_the_reference_is_right(models, name):
    """ONNX Runtime on CPU against float64 numpy: the reference itself is checked."""
    inputs = _inputs(name, 1000)
    got = _reference(models[name], inputs)
    want = _numpy(models[name]["module"], list(inputs.values()))
    for have, expected in zip(got.values(), want):
        np.testing.assert_allclose(have.reshape(expected.shape), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows", SIZES)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kind", list(BACKENDS.values()))
def test_same_predictions_as_the_reference(models, kind, name, rows):
    gpu = kind[1] == "cuda"
    # on a GPU the whole batch is one call by default: make "more rows than a call" happen there too
    handler = _handler(kind, models[name], chunk_rows=1000 if gpu else None)
    inputs = _inputs(name, rows)
    reference = _reference(models[name], inputs)
    tolerance = kind[3]
    # kl: by value here, loosely; the distribution in the test below
    atol, rtol = (0.05, 0.05) if tolerance == "kl" else (tolerance, 0)
    result, model = check_predictions(handler, inputs, reference, atol=atol, rtol=rtol)
    assert list(result.outputs) == list(reference) == model.output_names()
    assert model.device_used().startswith("cuda" if gpu else "cpu")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kind", [k for k in BACKENDS.values() if k.values[0][3] == "kl"])
def test_reduced_precision_keeps_the_distribution(models, kind, name):
    """fp16/bf16: each output's KL divergence from the reference ≤ 0.01 (docs/contract.md)."""
    inputs = _inputs(name, 20_000, seed=11)
    result, _ = score(_handler(kind, models[name]), inputs)
    # reduced precision does change values, a little (0 < max abs diff < 0.1)
    check_distribution(_reference(models[name], inputs), result.outputs)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kind", list(BACKENDS.values()))
def test_bit_identical_reruns(models, kind, name):
    check_bit_identical_reruns(lambda: _handler(kind, models[name]), _inputs(name, 4097, seed=7))


@pytest.mark.parametrize("kind", list(BACKENDS.values()))
def test_one_row_at_a_time_agrees_with_a_batch(models, kind):
    """Each row's prediction does not depend on its neighbours (within the tolerance: kernels
    may sum in another order at another batch size)."""
    tolerance = 0.05 if kind[3] == "kl" else max(kind[3], 1e-6)
    check_rows_do_not_depend_on_their_neighbours(lambda: _handler(kind, models["multi"]),
                                                 _inputs("multi", 9, seed=3), atol=tolerance)


@pytest.mark.parametrize("kind", list(BACKENDS.values()))
def test_a_nan_row_leaves_its_neighbours_alone(models, kind):
    """What quarantining non-finite outputs row by row relies on (the CLI case below)."""
    tolerance = 0.05 if kind[3] == "kl" else max(kind[3], 1e-6)
    check_a_bad_row_stays_in_its_row(lambda: _handler(kind, models["multi"]), _inputs("multi", 300, seed=9),
                                     [0, 150, 299], atol=tolerance)


@pytest.mark.parametrize("kind", list(BACKENDS.values()))
def test_threads_sharing_a_model_get_what_each_gets_alone(models, kind):
    """Four threads on one loaded model, as a Beam worker's threads: each batch's bytes are its
    own, whether the backend says it is thread-safe (ONNX Runtime) or the base takes turns."""
    check_threads_sharing_a_model(lambda: _handler(kind, models["multi"]),
                                  [_inputs("multi", 500, seed) for seed in range(4)])


@pytest.mark.parametrize("kind", list(BACKENDS.values()))
def test_out_of_memory_halves_the_call_in_process(models, kind):
    """The injected out-of-memory error above 100 rows a call, on every backend: 400-row calls
    are halved twice and the same rows retried, giving what calls that fit give."""
    tolerance = 0.05 if kind[3] == "kl" else max(kind[3], 1e-6)
    check_out_of_memory_loses_no_row(lambda chunk_rows=None: _handler(kind, models["multi"], chunk_rows),
                                     _inputs("multi", 1000, seed=5), atol=tolerance)


# -- through the CLI: a job on each CPU backend ----------------------------------------------

NONFINITE = """\
import numpy as np
import pyarrow as pa

def features(batch: pa.RecordBatch) -> np.ndarray:
    x = np.stack([batch.column(f"f{i}").to_numpy(zero_copy_only=False) for i in range(4)], axis=1)
    x = x.astype(np.float32)
    x[batch.column("id").to_numpy() % 199 == 0, 0] = np.nan   # the model turns these into NaN
    return x
"""


def _project(folder: Path, models: dict, backend: str, rows: int = 3000, **job) -> Path:
    write_schema(folder / "schemas")
    make_shards(folder / "data" / f"dt={DS}", shards=3, rows=rows)
    model = models["mlp"]["pt2" if backend == "torch" else "onnx"]
    target = folder / "models" / model.name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(model.read_bytes())
    write_job(folder, model=f"models/{model.name}", **job)
    text = (folder / "job.yaml").read_text().replace("backend: onnxruntime", f"backend: {backend}")
    (folder / "job.yaml").write_text(text)
    return folder / "job.yaml"


def _stamp(folder: Path, *extra: str) -> None:
    model = next(p for p in (folder / "models").iterdir() if p.suffix in (".pt2", ".onnx"))
    result = run_cli("stamp", f"models/{model.name}", "--job", "job.yaml", "--model-version", "m:1",
                     *extra, cwd=folder)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_a_torch_job_commits_what_the_onnx_job_commits(models, tmp_path):
    outputs = {}
    for backend in ("onnxruntime", "torch"):
        folder = tmp_path / backend
        _project(folder, models, backend)
        _stamp(folder)
        result = run_cli("run", "job.yaml", "--ds", DS, cwd=folder)
        assert result.returncode == 0, result.stderr
        outputs[backend] = read_partition(folder / "out" / f"dt={DS}")
    onnx_rows, _, onnx_manifest = outputs["onnxruntime"]
    torch_rows, _, torch_manifest = outputs["torch"]
    assert torch_manifest["backend"] == "torch" and torch_manifest["device"] == "cpu"
    assert torch_manifest["model_options"] == {"precision": "fp32"}
    assert onnx_manifest["model_options"] == {"precision": "fp32"}   # every backend declares it
    key = ["_source_shard", "_source_row"]
    a, b = onnx_rows.sort_by([(k, "ascending") for k in key]), torch_rows.sort_by([(k, "ascending") for k in key])
    assert a.num_rows == b.num_rows == 9000
    assert a.column("_input_hash").equals(b.column("_input_hash"))
    # the same column name on both backends: the exporter names outputs as the program does
    np.testing.assert_allclose(b.column("sigmoid").to_numpy(), a.column("sigmoid").to_numpy(), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_precision_is_declared_and_recorded(models, tmp_path):
    _project(tmp_path, models, "torch")
    _stamp(tmp_path)  # fp32, the default
    result = run_cli("run", "job.yaml", "--ds", DS, "--set", "model.options.precision=bf16", cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert "model.options.precision is bf16 but the model was stamped for fp32" in result.stderr
    assert not (tmp_path / "out").exists()
    sidecar = json.loads((tmp_path / "models" / "mlp.pt2.batchinfer.json").read_text())
    assert sidecar["precision"] == "fp32"

    _stamp(tmp_path, "--set", "model.options.precision=bf16")
    result = run_cli("run", "job.yaml", "--ds", DS, "--set", "model.options.precision=bf16", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows, _, manifest = read_partition(tmp_path / "out" / f"dt={DS}")
    assert manifest["model_options"] == {"precision": "bf16"} and rows.num_rows == 9000
    # the committed bf16 partition is not a no-op for an fp32 run: it is another declaration
    _stamp(tmp_path)
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert "model.options" in result.stderr and "--overwrite" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_non_finite_outputs_are_quarantined_not_committed(models, tmp_path, backend):
    _project(tmp_path, models, backend, preprocess="conformance_nonfinite:features")
    (tmp_path / "conformance_nonfinite.py").write_text(NONFINITE)
    _stamp(tmp_path)
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows, quarantine, manifest = read_partition(tmp_path / "out" / f"dt={DS}")
    ids = rows.column("id").to_numpy()
    bad = np.array([json.loads(v)["id"] for v in quarantine.column("_values").to_pylist()])
    assert len(bad) > 0 and np.all(bad % 199 == 0) and not np.any(ids % 199 == 0)
    assert rows.num_rows + quarantine.num_rows == 9000
    assert all("non-finite model output in sigmoid" in r for r in quarantine.column("_reason").to_pylist())


@pytest.mark.slow
def test_out_of_memory_halves_the_chunk_and_loses_no_row(models, tmp_path):
    """An injected CUDA out-of-memory error above 1,000 rows a call: the 4,096-row chunks are
    halved twice and the same rows retried; every row is scored exactly once."""
    _project(tmp_path, models, "torch", rows=5000, batch={"rows": 8192})
    _stamp(tmp_path)
    clean = run_cli("run", "job.yaml", "--ds", DS, "--set", "output.path=clean/dt={ds}", cwd=tmp_path)
    assert clean.returncode == 0, clean.stderr
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path, env={"BATCHINFER_FAULT": "oom:1000"})
    assert result.returncode == 0, result.stderr
    assert "out of device memory at 4096 rows per model call; retrying the same rows at 2048" in result.stderr
    rows, quarantine, _ = read_partition(tmp_path / "out" / f"dt={DS}")
    want, _, _ = read_partition(tmp_path / "clean" / f"dt={DS}")
    assert quarantine.num_rows == 0 and rows.num_rows == 15000
    keys = list(zip(rows.column("_source_shard").to_pylist(), rows.column("_source_row").to_pylist()))
    assert len(set(keys)) == len(keys) == 15000
    key = [("_source_shard", "ascending"), ("_source_row", "ascending")]
    np.testing.assert_allclose(rows.sort_by(key).column("sigmoid").to_numpy(),
                               want.sort_by(key).column("sigmoid").to_numpy(), atol=1e-6, rtol=0)
    metrics = json.loads((tmp_path / "out" / f"dt={DS}" / "_metrics.json").read_text())["metrics"]
    assert metrics["model_chunk_rows"] == 512.0       # 4096 → 2048 → 1024 → 512 (≤ 1000)
    assert metrics["model_oom_backoffs"] >= 3         # per model copy; every copy backs off
    clean_metrics = json.loads((tmp_path / "clean" / f"dt={DS}" / "_metrics.json").read_text())["metrics"]
    assert clean_metrics["model_oom_backoffs"] == 0 and clean_metrics["model_chunk_rows"] == 4096.0


def test_the_conformance_cases_gpu_check_selects_passed_in_this_session(request):
    """What bench/gpu_check.sh's own pytest run asserted (its cases passed, none failed), from
    this module's run of them, selected as pytest selects them (-m, -k). It is the module's last
    test: the cases ran before it, in this process (also under pytest-xdist, which keeps a module
    on one worker: ``--dist loadscope``). tests/conformance/test_gpu_check.py runs the rest of the
    script."""
    pytest.importorskip("torch")
    items = [item for item in request.session.items if item.path == Path(__file__)]
    marks, keywords = map(Expression.compile, gpu_check_cpu_selection())
    chosen = [item.nodeid for item in items
              if marks.evaluate(MarkMatcher.from_markers(item.iter_markers()))
              and keywords.evaluate(KeywordMatcher.from_item(item))]
    if not chosen:
        pytest.skip("the cases bench/gpu_check.sh selects are not part of this session")
    assert len(chosen) >= 20, chosen  # each torch-cpu precision, model and size
    assert {node: OUTCOMES.get(node) for node in chosen} == dict.fromkeys(chosen, "passed")
