"""What a run does with the partition as it is (``PartitionCommit.decide``: reuse, replace or
conflict, contract §4), and the commit step's clock (one clock stamps a run, the commit's end
included)."""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timedelta, timezone

import pytest

from batchinfer.commands.remedies import error_line
from batchinfer.errors import Action, ContractError, SpecError
from batchinfer.io.commit import Identity, PartitionCommit, decide
from batchinfer.io.manifest import create_manifest
from batchinfer.io.outputs import write_json
from batchinfer.io.records import Challenger, FileRecord, Manifest, ShardRecord, ShardResult, Totals

TRIPLE = {"model_version": "m:1", "model_digest": "d1", "schema_version": "s@1", "preprocess_hash": "p1"}
V2 = ("v2", {**TRIPLE, "model_version": "m:2"}, {})
SHOWN = "out/dt=2026-01-15"


def _manifest(**changes) -> Manifest:
    shards = tuple(ShardRecord(path=f"data/part-{i}.parquet", sha256="abc", rows_in=1, rows_scored=1,
                               rows_quarantined=0, status="scored", reason=None) for i in range(2))
    manifest = Manifest(job="j", ds="2026-01-15", attempt="20260115T000000Z-00000001", triple=TRIPLE,
                        job_spec_sha256="h", runner="direct", device="cpu", started_at="t0",
                        finished_at="t1", mlflow_run_id=None, totals=Totals.of(shards), shards=shards,
                        challengers=(Challenger(name=V2[0], triple=V2[1], backend="onnx", device="cpu"),))
    return dataclasses.replace(manifest, **changes)


def _wanted(**changes) -> Identity:
    names = frozenset({"data/part-0.parquet", "data/part-1.parquet"})
    wanted = Identity(job="j", ds="2026-01-15", shards=names, shards_as_then=names, triple=TRIPLE,
                      model_options={}, challengers=(V2,))
    return dataclasses.replace(wanted, **changes)


def test_nothing_committed_is_a_replace_of_nothing():
    for overwrite in (False, True):
        decision = decide(None, _wanted(), overwrite=overwrite, shown=SHOWN)
        assert (decision.action, decision.manifest) == ("replace", None)


def test_the_same_partition_is_reused_and_overwrite_replaces_it():
    committed = _manifest()
    assert decide(committed, _wanted(), overwrite=False, shown=SHOWN).action == "reuse"
    # A challenger the partition has and this run does not ask for is no reason to refuse.
    assert decide(committed, _wanted(challengers=()), overwrite=False, shown=SHOWN).action == "reuse"
    replaced = decide(committed, _wanted(triple={**TRIPLE, "model_version": "m:9"}),
                      overwrite=True, shown=SHOWN)
    assert (replaced.action, replaced.manifest) == ("replace", committed)


def test_shards_named_as_before_secrets_were_masked_are_the_same_shards():
    committed = _manifest()
    masked = frozenset({"data/***/part-0.parquet", "data/***/part-1.parquet"})
    as_then = frozenset(s.path for s in committed.shards)
    assert decide(committed, _wanted(shards=masked, shards_as_then=as_then), overwrite=False,
                  shown=SHOWN).action == "reuse"


@pytest.mark.parametrize("wanted, message", [
    (_wanted(job="k"), f"{SHOWN} holds the partition of job 'j', ds '2026-01-15', not of job 'k', "
                       f"ds '2026-01-15': give each job and date its own output.path"),
    (_wanted(ds="2026-01-16"), "not of job 'j', ds '2026-01-16'"),
    (_wanted(shards=frozenset({"data/part-0.parquet", "data/part-2.parquet"}), shards_as_then=frozenset()),
     f"{SHOWN} was committed from other shards than input.path lists now (1 new, 1 no longer "
     f"listed; e.g. data/part-1.parquet): pass --update to score only the new and changed "
     f"shards, or --overwrite to score the partition as it is now"),
    (_wanted(triple={**TRIPLE, "model_digest": "d2"}),
     f"{SHOWN} is committed under another triple (model_digest committed d1 now d2): pass "
     f"--overwrite to replace it"),
    (_wanted(model_options={"precision": "bf16"}),
     f"{SHOWN} was committed with model.options {{}}, which change predictions; this run has "
     f"{{'precision': 'bf16'}}: pass --overwrite to replace it"),
    (_wanted(challengers=(V2, ("v3", TRIPLE, {}))),
     f"{SHOWN} was committed without challenger v3 as this run declares it (committed: v2;"),
    (_wanted(challengers=(("v2", V2[1], {"precision": "bf16"}),)),
     "was committed without challenger v2 as this run declares it"),
], ids=["job", "ds", "shards", "triple", "options", "challenger", "challenger-options"])
def test_another_partition_is_a_conflict_naming_why(wanted, message):
    committed = _manifest()
    decision = decide(committed, wanted, overwrite=False, shown=SHOWN)
    assert (decision.action, decision.manifest) == ("conflict", committed)
    assert isinstance(decision.refusal, ContractError) and decision.refusal.path == SHOWN
    said = error_line(decision.refusal)   # as the CLI prints it: the remedy as flags
    assert message in said, said
    assert [r.action for r in decision.refusal.remedies][-1] is Action.OVERWRITE
    assert "--" not in str(decision.refusal)   # below the CLI, the remedy is a value
    assert decide(committed, wanted, overwrite=True, shown=SHOWN).action == "replace"


def test_a_partition_committed_before_onnxruntime_declared_precision_is_the_same_partition():
    """Manifests written before onnxruntime declared ``precision`` record ``{}``: the partition
    ran at fp32, the value a declaration without it implies, so a nightly rerun is a no-op; another
    precision is another partition (champion and challenger alike)."""
    committed = _manifest(backend="onnxruntime", challengers=(
        Challenger(name=V2[0], triple=V2[1], backend="onnxruntime", device="cpu"),))
    fp32, int8 = {"precision": "fp32"}, {"precision": "int8"}
    same = _wanted(model_options=fp32, challengers=(("v2", V2[1], fp32),))
    assert decide(committed, same, overwrite=False, shown=SHOWN).action == "reuse"
    for other in (_wanted(model_options=int8, challengers=(("v2", V2[1], fp32),)),
                  _wanted(model_options=fp32, challengers=(("v2", V2[1], int8),))):
        assert decide(committed, other, overwrite=False, shown=SHOWN).action == "conflict"


def test_decide_reads_the_partition_and_refuses_a_file(tmp_path):
    out = tmp_path / "out"
    partition = PartitionCommit(str(out))
    assert partition.decide(_wanted(), overwrite=False, shown=SHOWN).action == "replace"
    committed = _manifest()
    assert create_manifest(partition.layout(committed.attempt), committed, replace=False)
    decision = partition.decide(_wanted(), overwrite=False, shown=SHOWN)
    assert (decision.action, decision.manifest) == ("reuse", committed)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SpecError, match="output.path f is a file; it must be a folder"):
        PartitionCommit(str(tmp_path / "file")).decide(_wanted(), overwrite=False, shown="f")


def test_the_commit_step_stamps_finished_at_with_the_runs_clock(tmp_path):
    """The clock given to the attempt travels in the commit plan to the commit step."""
    from batchinfer.clock import rfc3339
    from batchinfer.pipeline.commit_step import CommitPartition, CommitPlan
    from batchinfer.redaction import Deferred

    moments = iter([datetime(2026, 1, 15, 3, 4, 5, 678000, tzinfo=timezone(timedelta(hours=2)))])
    attempt = PartitionCommit(str(tmp_path / "out")).begin("20260115T010405Z-0000abcd",
                                                            clock=lambda: next(moments))
    record = ShardRecord(path="data/part-0.parquet", sha256="abc", rows_in=1, rows_scored=1,
                         rows_quarantined=0, status="scored", reason=None,
                         files=(FileRecord(f"predictions/{attempt.attempt}/part-00000-00000.parquet", 1, "x"),))
    write_json(attempt.layout.fs, attempt.layout.shard_result(0), ShardResult(record=record).to_dict())
    header = dataclasses.replace(_manifest(), attempt=attempt.attempt, finished_at="", shards=(),
                                 totals=Totals.of([]), challengers=())
    plan = CommitPlan(output_url=Deferred(str(tmp_path / "out")), attempt=attempt.attempt, replacing=None,
                      shard_count=1, header=header, breach=lambda rows, bad, unreadable: None,
                      clock=attempt.clock)
    assert list(CommitPartition(plan).process(0)) == ["committed"]
    committed = PartitionCommit(str(tmp_path / "out")).committed()
    assert committed is not None and committed.finished_at == "2026-01-15T01:04:05.678Z"
    assert committed.finished_at == rfc3339(datetime(2026, 1, 15, 1, 4, 5, 678000, tzinfo=timezone.utc))
    # its record holds the shards' results folded, not each of them (issue 34)
    written = json.loads(attempt.layout.fs.cat_file(attempt.layout.outcome))
    assert "results" not in written and written["summary"]["totals"] == committed.totals.to_dict()
    assert attempt.outcome(committed.triple).summary.totals == committed.totals
