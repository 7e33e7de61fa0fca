"""Inputs from tables (contract §3 ``input``), driven through the CLI as a user runs them.

A Delta table of features, partitioned by ``dt`` (version 0: a file of DS and one of another
date; version 1: a second file of DS, with one row out of the schema's range): ``run`` scores
the DS partition's two files as its shards, quarantines the bad row as for files and commits a
manifest naming version 1; ``plan`` says the version is pinned. After a version 2 appends a
file to DS, a plain rerun is the no-op it is for files and still reads version 1; ``--set
input.version=2`` is another set of shards (exit 3); ``run --update`` reads version 2 and scores
only the new file, keeping the other two where they are. An Iceberg table (a SQL catalog on
sqlite) is validated and scored the same way, its manifest naming the snapshot.

Eight CLI runs, forked from the session's fork server, on tables of a few hundred rows.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml
from deltalake import DeltaTable, write_deltalake

from factories import DS, check_partition, mlp_reference, numeric_project, one_line_error, run_cli

pytestmark = pytest.mark.slow

OTHER = "2026-01-16"


def features(ids: range, dt: str, seed: int, bad: int | None = None) -> pa.Table:
    """Rows ``ids`` of date ``dt``; row ``bad`` has f0 out of the schema's range (quarantined)."""
    rng = np.random.default_rng(seed)
    x = np.clip(rng.standard_normal((len(ids), 4)), -3, 3).astype(np.float32)
    if bad is not None:
        x[ids.index(bad), 0] = 50.0
    return pa.table({"id": pa.array(list(ids), pa.int64()),
                     **{f"f{i}": pa.array(x[:, i]) for i in range(4)}, "dt": [dt] * len(ids)})


def use_table(root: Path, **inputs) -> None:
    spec = yaml.safe_load((root / "job.yaml").read_text())
    spec["input"] = inputs
    spec["output"]["path"] = "out/dt={ds}"
    (root / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def check_scores(out: Path, manifest: dict) -> None:
    """Every scored row has the model's prediction of its features, read from its shard."""
    preds, _, _ = check_partition(out, [s["path"] for s in manifest["shards"]])
    by_shard = {s["path"]: pq.read_table(s["path"]) for s in manifest["shards"]}
    for shard, table in by_shard.items():
        mine = preds.filter(pc.equal(preds["_source_shard"], shard))
        x = np.stack([table[f"f{i}"].to_numpy() for i in range(4)], axis=1)[mine["_source_row"].to_numpy()]
        np.testing.assert_allclose(mine["y"].to_numpy().ravel(), mlp_reference(x), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def delta(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("delta_input")
    numeric_project(root, shards=1, rows=10)
    table = root / "tables" / "features"
    write_deltalake(table, pa.concat_tables([features(range(0, 200), DS, 0),
                                             features(range(200, 300), OTHER, 1)]), partition_by=["dt"])
    write_deltalake(table, features(range(300, 500), DS, 2, bad=357), partition_by=["dt"],
                    mode="append")
    use_table(root, path="tables/features", format="delta", filter={"dt": "{ds}"})
    run = ("run", "job.yaml", "--ds", DS)
    out = root / "out" / f"dt={DS}"
    first = run_cli(*run, cwd=root)
    assert first.returncode == 0, first.stderr
    committed = json.loads((out / "_manifest.json").read_text())
    check_scores(out, committed)   # now: the partition changes below
    result = {"root": root, "out": out, "first": first, "committed": committed}
    write_deltalake(table, features(range(500, 600), DS, 3), partition_by=["dt"], mode="append")
    result["plan"] = run_cli("plan", "job.yaml", "--ds", DS, cwd=root)
    result["rerun"] = run_cli(*run, cwd=root)
    result["after_rerun"] = json.loads((out / "_manifest.json").read_text())
    result["later"] = run_cli(*run, "--set", "input.version=2", cwd=root)
    result["update"] = run_cli(*run, "--update", cwd=root)
    result["updated"] = json.loads((out / "_manifest.json").read_text())
    result["metrics"] = json.loads((out / "_metrics.json").read_text())
    return result


def test_delta_partition_scored_quarantined_and_pinned(delta):
    assert delta["first"].returncode == 0, delta["first"].stderr
    manifest, out = delta["committed"], delta["out"]   # its files and scores checked when committed
    files = DeltaTable(delta["root"] / "tables" / "features", version=1).file_uris(
        file_pruning_predicate=[("dt", "=", DS)])
    assert sorted(s["path"] for s in manifest["shards"]) == sorted(files)   # the table's files
    assert manifest["input_table"] == {"format": "delta", "version": 1, "filter": {"dt": DS},
                                       "table": str(delta["root"] / "tables" / "features")}
    said = delta["first"].stdout + delta["first"].stderr
    assert f"reading delta table {delta['root'] / 'tables' / 'features'} at version 1 (where dt = '{DS}')" in said
    assert manifest["totals"]["rows_in"] == 400 and manifest["totals"]["rows_quarantined"] == 1
    bad = [s for s in manifest["shards"] if s["rows_quarantined"]]
    assert len(bad) == 1 and bad[0]["status"] == "scored"
    quarantined = pq.read_table(out / next(f["path"] for f in bad[0]["files"]
                                           if f["path"].startswith("quarantine/")))
    assert quarantined["_source_row"].to_pylist() == [57] and quarantined["_column"].to_pylist() == ["f0"]


def test_delta_rerun_reads_the_pinned_version(delta):
    plan = delta["plan"]
    assert plan.returncode == 0, plan.stderr
    assert "delta version 1 (pinned by the partition's manifest)" in plan.stdout
    assert "--update would keep 2 of 3 shards" in plan.stdout, plan.stdout
    rerun = delta["rerun"]
    assert rerun.returncode == 0, rerun.stderr
    assert "already committed" in rerun.stdout + rerun.stderr
    assert delta["after_rerun"] == delta["committed"]
    later = delta["later"]   # the job names the newer version: another set of shards
    assert later.returncode == 3
    assert "other shards than input.path lists now (1 new" in one_line_error(later)


def test_delta_update_scores_only_the_new_file(delta):
    update, before, after = delta["update"], delta["committed"], delta["updated"]
    assert update.returncode == 0, update.stderr
    assert after["input_table"]["version"] == 2 and after["attempt"] != before["attempt"]
    assert "at version 2" in update.stdout + update.stderr
    kept = {s["path"]: s for s in before["shards"]}
    new = [s for s in after["shards"] if s["path"] not in kept]
    assert len(after["shards"]) == 3 and len(new) == 1 and new[0]["rows_in"] == 100
    assert new[0]["scored_by"] == after["attempt"]
    for shard in after["shards"]:
        if shard["path"] in kept:
            assert shard["scored_by"] == before["attempt"]
            assert shard["files"] == kept[shard["path"]]["files"]
    assert delta["metrics"]["metrics"]["shards_reused"] == 2
    assert delta["metrics"]["params"]["input.version"] == "2"
    check_scores(delta["out"], after)


def test_iceberg_partition_scored(tmp_path):
    from pyiceberg.catalog import load_catalog

    numeric_project(tmp_path, shards=1, rows=10, stamp=False)
    # Iceberg's files hold the partition column too: the schema takes the extra column
    (tmp_path / "schemas" / "feats" / "v1.py").write_text(
        (tmp_path / "schemas" / "feats" / "v1.py").read_text().replace("strict=True", "strict=False"))
    stamped = run_cli("stamp", "models/model.onnx", "--job", "job.yaml", "--model-version", "model:1",
                      cwd=tmp_path)
    assert stamped.returncode == 0, stamped.stderr
    catalog = load_catalog("features", type="sql", uri=f"sqlite:///{tmp_path / 'catalog.db'}",
                           warehouse=f"file://{tmp_path / 'warehouse'}")
    catalog.create_namespace("feats")
    table = catalog.create_table("feats.daily", schema=features(range(1), DS, 0).schema)
    with table.update_spec() as spec:
        spec.add_identity("dt")
    table.append(pa.concat_tables([features(range(0, 300), DS, 0, bad=57),
                                  features(range(300, 400), OTHER, 1)]))
    snapshot = table.current_snapshot().snapshot_id
    use_table(tmp_path, path="feats.daily", format="iceberg", filter={"dt": "{ds}"},
              catalog={"name": "features", "uri": "sqlite:///catalog.db"})
    checked = run_cli("validate", "job.yaml", "--ds", DS, cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert f"input: iceberg table feats.daily, version {snapshot}, filter dt='{DS}'" in checked.stdout
    assert "1 shards, 300 rows, 1 bad" in checked.stdout, checked.stdout
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out" / f"dt={DS}"
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["input_table"] == {"format": "iceberg", "table": "feats.daily",
                                       "version": snapshot, "filter": {"dt": DS}}
    assert manifest["totals"]["rows_in"] == 300 and manifest["totals"]["rows_quarantined"] == 1
    assert all(f"/dt={DS}/" in s["path"] for s in manifest["shards"])
    check_scores(out, manifest)
