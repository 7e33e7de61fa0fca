"""The parts the handler composes around a backend (batchinfer/handlers): call planning
(calls.py), the out-of-memory policy (oom.py), the batch contract (batch_contract.py), the loaded
model (loaded.py), the per-process model cache and the lock on a model that is not thread-safe
(sharing.py), and the fault value the handler carries (faults.py). Each is checked on its own
here; tests/unit/test_model_failures.py and test_token_batches.py check them together through
``BatchModelHandler.infer``.
Rerun with ``.venv/bin/pytest tests/unit/test_handler_parts.py -q``.
"""
from __future__ import annotations

import gc
import os
import pickle
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer import faults
from batchinfer.errors import ModelError
from batchinfer.handlers import base, sharing
from batchinfer.handlers.base import BatchModelHandler, Prepared
from batchinfer.handlers.batch_contract import BatchContract
from batchinfer.handlers.calls import plan_calls
from batchinfer.handlers.loaded import LoadedModel
from batchinfer.handlers.oom import InjectedOutOfMemory, OutOfMemoryPolicy
from batchinfer.handlers.protocol import ModelFacts

# -- call planning ------------------------------------------------------------------------------

def test_calls_by_rows_hold_the_limit_and_the_padded_width():
    assert plan_calls(0, 10, rows=4, width=9) == [(0, 4, 9), (4, 8, 9), (8, 10, 9)]
    assert plan_calls(3, 10, rows=None) == [(3, 10, 0)]             # no limit: the whole range
    assert plan_calls(5, 5, rows=4) == []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=60), st.integers(0, 59),
       st.integers(1, 2000), st.one_of(st.none(), st.integers(1, 20)), st.booleans())
def test_any_plan_covers_each_row_once_within_its_limits(lengths, first, tokens, rows, by_tokens):
    lengths = np.array(sorted(lengths, reverse=True))
    start = min(first, len(lengths) - 1)
    calls = (plan_calls(start, len(lengths), rows=rows, lengths=lengths, tokens=tokens) if by_tokens
             else plan_calls(start, len(lengths), rows=rows, width=7))
    assert [lo for lo, _, _ in calls] == [start] + [hi for _, hi, _ in calls[:-1]]
    assert calls[-1][1] == len(lengths)
    for lo, hi, width in calls:
        assert hi > lo and (rows is None or hi - lo <= rows)
        if by_tokens:
            assert width == max(1, lengths[lo])                        # its longest row
            assert (hi - lo) * width <= tokens or hi - lo == 1
        else:
            assert width == 7


# -- the out-of-memory policy ------------------------------------------------------------------

def test_back_off_halves_and_remembers_rows_or_tokens(caplog):
    policy = OutOfMemoryPolicy()
    assert policy.row_limit(4096) == 4096 and policy.token_limit(8192) == 8192
    assert policy.back_off(MemoryError("full"), 4096, 0, by_tokens=False) == 2048
    assert policy.row_limit(4096) == 2048 and policy.row_limit(100) == 100
    assert policy.token_limit(8192) == 8192                           # rows only
    assert "out of device memory at 4096 rows per model call; retrying the same rows at 2048" in caplog.text
    assert policy.back_off(MemoryError("full"), 40, 50, by_tokens=True) == 20
    assert policy.token_limit(8192) == 1000                           # 20 rows × 50 wide
    with pytest.raises(ModelError, match=r"out of device memory on a single row \(full\)"):
        policy.back_off(MemoryError("full"), 1, 50, by_tokens=True)


def test_the_injected_fault_fails_calls_above_its_rows_only():
    OutOfMemoryPolicy().before_call(10**9)                            # not armed: nothing
    policy = OutOfMemoryPolicy(inject_above=1000)
    policy.before_call(1000)
    with pytest.raises(InjectedOutOfMemory, match="injected above 1000 rows"):
        policy.before_call(1001)


# -- the batch contract -----------------------------------------------------------------------

def test_the_batch_contract_wants_a_row_out_per_row_in_and_one_signature():
    contract = BatchContract()
    contract.check({"y": np.zeros((5, 2), np.float32)}, 5)
    contract.check({"y": np.zeros((3, 2), np.float32)}, 3)            # another row count: fine
    with pytest.raises(ModelError, match=r"output 'y' has shape \[4, 2\] for 5 input rows"):
        contract.check({"y": np.zeros((4, 2), np.float32)}, 5)
    with pytest.raises(ModelError, match=r"'y' was float32 \[2\] per row and is now float32 \[3\]"):
        contract.check({"y": np.zeros((5, 3), np.float32)}, 5)
    with pytest.raises(ModelError, match=r"'y' was float32 \[2\] per row and is now float64 \[2\]"):
        contract.check({"y": np.zeros((5, 2), np.float64)}, 5)
    assert BatchContract().signatures == {}                           # per handler, not global


# -- the loaded model and the model cache --------------------------------------------------------

class CountingBackend:
    """A model that is a Python object (so that it can be watched being freed)."""

    warm_up = False
    opened: list[str] = []

    def __init__(self, digest):
        self.digest = digest

    def load(self, path):
        CountingBackend.opened.append(self.digest)
        return {"weights": np.arange(3)}

    def facts(self, model):
        # a tuple and a list: the loaded model answers with plain lists and tuples
        return ModelFacts(inputs=("x",), outputs=["y"], input_shapes={"x": [1]}, default_chunk_rows=2)

    def predict(self, model, inputs):
        return {"y": inputs["x"][:, 0] * model["weights"][2]}


class Counting(BatchModelHandler):
    """The handler a run wraps CountingBackend in (a subclass for the tests' one-line builds)."""

    opened = CountingBackend.opened

    def __init__(self, digest="counting", **options):
        super().__init__(CountingBackend(digest), "counting.model", digest=digest, options=options)


def test_a_local_model_binds_the_hooks_and_a_served_one_answers_plain_data():
    handler = Counting()
    loaded = handler.load_model()
    assert isinstance(loaded, LoadedModel) and handler.load_model() is loaded
    assert loaded.input_names() == ["x"] and loaded.output_names() == ["y"]
    assert loaded.input_shapes() == {"x": (1,)} and loaded.default_chunk_rows() == 2
    assert loaded.device_used() == "cpu"
    assert loaded.predict({"x": np.ones((2, 1))})["y"].tolist() == [2.0, 2.0]
    shared = Counting(share_across_processes=True)
    served = shared.load_model()
    assert isinstance(served, LoadedModel) and pickle.loads(pickle.dumps(served.facts())) == served.facts()
    assert served._lock is sharing.call_lock(shared.model_key())   # held where it is served
    assert served.input_names() == ["x"]
    result = shared.infer(served, Prepared((0, 0), 5, np.ones((5, 1))))
    assert result.outputs["y"].tolist() == [2.0] * 5 and result.chunk_rows == 2


def test_a_model_is_cached_while_a_handler_holds_it_and_freed_after():
    Counting.opened.clear()
    first = Counting(digest="cached")
    model = first.load_model()
    worker = pickle.loads(pickle.dumps(first))         # what Beam hands an in-process worker
    assert worker._held is None and worker._loaded is None   # the model does not travel
    assert worker.load_model().model is model.model and Counting.opened == ["cached"]
    key = first.model_key()
    del worker, model
    gc.collect()
    assert key in sharing._models                      # `first` still holds it
    del first
    gc.collect()
    assert key not in sharing._models                  # no handler left: evicted
    Counting(digest="cached").load_model()
    assert Counting.opened == ["cached", "cached"]


# -- threads sharing a model ---------------------------------------------------------------------

class Entered:
    """A model that watches the threads in its ``predict``."""

    def __init__(self):
        self.guard = threading.Lock()
        self.inside = 0
        self.most = 0          # threads inside at once, at most
        self.threads: set[int] = set()


ENTERED: dict[str, Entered] = {}   # by digest: the model each test's handlers load


class OneAtATimeBackend:
    """A backend whose ``predict`` may not run in two threads at once, as TensorRT's one
    execution context or the torch CUDA path's one set of staging buffers: a call that finds
    another thread inside fails its rows."""

    warm_up = False

    def __init__(self, digest):
        self.digest = digest

    def load(self, path):
        return ENTERED.setdefault(self.digest, Entered())

    def facts(self, model):
        return ModelFacts(inputs=["x"], outputs=["y"])

    def predict(self, model, inputs):
        with model.guard:
            model.inside += 1
            model.most = max(model.most, model.inside)
            model.threads.add(threading.get_ident())
            clash = model.inside > 1
        try:
            if clash:
                raise RuntimeError("another thread is inside predict")
            time.sleep(0.002)   # the call's time on the device: room for another thread to come in
            return {"y": inputs["x"][:, 0] * 2}
        finally:
            with model.guard:
                model.inside -= 1


def OneAtATime(digest):
    return BatchModelHandler(OneAtATimeBackend(digest), "one-at-a-time.model", digest=digest,
                             options={"chunk_rows": 2})


def test_a_beam_workers_threads_take_turns_on_a_model_that_is_not_thread_safe():
    """Beam's direct runner with 4 threads in this process: each thread unpickles a handler of
    its own and one of them loads the model, which Beam's ``Shared`` hands the others — the
    threads' handlers share nothing but the model and its key. Its calls never overlap and every
    row is scored. (With the lock off, ``thread_safe = True`` on the backend, 4 threads were inside at once
    and rows failed.)"""
    import apache_beam as beam
    from apache_beam.testing.util import assert_that, equal_to

    from batchinfer.beam_compat import RunInference
    from batchinfer.pipeline.runner_options import pipeline_options

    batches = [Prepared((i, 0), 8, np.full((8, 1), i, np.float32)) for i in range(16)]
    options = pipeline_options("direct", {"direct_num_workers": 4, "direct_running_mode": "multi_threading"})
    with beam.Pipeline(options=options) as pipeline:
        scored = (pipeline | beam.Create(batches) | beam.Reshuffle()
                  | RunInference(OneAtATime("beam-threads"))
                  | beam.Map(lambda r: (r.example.key[0], r.inference.failed,
                                      r.inference.outputs.get("y", np.zeros(0)).tolist())))
        assert_that(scored, equal_to([(i, [], [2.0 * i] * 8) for i in range(16)]))
    model = ENTERED["beam-threads"]
    assert len(model.threads) > 1 and model.most == 1, (len(model.threads), model.most)


def test_the_time_a_call_waits_for_the_lock_is_not_the_models(monkeypatch):
    """``_compute_ms`` is the model's time: a call that waits for another thread's (here a lock
    that takes a second of a fake clock to get) does not count the wait."""
    clock = [0.0]

    class SlowLock:
        def __enter__(self):
            clock[0] += 1.0

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(base, "call_lock", lambda key: SlowLock())
    handler = OneAtATime("slow-lock")
    monkeypatch.setattr(OneAtATimeBackend, "predict", lambda self, model, inputs: {"y": inputs["x"][:, 0]})
    model = handler.load_model()
    result = handler.infer(model, Prepared((0, 0), 4, np.ones((4, 1), np.float32)))
    assert result.failed == [] and result.compute_ms == 0.0          # 2 calls, 2 s waited, 0 s computed
    waited = model.waited_s()
    model.predict({"x": np.ones((1, 1), np.float32)})
    assert model.waited_s() - waited == 1.0


# -- calls at once (call_threads) ------------------------------------------------------------------

class AtOnceBackend:
    """A thread-safe model that says how many calls it takes at once and watches them: each call
    holds its thread a moment (the model's time, GIL released), so calls made at once overlap.
    Rows whose x is negative are rejected (the rows-isolation path); ``oom_above`` rows or more
    in one call raise the injected out-of-memory error."""

    thread_safe = True
    warm_up = True

    def __init__(self, digest, threads, oom_above=None):
        self.digest, self.threads, self.oom_above = digest, threads, oom_above

    def load(self, path):
        return ENTERED.setdefault(self.digest, Entered())

    def facts(self, model):
        return ModelFacts(inputs=["x"], outputs=["y"], call_threads=self.threads)

    def predict(self, model, inputs):
        x = inputs["x"]
        if self.oom_above is not None and len(x) >= self.oom_above:
            raise InjectedOutOfMemory("out of memory (test)")
        with model.guard:
            model.inside += 1
            model.most = max(model.most, model.inside)
            model.threads.add(threading.get_ident())
        try:
            time.sleep(0.003)
            if (x < 0).any():
                raise ValueError("negative input")
            return {"y": x[:, 0] * 3.0}
        finally:
            with model.guard:
                model.inside -= 1


def _at_once(digest, threads, chunk_rows=4, oom_above=None):
    return BatchModelHandler(AtOnceBackend(digest, threads, oom_above), "at-once.model",
                             digest=digest, options={"chunk_rows": chunk_rows})


def test_calls_at_once_overlap_and_give_the_outputs_of_calls_in_turn():
    x = np.arange(103, dtype=np.float32).reshape(-1, 1)
    at_once, in_turn = _at_once("at-once-2", 2), _at_once("at-once-1", 1)
    got = at_once.infer(at_once.load_model(), Prepared((0, 0), 103, x))
    want = in_turn.infer(in_turn.load_model(), Prepared((0, 0), 103, x))
    assert got.outputs["y"].tolist() == want.outputs["y"].tolist() == (x[:, 0] * 3).tolist()
    assert got.ok_rows.tolist() == list(range(103)) and got.chunk_rows == 4
    assert ENTERED["at-once-2"].most == 2 and ENTERED["at-once-1"].most == 1
    assert len(ENTERED["at-once-2"].threads - {threading.get_ident()}) == 2   # the pool's two
    # the model's time is the calls' wall time together: about half of the calls' sum (26 calls
    # of >= 3 ms on 2 threads), never their sum
    assert got.compute_ms < 0.8 * want.compute_ms, (got.compute_ms, want.compute_ms)


def test_a_rejected_row_or_out_of_memory_among_calls_at_once_is_met_as_in_turn():
    x = np.arange(40, dtype=np.float32).reshape(-1, 1)
    x[[9, 33]] = -1.0                                         # rows in the 3rd and the 9th call
    for threads in (1, 2):
        handler = _at_once(f"reject-{threads}", threads)
        result = handler.infer(handler.load_model(), Prepared((0, 0), 40, x))
        assert [row for row, _ in result.failed] == [9, 33]
        assert result.ok_rows.tolist() == [r for r in range(40) if r not in (9, 33)]
        assert result.outputs["y"].tolist() == (x[result.ok_rows, 0] * 3).tolist()
    # calls of 8 rows run out of memory; halved to 4, every row is scored once, in order
    handler = _at_once("oom-at-once", 2, chunk_rows=8, oom_above=8)
    result = handler.infer(handler.load_model(), Prepared((0, 0), 40, np.ones((40, 1), np.float32)))
    assert result.failed == [] and result.oom_backoffs == 1 and result.chunk_rows == 4
    assert result.outputs["y"].tolist() == [3.0] * 40


def test_a_model_that_is_not_thread_safe_makes_its_calls_in_turn_whatever_it_says():
    backend = AtOnceBackend("says-2-but-locked", 2)
    backend.thread_safe = False
    handler = BatchModelHandler(backend, "locked.model", digest="locked", options={"chunk_rows": 4})
    model = handler.load_model()
    assert model.call_threads() == 1
    handler.infer(model, Prepared((0, 0), 40, np.ones((40, 1), np.float32)))
    assert ENTERED["says-2-but-locked"].most == 1


def test_onnx_runtime_on_the_cpu_takes_a_call_per_core_unless_the_job_says(tmp_path):
    from batchinfer.errors import SpecError
    from batchinfer.handlers.onnx import cpu_call_threads

    assert cpu_call_threads({}) == len(os.sched_getaffinity(0))
    assert cpu_call_threads({"call_threads": 3}) == 3
    assert cpu_call_threads({"intra_op_num_threads": 2}) == 1      # the job chose intra-op threads
    assert cpu_call_threads({"intra_op_num_threads": 1, "call_threads": 2}) == 2
    with pytest.raises(SpecError, match="call_threads must be at least 1, not 0"):
        cpu_call_threads({"call_threads": 0})


# -- the fault value the handler carries ----------------------------------------------------------

def test_faults_are_read_from_an_environment_once_and_scoped(monkeypatch):
    assert faults.Faults.from_environ({"BATCHINFER_FAULT": "write:2"}) == faults.Faults("write", 2)
    assert faults.Faults.from_environ({"BATCHINFER_FAULT": "read"}) == faults.Faults("read", 1)
    assert faults.Faults.from_environ({}) == faults.Faults()
    assert faults.Faults("oom", 1000).oom_rows() == 1000 and faults.Faults("read").oom_rows() is None
    assert pickle.loads(pickle.dumps(faults.Faults("oom", 7))) == faults.Faults("oom", 7)
    before = faults.active()
    with faults.scoped(faults.Faults("shard_done", 3)):
        monkeypatch.setenv("BATCHINFER_FAULT", "read")   # read once: a later variable changes nothing
        assert faults.armed("shard_done") and not faults.armed("read")
        faults.point("shard_done")
        faults.point("shard_done")                      # the 3rd would kill this process
    assert faults.active() == before


def test_the_oom_fault_travels_with_the_handler_and_halves_its_calls():
    with faults.scoped(faults.Faults("oom", 3)):
        handler = Counting(digest="oom", chunk_rows=8)
    handler = pickle.loads(pickle.dumps(handler))     # to a worker, where no fault is installed
    result = handler.infer(handler.load_model(), Prepared((0, 0), 20, np.ones((20, 1))))
    assert result.failed == [] and result.outputs["y"].tolist() == [2.0] * 20
    assert result.oom_backoffs == 2 and result.chunk_rows == 2        # 8 → 4 → 2 (≤ 3)
    clean = Counting(digest="clean", chunk_rows=8)
    assert clean.infer(clean.load_model(), Prepared((0, 0), 20, np.ones((20, 1)))).oom_backoffs == 0


# -- torch ---------------------------------------------------------------------------------------

def test_torch_out_of_memory_is_recognised():
    torch = pytest.importorskip("torch")
    from batchinfer.handlers.pytorch import TorchBackend

    backend = TorchBackend(device="cpu")
    assert backend.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert not backend.is_out_of_memory(RuntimeError("shape mismatch"))


def test_omp_wait_policy_is_set_for_torchs_import_only(monkeypatch):
    from batchinfer.handlers.pytorch import _passive_openmp

    monkeypatch.delitem(sys.modules, "torch", raising=False)   # as before torch's first import
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with _passive_openmp():
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in os.environ                  # children inherit nothing
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with _passive_openmp():
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"        # the user's own wins
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
