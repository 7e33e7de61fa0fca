"""What ``run --update`` keeps, scores and drops (``io/update.py``, contract §5.3 "Update"), what
``decide`` says with ``update``, and the checked replace of a manifest that two updates race for."""
from __future__ import annotations

import dataclasses

import pytest

from batchinfer.commands.remedies import error_line
from batchinfer.errors import Action, Remedy
from batchinfer.io.commit import Identity, PartitionCommit, decide
from batchinfer.io.manifest import create_manifest
from batchinfer.io.records import (
    Challenger,
    ChallengerShard,
    FileRecord,
    Manifest,
    ShardRecord,
    Totals,
)
from batchinfer.io.update import current_digests, plan_update

TRIPLE = {"model_version": "m:1", "model_digest": "d1", "schema_version": "s@1", "preprocess_hash": "p1"}
OLD, EARLIER = "20260115T000000Z-00000001", "20260114T000000Z-0000000e"
SHOWN = "out/dt=2026-01-15"


def _shard(name: str, sha: str | None = None, scored_by: str | None = None, rows: int = 10) -> ShardRecord:
    return ShardRecord(path=name, sha256=sha or f"sha-{name}", rows_in=rows, rows_scored=rows,
                       rows_quarantined=0, status="scored", reason=None, scored_by=scored_by,
                       files=(FileRecord(f"predictions/{scored_by or OLD}/part-{name}.parquet", rows, "f"),))


def _manifest(*shards: ShardRecord, challengers: tuple[str, ...] = ("v2",)) -> Manifest:
    return Manifest(job="j", ds="2026-01-15", attempt=OLD, triple=TRIPLE, job_spec_sha256="spec",
                    runner="direct", device="cpu", started_at="t0", finished_at="t1",
                    mlflow_run_id=None, totals=Totals.of(shards), shards=shards,
                    challengers=tuple(Challenger(name=n, triple=TRIPLE, backend="onnxruntime", device="cpu",
                                                 shards=tuple(ChallengerShard(path=s.path, rows_scored=1,
                                                                              rows_rejected=0) for s in shards))
                                      for n in challengers))


def _plan(committed: Manifest, listed, **changes):
    args = {"job_spec_sha256": "spec", "challengers": ["v2"], "shown": SHOWN, **changes}
    return plan_update(committed, listed, **args)


def test_keeps_the_unchanged_scores_the_new_and_rewritten_drops_the_removed():
    committed = _manifest(_shard("a"), _shard("b"), _shard("c", scored_by=EARLIER))
    update = _plan(committed, [("a", "sha-a"), ("b", "other"), ("d", "sha-d"), ("c", "sha-c")])
    assert not update.unchanged and update.refusal is None
    assert sorted(update.kept) == [0, 3]   # by index as listed now
    assert (update.added, update.rewritten, update.removed) == (("d",), ("b",), ())
    # Kept entries are the committed ones, their files where they are, scored_by filled in
    # (a manifest without it: its own attempt; one a resume adopted: the attempt that scored it).
    a, c = update.kept[0].record, update.kept[3].record
    assert (a.scored_by, a.files) == (OLD, committed.shards[0].files)
    assert (c.scored_by, c.files) == (EARLIER, committed.shards[2].files)
    assert update.kept[0].challengers == {"v2": committed.challengers[0].shards[0]}
    assert update.rows_kept == 20
    assert update.summary(4).startswith(
        f"updating: keeping 2 of 4 shards (20 rows) scored by attempt(s) {EARLIER}, {OLD}; scoring 2 "
        f"(1 new, 1 rewritten); dropping 0 no longer listed")


def test_a_removed_shard_is_dropped_and_unreadable_bytes_count_as_rewritten():
    committed = _manifest(_shard("a"), _shard("b"), _shard("c"))
    update = _plan(committed, [("a", None), ("c", "sha-c")])
    assert (sorted(update.kept), update.rewritten, update.removed, update.added) == ([1], ("a",), ("b",), ())


def test_the_same_shards_with_the_same_bytes_are_unchanged_whatever_the_spec():
    committed = _manifest(_shard("a"), _shard("b"))
    update = _plan(committed, [("a", "sha-a"), ("b", "sha-b")], job_spec_sha256="another")
    assert update.unchanged and update.refusal is None and sorted(update.kept) == [0, 1]


@pytest.mark.parametrize("listed", [[("a", "sha-a"), ("b", "sha-b"), ("d", "sha-d")],
                                    [("a", "sha-a"), ("b", "new")], [("a", "sha-a")]],
                         ids=["added", "rewritten", "removed"])
def test_changed_shards_under_another_spec_are_refused(listed):
    update = _plan(_manifest(_shard("a"), _shard("b")), listed, job_spec_sha256="another")
    assert update.refusal is not None
    said = error_line(update.refusal)
    assert said.startswith(f"{SHOWN} was committed from another job spec (sha256 spec…")
    assert "pass --overwrite to score the partition again" in said
    assert update.refusal.remedies == (Remedy(Action.OVERWRITE, "to score the partition again"),)


def test_challengers_the_run_does_not_declare_are_dropped():
    committed = _manifest(_shard("a"), challengers=("v2", "adhoc"))
    update = _plan(committed, [("a", "sha-a"), ("b", "sha-b")])
    assert update.dropped_challengers == ("adhoc",)
    assert set(update.kept[0].challengers) == {"v2"}
    assert "challenger(s) adhoc not declared: dropped" in update.summary(2)


def test_shards_named_as_before_secrets_were_masked_are_matched():
    committed = _manifest(_shard("data/secret/a"))
    update = _plan(committed, [("data/***/a", "sha-data/secret/a")], as_then=["data/secret/a"])
    assert update.unchanged and update.kept[0].record.path == "data/secret/a"


def _wanted(**changes) -> Identity:
    names = frozenset({"a", "b", "d"})
    wanted = Identity(job="j", ds="2026-01-15", shards=names, shards_as_then=names, triple=TRIPLE,
                      model_options={}, challengers=(("v2", TRIPLE, {}),))
    return dataclasses.replace(wanted, **changes)


def test_decide_with_update_takes_another_set_of_shards_and_nothing_else():
    committed = _manifest(_shard("a"), _shard("b"))
    assert decide(committed, _wanted(), overwrite=False, shown=SHOWN).action == "conflict"
    assert decide(committed, _wanted(), overwrite=False, shown=SHOWN, update=True).action == "update"
    assert decide(None, _wanted(), overwrite=False, shown=SHOWN, update=True).action == "replace"
    for other in (_wanted(triple={**TRIPLE, "model_digest": "d2"}), _wanted(job="k"),
                  _wanted(model_options={"precision": "bf16"}),
                  _wanted(challengers=(("v3", TRIPLE, {}),))):
        decision = decide(committed, other, overwrite=False, shown=SHOWN, update=True)
        assert decision.action == "conflict" and decision.refusal is not None \
            and "--overwrite" in error_line(decision.refusal)


def test_current_digests_hash_the_bytes_and_say_none_for_a_missing_shard(tmp_path):
    import hashlib

    (tmp_path / "a").write_bytes(b"abc")
    assert current_digests([str(tmp_path / "a"), str(tmp_path / "gone")]) == [
        hashlib.sha256(b"abc").hexdigest(), None]


def test_a_replace_checks_the_manifest_is_still_the_one_it_replaces(tmp_path):
    """Two updates of one manifest: the first replaces it; the second, which set out to replace
    the same one, finds another there and loses (False), the winner's manifest untouched."""
    partition = PartitionCommit(str(tmp_path / "out"))
    first = _manifest(_shard("a"))
    assert create_manifest(partition.layout(OLD), first)
    winner = dataclasses.replace(first, attempt="20260116T000000Z-000000aa")
    loser = dataclasses.replace(first, attempt="20260116T000000Z-000000bb")
    assert create_manifest(partition.layout(winner.attempt), winner, replace=True, expected=OLD)
    assert not create_manifest(partition.layout(loser.attempt), loser, replace=True, expected=OLD)
    assert partition.committed() == winner
    assert not (tmp_path / "out" / "_tmp" / loser.attempt / "_manifest.json").exists()
