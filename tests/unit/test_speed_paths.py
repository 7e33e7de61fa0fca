"""The choices made for speed (bench/README.md) keep results and start-up promises.

- ONNX Runtime on CPU runs a batch in calls of ``CPU_CHUNK_ROWS`` rows: the predictions are the
  same, bit for bit, whatever the call size (contract §5.4: same input, triple, backend and device).
- ``model.options.allow_spinning`` is a checked boolean.
- Prediction files are written on a writer thread: every batch still ends up in the manifest
  with accounting intact (the e2e, crash and S3 fault tests cover the failures).
- Extras that batchinfer never uses (torch, boto3, hypothesis) are not imported by a run.
- A job refused before scoring touches no MLflow store, although its helper starts first.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from batchinfer.backends import check_options
from batchinfer.errors import SpecError
from batchinfer.handlers.base import BatchModelHandler, Prepared, handler_for
from batchinfer.handlers.onnx import CPU_CHUNK_ROWS
from batchinfer.imports import without
from factories import DS, make_mlp_onnx, numeric_project, read_partition, run_cli


def counting_handler(path: Path, **options) -> tuple[BatchModelHandler, list[int]]:
    handler = handler_for("onnxruntime", str(path), digest="test", device="cpu", options=options)
    calls: list[int] = []
    predict = handler.model_backend.predict

    def counted(model, inputs):
        calls.append(len(next(iter(inputs.values()))))
        return predict(model, inputs)

    handler.model_backend.predict = counted  # type: ignore[method-assign]
    return handler, calls


def test_onnx_cpu_scores_in_chunks_with_identical_results(tmp_path):
    model_path = make_mlp_onnx(tmp_path / "m.onnx", n_features=4, hidden=64)
    x = np.random.default_rng(3).standard_normal((10_000, 4)).astype(np.float32)
    results = {}
    cases = [("default", {}), ("whole", {"chunk_rows": 65_536}), ("odd", {"chunk_rows": 7}),
             ("in_turn", {"call_threads": 1}), ("four_at_once", {"call_threads": 4, "chunk_rows": 1000})]
    for label, options in cases:
        handler, calls = counting_handler(model_path, **options)
        model = handler.load_model()
        inference = handler.infer(model, Prepared(key=(0, 0), rows=len(x), features=x))
        results[label] = inference.outputs["y"]
        by_cpu = [CPU_CHUNK_ROWS, CPU_CHUNK_ROWS, 10_000 - 2 * CPU_CHUNK_ROWS]
        expected = {"default": by_cpu, "in_turn": by_cpu, "whole": [10_000], "four_at_once": [1000] * 10,
                    "odd": [7] * (10_000 // 7) + [10_000 % 7]}[label]
        # the first chunk once more, untimed, first: the warm-up (its set-up is not model time);
        # then the first call on its own, the rest at once (in whatever order their threads start)
        assert calls[:2] == [expected[0], expected[0]], label
        assert sorted(calls[2:]) == sorted(expected[1:]), label
        np.testing.assert_array_equal(inference.ok_rows, np.arange(10_000))
    assert results["default"].shape == (10_000, 1)
    # bit for bit, not approximately
    assert len({r.tobytes() for r in results.values()}) == 1, "calls of any size, in turn or at once"


def test_allow_spinning_is_a_checked_boolean():
    assert check_options("onnxruntime", {"allow_spinning": True}) == {"allow_spinning": True}
    with pytest.raises(SpecError, match="allow_spinning: expected bool"):
        check_options("onnxruntime", {"allow_spinning": "yes"})


@pytest.mark.slow
def test_call_size_changes_no_prediction_end_to_end(tmp_path):
    """The same partition scored with the default call size and with 7-row calls: identical."""
    numeric_project(tmp_path, shards=3, rows=1000, batch={"rows": 400})
    scores = {}
    for ds_out, extra in [("a", []), ("b", ["--set", "model.options.chunk_rows=7"])]:
        result = run_cli("run", "job.yaml", "--ds", DS, "--set", f"output.path=out/{ds_out}",
                         *extra, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        predictions, quarantine, manifest = read_partition(tmp_path / "out" / ds_out)
        assert manifest["totals"]["rows_in"] == 3000
        assert manifest["totals"]["rows_scored"] + manifest["totals"]["rows_quarantined"] == 3000
        # 3 shards × batches of 400, 400, 200: every batch's file is listed, none twice
        files = [f["path"] for s in manifest["shards"] for f in s["files"]]
        assert len(files) == len(set(files)) == 9
        order = predictions.sort_by([("_source_shard", "ascending"), ("_source_row", "ascending")])
        scores[ds_out] = (order.column("_source_row").to_pylist(),
                          order.column("_input_hash").to_pylist(),
                          order.column("y").to_numpy().tobytes())
    assert scores["a"] == scores["b"]


def test_without_hides_only_for_the_block():
    name = "batchinfer_not_a_real_module_xyz"
    with without("json", name):
        assert "json" in sys.modules and sys.modules["json"] is not None  # already imported
        import json as again  # noqa: F401  (still importable)
        with pytest.raises(ImportError):
            importlib.import_module(name)
    assert name not in sys.modules


def test_a_run_does_not_import_unused_extras():
    """Beam's and pandera's optional imports are hidden during batchinfer's imports; the
    extras stay importable afterwards."""
    present = [n for n in ("torch", "boto3", "hypothesis") if importlib.util.find_spec(n)]
    code = ("import sys, batchinfer.handlers.base, batchinfer.rows.validation, batchinfer.pipeline.transforms\n"
            f"print([n for n in {present!r} if n in sys.modules])\n"
            f"import importlib\nfor n in {present!r}: importlib.import_module(n)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_job_that_fails_preflight_touches_no_mlflow_store(tmp_path):
    numeric_project(tmp_path, shards=1, rows=50)
    make_mlp_onnx(tmp_path / "models" / "model.onnx", seed=1)  # not the model that was stamped
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "mlflow.db").exists()  # the helper started, but touched nothing


def test_io_binding_is_used_when_asked_and_gives_the_same_bytes(tmp_path):
    """``model.options.io_binding`` (on by default for GPU providers) goes through ONNX Runtime's
    IO binding instead of ``run``; the predictions are the same bytes."""
    model_path = make_mlp_onnx(tmp_path / "m.onnx", n_features=4, hidden=16)
    x = np.random.default_rng(5).standard_normal((5000, 4)).astype(np.float32)
    plain = handler_for("onnxruntime", str(model_path), digest="plain", device="cpu")
    bound = handler_for("onnxruntime", str(model_path), digest="bound", device="cpu",
                        options={"io_binding": True})
    loaded = bound.load_model()
    session = loaded.model.session
    calls = []
    real = session.run_with_iobinding

    def counted(binding, *args):
        calls.append(1)
        return real(binding, *args)

    session.run_with_iobinding = counted
    session.run = None   # would raise if the bound handler called it
    got = bound.infer(loaded, Prepared(key=(0, 0), rows=len(x), features=x)).outputs["y"]
    want = plain.infer(plain.load_model(), Prepared(key=(0, 0), rows=len(x), features=x)).outputs["y"]
    assert calls and got.tobytes() == want.tobytes()


def test_a_shared_model_answers_every_hook_with_data_that_pickles(tmp_path):
    """``share_across_processes``: workers reach the model through a proxy that pickles what
    crosses; ONNX Runtime's own answers (NodeArg) do not pickle, the LoadedModel's do."""
    import pickle

    from batchinfer.handlers.loaded import LoadedModel

    model_path = make_mlp_onnx(tmp_path / "m.onnx", n_features=4, hidden=16)
    shared = handler_for("onnxruntime", str(model_path), digest="shared", device="cpu",
                         options={"share_across_processes": True, "model_copies": 1})
    served = shared.load_model()
    assert isinstance(served, LoadedModel) and shared.model_copies() == 1
    with pytest.raises(TypeError):
        pickle.dumps(served.model.session.get_inputs())
    loaded = served
    for answer in (loaded.input_names(), loaded.output_names(), loaded.input_shapes(),
                   loaded.default_chunk_rows(), loaded.device_used(), loaded.facts()):
        pickle.dumps(answer)
    x = np.random.default_rng(2).standard_normal((300, 4)).astype(np.float32)
    plain = handler_for("onnxruntime", str(model_path), digest="plain", device="cpu")
    got = shared.infer(served, Prepared(key=(0, 0), rows=300, features=x)).outputs["y"]
    want = plain.infer(plain.load_model(), Prepared(key=(0, 0), rows=300, features=x)).outputs["y"]
    assert got.tobytes() == want.tobytes()
