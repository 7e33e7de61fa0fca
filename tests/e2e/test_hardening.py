"""Inputs that once committed wrong or incomplete output with exit 0 (the hardening issue).

Each case is driven as a user meets it — through the CLI, on a copy of a stamped project — and
checks the exit code, the one-line message and what was (not) written. Where a case cannot be
reached from the CLI in reasonable time (a shard over the 256 MB in-memory limit replaced while
it is read), the run is in-process with the limit lowered. Rerun with
``.venv/bin/pytest tests/e2e/test_hardening.py -q``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factories import (
    DS,
    NoTracking,
    check_partition,
    make_mlp_onnx,
    make_shards,
    one_line_error,
    read_partition,
    run_cli,
    save_onnx,
)
from servers import copy_project

pytestmark = pytest.mark.slow


@pytest.fixture
def project(tmp_path, stamped_template) -> Path:
    """A stamped job folder: 3 shards × 1000 rows in data/dt=DS/, output out/dt={ds}."""
    copy_project(stamped_template, tmp_path)
    return tmp_path


def cli(project: Path, *args: str, env: dict | None = None, timeout: float = 300):
    return run_cli(*args, cwd=project, env=env, timeout=timeout)


def run(project: Path, *sets: str, command: str = "run", extra: tuple[str, ...] = (), **kwargs):
    args = [command, "job.yaml", "--ds", DS, *extra]
    for item in sets:
        args += ["--set", item]
    return cli(project, *args, **kwargs)


def shards_of(project: Path) -> list[Path]:
    return sorted(p for p in (project / "data" / f"dt={DS}").glob("*.parquet") if p.is_file())


def stamp(project: Path, model: str, version: str = "model:2") -> None:
    result = cli(project, "stamp", model, "--job", "job.yaml", "--model-version", version)
    assert result.returncode == 0, result.stderr


# -- 1. prediction, id and audit columns never share a name -------------------------------------

@pytest.mark.parametrize("setting, named", [
    ("output.predictions={y: id}", "'id'"),                     # ids overwritten by scores
    ("output.predictions={y: _source_row}", "'_source_row'"),   # predictions dropped
    ("output.predictions={y: _input_hash}", "'_input_hash'"),
    ("output.id_columns=[id, id]", "'id' twice"),
])
def test_column_name_collisions_exit_2_before_any_work(project, setting, named):
    for command in ("plan", "run"):
        result = run(project, setting, command=command)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        line = one_line_error(result, command)
        assert named in line, line
    assert not (project / "out").exists()


def test_model_output_named_like_an_id_column_exit_2_before_any_work(project):
    make_mlp_onnx(project / "models" / "ids.onnx", output_name="id")
    stamp(project, "models/ids.onnx")
    result = run(project, "model.uri=models/ids.onnx")
    assert result.returncode == 2, result.stderr
    line = one_line_error(result)
    assert "'id'" in line and "output.id_columns" in line and "output.predictions" in line, line
    assert not (project / "out").exists()
    # mapped to a name of its own, the same model commits, ids intact
    result = run(project, "model.uri=models/ids.onnx", "output.predictions={id: score}")
    assert result.returncode == 0, result.stderr
    preds, _, _ = check_partition(project / "out" / f"dt={DS}", shards_of(project))
    assert sorted(preds["id"].to_pylist()) == list(range(3000))
    assert "score" in preds.column_names


# -- 2. the manifest's sha256 is of the bytes the rows came from ----------------------------------

def _stream_everything(monkeypatch) -> None:
    """Read every shard through HashingFile (as a shard over 256 MB is)."""
    import batchinfer.io.shards as shards

    monkeypatch.setattr(shards, "MAX_IN_MEMORY_BYTES", 0)


def _run_in_process(project: Path, *overrides: str):
    from batchinfer.commands.run import run_job
    from batchinfer.spec import load_job

    return run_job(load_job(project / "job.yaml", ds=DS, overrides=list(overrides)),
                   tracking=NoTracking())


def test_streamed_shards_record_the_digest_of_their_bytes(project, monkeypatch):
    _stream_everything(monkeypatch)
    outcome = _run_in_process(project, "batch.rows=100")
    assert outcome.status == "committed"
    _, _, manifest = check_partition(project / "out" / f"dt={DS}", shards_of(project))
    for shard in manifest["shards"]:
        assert shard["status"] == "scored"
        assert shard["sha256"] == hashlib.sha256(Path(shard["path"]).read_bytes()).hexdigest()


@pytest.mark.parametrize("how", ["in_place", "renamed_over"])
def test_streamed_shard_replaced_while_read_is_unreadable(project, monkeypatch, how):
    """A shard rewritten between its first and last read: its rows and any digest would
    disagree, so it is unreadable ("changed while being read"), never committed under a
    digest of other bytes."""
    import batchinfer.io.shards as shards

    _stream_everything(monkeypatch)
    victim = shards_of(project)[1]
    make_shards(project / "replacement", shards=1, rows=1000, seed=99)
    replacement = (project / "replacement" / "part-00000.parquet").read_bytes()
    original_read = shards.HashingFile.read
    state = {"reads": 0, "done": False}

    def read(self, n=-1):
        data = original_read(self, n)
        state["reads"] += 1
        if not state["done"] and self._raw.path.endswith(victim.name) and state["reads"] > 3:
            state["done"] = True
            if how == "in_place":
                with open(victim, "r+b") as fh:
                    fh.write(replacement)
                    fh.truncate()
            else:
                Path(str(victim) + ".new").write_bytes(replacement)
                os.replace(str(victim) + ".new", victim)
        return data

    monkeypatch.setattr(shards.HashingFile, "read", read)
    outcome = _run_in_process(project, "batch.rows=100", "quarantine.max_bad_shards=1")
    assert state["done"]
    assert outcome.status == "committed"
    preds, _, manifest = read_partition(project / "out" / f"dt={DS}")
    entry = next(s for s in manifest["shards"] if s["path"] == str(victim))
    assert entry["status"] == "unreadable" and entry["reason"] == "changed while being read"
    assert entry["sha256"] is None and entry["files"] == []
    assert str(victim) not in set(preds["_source_shard"].to_pylist())
    for shard in manifest["shards"]:
        if shard["path"] != str(victim):
            assert shard["sha256"] == hashlib.sha256(Path(shard["path"]).read_bytes()).hexdigest()


@pytest.mark.server
def test_s3_object_replaced_while_streamed_is_unreadable(s3_server, new_bucket, monkeypatch):
    import batchinfer.io.shards as shards

    _stream_everything(monkeypatch)
    fs = s3_server.s3fs()
    table = pa.table({"x": np.arange(200_000, dtype=np.int64)})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=20_000)
    fs.pipe_file(f"{new_bucket}/s.parquet", sink.getvalue().to_pybytes())
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    reader = shards.ShardReader(f"s3://{new_bucket}/s.parquet")
    batches = reader.batches(20_000)
    next(batches)
    fs.pipe_file(f"{new_bucket}/s.parquet", sink.getvalue().to_pybytes()[::-1])
    with pytest.raises(shards.Unreadable, match="changed while being read"):
        list(batches)
    # unchanged, the streamed digest is the object's
    fs.pipe_file(f"{new_bucket}/t.parquet", sink.getvalue().to_pybytes())
    reader = shards.ShardReader(f"s3://{new_bucket}/t.parquet")
    assert sum(b.num_rows for b in reader.batches(30_000)) == 200_000
    assert reader.sha256 == hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()


# -- 3. a model that breaks the batch contract is a model failure --------------------------------

def make_batch_sum_onnx(path: Path) -> Path:
    """y = sum over the whole batch of x @ 1: shape [1, 1] whatever the rows."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]),
         helper.make_node("ReduceSum", ["h", "axes"], ["y"], keepdims=1)], "batch_sum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])],
        [numpy_helper.from_array(np.ones((4, 1), np.float32), "w"),
         numpy_helper.from_array(np.array([0], np.int64), "axes")])
    return save_onnx(graph, path)


def test_model_whose_output_ignores_the_batch_exits_5_and_commits_nothing(project):
    make_batch_sum_onnx(project / "models" / "sum.onnx")
    stamp(project, "models/sum.onnx")
    result = run(project, "model.uri=models/sum.onnx")
    assert result.returncode == 5, result.stdout + result.stderr
    line = one_line_error(result)
    assert "batch contract" in line and "[1, 1]" in line and "1000 input rows" in line, line
    assert "while running" not in line  # our message, not Beam's stage names
    out = project / "out" / f"dt={DS}"
    assert not (out / "_manifest.json").exists()
    assert not [p for p in out.rglob("*") if p.is_file()] if out.exists() else True


# -- 4. a glob that matches a folder reads the folder --------------------------------------------

def test_glob_matching_a_spark_folder_reads_its_parquet_files(project):
    folder = project / "data" / f"dt={DS}" / "part-9.parquet"   # as Spark and Hive write it
    make_shards(folder, shards=2, rows=250, seed=5)
    (folder / "_SUCCESS").write_bytes(b"")
    (folder / ".part-00000.parquet.crc").write_bytes(b"crc")
    (folder / "_temporary" / "0").mkdir(parents=True)
    (folder / "_temporary" / "0" / "part-x.parquet").write_bytes(b"half-written")
    inside = sorted(folder.glob("part-*.parquet"))

    plan = run(project, command="plan")
    assert plan.returncode == 0, plan.stderr
    assert "(5 shards, 3 metadata file(s) ignored)" in plan.stdout, plan.stdout
    for path in inside:
        assert f"  {path}\n" in plan.stdout
    assert f"ignored: {folder / '_SUCCESS'}" in plan.stdout

    result = run(project)
    assert result.returncode == 0, result.stderr
    assert "ignoring 3 metadata file(s)" in result.stdout
    preds, _, manifest = check_partition(project / "out" / f"dt={DS}", shards_of(project) + inside)
    assert manifest["totals"]["rows_scored"] == 3000 + 500
    assert {s["status"] for s in manifest["shards"]} == {"scored"}


# -- 5. values from ${NAME} stay out of --debug output --------------------------------------------

@pytest.mark.parametrize("setting, code", [
    ("input.path=${BI_SECRET_DIR}/dt={ds}/*.parquet", 2),   # NoShardsError
    ("model.uri=${BI_SECRET_DIR}/model.onnx", 2),          # ModelFileError
])
def test_debug_tracebacks_and_logs_never_show_secret_values(project, setting, code):
    secret = "/tmp/s3cr3t-bucket-name-7f3a"
    result = cli(project, "--debug", "run", "job.yaml", "--ds", DS, "--set", setting,
                 env={"BI_SECRET_DIR": secret})
    assert result.returncode == code, result.stderr
    assert "Traceback" in result.stderr  # --debug did show one
    assert "s3cr3t" not in result.stdout + result.stderr
    assert "${BI_SECRET_DIR}" in result.stderr


def test_a_plain_variable_is_recorded_in_full_where_the_data_came_from(project):
    """``${NAME}`` that is not a secret (``${FEATURES}``) is the data's real place: `plan`,
    `_source_shard` and the manifest name it in full. A partition committed when every value
    was masked (shards named ``${FEATURES}/…``) is still the same partition to a rerun."""
    data = str((project / "data").resolve())
    env = {"FEATURES": data}
    setting = "input.path=${FEATURES}/dt={ds}/*.parquet"
    plan = run(project, setting, command="plan", env=env)
    assert plan.returncode == 0, plan.stderr
    assert f"input:      {data}/dt={DS}/*.parquet  (3 shards)" in plan.stdout
    assert f"  {data}/dt={DS}/part-00000.parquet" in plan.stdout
    result = run(project, setting, env=env)
    assert result.returncode == 0, result.stderr
    out = project / "out" / f"dt={DS}"
    preds, _, manifest = check_partition(out, shards_of(project))   # full shard paths
    assert set(preds["_source_shard"].to_pylist()) == {str(p) for p in shards_of(project)}
    for shard in manifest["shards"]:   # as a partition committed before looked
        shard["path"] = shard["path"].replace(data, "${FEATURES}")
    (out / "_manifest.json").write_text(json.dumps(manifest))
    again = run(project, setting, env=env)
    assert again.returncode == 0, again.stderr
    assert "already committed" in again.stdout


# -- 6. an output inside the input's reach is refused ---------------------------------------------

@pytest.mark.parametrize("input_path, output_path", [
    ("data/dt={ds}/*.parquet", "data/dt={ds}"),           # the input folder itself
    ("data/dt={ds}", "data/dt={ds}/scored"),              # a folder input reads everything below
    ("data/dt={ds}/*", "data/dt={ds}/scored"),            # the glob matches the output folder
    ("data/**/*.parquet", "data/scores/dt={ds}"),         # next date reads this date's predictions
    ("data/*/*.parquet", "data/dt={ds}"),                 # the same, one level up
])
def test_output_inside_the_input_exit_2_before_any_work(project, input_path, output_path):
    before = sorted(p for p in (project / "data").rglob("*"))
    result = run(project, f"input.path={input_path}", f"output.path={output_path}")
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line_error(result)
    assert "output.path" in line and "input" in line, line
    assert sorted(p for p in (project / "data").rglob("*")) == before


def test_output_beside_the_input_is_allowed(project):
    result = run(project, "input.path=data/dt={ds}/*.parquet", "output.path=data/scores/dt={ds}")
    assert result.returncode == 0, result.stderr


def test_an_output_committed_for_another_date_is_not_a_noop(project):
    """output.path without {ds}: the second date used to find the first date's manifest, call
    it "already committed with this triple" and exit 0 having scored nothing."""
    other = "2026-01-16"
    shutil.copytree(project / "data" / f"dt={DS}", project / "data" / f"dt={other}")
    assert run(project, "output.path=out/fixed").returncode == 0
    result = cli(project, "run", "job.yaml", "--ds", other, "--set", "output.path=out/fixed")
    assert result.returncode == 3, result.stdout + result.stderr
    line = one_line_error(result)
    assert DS in line and other in line, line
    assert json.loads((project / "out" / "fixed" / "_manifest.json").read_text())["ds"] == DS


# -- 7. spec values are what they say they are ----------------------------------------------------

@pytest.mark.parametrize("setting, key", [
    ("batch.rows=true", "batch.rows"),                    # was 1 row per batch
    ("batch.rows=2.0", "batch.rows"),
    ("batch.rows='8192'", "batch.rows"),
    ("quarantine.max_bad_shards=true", "quarantine.max_bad_shards"),
    ("quarantine.max_bad_fraction=true", "quarantine.max_bad_fraction"),
    ("quarantine.max_bad_fraction='0.5'", "quarantine.max_bad_fraction"),
])
def test_spec_values_of_the_wrong_type_exit_2(project, setting, key):
    result = run(project, setting, command="validate")
    assert result.returncode == 2, result.stdout + result.stderr
    assert key in one_line_error(result, "validate")


def test_backend_options_of_the_wrong_type_exit_2_before_any_work(project):
    result = run(project, "model.options.chunk_rows=true")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "model.options.chunk_rows" in one_line_error(result)
    assert not (project / "out").exists()


def test_spec_integers_where_floats_are_expected_are_fine(project):
    result = run(project, "quarantine.max_bad_fraction=0", command="validate")
    assert result.returncode == 0, result.stderr


def test_a_key_given_twice_exit_2(project):
    job = project / "job.yaml"
    job.write_text(job.read_text() + "batch:\n  rows: 100\nbatch:\n  rows: 7\n")
    result = run(project, command="plan")
    assert result.returncode == 2
    assert "'batch' is given twice" in one_line_error(result, "plan")
    job.write_text(job.read_text().replace("batch:\n  rows: 100\nbatch:\n  rows: 7\n", ""))
    result = run(project, "output.predictions={y: a, y: b}", command="plan")
    assert result.returncode == 2
    assert "twice" in one_line_error(result, "plan")


def test_a_date_that_does_not_exist_exit_2(project):
    shutil.copytree(project / "data" / f"dt={DS}", project / "data" / "dt=2026-02-30")
    result = cli(project, "run", "job.yaml", "--ds", "2026-02-30")
    assert result.returncode == 2
    assert "2026-02-30" in one_line_error(result)


# -- 8. files that are not files, models that are folders, scratch left by races ------------------

def test_dangling_symlink_is_an_unreadable_shard_with_a_reason(project):
    link = project / "data" / f"dt={DS}" / "part-00003.parquet"
    link.symlink_to(project / "gone.parquet")
    result = run(project)
    assert result.returncode == 4, result.stderr
    line = one_line_error(result)
    assert "1 unreadable shards" in line and "while running" not in line, line
    result = run(project, "quarantine.max_bad_shards=1")
    assert result.returncode == 0, result.stderr
    _, _, manifest = read_partition(project / "out" / f"dt={DS}")
    entry = next(s for s in manifest["shards"] if s["path"] == str(link))
    assert entry["status"] == "unreadable"
    assert "symbolic link" in entry["reason"]
    assert manifest["totals"]["rows_scored"] == 3000


def test_fifo_named_like_a_shard_is_unreadable_and_never_opened(project):
    fifo = project / "data" / f"dt={DS}" / "part-00003.parquet"
    os.mkfifo(fifo)
    result = run(project, command="validate", timeout=120)   # it used to block forever
    assert result.returncode == 4, result.stderr
    assert f"unreadable  {fifo}: not a regular file (a FIFO)" in result.stdout
    result = run(project, "quarantine.max_bad_shards=1", timeout=120)
    assert result.returncode == 0, result.stderr


def test_model_uri_that_is_a_folder_says_so(project):
    result = run(project, "model.uri=models")
    assert result.returncode == 2   # the user's mistake: a retry finds the same folder
    line = one_line_error(result)
    assert "is a folder" in line and ".onnx" in line, line


# -- what else the search for each class turned up -------------------------------------------------

def test_preprocessing_that_returns_other_rows_exit_2_and_commits_nothing(project):
    (project / "drop_one.py").write_text(
        "import numpy as np\n\n"
        "def transform(batch):\n"
        "    x = np.stack([batch.column(f'f{i}').to_numpy() for i in range(4)], 1)\n"
        "    return x[1:].astype(np.float32)\n")
    (project / "as_list.py").write_text(
        "def transform(batch):\n"
        "    return [[0.0] * 4] * batch.num_rows\n")
    for module, said in (("drop_one", "shape [999, 4] for 1000 rows"), ("as_list", "list")):
        result = cli(project, "stamp", "models/model.onnx", "--job", "job.yaml",
                     "--set", f"preprocess={module}:transform", "--model-version", "model:1")
        assert result.returncode == 0, result.stderr
        result = run(project, f"preprocess={module}:transform")
        assert result.returncode == 2, result.stdout + result.stderr
        assert said in one_line_error(result), result.stderr
        assert not (project / "out" / f"dt={DS}" / "_manifest.json").exists()


def test_a_partition_of_another_job_is_not_taken_for_this_one(project):
    assert run(project).returncode == 0
    result = run(project, "name=other_job")
    assert result.returncode == 3, result.stdout + result.stderr
    line = one_line_error(result)
    assert "'testjob'" in line and "'other_job'" in line, line


def test_shards_added_after_the_commit_are_not_a_noop(project):
    assert run(project).returncode == 0
    make_shards(project / "late", shards=1, rows=10, seed=3)
    late = project / "data" / f"dt={DS}" / "part-00009.parquet"
    shutil.move(project / "late" / "part-00000.parquet", late)
    result = run(project)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "1 new" in one_line_error(result)
    result = run(project, extra=("--overwrite",))
    assert result.returncode == 0, result.stderr
    _, _, manifest = check_partition(project / "out" / f"dt={DS}", shards_of(project))
    assert manifest["totals"]["rows_in"] == 3010
    assert run(project).stdout.endswith("nothing to do\n")


def test_cleanup_leaves_folders_that_are_not_attempts(project):
    keep = project / "out" / f"dt={DS}" / "predictions" / "notes" / "README.txt"
    keep.parent.mkdir(parents=True)
    keep.write_text("the user's own file")
    result = run(project)
    assert result.returncode == 0, result.stderr
    assert keep.read_text() == "the user's own file"
    manifest = json.loads((project / "out" / f"dt={DS}" / "_manifest.json").read_text())
    assert (project / "out" / f"dt={DS}" / "predictions" / manifest["attempt"]).is_dir()


def make_width_of_batch_onnx(path: Path) -> Path:
    """y = x[:, :(rows % 7) + 1]: an output whose width depends on the call's rows."""
    from onnx import TensorProto, helper, numpy_helper

    consts = {"zero": [0], "seven": 7, "one": 1, "axis1": [1]}
    graph = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["s"]),
         helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
         helper.make_node("Mod", ["n", "seven"], ["r"]),
         helper.make_node("Add", ["r", "one"], ["k"]),
         helper.make_node("Slice", ["x", "zero", "k", "axis1"], ["y"])], "width_of_batch",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "K"])],
        [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items()])
    return save_onnx(graph, path)


def test_model_whose_output_width_changes_between_calls_exits_5(project):
    """Batches of 300 rows and a last one of 100: widths 4 and 3. Committed, the partition's
    files would disagree on the prediction column's type."""
    make_width_of_batch_onnx(project / "models" / "width.onnx")
    stamp(project, "models/width.onnx")
    result = run(project, "model.uri=models/width.onnx", "batch.rows=300")
    assert result.returncode == 5, result.stdout + result.stderr
    line = one_line_error(result)
    assert "batch contract" in line and "per row and is now" in line, line
    assert not (project / "out" / f"dt={DS}" / "_manifest.json").exists()


def make_int_input_onnx(path: Path) -> Path:
    """Takes int64 codes (as token ids or counts would be): y = sum of the codes as float."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
         helper.make_node("ReduceSum", ["xf", "axes"], ["y"], keepdims=1)], "codes",
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(np.array([1], np.int64), "axes")])
    return save_onnx(graph, path)


def test_float_features_for_an_integer_model_input_exit_2_not_truncated(project):
    make_int_input_onnx(project / "models" / "codes.onnx")
    stamp(project, "models/codes.onnx")
    result = run(project, "model.uri=models/codes.onnx")
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line_error(result)
    assert "float32" in line and "int64" in line and "'x'" in line, line
    assert not (project / "out" / f"dt={DS}" / "_manifest.json").exists()


@pytest.mark.parametrize("features, said", [('"f0"', "list of column names"),
                                            ('["f0", "f1", "f0"]', "more than once")])
def test_schema_features_that_are_not_a_list_of_columns_exit_2(project, features, said):
    schema = project / "schemas" / "feats" / "v1.py"
    text = schema.read_text()
    start = text.index("FEATURES = ")
    schema.write_text(text[:start] + f"FEATURES = {features}\n")
    (project / "schemas" / "lock.json").unlink(missing_ok=True)
    result = run(project, command="plan")
    assert result.returncode == 2, result.stdout + result.stderr
    assert said in one_line_error(result, "plan")


def test_an_output_path_that_is_a_file_exit_2(project):
    result = run(project, "output.path=job.yaml")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "is a file" in one_line_error(result)
    result = cli(project, "inspect", "job.yaml")
    assert result.returncode == 2
    assert "no committed partition" in one_line_error(result, "inspect")
