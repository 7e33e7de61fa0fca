"""SmoothQuant's graph transform (batchinfer/convert/smoothing.py): the smoothed FP32 model
computes what the original does, and its activations' outlier channels are evened out."""
from __future__ import annotations

import numpy as np
import pytest

from factories import make_mlp_onnx

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from batchinfer.convert import smoothing  # noqa: E402


def _run(model, x: np.ndarray, outputs=None) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(outputs, {"x": x})


def test_smoothed_model_computes_the_same_and_evens_the_channels(tmp_path):
    model = onnx.load(str(make_mlp_onnx(tmp_path / "m.onnx", n_features=6, hidden=16, seed=3)))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 6)).astype(np.float32)
    x[:, 2] *= 40.0                                  # an outlier channel, as in a transformer
    assert set(smoothing.smoothable(model)) == {"x", "h2"}
    maxima = smoothing.activation_maxima(model, {"x": x}, tokens=None, lengths_from="attention_mask",
                                         sequences=())
    np.testing.assert_allclose(maxima["x"], np.abs(x).max(axis=0), rtol=1e-6)

    smoothed, count = smoothing.smooth(model, maxima, 0.7)
    assert count == 2
    onnx.checker.check_model(smoothed)
    assert [n.op_type for n in smoothed.graph.node].count("Mul") == 2
    np.testing.assert_allclose(_run(smoothed, x)[0], _run(model, x)[0], rtol=1e-5, atol=1e-6)
    # what the first MatMul now multiplies: channel 2 no longer 40x the others
    probe = onnx.ModelProto()
    probe.CopyFrom(smoothed)
    probe.graph.output.append(onnx.helper.make_tensor_value_info("x_smoothquant", onnx.TensorProto.FLOAT, None))
    seen = np.abs(_run(probe, x, ["x_smoothquant"])[0]).max(axis=0)
    assert seen.max() / seen.min() < 0.5 * maxima["x"].max() / maxima["x"].min()
    assert len(model.graph.node) == 6, "smooth changed the model it was given"
