"""Resume (contract §5.3 "Resume", io/resume.py) and the cleanup around it (io/manifest.py), on
scratch records and files made by hand: which finished shards a run adopts, which it scores
again, and that no cleanup deletes a file the committed manifest lists. The whole thing, killed
at every fault point, is tests/faults/test_crash.py."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from batchinfer.io.commit import PartitionCommit
from batchinfer.io.manifest import clean_after_commit
from batchinfer.io.outputs import Layout
from batchinfer.io.records import (
    AttemptKey,
    Challenger,
    ChallengerShard,
    FileRecord,
    Manifest,
    ShardRecord,
    ShardResult,
    Totals,
)
from batchinfer.io.resume import find

OLD, NEW, OTHER = "20260101T000000Z-0000000a", "20260101T010000Z-0000000b", "20260101T020000Z-0000000c"
KEY = AttemptKey(job="j", ds="2026-01-01", job_spec_sha256="s" * 64, triple={"model_version": "m:1"},
                 challengers=(Challenger(name="c", triple={"model_version": "c:1"}),))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def crashed(tmp_path: Path):
    """Two input shards and an attempt (OLD, with KEY) that finished both: shard 0 with a
    prediction file and a challenger file, shard 1 unreadable; its debris (an unlisted file)."""
    inputs = []
    for i in range(3):
        inputs.append(tmp_path / "in" / f"part-{i}.parquet")
        inputs[-1].parent.mkdir(exist_ok=True)
        inputs[-1].write_bytes(f"shard {i}".encode())
    out = tmp_path / "out"
    scratch = out / "_tmp" / OLD
    (scratch / "shards").mkdir(parents=True)
    (scratch / "attempt.json").write_text(json.dumps(KEY.to_dict()))
    files = {"predictions": f"predictions/{OLD}/part-00000-00000.parquet",
             "challenger": f"challengers/c/{OLD}/part-00000-00000.parquet"}
    for name, rel in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(name.encode())
    (out / f"predictions/{OLD}/part-00002-00000.parquet").write_bytes(b"half a file")
    results = [
        ShardResult(record=ShardRecord(path=str(inputs[0]), sha256=sha(b"shard 0"), rows_in=1,
                                       rows_scored=1, rows_quarantined=0, status="scored", reason=None,
                                       files=(FileRecord(files["predictions"], 1, sha(b"predictions")),),
                                       scored_by=OLD),
                    challengers={"c": ChallengerShard(path=str(inputs[0]), rows_scored=1, rows_rejected=0,
                                                      files=(FileRecord(files["challenger"], 1,
                                                                        sha(b"challenger")),))}),
        ShardResult(record=ShardRecord(path=str(inputs[1]), sha256=sha(b"shard 1"), rows_in=None,
                                       rows_scored=0, rows_quarantined=0, status="unreadable",
                                       reason="not Parquet", scored_by=OLD)),
    ]
    for i, result in enumerate(results):
        (scratch / "shards" / f"{i:05d}.json").write_text(json.dumps(result.to_dict()))
    shards = [(str(p), str(p)) for p in inputs]
    return out, inputs, shards, files


def test_a_finished_shard_is_adopted_an_unreadable_one_is_read_again(crashed):
    out, _, shards, files = crashed
    resume = find(str(out), KEY, shards)
    assert set(resume.adopted) == {0} and resume.adopted[0].record.scored_by == OLD
    assert not resume.changed and not resume.damaged
    assert "reusing 1 of 3 shards (1 rows)" in resume.summary(3)
    assert find(str(out), KEY, shards, exclude=OLD).adopted == {}


def _split(out: Path) -> Path:
    """Shard 0's result as the writers leave it now: the champion's, with its model's rows, and
    the challenger's part beside it (io/outputs.py ``Layout.challenger_result``)."""
    scratch = out / "_tmp" / OLD
    path = scratch / "shards" / "00000.json"
    result = ShardResult.from_dict(json.loads(path.read_text()))
    part = result.challengers["c"]
    path.write_text(json.dumps(dataclasses.replace(
        result, challengers={}, model=dataclasses.replace(result.model, rows=1)).to_dict()))
    (scratch / "challengers" / "c").mkdir(parents=True)
    (scratch / "challengers" / "c" / "00000.json").write_text(json.dumps(part.to_dict()))
    return scratch / "challengers" / "c" / "00000.json"


def test_a_shard_is_adopted_with_each_challengers_part_and_not_without(crashed):
    out, _, shards, files = crashed
    part = _split(out)
    [(index, adopted)] = find(str(out), KEY, shards).adopted.items()
    assert index == 0 and adopted.challengers["c"].files[0].path == files["challenger"]
    # A part that does not account for the rows the champion's model was given is not one.
    text = part.read_text()
    part.write_text(text.replace('"rows_rejected": 0', '"rows_rejected": 1'))
    assert find(str(out), KEY, shards).adopted == {}
    part.unlink()   # the challenger had not written the shard's last batch yet
    resume = find(str(out), KEY, shards)
    assert resume.adopted == {} and not resume.damaged and not resume.changed


@pytest.mark.parametrize("change", [
    {"job_spec_sha256": "t" * 64}, {"triple": {"model_version": "m:2"}},
    {"model_options": {"precision": "bf16"}}, {"ds": "2026-01-02"},
    {"challengers": ()}, {"challengers": (Challenger(name="c", triple={"model_version": "c:2"}),)},
])
def test_another_key_adopts_nothing(crashed, change):
    out, _, shards, _ = crashed
    assert find(str(out), dataclasses.replace(KEY, **change), shards).adopted == {}


def test_a_shard_rewritten_since_is_scored_again(crashed):
    out, inputs, shards, _ = crashed
    inputs[0].write_bytes(b"shard 0, rewritten")
    resume = find(str(out), KEY, shards)
    assert resume.adopted == {} and resume.changed == (str(inputs[0]),)


@pytest.mark.parametrize("which", ["predictions", "challenger"])
def test_a_finished_shard_whose_file_changed_or_went_is_scored_again(crashed, which):
    out, inputs, shards, files = crashed
    (out / files[which]).write_bytes(b"other bytes")
    assert find(str(out), KEY, shards).damaged == (str(inputs[0]),)
    (out / files[which]).unlink()
    resume = find(str(out), KEY, shards)
    assert resume.adopted == {} and resume.damaged == (str(inputs[0]),)


def _manifest(attempt: str, shard: ShardRecord, challenger_files=()) -> Manifest:
    return Manifest(job="j", ds="2026-01-01", attempt=attempt, triple={}, job_spec_sha256="",
                    runner="direct", device="cpu", started_at="", finished_at="", mlflow_run_id=None,
                    totals=Totals.of([shard]), shards=(shard,),
                    challengers=(Challenger(name="c", triple={}, shards=(ChallengerShard(
                        path=shard.path, rows_scored=1, rows_rejected=0, files=challenger_files),)),))


def test_cleanup_keeps_every_listed_file_in_an_earlier_attempts_folder(crashed):
    out, inputs, shards, files = crashed
    adopted = find(str(out), KEY, shards).adopted[0]
    other = out / "predictions" / OTHER / "part-00000-00000.parquet"   # a third attempt's debris
    other.parent.mkdir(parents=True)
    other.write_bytes(b"x")
    manifest = _manifest(NEW, adopted.record, adopted.challengers["c"].files)
    clean_after_commit(Layout(PartitionCommit(str(out)).layout(NEW).fs, str(out), NEW), manifest)
    present = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert present == manifest.files() == set(files.values())
    assert not (out / "_tmp").exists()


def test_a_loser_keeps_its_files_that_the_winner_adopted(crashed):
    """A run (NEW) adopted OLD's finished shard and committed; OLD was not dead but losing: its
    abort removes only what the winner's manifest does not list."""
    out, _, shards, files = crashed
    adopted = find(str(out), KEY, shards).adopted[0]
    manifest = _manifest(NEW, adopted.record, adopted.challengers["c"].files)
    (out / "_manifest.json").write_text(json.dumps(manifest.to_dict()))
    PartitionCommit(str(out)).begin(OLD).abort()
    present = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert present == {"_manifest.json", *files.values()}


def test_the_commit_step_finds_adopted_files_removed_since(crashed):
    """What the commit step checks before it commits a manifest listing adopted files
    (pipeline/commit_step.py): one listing per folder."""
    out, _, _, files = crashed
    attempt = PartitionCommit(str(out)).begin(NEW)
    assert attempt.missing(set(files.values())) == []
    (out / files["challenger"]).unlink()
    assert attempt.missing(set(files.values())) == [files["challenger"]]
    assert attempt.missing({f"quarantine/{OLD}/part-00000-00000.parquet"}) == [
        f"quarantine/{OLD}/part-00000-00000.parquet"]
