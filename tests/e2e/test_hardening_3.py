"""Table outputs and table inputs that failed after the work had begun (the hardening issue, items
7 and 8), driven through the CLI as a user meets them.

7. ``output.partition_column`` named like a column the tables hold — an audit column, a
   quarantine column, an explanation column, an id or prediction column, the same regardless of
   case — used to exit 5 at the commit, after all the scoring. It is a colliding column name
   (contract §3): exit 2 before any work, for ``plan`` and ``run``, on Delta and Iceberg, one line
   naming the column; nothing written.
8. ``run --overwrite`` and ``profile`` of a partition whose pinned input version lost its files
   (Delta ``VACUUM``; Iceberg files removed, or the snapshot expired) used to exit 5 ("cannot
   read shard") once the run had begun. The table no longer has that version: exit 3 before any
   work, one line naming the table, the version and what to do. ``plan`` and a plain rerun stay
   what they were (the partition is committed), with one warning line.

Rerun with ``.venv/bin/pytest tests/e2e/test_hardening_3.py -q -p no:cacheprovider``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml

from factories import DS, numeric_project, one_line_error, run_cli, snapshot
from servers import copy_project

pytestmark = pytest.mark.slow


@pytest.fixture
def project(tmp_path, stamped_template) -> Path:
    """A stamped job folder: 3 shards × 1000 rows in data/dt=DS/, model output ``y``."""
    copy_project(stamped_template, tmp_path)
    return tmp_path


def run(project: Path, *sets: str, command: str = "run", extra: tuple[str, ...] = ()):
    args = [command, "job.yaml", "--ds", DS, *extra]
    for item in sets:
        args += ["--set", item]
    return run_cli(*args, cwd=project)


# -- 7. the tables' partition column is never a column the job writes -----------------------------

@pytest.mark.parametrize("fmt, column, named", [
    ("delta", "_source_row", "batchinfer's own '_source_row'"),         # audit: Delta refused it at the commit
    ("delta", "_reason", "batchinfer's own '_reason'"),                 # the quarantine table's
    ("delta", "_explanation", "batchinfer's own '_explanation'"),       # explain's, even without explain
    ("delta", "_SOURCE_SHARD", "batchinfer's own '_source_shard'"),     # Delta ignores case
    ("delta", "ID", "output.id_columns' 'id'"),
    ("iceberg", "_source_row", "batchinfer's own '_source_row'"),       # its data files hold it too
    ("iceberg", "_values", "batchinfer's own '_values'"),
    ("iceberg", "_Model_Digest", "batchinfer's own '_model_digest'"),
])
def test_partition_column_named_like_a_written_column_exit_2_before_any_work(project, fmt, column, named):
    for command in ("plan", "run"):
        result = run(project, f"output.format={fmt}", "output.path=tables",
                     f"output.partition_column={column}", command=command)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        line = one_line_error(result, command)
        assert f"output.partition_column {column!r} is also a column the job writes" in line, line
        assert named in line, line
    assert not (project / "tables").exists()


def test_partition_column_named_like_the_models_output_in_another_case_exit_2(project):
    """The model's output ``y`` is a prediction column once the model loads (still before any
    work); ``Y`` collides with it in a Delta table as ``y`` does."""
    result = run(project, "output.format=delta", "output.path=tables", "output.partition_column=Y")
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line_error(result)
    assert "output.partition_column 'Y'" in line and "the prediction column 'y'" in line, line
    assert not (project / "tables").exists()


def test_columns_that_differ_only_in_case_exit_2_for_a_table_output_only(project):
    """A table's column names ignore case (Delta refused ``ID`` beside ``id`` at the commit, after
    the scoring); a Parquet file's do not, so a files output keeps both."""
    for command in ("plan", "run"):
        result = run(project, "output.format=delta", "output.path=tables",
                     "output.predictions={y: ID}", command=command)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        line = one_line_error(result, command)
        assert "'ID'" in line and "output.id_columns (as 'id'" in line, line
    assert not (project / "tables").exists()
    result = run(project, "output.predictions={y: ID}")
    assert result.returncode == 0, result.stderr


# -- 8. a pinned table version whose files are gone is exit 3, before any work --------------------

def features(ids: range, dt: str, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    x = np.clip(rng.standard_normal((len(ids), 4)), -3, 3).astype(np.float32)
    return pa.table({"id": pa.array(list(ids), pa.int64()),
                     **{f"f{i}": pa.array(x[:, i]) for i in range(4)}, "dt": [dt] * len(ids)})


def use_table(root: Path, **inputs) -> None:
    spec = yaml.safe_load((root / "job.yaml").read_text())
    spec["input"] = inputs
    (root / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def check_refused_before_any_work(root: Path, what: str, version: int, table: str, latest: int) -> None:
    """``run --overwrite`` and ``profile`` exit 3 with one line naming the table, the pinned
    version and what to do; the partition and the profile's path are untouched. ``plan`` and a
    plain rerun exit 0 (the partition stays committed) with one warning line saying the same."""
    out = root / "out" / f"dt={DS}"
    before = snapshot(out)
    for command, extra in (("run", ("--overwrite",)), ("profile", ("--out", "profile.json"))):
        result = run(root, command=command, extra=extra)
        assert result.returncode == 3, (command, result.stdout, result.stderr)
        line = one_line_error(result, command)
        assert f"scored from {what} {version} of" in line, line
        assert f"table {table}, which the table no longer has" in line, line
        assert "--update" in line and f"--overwrite --set input.version={latest}" in line, line
        assert "cannot read shard" not in line, line
        assert snapshot(out) == before, command
        assert not (root / "profile.json").exists()
    for command in ("plan", "run"):
        result = run(root, command=command)
        assert result.returncode == 0, (command, result.stdout, result.stderr)
        assert "nothing to do" in result.stdout, result.stdout
        warnings = result.stderr.strip().splitlines()
        assert len(warnings) == 1 and warnings[0].startswith("WARNING batchinfer: "), result.stderr
        assert f"{version} of" in warnings[0] and "--update" in warnings[0], warnings[0]
        assert snapshot(out) == before, command


def test_delta_version_vacuumed_exit_3_and_update_reads_the_latest(tmp_path):
    from deltalake import DeltaTable, write_deltalake

    numeric_project(tmp_path, shards=1, rows=10)
    table = tmp_path / "tables" / "features"
    write_deltalake(table, features(range(0, 200), DS, 0), partition_by=["dt"])
    use_table(tmp_path, path="tables/features", format="delta", filter={"dt": "{ds}"})
    first = run(tmp_path)
    assert first.returncode == 0, first.stderr
    out = tmp_path / "out" / f"dt={DS}"
    assert json.loads((out / "_manifest.json").read_text())["input_table"]["version"] == 0
    # The partition rewritten in the table (version 1), then version 0's files vacuumed.
    write_deltalake(table, features(range(0, 150), DS, 1), partition_by=["dt"], mode="overwrite")
    removed = DeltaTable(table).vacuum(retention_hours=0, enforce_retention_duration=False,
                                       dry_run=False)
    assert removed, "the vacuum removed nothing"
    latest = DeltaTable(table).version()
    check_refused_before_any_work(tmp_path, "version", 0, str(table), latest)
    # Naming the gone version itself is "no such version" (exit 2), not a shard failure.
    named = run(tmp_path, "input.version=0", command="validate")
    assert named.returncode == 2, named.stdout + named.stderr
    line = one_line_error(named, "validate")
    assert "input.version 0" in line and "no such version" in line and "vacuumed" in line, line
    # What the line says to do works: --update reads the latest version.
    update = run(tmp_path, extra=("--update",))
    assert update.returncode == 0, update.stderr
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["input_table"]["version"] == latest and manifest["totals"]["rows_in"] == 150


def test_iceberg_snapshot_whose_files_are_gone_or_expired_exit_3(tmp_path):
    from pyiceberg.catalog import load_catalog

    numeric_project(tmp_path, shards=1, rows=10, stamp=False)
    schema = tmp_path / "schemas" / "feats" / "v1.py"   # Iceberg's files hold dt: not strict
    schema.write_text(schema.read_text().replace("strict=True", "strict=False"))
    stamped = run_cli("stamp", "models/model.onnx", "--job", "job.yaml", "--model-version", "model:1",
                      cwd=tmp_path)
    assert stamped.returncode == 0, stamped.stderr
    catalog = load_catalog("features", type="sql", uri=f"sqlite:///{tmp_path / 'catalog.db'}",
                           warehouse=f"file://{tmp_path / 'warehouse'}")
    catalog.create_namespace("feats")
    iceberg = catalog.create_table("feats.daily", schema=features(range(1), DS, 0).schema)
    with iceberg.update_spec() as spec:
        spec.add_identity("dt")
    iceberg.append(features(range(0, 200), DS, 0))
    pinned = iceberg.current_snapshot().snapshot_id
    old_files = [task.file.file_path.removeprefix("file://") for task in iceberg.scan().plan_files()]
    use_table(tmp_path, path="feats.daily", format="iceberg", filter={"dt": "{ds}"},
              catalog={"name": "features", "uri": "sqlite:///catalog.db"})
    first = run(tmp_path)
    assert first.returncode == 0, first.stderr
    iceberg.overwrite(features(range(0, 150), DS, 1))
    latest = catalog.load_table("feats.daily").current_snapshot().snapshot_id
    # The pinned snapshot still listed, its data files removed (a lifecycle rule, a cleanup).
    for path in old_files:
        os.remove(path)
    check_refused_before_any_work(tmp_path, "snapshot", pinned, "feats.daily", latest)
    # The snapshot expired too (as an engine's expire_snapshots leaves it): the same.
    catalog.load_table("feats.daily").maintenance.expire_snapshots().by_id(pinned).commit()
    check_refused_before_any_work(tmp_path, "snapshot", pinned, "feats.daily", latest)
