"""Test data, models and jobs, made on the spot (nothing is downloaded).

Everything is deterministic for a given seed. Used by unit, end-to-end and fault tests alike.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
DS = "2026-01-15"


def make_mlp_onnx(path: Path, n_features: int = 4, hidden: int = 8, seed: int = 0,
                  input_name: str = "x", output_name: str = "y") -> Path:
    """A small MLP (F → hidden → 1, ReLU, sigmoid) as ONNX; also returns its weights via
    :func:`mlp_reference` for parity checks."""
    from onnx import TensorProto, helper, numpy_helper

    w1, b1, w2, b2 = _weights(n_features, hidden, seed)
    graph = helper.make_graph(
        [helper.make_node("MatMul", [input_name, "w1"], ["h0"]),
         helper.make_node("Add", ["h0", "b1"], ["h1"]),
         helper.make_node("Relu", ["h1"], ["h2"]),
         helper.make_node("MatMul", ["h2", "w2"], ["o0"]),
         helper.make_node("Add", ["o0", "b2"], ["o1"]),
         helper.make_node("Sigmoid", ["o1"], [output_name])],
        "mlp",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["N", n_features])],
        [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"),
         numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(b2, "b2")])
    return save_onnx(graph, path)


def save_onnx(graph, path: Path) -> Path:
    """An ONNX graph as a checked opset-17 model file (ONNX Runtime 1.32 reads IR version 8)."""
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


def _weights(n_features: int, hidden: int, seed: int):
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((n_features, hidden)).astype(np.float32) * 0.5
    b1 = rng.standard_normal(hidden).astype(np.float32) * 0.1
    w2 = rng.standard_normal((hidden, 1)).astype(np.float32) * 0.5
    b2 = rng.standard_normal(1).astype(np.float32) * 0.1
    return w1, b1, w2, b2


def make_shards(folder: Path, shards: int = 3, rows: int = 1000, n_features: int = 4,
                seed: int = 0) -> list[Path]:
    """Parquet shards with ``id`` int64 and ``f0..`` float32 in [-3, 3]."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for s in range(shards):
        x = np.clip(rng.standard_normal((rows, n_features)), -3, 3).astype(np.float32)
        cols: dict[str, Any] = {"id": np.arange(s * rows, (s + 1) * rows, dtype=np.int64)}
        cols.update({f"f{i}": x[:, i] for i in range(n_features)})
        path = folder / f"part-{s:05d}.parquet"
        pq.write_table(pa.table(cols), path)
        paths.append(path)
    return paths


def shifted_shards(folder: Path, shift: float, *, rows: int, seed: int = 0) -> None:
    """:func:`make_shards`' two shards (same seed: the baseline's rows) with f0 moved by ``shift``
    standard deviations: drift of a known size."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in make_shards(folder, shards=2, rows=rows, seed=seed):
        table = pq.read_table(path)
        f0 = table.column("f0").to_numpy() + np.float32(shift)
        pq.write_table(table.set_column(1, "f0", pa.array(f0.astype(np.float32))), path)


def spoil_rows(shard: Path, rows: Sequence[int], column: str = "f0") -> None:
    """Put a value out of the schema's range (50.0; feats allows [-10, 10]) in ``rows`` of
    ``column`` of a shard: those rows are quarantined."""
    table = pq.read_table(shard)
    values = table[column].to_numpy().copy()
    values[list(rows)] = 50.0
    index = table.column_names.index(column)
    pq.write_table(table.set_column(index, column, pa.array(values, pa.float32())), shard)


def write_schema(root: Path, name: str = "feats", version: int = 1, n_features: int = 4,
                 strict: bool = True, low: float = -10, high: float = 10) -> Path:
    """A pandera-polars schema module: id Int64 plus f0.. Float32 in [low, high]."""
    path = root / name / f"v{version}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = "\n".join(
        f'        "f{i}": pa.Column(pl.Float32, checks=pa.Check.in_range({low}, {high})),'
        for i in range(n_features))
    path.write_text(textwrap.dedent(f'''\
        import pandera.polars as pa
        import polars as pl

        SCHEMA = pa.DataFrameSchema(
            {{
                "id": pa.Column(pl.Int64, nullable=False),
        {columns}
            }},
            strict={strict},
        )
        FEATURES = [{", ".join(f'"f{i}"' for i in range(n_features))}]
        '''))
    return path


def write_job(folder: Path, *, name: str = "testjob", schema: str = "feats@1",
              preprocess: str | None = None, model: str = "models/model.onnx",
              extra: dict | None = None, **sections: Any) -> Path:
    """A job spec in ``folder``; keyword sections replace the defaults (dicts, as YAML)."""
    import yaml

    spec: dict[str, Any] = {
        "name": name,
        "input": {"path": "data/dt={ds}/*.parquet"},
        "schema": schema,
        "schemas": {"root": "schemas"},
        "model": {"uri": model, "backend": "onnxruntime", "device": "cpu"},
        "output": {"path": "out/dt={ds}", "id_columns": ["id"]},
        "tracking": {"uri": "sqlite:///mlflow.db", "experiment": name},
    }
    if preprocess:
        spec["preprocess"] = preprocess
    spec.update(sections)
    spec.update(extra or {})
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def numeric_project(folder: Path, *, shards: int = 3, rows: int = 1000, n_features: int = 4,
                    stamp: bool = True, **job_sections: Any) -> Path:
    """A complete job folder: schema feats@1, data for DS, an MLP model (stamped), job.yaml."""
    write_schema(folder / "schemas", n_features=n_features)
    make_shards(folder / "data" / f"dt={DS}", shards=shards, rows=rows, n_features=n_features)
    make_mlp_onnx(folder / "models" / "model.onnx", n_features=n_features)
    job = write_job(folder, **job_sections)
    if stamp:
        result = run_cli("stamp", "models/model.onnx", "--job", "job.yaml",
                         "--model-version", "model:1", cwd=folder)
        assert result.returncode == 0, result.stderr
    return job


def mlp_reference(x: np.ndarray, n_features: int = 4, hidden: int = 8, seed: int = 0) -> np.ndarray:
    """What :func:`make_mlp_onnx`'s model computes, in numpy (float64)."""
    w1, b1, w2, b2 = _weights(n_features, hidden, seed)
    h = np.maximum(x.astype(np.float64) @ w1 + b1, 0)
    return 1 / (1 + np.exp(-(h @ w2 + b2)))[:, 0]


def run_cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 300,
            track: bool = False, fresh: bool = False) -> subprocess.CompletedProcess:
    """``batchinfer ARGS`` in a process of its own, as a user runs it: a child forked from the
    session's fork server (``cli.main`` with everything imported once, see forkserver.py), or
    with ``fresh=True`` a plain ``python -m batchinfer`` (the entry point, start-up imports).

    Tracking is a stub (:class:`NoTracking`) unless ``track=True`` or ``fresh=True``: MLflow's
    helper process costs ~1.7 s a run, and tracking has tests of its own (test_tracking.py,
    test_secrets.py, test_concurrency.py, test_interrupt.py) that run it for real."""
    full_env = {**os.environ, **(env or {})}
    command = [sys.executable, "-m", "batchinfer", *args]
    if fresh:
        return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True,
                              timeout=timeout)
    import forkserver

    run = forkserver.shared().run(*args, cwd=Path(cwd), env=full_env, track=track,
                                  timeout=timeout)
    return subprocess.CompletedProcess(command, run.returncode, run.stdout, run.stderr)


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """relative path → (size, mtime_ns) of every file under ``folder`` (to show nothing changed)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_error(result: subprocess.CompletedProcess, command: str = "run") -> str:
    """The single stderr line of a failed command (contract §2: no bare traceback)."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"batchinfer {command}: "), lines[0]
    return lines[0]


def read_partition(output: Path | str, fs=None) -> tuple[pa.Table, pa.Table, dict]:
    """(predictions, quarantine, manifest) of a committed output, following the manifest only,
    through the product's own reader (io/partitions.py: any format)."""
    from batchinfer.io.outputs import PREDICTIONS, QUARANTINE
    from batchinfer.io.partitions import open_partition

    committed = open_partition(str(output), fs)
    assert committed is not None, f"{output} holds no committed partition"
    manifest = json.loads(committed.layout.fs.cat_file(committed.layout.manifest))
    files = [f for shard in committed.manifest.shards for f in shard.files]
    preds = committed.read(files, PREDICTIONS)
    quar = committed.read(files, QUARANTINE)
    return (preds if preds is not None else pa.table({}),
            quar if quar is not None else pa.table({}), manifest)


def all_input_rows(paths: Sequence[Path]) -> set[tuple[str, int]]:
    return {(str(p), i) for p in paths for i in range(pq.ParquetFile(p).metadata.num_rows)}


class NoTracking:
    """Stands in for batchinfer.io.tracking.TrackingRun in in-process tests whose subject is not
    tracking (its MLflow helper process costs about 2 s of CPU a run): no run id, nothing
    uploaded; any other method is a no-op."""

    error, run_id = "tracking stubbed by the test", None

    def __init__(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        return None

    def finish(self, *args, **kwargs):
        return False

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_reaches_children() -> Iterator[None]:
    """A suite started in the background by a script (``pytest … &`` without job control)
    inherits SIGINT ignored, and so would every process it starts: Python installs its
    KeyboardInterrupt handler only where SIGINT is not ignored, so the tests that press Ctrl-C
    on a run (test_interrupt.py, the Dask launcher's) would wait for a process that never
    hears it. A handled SIGINT is reset to the default in a child, an ignored one is not: the
    handler here gives every child the disposition a terminal's process has."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory) -> Iterator[Path]:
    """The session's model cache (``$BATCHINFER_MODEL_CACHE``): models fetched from a store by a
    test's jobs land here, never in ``~/.cache``. A test that counts downloads sets its own."""
    folder = tmp_path_factory.mktemp("model-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("BATCHINFER_MODEL_CACHE", str(folder))
    yield folder
    mp.undo()


@pytest.fixture(scope="module")
def no_tracking():
    """Replace TrackingRun by :class:`NoTracking` for one test module (use it with
    ``pytestmark = pytest.mark.usefixtures("no_tracking")`` or as an autouse import)."""
    import batchinfer.io.tracking

    mp = pytest.MonkeyPatch()
    mp.setattr(batchinfer.io.tracking, "TrackingRun", NoTracking)
    yield
    mp.undo()


def point_external_data(model: Path, location: str) -> None:
    """Make every external-data reference of ONNX ``model`` say ``location`` (no data moves)."""
    import onnx

    proto = onnx.load(str(model), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    model.write_bytes(proto.SerializeToString())


def partition_files(out: Path) -> set[str]:
    """Every file under predictions/ and quarantine/, relative to ``out``."""
    return {str(p.relative_to(out)) for kind in ("predictions", "quarantine") if (out / kind).exists()
            for p in (out / kind).rglob("*") if p.is_file()}


def check_partition(out: Path, shard_paths: Sequence[Path]) -> tuple[pa.Table, pa.Table, dict]:
    """A committed local partition holds what contract §4–§5 promise: every shard listed, every file's
    sha256 and row count right and under the attempt that scored its shard (the manifest's, or
    for a shard adopted on resume the crashed attempt's: ``scored_by``), per-shard and total accounting
    (§5.1), each input row exactly once, no file outside the manifest, no scratch left.
    Returns (predictions, quarantine, manifest)."""
    preds, quar, manifest = read_partition(out)
    assert sorted(s["path"] for s in manifest["shards"]) == sorted(str(p) for p in shard_paths)
    listed = set()
    for shard in manifest["shards"]:
        by_kind = {"predictions": 0, "quarantine": 0}
        for f in shard["files"]:
            data = (out / f["path"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == f["sha256"], f["path"]
            assert pq.read_metadata(out / f["path"]).num_rows == f["rows"]
            by_kind[f["path"].split("/")[0]] += f["rows"]
            assert f["path"].split("/")[1] == (shard.get("scored_by") or manifest["attempt"])
            listed.add(f["path"])
        if shard["status"] == "unreadable":
            assert shard["rows_in"] is None and shard["files"] == [] and shard["reason"]
            continue
        assert shard["rows_in"] == pq.read_metadata(shard["path"]).num_rows
        assert shard["rows_in"] == shard["rows_scored"] + shard["rows_quarantined"]
        assert by_kind == {"predictions": shard["rows_scored"], "quarantine": shard["rows_quarantined"]}
    totals = manifest["totals"]
    assert totals["rows_scored"] == preds.num_rows == sum(s["rows_scored"] for s in manifest["shards"])
    assert totals["rows_quarantined"] == quar.num_rows
    assert totals["rows_in"] == sum(s["rows_in"] or 0 for s in manifest["shards"])
    assert totals["shards_unreadable"] == sum(s["status"] == "unreadable" for s in manifest["shards"])
    keys = []
    for table in (preds, quar):
        if table.num_rows:
            keys += zip(table["_source_shard"].to_pylist(), table["_source_row"].to_pylist())
    assert len(keys) == len(set(keys)), "a row is in the partition twice"
    expected = {(s["path"], i) for s in manifest["shards"] if s["rows_in"] is not None
                for i in range(s["rows_in"])}
    assert set(keys) == expected, "rows lost or invented"
    assert partition_files(out) == listed, "files outside the manifest"
    assert not (out / "_tmp").exists(), "scratch left behind"
    return preds, quar, manifest


# -- a partition against a clean run's (crash, resume and update tests) -------------------------

EXEMPT = {"_inference_id", "_compute_ms"}


def kept_for_resume(out: Path, *, all_finished: bool = True) -> set[str]:
    """A run that stopped after scoring (exit 4 or 5, Ctrl-C) committed nothing and kept what
    the next run can adopt (contract §5.3): no manifest, every file its finished shards' results
    list, and — when it stopped with every shard finished (``all_finished``: a refusal of the
    commit step) — no other data file (a run stopped part-way leaves its unfinished shards'
    files to the next commit's cleanup). Returns the shards kept."""
    assert not (out / "_manifest.json").exists()
    listed, shards = set(), set()
    for path in (out / "_tmp").glob("*/shards/*.json"):
        result = json.loads(path.read_text())
        shards.add(result["record"]["path"])
        listed |= {f["path"] for f in result["record"]["files"]}
        listed |= {f["path"] for c in result.get("challengers", {}).values() for f in c["files"]}
    for part in (out / "_tmp").glob("*/challengers/*/*.json"):
        listed |= {f["path"] for f in json.loads(part.read_text())["files"]}
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*.parquet")
               if p.is_file() and p.relative_to(out).parts[0] != "_tmp"}
    assert listed <= on_disk, f"files a kept shard lists are gone: {sorted(listed - on_disk)[:3]}"
    if all_finished:
        assert on_disk <= listed, f"files no finished shard lists: {sorted(on_disk - listed)[:3]}"
    return shards


def finished_shards(out: Path) -> dict[str, str]:
    """shard → attempt, of every shard result a killed run left in ``out``'s scratch (one cut
    short by the kill is none)."""
    found = {}
    for path in (out / "_tmp").glob("*/shards/*.json"):
        try:
            found[json.loads(path.read_text())["record"]["path"]] = path.parent.parent.name
        except ValueError:
            pass
    return found


def canonical(table: pa.Table) -> pa.Table:
    """Sorted by (_source_shard, _source_row), execution-describing columns dropped,
    dictionary columns decoded."""
    if not table.num_columns:
        return table
    table = table.drop_columns([c for c in table.column_names if c in EXEMPT])
    columns = {}
    for name in table.column_names:
        col = table[name].combine_chunks()
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        columns[name] = col
    table = pa.table(columns)
    return table.sort_by([("_source_shard", "ascending"), ("_source_row", "ascending")])


def assert_same_result(out: Path, reference: Path, shard_paths: Sequence[Path]) -> dict:
    """``out`` is a whole partition (:func:`check_partition`) with the rows, ``_input_hash``,
    predictions (bit for bit), quarantine, triple, totals and shard entries of ``reference``:
    what a clean run commits (contract §5.3), the ids that name attempts aside."""
    preds, quar, manifest = check_partition(out, shard_paths)
    ref_preds, ref_quar, ref_manifest = read_partition(reference)
    a, b = canonical(preds), canonical(ref_preds)
    assert a.column_names == b.column_names
    assert a.num_rows == b.num_rows
    for name in a.column_names:
        if name == "y":  # bit for bit
            assert np.array_equal(a[name].to_numpy().view(np.uint32), b[name].to_numpy().view(np.uint32))
        else:
            assert a[name].equals(b[name]), name
    assert canonical(quar).equals(canonical(ref_quar))
    assert manifest["triple"] == ref_manifest["triple"]
    assert manifest["totals"] == ref_manifest["totals"]
    def strip(m):
        return sorted((s["path"], s["sha256"], s["rows_in"], s["rows_scored"],
                                  s["rows_quarantined"], s["status"]) for s in m["shards"])
    assert strip(manifest) == strip(ref_manifest)
    return manifest


# -- races forced, not hoped for ------------------------------------------------------------------

# A preprocessing module (write it as barrier_prep.py, preprocess barrier_prep:transform) that,
# with BARRIER set to a folder, says it is there and waits until the test lets every racer go:
# it runs after a run's decision, so each racer is past its manifest check when any commits.
BARRIER_SOURCE = '''\
import os
import time
from pathlib import Path

import numpy as np


def transform(batch):
    folder = os.environ.get("BARRIER")
    if folder:
        Path(folder, f"ready-{os.getpid()}").touch()
        while not Path(folder, "go").exists():
            time.sleep(0.01)
    return np.stack([batch.column(f"f{i}").to_numpy(zero_copy_only=False) for i in range(4)],
                    axis=1).astype(np.float32)
'''


def release_at_barrier(procs: Sequence[Any], barrier: Path, timeout: float = 240) -> None:
    """Wait until every one of ``procs`` is at ``barrier`` (BARRIER_SOURCE), then let them go."""
    import time

    deadline = time.monotonic() + timeout
    while len(list(barrier.glob("ready-*"))) < len(procs):
        assert time.monotonic() < deadline, "not every run reached the barrier"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.02)
    (barrier / "go").touch()

