"""A writer's open shards (pipeline/writer/finished.py): a shard's result comes out with the
record of its last batch to be written — whatever order its batches were written in — and
never before every batch is in (issue 34: no GroupByKey between a shard's files and its result)."""
from __future__ import annotations

import itertools

import pytest

from batchinfer.io.records import ChallengerShard, FileRecord, ModelStats, ShardResult
from batchinfer.pipeline.shard_reports import BatchRecord, ChallengerBatchRecord, ShardInfo
from batchinfer.pipeline.writer.finished import OpenShards
from batchinfer.pipeline.writer.policy import WritePolicy

ATTEMPT = "20260101T000000Z-0000000a"
INFO = ShardInfo("abc", 10, None, {"read": 0.5})


def _batch(number: int, rows: int) -> BatchRecord:
    return BatchRecord(batch=number, rows_in=rows, rows_scored=rows, rows_quarantined=0,
                       files=(FileRecord(f"p/{number}", rows, "h"),), model=ModelStats(rows=rows),
                       compute_ms=1.0)


def _challenger(number: int, rows: int) -> ChallengerBatchRecord:
    return ChallengerBatchRecord(name="c", batch=number, rows_in=rows, rows_scored=rows,
                                 rows_rejected=0, compute_ms=2.0)


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_the_shard_finishes_with_its_last_batch_written_in_any_order(order):
    shards = OpenShards(WritePolicy.champion(), ("s0", "s1"), ATTEMPT)
    rows = {0: 4, 1: 4, 2: 2}
    out = []
    for k, number in enumerate(order):
        info = INFO if number == 2 else None          # the last batch carries the shard's info
        assert shards.finishes(1, number, info) == (k == 2)
        out.append(shards.add(1, number, _batch(number, rows[number]), info))
    assert out[:2] == [None, None] and isinstance(out[2], ShardResult)
    result = out[2]
    assert result.record.path == "s1" and result.record.scored_by == ATTEMPT
    assert result.record.rows_in == 10 and result.record.sha256 == "abc"
    assert [f.path for f in result.record.files] == ["p/0", "p/1", "p/2"]   # in batch order
    assert result.seconds["read"] == 0.5
    assert len(shards) == 0


def test_two_shards_open_at_once_finish_apart():
    shards = OpenShards(WritePolicy.champion(), ("s0", "s1"), ATTEMPT)
    assert shards.add(0, 0, _batch(0, 6), None) is None
    assert shards.add(1, 0, _batch(0, 10), INFO) is not None        # one batch: at once
    assert len(shards) == 1
    assert shards.add(0, 1, _batch(1, 4), INFO) is not None


def test_a_challengers_part_accounts_for_its_batches():
    shards = OpenShards(WritePolicy.challenger("c"), ("s0",), ATTEMPT)
    assert shards.add(0, 1, _challenger(1, 4), INFO) is None        # batch 0 not written yet
    part = shards.add(0, 0, _challenger(0, 6), None)
    assert isinstance(part, ChallengerShard)
    assert (part.rows_scored, part.rows_rejected, part.compute_ms) == (10, 0, 4.0)


def test_the_commit_joins_a_part_only_if_it_accounts_for_the_champions_rows():
    champion = OpenShards(WritePolicy.champion(), ("s0",), ATTEMPT).add(0, 0, _batch(0, 10), INFO)
    assert isinstance(champion, ShardResult) and champion.scored_rows
    good = ChallengerShard(path="s0", rows_scored=9, rows_rejected=1)
    assert champion.joined({"c": good}).challengers == {"c": good}
    with pytest.raises(RuntimeError, match="accounting failed for challenger c on shard s0"):
        champion.joined({"c": ChallengerShard(path="s0", rows_scored=9, rows_rejected=0)})


def test_the_next_batch_is_decoded_on_the_pool_while_the_caller_holds_this_one():
    """``decoded_ahead``: batch k+1 is being read (on the pool's thread) before the caller is
    done with batch k; what the reader raises comes where its batch would have; a caller that
    stops early leaves no read running."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa

    from batchinfer.io.shards import Unreadable, decoded_ahead

    log: list[tuple[str, int, str]] = []
    reading = threading.Event()

    def reader(fail_at=None):
        for k in range(3):
            log.append(("read", k, threading.current_thread().name))
            if k == fail_at:
                raise Unreadable("corrupt Parquet data")
            if k == 1:
                reading.set()
            yield pa.record_batch({"x": [k]})

    with ThreadPoolExecutor(1, thread_name_prefix="decode") as pool:
        got = []
        for batch, seconds in decoded_ahead(reader(), pool):
            if batch.column(0)[0].as_py() == 0:
                assert reading.wait(5)           # batch 1 read while batch 0 is still ours
            got.append(batch.column(0)[0].as_py())
            assert seconds >= 0
        assert got == [0, 1, 2]
        assert {name for _, _, name in log} == {"decode_0"}
        seen = []
        with pytest.raises(Unreadable):
            for batch, _ in decoded_ahead(reader(fail_at=2), pool):
                seen.append(batch.column(0)[0].as_py())
        assert seen == [0, 1]                    # the error where batch 2 would have come
        log.clear()
        ahead = decoded_ahead(reader(), pool)
        next(ahead)
        ahead.close()                            # stops early: waits for the read in flight
        assert [k for _, k, _ in log] == [0, 1]
