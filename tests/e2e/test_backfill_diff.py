"""`batchinfer backfill` and `batchinfer diff` (contract §2), driven through the CLI.

backfill: every date in the range is a run of its own; committed partitions are skipped; it
stops at the first failing date unless --keep-going, and exits with that date's code; running
the same command again resumes. diff: two committed outputs of one partition, compared row by
row through their manifests.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factories import DS, make_mlp_onnx, make_shards, numeric_project, read_partition, run_cli

pytestmark = pytest.mark.slow

DAYS = ["2026-01-15", "2026-01-16", "2026-01-17"]
ROWS = 2 * 300


def committed(project: Path, ds: str) -> dict | None:
    path = project / "out" / f"dt={ds}" / "_manifest.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("backfill")
    numeric_project(root, shards=2, rows=300)
    make_shards(root / "data" / f"dt={DAYS[2]}", shards=2, rows=300, seed=7)
    # DAYS[1] has no data yet: its run exits 2 ("no shard matches")
    return root


@pytest.fixture
def project(template, tmp_path) -> Path:
    root = tmp_path / "p"
    shutil.copytree(template, root)
    return root


def test_backfill_stops_at_the_first_failure_and_resumes(project):
    first = run_cli("backfill", "job.yaml", "--start", DAYS[0], "--end", DAYS[2], cwd=project)
    assert first.returncode == 2, first.stderr
    assert committed(project, DAYS[0])["totals"]["rows_in"] == ROWS
    assert committed(project, DAYS[1]) is None
    assert committed(project, DAYS[2]) is None  # not attempted after the failure
    lines = first.stdout.splitlines()
    assert any(line.startswith(f"{DAYS[0]}  committed: {ROWS} rows in") for line in lines)
    assert any(line.startswith(f"{DAYS[1]}  failed (exit 2): no shard matches") for line in lines)
    assert not any(line.startswith(DAYS[2]) for line in lines)
    err = first.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("batchinfer backfill: 1 of 3 partition(s) failed")
    assert "rerun" in err[0]

    make_shards(project / "data" / f"dt={DAYS[1]}", shards=2, rows=300, seed=3)
    attempt = committed(project, DAYS[0])["attempt"]
    second = run_cli("backfill", "job.yaml", "--start", DAYS[0], "--end", DAYS[2], cwd=project)
    assert second.returncode == 0, second.stderr
    assert committed(project, DAYS[0])["attempt"] == attempt  # skipped, not rescored
    for ds in DAYS:
        predictions, quarantine, manifest = read_partition(project / "out" / f"dt={ds}")
        assert manifest["ds"] == ds
        assert predictions.num_rows + quarantine.num_rows == ROWS
        assert set(predictions.column("_source_shard").to_pylist()) == {
            f"{project}/data/dt={ds}/part-0000{i}.parquet" for i in range(2)}
    assert f"{DAYS[0]}  " in second.stdout and "already committed" in second.stdout
    assert "3 partition(s): 2 committed, 1 already committed" in second.stdout


def test_backfill_update_scores_a_late_shard_and_skips_what_did_not_change(project):
    """Late data (contract §5.3 "Update"): after a backfill, a shard arrives late in one date;
    a plain backfill stops there (exit 3, naming --update), ``backfill --update`` scores that
    shard only and leaves the other date as it was."""
    dates = ("--start", DAYS[0], "--end", DAYS[2])
    make_shards(project / "data" / f"dt={DAYS[1]}", shards=2, rows=300, seed=3)
    first = run_cli("backfill", "job.yaml", *dates, cwd=project)
    assert first.returncode == 0, first.stderr
    before = {ds: committed(project, ds) for ds in DAYS}
    make_shards(project / "late", shards=1, rows=300, seed=9)
    (project / "late" / "part-00000.parquet").rename(project / "data" / f"dt={DAYS[1]}" / "part-00002.parquet")
    plain = run_cli("backfill", "job.yaml", *dates, cwd=project)
    assert plain.returncode == 3 and "pass --update" in plain.stdout, plain.stdout
    update = run_cli("backfill", "job.yaml", *dates, "--update", cwd=project)
    assert update.returncode == 0, update.stderr
    assert "updating: keeping 2 of 3 shards (600 rows)" in update.stdout
    assert "3 partition(s): 1 committed, 2 already committed" in update.stdout
    after = {ds: committed(project, ds) for ds in DAYS}
    assert after[DAYS[0]] == before[DAYS[0]] and after[DAYS[2]] == before[DAYS[2]]
    assert after[DAYS[1]]["totals"]["rows_in"] == ROWS + 300
    assert [s["scored_by"] for s in after[DAYS[1]]["shards"]] == [before[DAYS[1]]["attempt"]] * 2 + [
        after[DAYS[1]]["attempt"]]
    both = run_cli("backfill", "job.yaml", *dates, "--update", "--overwrite", cwd=project)
    assert both.returncode == 2 and "not both" in both.stderr


def test_backfill_keep_going_scores_the_rest(project):
    result = run_cli("backfill", "job.yaml", "--start", DAYS[0], "--end", DAYS[2], "--keep-going",
                     cwd=project)
    assert result.returncode == 2, result.stderr
    assert committed(project, DAYS[0]) is not None
    assert committed(project, DAYS[1]) is None
    assert committed(project, DAYS[2])["totals"]["rows_in"] == ROWS
    assert f"failed: {DAYS[1]}" in result.stderr


def test_backfill_of_one_day_with_ds_and_dry_run(project):
    result = run_cli("backfill", "job.yaml", "--ds", DAYS[2], "--dry-run", cwd=project)
    assert result.returncode == 0, result.stderr
    assert "would score 2 shards" in result.stdout
    assert not (project / "out").exists()
    result = run_cli("backfill", "job.yaml", "--ds", DAYS[2], cwd=project)
    assert result.returncode == 0, result.stderr
    assert committed(project, DAYS[2]) is not None and committed(project, DAYS[0]) is None


@pytest.mark.parametrize("args, message", [
    (["--start", "2026-01-17", "--end", "2026-01-15"], "--end 2026-01-15 is before --start 2026-01-17"),
    (["--start", "2026-02-30", "--end", "2026-03-01"], "--start '2026-02-30' is not a date"),
    (["--start", "2026-01-15"], "give --start and --end (or --ds for one date)"),
    (["--ds", DS, "--start", DS, "--end", DS], "--ds or --start/--end, not both"),
    (["--start", DS, "--end", DS, "--set", "nope=1"], "nope"),
])
def test_backfill_usage_errors_exit_2_with_one_line(project, args, message):
    result = run_cli("backfill", "job.yaml", *args, cwd=project)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchinfer backfill: ") and message in lines[0]
    assert not (project / "out").exists()


# -- diff ------------------------------------------------------------------------------------

def score(project: Path, out: str, *extra: str) -> Path:
    result = run_cli("run", "job.yaml", "--ds", DS, "--set", f"output.path=out/{out}", *extra,
                     cwd=project)
    assert result.returncode == 0, result.stderr
    return project / "out" / out


def diff(project: Path, a: Path, b: Path) -> dict:
    result = run_cli("diff", str(a), str(b), "--json", cwd=project)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_diff_of_two_identical_runs(project):
    a, b = score(project, "a"), score(project, "b", "--set", "batch.rows=7")
    report = diff(project, a, b)
    assert report["identical"] is True
    assert report["same_partition"] is True
    assert report["triple_differs"] == {}
    assert report["rows"] == {"scored_both": ROWS, "scored_only_a": 0, "scored_only_b": 0,
                              "quarantined_both": 0, "input_hash_differs": 0}
    assert report["columns"]["y"] == {"differ": 0, "max_abs_diff": 0.0}
    assert report["columns"]["id"]["differ"] == 0
    text = run_cli("diff", str(a), str(b), cwd=project)
    assert text.returncode == 0, text.stderr
    assert text.stdout.strip().splitlines()[-1] == "verdict: identical"


def test_diff_finds_another_model_and_changed_input(project):
    a = score(project, "a")
    make_mlp_onnx(project / "models" / "model.onnx", seed=9)
    stamped = run_cli("stamp", "models/model.onnx", "--job", "job.yaml", "--model-version", "model:2",
                      cwd=project)
    assert stamped.returncode == 0, stamped.stderr
    shard = project / "data" / f"dt={DS}" / "part-00001.parquet"
    table = pq.read_table(shard)
    f0 = table.column("f0").to_pylist()
    f0[10] = 0.25
    pq.write_table(table.set_column(table.schema.get_field_index("f0"), "f0",
                                    pa.array(f0, pa.float32())), shard)
    b = score(project, "b")
    report = diff(project, a, b)
    assert report["identical"] is False
    assert set(report["triple_differs"]) == {"model_version", "model_digest"}
    assert report["triple_differs"]["model_version"] == {"a": "model:1", "b": "model:2"}
    assert report["shards"]["input_changed"] == [str(shard)]
    assert report["rows"]["input_hash_differs"] == 1
    assert report["rows"]["scored_both"] == ROWS
    assert report["columns"]["y"]["differ"] > ROWS // 2
    assert report["columns"]["y"]["max_abs_diff"] > 0
    text = run_cli("diff", str(a), str(b), cwd=project)
    assert "model_version: model:1 → model:2" in text.stdout
    assert text.stdout.strip().splitlines()[-1] == "verdict: different"


def test_diff_of_an_uncommitted_output_exits_2(project):
    a = score(project, "a")
    result = run_cli("diff", str(a), str(project / "out" / "nothing"), cwd=project)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds no committed partition" in lines[0]


@pytest.mark.parametrize("a, b, type_, expected", [
    (["a", "b", None], ["a", "c", None], pa.string(), (1, None)),          # nulls on both sides match
    ([1.0, 2.0, float("nan")], [1.0, 2.5, float("nan")], pa.float64(), (1, 0.5)),
    ([[1, 2], [3, 4]], [[1, 2], [3, 5]], pa.list_(pa.float32(), 2), (1, 1.0)),  # [N, 2] outputs
    ([1, 2], [1, 2], pa.int64(), (0, 0.0)),
    ([], [], pa.string(), (0, None)),
])
def test_column_difference(a, b, type_, expected):
    from batchinfer.commands.diff import _column_difference

    assert _column_difference(pa.chunked_array([pa.array(a, type_)]),
                              pa.chunked_array([pa.array(b, type_)])) == expected
