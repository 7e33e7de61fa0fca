"""The typed records (io/records.py, pipeline/shard_reports.py): wide ones are keyword-only; their JSON
is generated from their fields (batchinfer/codec.py) with the keys in the files' order, and reads back,
validated against the same declaration (io/readback.py ``check``), to the same record."""
from __future__ import annotations

import json

import pytest

from batchinfer.errors import ContractError, StorageError
from batchinfer.io.manifest import manifest_bytes
from batchinfer.io.readback import check
from batchinfer.io.records import (
    Challenger,
    ChallengerShard,
    FileRecord,
    Manifest,
    ModelStats,
    PreprocessStats,
    ShardRecord,
    ShardResult,
    Totals,
)
from batchinfer.pipeline.shard_reports import BatchRecord, ChallengerBatchRecord

FILE = FileRecord("predictions/A/part-00000-00000.parquet", 8, "a" * 64)
SHARD = ShardRecord(path="s0", sha256="c" * 64, rows_in=10, rows_scored=8, rows_quarantined=2,
                    status="scored", reason="bad", files=(FILE,))
LOST = ShardRecord(path="s1", sha256=None, rows_in=None, rows_scored=0, rows_quarantined=0,
                   status="unreadable", reason="zero-byte file")
THEIRS = ChallengerShard(path="s0", rows_scored=7, rows_rejected=1, reason="raised", compute_ms=1.5,
                         files=(FileRecord("challengers/v2/A/part-00000-00000.parquet", 7, "e" * 64),))


def _manifest(challengers=()) -> Manifest:
    return Manifest(job="j", ds="2026-01-15", attempt="A", triple={"model_version": "m:1"},
                    job_spec_sha256="f" * 64, runner="direct", device="cpu", backend="onnxruntime",
                    model_options={"precision": "fp32"}, started_at="t0", finished_at="t1",
                    mlflow_run_id="r1", totals=Totals.of([SHARD, LOST]), shards=(SHARD, LOST),
                    challengers=challengers)


def _result() -> ShardResult:
    return ShardResult(record=SHARD, seconds={"read": 0.1},
                       model=ModelStats(rows=10, raised=1, error="boom", chunk_rows=500, warmup_ms=3.0),
                       profile={"f1": {"count": 3, "nulls": 0, "mean": 1.0, "m2": 0.5, "min": 0.0,
                                       "max": 2.0, "counts": [], "at_cuts": [], "at_min": 0}},
                       quarantine=(("f1", "type", 2), (None, "model", 1)), batches=((10, 2.5),),
                       challengers={"v2": THEIRS},
                       preprocess=PreprocessStats(10, {"KeyError": 2}, {"KeyError": "KeyError: 'x'"}, "tb"))


@pytest.mark.parametrize("record, given", [
    (ShardRecord, ("s", None, None, 0, 0, "empty", None)),
    (Totals, (0, 0, 0, 0, 0)),
    (ChallengerShard, ("s", 0, 0)),
    (Challenger, ("c", {})),
    (ModelStats, (1, 0, None)),
    (ShardResult, (LOST,)),
    (BatchRecord, (0, 1, 1, 0)),
    (ChallengerBatchRecord, ("c", 0, 1, 1, 0)),
])
def test_wide_records_take_keywords_only(record, given):
    with pytest.raises(TypeError):
        record(*given)


def test_the_manifest_keys_are_in_the_files_order():
    data = json.loads(manifest_bytes(_manifest((Challenger(name="v2", triple={"model_version": "c:1"},
                                                           shards=(THEIRS,)),))))
    assert list(data) == ["manifest_version", "job", "ds", "attempt", "triple", "job_spec_sha256",
                          "runner", "device", "backend", "model_options", "started_at",
                          "finished_at", "mlflow_run_id", "totals", "shards", "challengers"]
    assert list(data["shards"][0]) == ["path", "sha256", "rows_in", "rows_scored",
                                       "rows_quarantined", "status", "reason", "files", "scored_by"]
    assert list(data["shards"][0]["files"][0]) == ["path", "rows", "sha256"]
    assert list(data["challengers"][0]) == ["name", "triple", "backend", "device", "model_options",
                                            "rows_scored", "rows_rejected", "compute_ms", "shards"]
    assert list(data["totals"]) == ["shards", "rows_in", "rows_scored", "rows_quarantined",
                                    "shards_unreadable"]
    assert "challengers" not in json.loads(manifest_bytes(_manifest()))


@pytest.mark.parametrize("challengers", [(), (Challenger(name="v2", triple={"model_version": "c:1"},
                                                         backend="onnxruntime", device="cpu",
                                                         shards=(THEIRS,)),)])
def test_a_manifest_reads_back_through_its_schema_to_itself(challengers):
    manifest = _manifest(challengers)
    assert check(Manifest, manifest_bytes(manifest), "m", ContractError) == manifest
    assert Manifest.from_dict(json.loads(manifest_bytes(manifest))) == manifest


def test_a_shard_result_reads_back_through_its_schema_to_itself():
    result = _result()
    text = json.dumps(result.to_dict())
    assert check(ShardResult, text, "r", StorageError) == result
    assert ShardResult.from_dict(json.loads(text)) == result
    data = result.to_dict()
    assert data["quarantine"] == [["f1", "type", 2], [None, "model", 1]]   # lists, as JSON has them
    assert data["model"] == {"rows": 10, "raised": 1, "error": "boom", "oom_backoffs": 0,
                             "chunk_rows": 500, "warmup_ms": 3.0, "tokens": 0, "padded_tokens": 0}


def test_missing_keys_take_the_records_defaults_and_numbers_their_types():
    result = ShardResult.from_dict({"record": LOST.to_dict(), "batches": [[3, 2]],
                                    "challengers": {"v2": {"path": "s1", "rows_scored": 0,
                                                           "rows_rejected": 0, "compute_ms": 4}}})
    assert result == ShardResult(record=LOST, batches=((3, 2.0),), challengers={
        "v2": ChallengerShard(path="s1", rows_scored=0, rows_rejected=0, compute_ms=4.0)})
    assert isinstance(result.batches[0][1], float)
    assert isinstance(result.challengers["v2"].compute_ms, float)
    # a manifest without totals: counted from its shards
    data = _manifest().to_dict()
    del data["totals"]
    assert Manifest.from_dict(data).totals == Totals.of([SHARD, LOST])
