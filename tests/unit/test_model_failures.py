"""Model failures (contract §4: rows whose batch the model rejects, or whose output is non-finite,
are quarantined with ``_check: "model"``; the batch is split to isolate them). A model whose
output has another number of rows than it was given breaks the batch contract: exit 5, nothing
committed, never isolated row by row.

Real ONNX models that misbehave only on some rows, run in-process (``run_job`` on the
DirectRunner; MLflow tracking replaced by a stub), plus unit tests of
``BatchModelHandler.infer`` with a Python fake model.
Rerun with ``.venv/bin/pytest tests/unit/test_model_failures.py -q``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from factories import (
    DS,
    _weights,
    check_partition,
    make_shards,
    mlp_reference,
    no_tracking,  # noqa: F401  (fixture)
    save_onnx,
    write_job,
    write_schema,
)

ROWS, BATCH = 300, 100
BAD = {0: [5, 150, 151], 1: [299]}     # shard → rows that make the model misbehave




pytestmark = pytest.mark.usefixtures("no_tracking")  # MLflow is not under test here


# -- models ------------------------------------------------------------------------------------

def _mlp_nodes(helper):
    """make_mlp_onnx's graph up to the logit ``o1`` and its sigmoid ``p``."""
    return [helper.make_node("MatMul", ["x", "w1"], ["h0"]),
            helper.make_node("Add", ["h0", "b1"], ["h1"]),
            helper.make_node("Relu", ["h1"], ["h2"]),
            helper.make_node("MatMul", ["h2", "w2"], ["o0"]),
            helper.make_node("Add", ["o0", "b2"], ["o1"]),
            helper.make_node("Sigmoid", ["o1"], ["p"])]


def _column(helper, numpy_helper, index: int, out: str):
    """Nodes and initializers giving x[:, index:index+1] as ``out``."""
    inits = [numpy_helper.from_array(np.array([index], np.int64), f"{out}_s"),
             numpy_helper.from_array(np.array([index + 1], np.int64), f"{out}_e"),
             numpy_helper.from_array(np.array([1], np.int64), f"{out}_a")]
    return [helper.make_node("Slice", ["x", f"{out}_s", f"{out}_e", f"{out}_a"], [out])], inits


def make_model(path: Path, kind: str) -> Path:
    """An MLP (same weights as make_mlp_onnx) that misbehaves on some rows:

    - ``gather``: adds ``table[int(x0)]`` (zeros, 5 entries): ONNX Runtime raises for x0 ≥ 5;
    - ``nan``: a second output ``lg = log(x1 + 5)``: NaN for x1 < -5, -inf for x1 = -5;
    - ``compress``: keeps only rows with x0 < 5 (the batch dimension shrinks);
    - ``drop_last``: always returns one row fewer than it was given.
    """
    from onnx import TensorProto, helper, numpy_helper

    w1, b1, w2, b2 = _weights(4, 8, 0)
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"),
             numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(b2, "b2")]
    nodes = _mlp_nodes(helper)
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 1])]
    if kind == "gather":
        col, col_inits = _column(helper, numpy_helper, 0, "x0")
        nodes += col + [helper.make_node("Cast", ["x0"], ["i0"], to=TensorProto.INT64),
                        helper.make_node("Reshape", ["i0", "flat"], ["i1"]),
                        helper.make_node("Gather", ["table", "i1"], ["g"], axis=0),
                        helper.make_node("Reshape", ["g", "col"], ["g1"]),
                        helper.make_node("Add", ["p", "g1"], ["y"])]
        inits += col_inits + [numpy_helper.from_array(np.zeros(5, np.float32), "table"),
                              numpy_helper.from_array(np.array([-1], np.int64), "flat"),
                              numpy_helper.from_array(np.array([-1, 1], np.int64), "col")]
    elif kind == "nan":
        col, col_inits = _column(helper, numpy_helper, 1, "x1")
        nodes += col + [helper.make_node("Add", ["x1", "five"], ["x1p"]),
                        helper.make_node("Log", ["x1p"], ["lg"]),
                        helper.make_node("Identity", ["p"], ["y"])]
        inits += col_inits + [numpy_helper.from_array(np.array(5, np.float32), "five")]
        outputs.append(helper.make_tensor_value_info("lg", TensorProto.FLOAT, ["N", 1]))
    elif kind == "compress":
        col, col_inits = _column(helper, numpy_helper, 0, "x0")
        nodes += col + [helper.make_node("Less", ["x0", "five"], ["keep2"]),
                        helper.make_node("Reshape", ["keep2", "flat"], ["keep"]),
                        helper.make_node("Compress", ["p", "keep"], ["y"], axis=0)]
        inits += col_inits + [numpy_helper.from_array(np.array(5, np.float32), "five"),
                              numpy_helper.from_array(np.array([-1], np.int64), "flat")]
    elif kind == "drop_last":
        inits += [numpy_helper.from_array(np.array([0], np.int64), "s"),
                  numpy_helper.from_array(np.array([-1], np.int64), "e"),
                  numpy_helper.from_array(np.array([0], np.int64), "a")]
        nodes += [helper.make_node("Slice", ["p", "s", "e", "a"], ["y"])]
    else:
        raise ValueError(kind)
    graph = helper.make_graph(nodes, kind,
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              outputs, inits)
    return save_onnx(graph, path)


# -- project -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model_failures")
    write_schema(folder / "schemas")     # f0..f3 in [-10, 10]: every trigger value is valid data
    shards = make_shards(folder / "data" / f"dt={DS}", shards=2, rows=ROWS, seed=5)
    for s, rows in BAD.items():           # x0 = 7.5 (gather, compress), x1 = -7 (nan; -5 → -inf)
        table = pq.read_table(shards[s])
        f0, f1 = table["f0"].to_numpy().copy(), table["f1"].to_numpy().copy()
        f0[rows] = 7.5
        f1[rows] = [-7.0 if i % 2 else -5.0 for i in range(len(rows))]
        table = table.set_column(1, "f0", pa.array(f0)).set_column(2, "f1", pa.array(f1))
        pq.write_table(table, shards[s])
    return folder, shards


def run_model(folder: Path, kind: str, max_bad_fraction: float = 0.05):
    from batchinfer.commands.run import run_job
    from batchinfer.commands.stamp import stamp
    from batchinfer.spec import load_job

    make_model(folder / "models" / f"{kind}.onnx", kind)
    job = write_job(folder, model=f"models/{kind}.onnx", batch={"rows": BATCH},
                    output={"path": f"out_{kind}", "id_columns": ["id"]},
                    quarantine={"max_bad_fraction": max_bad_fraction, "max_bad_shards": 0})
    job = job.rename(folder / f"{kind}.yaml")
    stamp(load_job(job, require_ds=False), None, f"{kind}:1")
    return run_job(load_job(job, ds=DS)), folder / f"out_{kind}"


def bad_keys(shards) -> set[tuple[str, int]]:
    return {(str(shards[s]), r) for s, rows in BAD.items() for r in rows}


def check_isolated(preds: pa.Table, quar: pa.Table, shards, reason_words: str) -> None:
    """Exactly the trigger rows are quarantined as model failures; every other row of the same
    batches is scored with the MLP's value."""
    keys = set(zip(quar["_source_shard"].to_pylist(), quar["_source_row"].to_pylist()))
    assert keys == bad_keys(shards)
    assert set(quar["_check"].to_pylist()) == {"model"}
    assert all(c is None for c in quar["_column"].to_pylist())
    for reason in quar["_reason"].to_pylist():
        assert reason_words in reason, reason
    for q in quar.to_pylist():
        assert json.loads(q["_values"])["f0"] == pytest.approx(7.5)   # the row as it came in
    scored = set(zip(preds["_source_shard"].to_pylist(), preds["_source_row"].to_pylist()))
    assert not scored & bad_keys(shards)
    assert np.isfinite(preds["y"].to_numpy()).all()
    for s, path in enumerate(shards):
        mine = preds.filter(pc.equal(preds["_source_shard"], str(path))).sort_by("_source_row")
        table = pq.read_table(path)
        x = np.stack([table[f"f{i}"].to_numpy() for i in range(4)], axis=1)
        rows = mine["_source_row"].to_numpy()
        np.testing.assert_allclose(mine["y"].to_numpy(), mlp_reference(x)[rows], rtol=1e-5, atol=1e-6)
        # the rows beside a bad row, in the same batch, were scored
        for r in BAD.get(s, []):
            batch = set(range(r // BATCH * BATCH, r // BATCH * BATCH + BATCH))
            assert batch - set(BAD[s]) <= set(rows.tolist())


def test_model_that_raises_on_some_rows(project):
    folder, shards = project
    outcome, out = run_model(folder, "gather")
    assert outcome.status == "committed", outcome.message
    preds, quar, manifest = check_partition(out, shards)
    check_isolated(preds, quar, shards, "out of")          # ORT: "indices element out of data bounds"
    assert manifest["totals"]["rows_quarantined"] == 4


def test_model_that_returns_nan_or_inf_for_some_rows(project):
    folder, shards = project
    outcome, out = run_model(folder, "nan")
    assert outcome.status == "committed", outcome.message
    preds, quar, _ = check_partition(out, shards)
    check_isolated(preds, quar, shards, "non-finite model output in lg")
    assert np.isfinite(preds["lg"].to_numpy()).all()
    values = [json.loads(v)["f1"] for v in quar["_values"].to_pylist()]
    assert sorted(values) == sorted([-5.0, -7.0, -5.0, -5.0])      # -inf and NaN rows both caught


@pytest.mark.parametrize("kind, shape", [("compress", r"\[9[89], 1\]"), ("drop_last", r"\[99, 1\]")])
def test_model_that_returns_another_number_of_rows_is_a_model_failure(project, kind, shape):
    """A model that drops rows (here: those it cannot score, or always the last) breaks the
    batch contract. Isolating rows would make it "fit" at one row per call and commit; instead
    the run fails (exit 5) on the first batch, whatever the threshold, and commits nothing."""
    from batchinfer.errors import ModelError

    folder, shards = project
    for fraction in (0.01, 1.0):
        with pytest.raises(ModelError) as info:
            run_model(folder, kind, max_bad_fraction=fraction)
        assert info.value.exit_code == 5
        assert "breaks the batch contract" in str(info.value)
        assert re.search(f"shape {shape} for 100 input rows", str(info.value)), info.value
        out = folder / f"out_{kind}"
        assert not (out / "_manifest.json").exists()
        assert not any(p.is_file() for p in out.rglob("*.parquet"))


# -- BatchModelHandler.infer with a fake backend ---------------------------------------------------

MARK = -999.0


def fake_handler(mode: str, chunk_rows: int | None = None):
    """A handler over a Python "model" (built here so that collecting this file imports no Beam)."""
    from batchinfer.handlers.base import BatchModelHandler
    from batchinfer.handlers.protocol import ModelFacts

    class Fake:
        warm_up = False   # every call counted below is a scoring call

        def __init__(self):
            self.calls = []

        def load(self, path):
            return "model"

        def facts(self, model):
            return ModelFacts(inputs=["x"], outputs=["y", "z"])

        def predict(self, model, inputs):
            x = inputs["x"]
            self.calls.append(len(x))
            marked = x[:, 0] == MARK
            if mode == "raise" and marked.any():
                raise RuntimeError(f"cannot score marker rows\n(at {np.flatnonzero(marked).tolist()})")
            if mode == "short" and marked.any():
                return {"y": x[~marked, 0] * 2, "z": x[:, 1]}
            if mode == "always_raise":
                raise RuntimeError("cannot score anything")
            return {"y": x[:, 0] * 2, "z": x[:, 1:3]}

    handler = BatchModelHandler(Fake(), "fake.model", digest=f"fake-{mode}-{chunk_rows}",
                                options={"chunk_rows": chunk_rows} if chunk_rows else {})
    handler.calls = handler.model_backend.calls   # type: ignore[attr-defined]  # the tests' view
    return handler


def prepared(n: int, marked: list[int]):
    from batchinfer.handlers.base import Prepared

    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    x[marked, 0] = MARK
    return Prepared(key=(0, 0), rows=n, features=x), x


@pytest.mark.parametrize("chunk_rows", [None, 16])
def test_infer_isolates_rejected_rows(chunk_rows):
    mode, words = "raise", "RuntimeError: cannot score marker rows (at [0])"
    handler = fake_handler(mode, chunk_rows)
    marked = [0, 3, 40, 41, 99]
    item, x = prepared(100, marked)
    result = handler.infer(handler.load_model(), item)
    assert [r for r, _ in result.failed] == marked
    for _, message in result.failed:
        assert words in message and "\n" not in message
    good = [r for r in range(100) if r not in marked]
    assert result.ok_rows.tolist() == good
    assert np.array_equal(result.outputs["y"], x[good, 0] * 2)      # aligned with ok_rows
    if mode == "raise":
        assert np.array_equal(result.outputs["z"], x[good, 1:3])
    # isolation by splitting: far fewer calls than one per row
    assert len(handler.calls) < 60
    assert result.compute_ms >= 0


@pytest.mark.parametrize("chunk_rows", [None, 16])
def test_infer_output_of_another_length_is_raised_not_isolated(chunk_rows):
    from batchinfer.errors import ModelError

    handler = fake_handler("short", chunk_rows)
    item, _ = prepared(100, [0, 3, 40])
    with pytest.raises(ModelError, match=r"output 'y' has shape \[\d+\] for \d+ input rows"):
        handler.infer(handler.load_model(), item)
    assert len(handler.calls) == 1     # the first call that shows it; no splitting


def test_infer_without_failures_is_one_call():
    handler = fake_handler("raise")
    item, x = prepared(100, [])
    result = handler.infer(handler.load_model(), item)
    assert handler.calls == [100] and result.failed == []
    assert result.ok_rows.tolist() == list(range(100))
    assert np.array_equal(result.outputs["y"], x[:, 0] * 2)


def test_infer_model_that_fails_every_row_is_bounded():
    from batchinfer.rows.isolation import MAX_LONE_FAILURES

    handler = fake_handler("always_raise")
    item, _ = prepared(1000, [])
    result = handler.infer(handler.load_model(), item)
    assert [r for r, _ in result.failed] == list(range(1000))
    assert result.ok_rows.size == 0 and result.outputs == {}
    assert len(handler.calls) < 2 * MAX_LONE_FAILURES + 20     # not one call per row, forever


def test_infer_empty_batch():
    handler = fake_handler("raise")
    item, _ = prepared(0, [])
    result = handler.infer(handler.load_model(), item)
    assert handler.calls == [] and result.ok_rows.size == 0 and result.failed == []


class _DeviceFull(RuntimeError):
    pass


def oom_handler(limit: int, chunk_rows: int = 1000):
    """A handler whose "device" holds at most ``limit`` rows a call."""
    from batchinfer.handlers.base import BatchModelHandler
    from batchinfer.handlers.protocol import ModelFacts

    class Small:
        warm_up = False

        def __init__(self):
            self.calls = []

        def load(self, path):
            return "model"

        def facts(self, model):
            return ModelFacts(inputs=["x"], outputs=["y"])

        def is_out_of_memory(self, exc):
            return isinstance(exc, _DeviceFull)

        def predict(self, model, inputs):
            x = inputs["x"]
            self.calls.append(len(x))
            if len(x) > limit:
                raise _DeviceFull(f"out of memory at {len(x)} rows")
            return {"y": x[:, 0] * 2}

    handler = BatchModelHandler(Small(), "small.model", digest=f"small-{limit}",
                                options={"chunk_rows": chunk_rows})
    handler.calls = handler.model_backend.calls   # type: ignore[attr-defined]  # the tests' view
    return handler


def test_out_of_memory_halves_the_chunk_and_retries_the_same_rows():
    handler = oom_handler(limit=300)
    item, x = prepared(2500, [])
    result = handler.infer(handler.load_model(), item)
    assert result.failed == [] and result.ok_rows.tolist() == list(range(2500))
    assert np.array_equal(result.outputs["y"], x[:, 0] * 2)          # every row once, in order
    assert result.oom_backoffs == 2 and result.chunk_rows == 250      # 1000 → 500 → 250
    assert handler.calls[:3] == [1000, 500, 250] and set(handler.calls[3:]) == {250}
    # the smaller chunk is kept: the next batch does not run out of memory again
    again = handler.infer(handler.load_model(), prepared(600, [])[0])
    assert again.oom_backoffs == 0 and again.chunk_rows == 250


def test_out_of_memory_on_one_row_is_a_model_error():
    from batchinfer.errors import ModelError

    handler = oom_handler(limit=0, chunk_rows=4)
    with pytest.raises(ModelError, match="runs out of device memory on a single row"):
        handler.infer(handler.load_model(), prepared(10, [])[0])
