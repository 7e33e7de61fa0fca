"""Mistakes that used to look like something else (issue 18, items 4 and 5), through the CLI on
a copy of the stamped numeric project (3 shards × 1000 rows, a 4-feature MLP):

- preprocessing that raises on every row is a fault of the function (exit 2, the exception in
  the line), not "data quality: 3000 of 3000 rows quarantined" (exit 4) — in ``run`` and in
  ``validate``, which runs the preprocessing too; one that raises on a few rows still has them
  quarantined;
- a model file that does not exist, or is not of its backend's format, and preprocessing of the
  wrong width for the model are the user's to fix (exit 2), not runtime failures the DAG
  retries (exit 5); the width is found on the first batch, before any model call.

Rerun with ``.venv/bin/pytest tests/e2e/test_preprocess_faults.py -q``.
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factories import DS, kept_for_resume, one_line_error, read_partition, run_cli, write_schema
from servers import copy_project

pytestmark = pytest.mark.slow

MODULES = {
    # A column the data does not have: a KeyError on every batch and on every row alone.
    "missing_column": """
        import numpy as np

        def transform(batch):
            columns = {name: batch.column(name).to_numpy() for name in batch.schema.names}
            return np.stack([columns[c] for c in ("f0", "f1", "f2", "income")], 1).astype(np.float32)
        """,
    # Rows whose id ends in 7 (mod 250) are refused: 12 of 3000, a data reason.
    "picky": """
        import numpy as np

        def transform(batch):
            ids = batch.column("id").to_numpy()
            bad = ids[ids % 250 == 7]
            if bad.size:
                raise ValueError(f"id {bad[0]} cannot be scored")
            return np.stack([batch.column(f"f{i}").to_numpy() for i in range(4)], 1).astype(np.float32)
        """,
    # A text column read as numbers: "41,000" is not a float.
    "income_as_float": """
        import numpy as np

        def transform(batch):
            x = [batch.column(f"f{i}").to_numpy() for i in range(3)]
            income = np.array(batch.column("income").to_pylist(), dtype=np.float32)
            return np.stack([*x, income], 1).astype(np.float32)
        """,
    # One column too few for the model's [N, 4] input.
    "three_columns": """
        import numpy as np

        def transform(batch):
            return np.stack([batch.column(f"f{i}").to_numpy() for i in range(3)], 1).astype(np.float32)
        """,
}


@pytest.fixture
def project(tmp_path, stamped_template) -> Path:
    copy_project(stamped_template, tmp_path)
    for name, source in MODULES.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    return tmp_path


def run(project: Path, *sets: str, command: str = "run", debug: bool = False):
    args = ["--debug"] if debug else []
    args += [command, "job.yaml", "--ds", DS]
    for item in sets:
        args += ["--set", item]
    return run_cli(*args, cwd=project)


def stamp(project: Path, *sets: str, model: str = "models/model.onnx") -> None:
    args = ["stamp", model, "--job", "job.yaml", "--model-version", "model:1"]
    for item in sets:
        args += ["--set", item]
    result = run_cli(*args, cwd=project)
    assert result.returncode == 0, result.stderr


def nothing_committed(project: Path) -> None:
    """No manifest; what is left is what a rerun could adopt (contract §5.3: a refusal after
    scoring began keeps the finished shards; with the preprocessing fixed, its hash and so the
    attempt key differ, and the next commit removes them)."""
    out = project / "out" / f"dt={DS}"
    assert not (out / "_manifest.json").exists()
    if out.exists():
        kept_for_resume(out, all_finished=False)


# -- item 4: a bug in the preprocessing is not bad data ------------------------------------------

def test_a_transform_that_raises_on_every_row_exits_2_naming_the_exception(project):
    stamp(project, "preprocess=missing_column:transform")
    result = run(project, "preprocess=missing_column:transform")
    assert result.returncode == 2, result.stdout + result.stderr      # it was 4: "data quality"
    line = one_line_error(result)
    assert "preprocess missing_column:transform raised KeyError: 'income'" in line, line
    assert "fault of the preprocessing" in line and "data quality" not in line, line
    nothing_committed(project)


def test_debug_shows_the_transforms_own_traceback(project):
    stamp(project, "preprocess=missing_column:transform")
    result = run(project, "preprocess=missing_column:transform", debug=True)
    assert result.returncode == 2
    assert 'missing_column.py", line 6, in transform' in result.stderr, result.stderr
    assert "KeyError: 'income'" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("batchinfer run: preprocess ")


def test_small_batches_all_rejected_for_one_reason_exit_2_at_the_threshold(project):
    """Batches of 50 rows are too few for the per-batch rule: every row is isolated and
    quarantined, and the threshold check then names the one reason (rule (b))."""
    stamp(project, "preprocess=missing_column:transform")
    result = run(project, "preprocess=missing_column:transform", "batch.rows=50")
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line_error(result)
    assert "raised KeyError: 'income' on every one of the 3000 rows it was given" in line, line
    nothing_committed(project)


def test_a_transform_that_raises_on_a_few_rows_has_them_quarantined(project):
    stamp(project, "preprocess=picky:transform")
    result = run(project, "preprocess=picky:transform")
    assert result.returncode == 0, result.stderr
    preds, quarantine, manifest = read_partition(project / "out" / f"dt={DS}")
    assert manifest["totals"]["rows_quarantined"] == 12 and preds.num_rows == 2988
    rows = quarantine.to_pylist()
    assert {r["_check"] for r in rows} == {"preprocess"}
    ids = sorted(json.loads(r["_values"])["id"] for r in rows)
    assert ids == [i for i in range(3000) if i % 250 == 7]
    assert all(r["_reason"].startswith("preprocessing failed: ValueError: id ") for r in rows)


def test_a_text_feature_the_transform_cannot_convert_exits_2(project):
    """A non-strict schema lets an ``income`` column of text through to the preprocessing."""
    write_schema(project / "schemas", version=2, strict=False)
    data = project / "data" / f"dt={DS}"
    for path in sorted(data.glob("*.parquet")):
        table = pq.read_table(path)
        income = pa.array([f"{40 + i % 9},000" for i in range(table.num_rows)])
        pq.write_table(table.append_column("income", income), path)
    sets = ("schema=feats@2", "preprocess=income_as_float:transform")
    stamp(project, *sets)
    result = run(project, *sets)
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line_error(result)
    assert "raised ValueError: could not convert string to float: '40,000'" in line, line
    nothing_committed(project)


def test_validate_runs_the_preprocessing_and_counts_what_it_rejects(project):
    result = run(project, "preprocess=picky:transform", command="validate")   # no declaration needed
    assert result.returncode == 0, result.stderr
    assert "3000 rows, 12 bad" in result.stdout
    assert "12  (row): preprocess ValueError (first: ValueError: id 7 cannot be scored)" in result.stdout
    result = run(project, "preprocess=missing_column:transform", command="validate")
    assert result.returncode == 2, result.stdout + result.stderr      # it was 0: "0 bad"
    assert "raised KeyError: 'income'" in one_line_error(result, "validate")


# -- item 5: mistakes a retry cannot fix are exit 2, not 5 ---------------------------------------

@pytest.mark.parametrize("uri, contents, said", [
    ("models/absent.onnx", None, "not found"),
    ("models/notes.onnx", b"not a model\n", "is not a readable ONNX model"),
    ("models", None, "is a folder"),
])
def test_a_model_uri_that_names_no_onnx_model_exits_2(project, uri, contents, said):
    if contents is not None:
        (project / uri).write_bytes(contents)
    result = run(project, f"model.uri={uri}")
    assert result.returncode == 2, result.stdout + result.stderr      # it was 5: retried by the DAG
    assert said in one_line_error(result)
    nothing_committed(project)


def test_a_pt2_that_is_not_a_torch_program_exits_2(project):
    (project / "models" / "model.pt2").write_bytes(b"\x80\x04 a pickle, say")
    sets = ("model.uri=models/model.pt2", "model.backend=torch")
    stamp(project, *sets, model="models/model.pt2")   # stamping reads only the bytes
    result = run(project, *sets)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "is not a torch.export program" in one_line_error(result)


def test_preprocessing_one_column_too_narrow_exits_2_on_the_first_batch(project):
    """Before: every one of the 3000 rows was tried alone (3000+ model calls), then exit 5
    "the model raised on every one of the 3000 rows". Now the declared input shape is checked
    before the first model call, so the line is the shape's, not the isolation's."""
    stamp(project, "preprocess=three_columns:transform")
    result = run(project, "preprocess=three_columns:transform")
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line_error(result)
    assert "model input 'x' of shape [N, 3]" in line and "takes [N, 4]" in line, line
    assert "raised on every" not in line
    nothing_committed(project)

