"""The pure parts of challenger models (contract §6 "Challengers"): the spec's names, folding a
challenger's batch records into its shard, the manifest entry, cleanup of challenger folders,
and the comparison statistics of ``diff`` (checked against scipy)."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from batchinfer.errors import SpecError
from batchinfer.io.manifest import clean_after_commit, remove_attempt
from batchinfer.io.outputs import Layout, write_file
from batchinfer.io.records import (
    Challenger,
    ChallengerShard,
    FileRecord,
    Manifest,
    ModelStats,
    ShardRecord,
    ShardResult,
    Totals,
    with_challenger_shards,
)
from batchinfer.pipeline.shard_reports import BatchRecord, ChallengerBatchRecord, ShardInfo, fold_shard
from batchinfer.rows.compare import TopMovers, abs_diff_quantiles, agreement, ranks, spearman
from batchinfer.spec import ModelSpec, default_challenger_name, parse_spec

ATTEMPT, OLD = "20260115T000000Z-aaaaaaaa", "20260114T000000Z-bbbbbbbb"


# -- spec ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("uri, name", [
    ("models/credit_v4.onnx", "credit_v4"), ("/abs/m.v2.onnx", "m.v2"),
    ("models:/credit/4", "credit-4"), ("s3://bucket/x/model.pt2", "model"),
])
def test_default_challenger_name_is_the_file_stem(uri, name):
    assert default_challenger_name(uri) == name
    assert ModelSpec(uri="m.onnx", challengers=[{"uri": uri}]).challengers[0].name == name


def _spec(challengers):
    return {"name": "j", "input": {"path": "in/*.parquet"}, "schema": "s@1",
            "model": {"uri": "m.onnx", "challengers": challengers},
            "output": {"path": "out"}}


@pytest.mark.parametrize("challengers, message", [
    ([{"uri": "a/m.onnx"}, {"uri": "b/m.onnx"}], "two challengers are named 'm'"),
    ([{"uri": "a/m.onnx", "name": "x/y"}], "name 'x/y' is not a safe folder name"),
    ([{"uri": "a/.onnx"}], "is not a safe folder name"),
    ([{"uri": "a/m.onnx", "options": {"nope": 1}}], "nope"),
    ([{"uri": "a/m.onnx", "challengers": []}], "unknown key 'model.challengers.0.challengers'"),
])
def test_bad_challengers_are_one_line_spec_errors(challengers, message):
    with pytest.raises(SpecError) as info:
        parse_spec(_spec(challengers))
    assert message in info.value.message and "\n" not in info.value.message


# -- folding and the manifest --------------------------------------------------------------------

def _batch(number, rows):
    return BatchRecord(batch=number, rows_in=rows, rows_scored=rows, rows_quarantined=0,
                       model=ModelStats(rows=rows))


def _challenger(number, rows, rejected=0, name="c"):
    files = (FileRecord(f"challengers/{name}/{ATTEMPT}/part-00000-{number:05d}.parquet",
                        rows - rejected, "h"),) if rows > rejected else ()
    return ChallengerBatchRecord(name=name, batch=number, rows_in=rows, rows_scored=rows - rejected,
                                 rows_rejected=rejected, files=files,
                                 first_reason="non-finite model output in y" if rejected else None,
                                 compute_ms=1.5)


def test_fold_shard_folds_each_challenger_in_batch_order():
    result = fold_shard("s", [ShardInfo("abc", 10), _batch(1, 4), _challenger(1, 4, 4),
                              _batch(0, 6), _challenger(0, 6, 1)], ["c"])
    shard = result.challengers["c"]
    assert (shard.rows_scored, shard.rows_rejected, shard.compute_ms) == (5, 5, 3.0)
    assert [f.path.rsplit("-", 1)[1] for f in shard.files] == ["00000.parquet"]
    assert shard.reason == "non-finite model output in y"
    assert ShardResult.from_dict(result.to_dict()) == result


@pytest.mark.parametrize("records", [
    [ShardInfo("abc", 10), _batch(0, 10)],                                   # never scored
    [ShardInfo("abc", 10), _batch(0, 6), _batch(1, 4), _challenger(0, 6)],   # a batch missing
    [ShardInfo("abc", 10), _batch(0, 10), _challenger(0, 9)],                # other rows
])
def test_a_challenger_must_score_every_batch_the_champion_scored(records):
    with pytest.raises(RuntimeError, match="accounting failed for challenger c on shard s"):
        fold_shard("s", records, ["c"])


def _manifest(shard, challengers):
    return Manifest(job="j", ds=None, attempt=ATTEMPT, triple={}, job_spec_sha256="h",
                    runner="direct", device="cpu", started_at="t0", finished_at="t1",
                    mlflow_run_id=None, totals=Totals.of([shard]), shards=(shard,),
                    challengers=challengers)


def test_manifest_lists_challengers_and_their_files():
    shard = ShardRecord(path="s0", sha256="abc", rows_in=2, rows_scored=2, rows_quarantined=0,
                        status="scored", reason=None,
                        files=(FileRecord(f"predictions/{ATTEMPT}/part-00000-00000.parquet", 2, "x"),))
    results = [ShardResult(record=shard, challengers={"c": ChallengerShard(
        path="s0", rows_scored=1, rows_rejected=1, reason="why", compute_ms=2.0,
        files=(FileRecord(f"challengers/c/{ATTEMPT}/part-00000-00000.parquet", 1, "y"),))}),
        ShardResult(record=ShardRecord(path="s1", sha256=None, rows_in=None, rows_scored=0,
                                       rows_quarantined=0, status="unreadable", reason="gone"))]
    entries = with_challenger_shards((Challenger(name="c", triple={"model_version": "c:1"},
                                                 backend="onnxruntime", device="cpu"),), results)
    manifest = _manifest(shard, entries)
    data = manifest.to_dict()
    assert data["challengers"][0]["rows_scored"] == 1 and data["challengers"][0]["rows_rejected"] == 1
    assert [s["path"] for s in data["challengers"][0]["shards"]] == ["s0", "s1"]
    assert Manifest.from_dict(data) == manifest
    assert manifest.files() == {f"predictions/{ATTEMPT}/part-00000-00000.parquet",
                                f"challengers/c/{ATTEMPT}/part-00000-00000.parquet"}
    assert "challengers" not in Manifest.from_dict({**data, "challengers": []}).to_dict()


def test_cleanup_keeps_listed_challenger_files_and_only_attempt_folders(tmp_path):
    layout = Layout.for_url(str(tmp_path), ATTEMPT)
    listed = f"challengers/c/{ATTEMPT}/part-00000-00000.parquet"
    for relative in (listed, f"challengers/c/{ATTEMPT}/part-00000-00001.parquet",
                     f"challengers/c/{OLD}/part-00000-00000.parquet",
                     f"challengers/gone/{OLD}/part-00000-00000.parquet",
                     "challengers/c/notes/mine.txt"):
        write_file(layout.fs, layout.abs(relative), b"x")
    shard = ShardRecord(path="s0", sha256="abc", rows_in=1, rows_scored=1, rows_quarantined=0,
                        status="scored", reason=None)
    manifest = _manifest(shard, (Challenger(
        name="c", triple={}, backend="onnxruntime", device="cpu", model_options={},
        shards=(ChallengerShard(path="s0", rows_scored=1, rows_rejected=0, reason=None,
                                compute_ms=0.0, files=(FileRecord(listed, 1, "h"),)),)),))
    clean_after_commit(layout, manifest)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted(["challengers/c/notes/mine.txt", listed])   # the user's folder stays
    assert not (tmp_path / "challengers" / "gone").exists()
    remove_attempt(layout, ATTEMPT)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "challengers/c/notes/mine.txt"]


# -- comparison statistics -----------------------------------------------------------------------

def test_ranks_and_spearman_agree_with_scipy_with_ties():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 20, 500).astype(np.float64)          # many ties
    b = a + rng.normal(0, 3, 500)
    assert np.array_equal(ranks(a), stats.rankdata(a))
    assert spearman(a, b) == pytest.approx(stats.spearmanr(a, b).statistic, abs=1e-12)
    assert spearman(a, a) == 1.0 and spearman(a, -a) == -1.0
    assert spearman(np.ones(5), b[:5]) is None and spearman(a[:1], b[:1]) is None


def test_abs_diff_quantiles_and_agreement():
    a, b = np.array([0.0, 1.0, 2.0, 3.0]), np.array([0.0, 1.5, 1.0, 6.0])
    gap = np.abs(a - b)
    assert abs_diff_quantiles(a, b) == pytest.approx(
        {"p50": np.quantile(gap, 0.5), "p90": np.quantile(gap, 0.9),
         "p99": np.quantile(gap, 0.99), "max": 3.0})
    assert abs_diff_quantiles(a[:0], b[:0]) == {"p50": None, "p90": None, "p99": None, "max": None}
    assert agreement(np.array(["x", "y", "z"], dtype=object), np.array(["x", "q", "z"], dtype=object)) == 2


def test_top_movers_are_bounded_ordered_and_independent_of_shard_order():
    rng = np.random.default_rng(0)
    shards = {f"s{i}": (np.arange(100), rng.random(100), rng.random(100)) for i in range(4)}
    shards["s2"][2][7] = shards["s2"][1][7] + 5.0        # ties between shards, broken by name
    shards["s1"][2][9] = shards["s1"][1][9] + 5.0

    def movers(order):
        top = TopMovers(6)
        for name in order:
            rows, a, b = shards[name]
            top.add(name, rows, a, b, {"id": (rows * 10).tolist()})
        return top.rows()

    first = movers(["s0", "s1", "s2", "s3"])
    assert first == movers(["s3", "s2", "s1", "s0"])
    assert len(first) == 6
    assert [(m["_source_shard"], m["_source_row"]) for m in first[:2]] == [("s1", 9), ("s2", 7)]
    every = sorted((abs(a[i] - b[i]) for rows, a, b in shards.values() for i in rows), reverse=True)
    assert [m["abs_diff"] for m in first] == pytest.approx(every[:6])
    assert first[0]["id"] == 90
    still = TopMovers(3)
    still.add("s", np.arange(3), np.ones(3), np.ones(3), {})
    assert still.rows() == []
