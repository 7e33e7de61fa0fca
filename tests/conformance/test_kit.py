"""The conformance kit (``batchinfer.testing``) as a backend from outside the repository uses it:
its suite subclassed for a handler over a numpy "model", and its checks failing on handlers
that break what they check. Without Beam or a model file: fast.
"""
from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from batchinfer.errors import ModelError
from batchinfer.handlers.base import BatchModelHandler
from batchinfer.testing import (
    BackendCase,
    BackendConformance,
    check_a_bad_row_stays_in_its_row,
    check_bit_identical_reruns,
    check_out_of_memory_loses_no_row,
    check_predictions,
    check_rows_do_not_depend_on_their_neighbours,
    check_threads_sharing_a_model,
)

WEIGHTS = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)


class NumpyHandler(BatchModelHandler):
    """x [N, 4] → logits [N, 3] and score [N]; ``flaw`` breaks one promise on purpose."""

    def __init__(self, chunk_rows=None, flaw=None):
        super().__init__("numpy.model", digest=f"numpy-{flaw}",
                         options={"chunk_rows": chunk_rows} if chunk_rows else {})
        self.flaw = flaw
        self.noise = np.random.default_rng()

    def open_model(self):
        return WEIGHTS

    def input_names(self, model):
        return ["x"]

    def output_names(self, model):
        return ["logits", "score"]

    def input_shapes(self, model):
        return {"x": (4,)}

    def default_chunk_rows(self, model):
        return 64

    def predict(self, model, inputs):
        logits = inputs["x"] @ model
        if self.flaw == "noisy":
            logits = logits + self.noise.standard_normal(logits.shape).astype(np.float32) * 1e-3
        if self.flaw == "batch_mean":    # every row's score depends on the call's other rows
            logits = logits - logits.mean(axis=0)
        return {"logits": logits, "score": 1 / (1 + np.exp(-logits[:, 0]))}


def numpy_inputs(rows: int, seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed + rows).standard_normal((rows, 4)).astype(np.float32)}


def numpy_reference(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    logits = inputs["x"].astype(np.float64) @ WEIGHTS.astype(np.float64)
    return {"logits": logits.astype(np.float32),
            "score": (1 / (1 + np.exp(-logits[:, 0]))).astype(np.float32)}


class TestNumpyBackend(BackendConformance):
    """The whole suite, at the backend's default call size and at 7 rows a call."""

    @pytest.fixture(params=[None, 7], ids=["default-calls", "7-row-calls"])
    def backend(self, request) -> BackendCase:
        return BackendCase(make_handler=lambda chunk_rows=None: NumpyHandler(chunk_rows or request.param),
                           inputs=numpy_inputs, reference=numpy_reference, atol=1e-5)


def test_the_kit_fails_a_model_that_is_not_deterministic():
    with pytest.raises(AssertionError, match="logits"):
        check_bit_identical_reruns(lambda: NumpyHandler(flaw="noisy"), numpy_inputs(100, 1))


def test_the_kit_fails_a_model_whose_rows_depend_on_their_neighbours():
    with pytest.raises(AssertionError, match="row 0"):
        check_rows_do_not_depend_on_their_neighbours(lambda: NumpyHandler(flaw="batch_mean"),
                                                     numpy_inputs(9, 3), atol=1e-6)
    with pytest.raises(AssertionError):   # and calls of other sizes change its results
        check_out_of_memory_loses_no_row(lambda chunk_rows=None: NumpyHandler(chunk_rows, "batch_mean"),
                                         numpy_inputs(1000, 5), atol=1e-6)


def test_the_kit_fails_a_model_that_spreads_a_bad_row():
    with pytest.raises(AssertionError, match="logits"):
        check_a_bad_row_stays_in_its_row(lambda: NumpyHandler(flaw="batch_mean"), numpy_inputs(50, 4),
                                         [3], atol=1e-6)


def test_the_kit_fails_wrong_predictions_and_a_broken_batch_contract():
    inputs = numpy_inputs(50, 2)
    wrong = {**numpy_reference(inputs), "score": np.zeros(50, np.float32)}
    with pytest.raises(AssertionError, match="score"):
        check_predictions(NumpyHandler(), inputs, wrong, atol=1e-5)
    short = NumpyHandler()
    short.predict = lambda model, inputs: {"logits": inputs["x"][1:] @ model, "score": inputs["x"][1:, 0]}
    with pytest.raises(ModelError, match="breaks the batch contract"):
        check_predictions(short, inputs)


class SharedScratch(NumpyHandler):
    """Says it is thread-safe but stages every call's input in one buffer of its model's (as the
    torch CUDA path stages in its pinned buffers): calls that overlap read each other's rows.
    Each thread's first call waits for the others inside, so that they do overlap."""

    thread_safe = True
    warm_up = False

    def open_model(self):
        return {"weights": WEIGHTS, "scratch": {}, "meet": threading.Barrier(4, timeout=30)}

    def predict(self, model, inputs):
        model["scratch"]["x"] = inputs["x"]
        if threading.current_thread() is not threading.main_thread() and not getattr(self, "met", False):
            self.met = True
            model["meet"].wait()
        logits = model["scratch"]["x"] @ model["weights"]
        return {"logits": logits, "score": 1 / (1 + np.exp(-logits[:, 0]))}


def test_the_kit_fails_a_backend_that_says_it_is_thread_safe_and_is_not():
    with pytest.raises(AssertionError, match="logits, thread"):
        check_threads_sharing_a_model(SharedScratch, [numpy_inputs(50, seed) for seed in range(4)])


def test_importing_batchinfer_imports_neither_the_kit_nor_pytest():
    code = ("import sys, batchinfer, batchinfer.cli, batchinfer.handlers.base, batchinfer.commands.run\n"
            "print(sorted(m for m in ('pytest', 'batchinfer.testing') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
