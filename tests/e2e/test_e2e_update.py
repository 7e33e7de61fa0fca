"""``run --update`` as a user runs it (contract §5.3 "Update"): a committed partition of four
shards (one with quarantined rows, one challenger) whose input then changes — a shard arrives
late, one is rewritten upstream, one is no longer listed. A plain run refuses (exit 3, naming
``--update``); ``plan`` says what an update would keep, score and drop; ``run --update`` scores
the two new and rewritten shards only, keeps the two others' files where they are (same paths,
same inodes: no copy), drops the removed shard's rows, and commits exactly what a clean run of
the shards as listed now commits; run again it is a no-op. ``--update`` with ``--overwrite`` is
a usage error; with another spec (a ``--set``) and changed shards, exit 3.

About ten CLI runs (forked from the session's fork server), one module fixture.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from factories import (
    DS,
    assert_same_result,
    canonical,
    make_mlp_onnx,
    numeric_project,
    one_line_error,
    run_cli,
    spoil_rows,
)

pytestmark = pytest.mark.slow

SHARDS, ROWS, BATCH = 4, 1000, 500
BAD = {0: [3, 700], 2: [10]}        # rows out of range: quarantined (shards 0 and 2 are kept)


def challenger_rows(out: Path, manifest: dict) -> pa.Table:
    entry = manifest["challengers"][0]
    return pa.concat_tables([pq.read_table(out / f["path"]) for s in entry["shards"] for f in s["files"]])


@pytest.fixture(scope="module")
def updated(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("update")
    numeric_project(root, shards=SHARDS, rows=ROWS, batch={"rows": BATCH})
    data = root / "data" / f"dt={DS}"
    for shard, rows in BAD.items():
        spoil_rows(data / f"part-{shard:05d}.parquet", rows)
    make_mlp_onnx(root / "models" / "other.onnx", seed=5)
    stamped = run_cli("stamp", "models/other.onnx", "--job", "job.yaml", "--model-version", "model:2", cwd=root)
    assert stamped.returncode == 0, stamped.stderr
    spec = yaml.safe_load((root / "job.yaml").read_text())
    spec["model"]["challengers"] = [{"name": "other", "uri": "models/other.onnx", "backend": "onnxruntime",
                                     "device": "cpu"}]
    (root / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    run = ("run", "job.yaml", "--ds", DS)
    first = run_cli(*run, cwd=root)
    assert first.returncode == 0, first.stderr
    out = root / "out" / f"dt={DS}"
    before = json.loads((out / "_manifest.json").read_text())
    stats = {p.relative_to(out): p.stat() for p in out.rglob("*.parquet")}

    # The input changes: shard 4 arrives late, shard 1 is rewritten, shard 3 is no longer there.
    shutil.copy(data / "part-00000.parquet", data / "part-00004.parquet")
    table = pq.read_table(data / "part-00001.parquet")
    f1 = table["f1"].to_numpy().copy()
    f1[0] += 1.0
    pq.write_table(table.set_column(2, "f1", pa.array(f1, pa.float32())), data / "part-00001.parquet")
    (data / "part-00003.parquet").unlink()
    shards = sorted(data.resolve().glob("*.parquet"))

    result = {
        "plain": run_cli(*run, cwd=root, env={"BATCHINFER_ERROR_FILE": str(root / "error.json")}),
        "plan": run_cli("plan", "job.yaml", "--ds", DS, cwd=root),
        "both": run_cli(*run, "--update", "--overwrite", cwd=root),
        "other_spec": run_cli(*run, "--update", "--set", "batch.rows=250", cwd=root),
        "dry": run_cli(*run, "--update", "--dry-run", cwd=root),
    }
    unchanged = json.loads((out / "_manifest.json").read_text())
    result["update"] = run_cli(*run, "--update", cwd=root)
    result["ref"] = run_cli(*run, "--set", "output.path=ref", cwd=root)
    result["again"] = run_cli(*run, "--update", cwd=root)
    result["inspect"] = run_cli("inspect", str(out), cwd=root)
    return {**result, "root": root, "out": out, "shards": shards, "before": before, "stats": stats,
            "unchanged": unchanged, "manifest": json.loads((out / "_manifest.json").read_text())}


def test_a_plain_run_refuses_naming_update_and_changes_nothing(updated):
    plain = updated["plain"]
    assert plain.returncode == 3
    assert "was committed from other shards than input.path lists now (1 new, 1 no longer listed" in (
        one_line_error(plain))
    assert "pass --update to score only the new and changed shards, or --overwrite" in plain.stderr
    # The error file carries the error's fields and its remedies as values (contract §2).
    record = json.loads((updated["root"] / "error.json").read_text())
    assert one_line_error(plain) == f"batchinfer run: {record['message']}"
    assert record["error"] == "ContractError" and record["path"], record
    assert [r["action"] for r in record["remedies"]] == ["update", "overwrite"], record
    assert record["remedies"][0]["purpose"] == "to score only the new and changed shards"
    for name in ("both", "other_spec", "dry"):   # none of them changed the commit either
        assert updated["unchanged"] == updated["before"], name


def test_plan_says_what_update_would_keep_score_and_drop(updated):
    plan = updated["plan"]
    assert plan.returncode == 0, plan.stderr
    line = next(s for s in plan.stdout.splitlines() if "a run would" in s)
    assert f"committed by attempt {updated['before']['attempt']}: a run exits 3 (" in line
    assert (f"--update would keep 2 of 4 shards (2,000 rows) scored by attempt(s) "
            f"{updated['before']['attempt']}; scoring 2 (1 new, 1 rewritten); dropping 1 no longer "
            f"listed") in line
    dry = updated["dry"]
    assert dry.returncode == 0, dry.stderr
    assert "dry run: would score 2 shards into" in dry.stdout and "updating: keeping 2 of 4" in dry.stdout


def test_update_with_overwrite_is_a_usage_error_and_another_spec_exit_3(updated):
    both = updated["both"]
    assert both.returncode == 2
    assert one_line_error(both).startswith("batchinfer run: give --update (score the new and rewritten")
    other = updated["other_spec"]
    assert other.returncode == 3
    assert "was committed from another job spec" in one_line_error(other)
    assert "pass --overwrite to score the partition again" in other.stderr


def test_update_scores_only_new_and_rewritten_shards_and_commits_what_a_clean_run_commits(updated):
    update, ref = updated["update"], updated["ref"]
    assert update.returncode == 0, update.stderr
    assert ref.returncode == 0, ref.stderr
    old, manifest = updated["before"], updated["manifest"]
    assert (f"updating: keeping 2 of 4 shards (2,000 rows) scored by attempt(s) {old['attempt']}; "
            f"scoring 2 (1 new, 1 rewritten); dropping 1 no longer listed") in update.stdout
    assert "scoring 2 shards into" in update.stdout
    out, shards = updated["out"], updated["shards"]
    # Same rows, _input_hash, predictions (bit for bit), quarantine and totals as a clean run of
    # the shards as listed now; every file listed and hashed right, nothing unlisted, no scratch.
    assert_same_result(out, updated["root"] / "ref", shards)
    assert manifest["totals"]["rows_quarantined"] == 5   # shard 4 is a copy of shard 0
    kept = {str(shards[0]), str(shards[2])}
    scored_by = {s["path"]: s["scored_by"] for s in manifest["shards"]}
    assert {p for p, a in scored_by.items() if a == old["attempt"]} == kept
    assert {p for p, a in scored_by.items() if a == manifest["attempt"]} == {str(shards[1]), str(shards[3])}
    # The kept shards' files (quarantine included) are where they were: same bytes, same inode.
    committed = {s["path"]: s for s in old["shards"]}
    for shard in manifest["shards"]:
        if shard["path"] in kept:
            assert shard["files"] == committed[shard["path"]]["files"]
            for f in shard["files"]:
                then, now = updated["stats"][Path(f["path"])], (out / f["path"]).stat()
                assert (now.st_ino, now.st_mtime_ns) == (then.st_ino, then.st_mtime_ns), f["path"]
    # The challenger's kept files too; its rows are the clean run's.
    entry = manifest["challengers"][0]
    assert [s["path"] for s in entry["shards"]] == [str(p) for p in shards]
    old_entry = {s["path"]: s for s in old["challengers"][0]["shards"]}
    assert all(s["files"] == old_entry[s["path"]]["files"] for s in entry["shards"] if s["path"] in kept)
    ref_manifest = json.loads((updated["root"] / "ref" / "_manifest.json").read_text())
    assert canonical(challenger_rows(out, manifest)).equals(
        canonical(challenger_rows(updated["root"] / "ref", ref_manifest)))
    # The files of the rewritten and the removed shard are gone with the old manifest.
    listed = {f["path"] for s in manifest["shards"] for f in s["files"]} | {
        f["path"] for s in entry["shards"] for f in s["files"]}
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*.parquet")}
    assert on_disk == listed
    metrics = json.loads((out / "_metrics.json").read_text())["metrics"]
    assert (metrics["shards_reused"], metrics["rows_reused"]) == (2, 2 * ROWS)
    report = (out / "report.html").read_text()
    assert "scored by" in report and "reused: 2 of 4 shards" in report


def test_update_again_is_a_no_op_and_inspect_says_who_scored_what(updated):
    again = updated["again"]
    assert again.returncode == 0, again.stderr
    assert "is already committed with this triple" in again.stdout
    assert "(--update: no shard new, rewritten or removed); nothing to do" in again.stdout
    inspect, manifest = updated["inspect"], updated["manifest"]
    assert inspect.returncode == 0, inspect.stderr
    assert (f"reused: 2 of 4 shards (2000 rows) scored by earlier attempt(s) "
            f"{updated['before']['attempt']} (2); 2 scored by {manifest['attempt']}") in inspect.stdout
