"""The conformance kit (``batchinfer.testing``) as a backend from outside the repository uses it:
its suite subclassed for a backend over a numpy "model", its checks failing on backends that
break what they check, and a backend of three methods run through a real Beam RunInference.
Without a model file: fast.
"""
from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from batchinfer.errors import ModelError
from batchinfer.handlers.protocol import ModelFacts
from batchinfer.testing import (
    BackendCase,
    BackendConformance,
    check_a_bad_row_stays_in_its_row,
    check_bit_identical_reruns,
    check_out_of_memory_loses_no_row,
    check_predictions,
    check_protocol,
    check_rows_do_not_depend_on_their_neighbours,
    check_threads_sharing_a_model,
    handler_of,
)

WEIGHTS = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)


class NumpyBackend:
    """x [N, 4] → logits [N, 3] and score [N]; ``flaw`` breaks one promise on purpose."""

    def __init__(self, flaw=None):
        self.flaw = flaw
        self.noise = np.random.default_rng()

    def load(self, path):
        return WEIGHTS

    def facts(self, model):
        return ModelFacts(inputs=["x"], outputs=["logits", "score"], input_shapes={"x": (4,)},
                          default_chunk_rows=64)

    def predict(self, model, inputs):
        logits = inputs["x"] @ model
        if self.flaw == "noisy":
            logits = logits + self.noise.standard_normal(logits.shape).astype(np.float32) * 1e-3
        if self.flaw == "batch_mean":    # every row's score depends on the call's other rows
            logits = logits - logits.mean(axis=0)
        return {"logits": logits, "score": 1 / (1 + np.exp(-logits[:, 0]))}


def NumpyHandler(chunk_rows=None, flaw=None, backend=None):
    """The backend in the one handler a run wraps every backend in."""
    return handler_of(backend or NumpyBackend(flaw), "numpy.model", chunk_rows=chunk_rows,
                      digest=f"numpy-{flaw}-{type(backend).__name__}")


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
    short = NumpyBackend()
    short.predict = lambda model, inputs: {"logits": inputs["x"][1:] @ model, "score": inputs["x"][1:, 0]}
    with pytest.raises(ModelError, match="breaks the batch contract"):
        check_predictions(NumpyHandler(backend=short), inputs)


class SharedScratchBackend(NumpyBackend):
    """Says it is thread-safe but stages every call's input in one buffer of its model's (as the
    torch CUDA path stages in its pinned buffers): calls that overlap read each other's rows.
    Each thread's first call waits for the others inside, so that they do overlap."""

    thread_safe = True
    warm_up = False

    def __init__(self):
        super().__init__()
        self.met = threading.local()   # each thread's first call waits for the others

    def load(self, path):
        return {"weights": WEIGHTS, "scratch": {}, "meet": threading.Barrier(4, timeout=30)}

    def predict(self, model, inputs):
        model["scratch"]["x"] = inputs["x"]
        if threading.current_thread() is not threading.main_thread() and not getattr(self.met, "done", False):
            self.met.done = True
            model["meet"].wait()
        logits = model["scratch"]["x"] @ model["weights"]
        return {"logits": logits, "score": 1 / (1 + np.exp(-logits[:, 0]))}


def test_the_kit_fails_a_backend_that_says_it_is_thread_safe_and_is_not():
    with pytest.raises(AssertionError, match="logits, thread"):
        check_threads_sharing_a_model(lambda: NumpyHandler(backend=SharedScratchBackend()),
                                      [numpy_inputs(50, seed) for seed in range(4)])


class ThreeMethods:
    """A whole backend: the model protocol's three methods, nothing else."""

    def load(self, path):
        return np.float32(3.0)

    def facts(self, model):
        return ModelFacts(inputs=["x"], outputs=["y"])

    def predict(self, model, inputs):
        return {"y": inputs["x"][:, 0] * model}


class TestThreeMethods(BackendConformance):
    """The kit's whole suite passes a backend of three methods."""

    @pytest.fixture
    def backend(self) -> BackendCase:
        return BackendCase(make_handler=lambda chunk_rows=None: handler_of(ThreeMethods(), "three.model",
                                                                           chunk_rows=chunk_rows),
                           inputs=lambda rows, seed: {"x": np.random.default_rng(seed).random((rows, 2), np.float32)},
                           reference=lambda inputs: {"y": inputs["x"][:, 0] * np.float32(3.0)})


def test_a_backend_of_three_methods_runs_a_beam_run_inference():
    """The kit's handler for ``ThreeMethods`` is what a run gives Beam: batches through
    ``RunInference`` come back scored, a rejected row isolated in its batch."""
    import apache_beam as beam
    from apache_beam.testing.util import assert_that, equal_to

    from batchinfer.beam_compat import RunInference
    from batchinfer.handlers.base import Prepared

    class Picky(ThreeMethods):
        def predict(self, model, inputs):
            if (inputs["x"] < 0).any():
                raise ValueError("negative")
            return super().predict(model, inputs)

    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    x[4, 0] = -1
    batches = [Prepared((0, 0), 3, x[:3]), Prepared((1, 0), 3, x[3:])]
    with beam.Pipeline() as pipeline:
        scored = (pipeline | beam.Create(batches)
                  | RunInference(handler_of(Picky(), "three.model", chunk_rows=2))
                  | beam.Map(lambda r: (r.example.key[0], r.inference.ok_rows.tolist(),
                                      r.inference.outputs["y"].tolist(), r.inference.failed)))
        assert_that(scored, equal_to([(0, [0, 1, 2], [0.0, 6.0, 12.0], []),
                                      (1, [0, 2], [18.0, 30.0], [(1, "ValueError: negative")])]))


def test_the_kit_fails_a_backend_that_breaks_the_protocol_with_a_clear_message():
    check_protocol(ThreeMethods(), "three.model", {"x": np.ones((3, 2), np.float32)})

    class NoFacts:
        def load(self, path):
            return None

        def predict(self, model, inputs):
            return {}

    with pytest.raises(AssertionError, match=r"NoFacts has no method 'facts': a model backend "
                                             r"implements load\(path\)"):
        check_protocol(NoFacts())

    class DictFacts(ThreeMethods):
        def facts(self, model):
            return {"inputs": ["x"], "outputs": ["y"]}

    with pytest.raises(AssertionError, match="DictFacts.facts returned dict, not a ModelFacts"):
        check_protocol(DictFacts())

    class StrayShape(ThreeMethods):
        def facts(self, model):
            return ModelFacts(inputs=["x"], outputs=["y"], input_shapes={"z": (2,)})

    with pytest.raises(AssertionError, match=r"input_shapes names \['z'\], which are not inputs \['x'\]"):
        check_protocol(StrayShape())

    class WrongOutputs(ThreeMethods):
        def predict(self, model, inputs):
            return {"score": inputs["x"][:, 0]}

    with pytest.raises(AssertionError, match=r"answered \['score'\], not the declared outputs \['y'\]"):
        check_protocol(WrongOutputs(), "three.model", {"x": np.ones((3, 2), np.float32)})


def test_importing_batchinfer_imports_neither_the_kit_nor_pytest():
    code = ("import sys, batchinfer, batchinfer.cli, batchinfer.handlers.base, batchinfer.commands.run\n"
            "print(sorted(m for m in ('pytest', 'batchinfer.testing') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
