"""Every file batchinfer reads back is checked at the edge (batchinfer/io/readback.py): fed
mutated JSON — keys dropped, values of the wrong type, NaN and infinities, lists for objects —
each reader either reads it or raises the one-line BatchInferError of its file kind, never
another exception; and what it did read can be used (reported, compared) without one.

| reader | file | error |
| ``read_manifest`` (run, inspect, diff, report, profile) | ``_manifest.json`` | ContractError (3) |
| ``Attempt.results`` / ``Attempt.outcome`` | scratch in ``_tmp/`` | StorageError (5) |
| ``read_profile`` (monitor.baseline, stamp --baseline) | a baseline | SpecError (2) |
| ``rebuild_report`` (report) | ``_profile.json``, ``_metrics.json`` | SpecError (2) |
| ``upload_tracking`` (track) | ``_metrics.json`` | SpecError (2) |
"""
from __future__ import annotations

import copy
import json
import math
import uuid
from typing import Any
from unittest import mock

import fsspec
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from batchinfer.app.drift_baseline import read_profile
from batchinfer.app.job_report import rebuild_report, render_report
from batchinfer.app.run_record import health_metrics
from batchinfer.commands.inspect import upload_tracking
from batchinfer.errors import BatchInferError, ContractError, SpecError, StorageError
from batchinfer.io.commit import CommitOutcome, PartitionCommit
from batchinfer.io.manifest import manifest_bytes, read_manifest
from batchinfer.io.outputs import MANIFEST, METRICS, PROFILE
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
    fold,
)
from batchinfer.rows.column_profiles import ColumnStats, baseline_column, drift, run_column
from batchinfer.rows.drift import run_columns

ATTEMPT = "20260115T010203Z-0000000a"
TRIPLE = {"model_version": "m:1", "model_digest": "d" * 64, "schema_version": "s@1",
          "preprocess_hash": "p" * 64}
RNG = np.random.default_rng(0)
VALUES = {"f0": RNG.standard_normal(500), "term": RNG.choice([36.0, 60.0], 500),
          "y": RNG.uniform(size=500)}
BASELINE = {name: baseline_column("prediction" if name == "y" else "feature", v)
            for name, v in VALUES.items()}


def _manifest() -> Manifest:
    files = (FileRecord(f"predictions/{ATTEMPT}/part-00000-00000.parquet", 8, "a" * 64),
             FileRecord(f"quarantine/{ATTEMPT}/part-00000-00000.parquet", 2, "b" * 64))
    shards = (ShardRecord(path="data/part-0.parquet", sha256="c" * 64, rows_in=10, rows_scored=8,
                          rows_quarantined=2, status="scored", reason="bad f1", files=files),
              ShardRecord(path="data/part-1.parquet", sha256=None, rows_in=None, rows_scored=0,
                          rows_quarantined=0, status="unreadable", reason="zero-byte file"))
    challenger = Challenger(name="v2", triple=TRIPLE, backend="onnxruntime", device="cpu",
                            model_options={"precision": "fp32"},
                            shards=(ChallengerShard(
                                path="data/part-0.parquet", rows_scored=7, rows_rejected=1,
                                reason="raised", compute_ms=1.5,
                                files=(FileRecord(f"challengers/v2/{ATTEMPT}/part-00000-00000.parquet",
                                                  7, "e" * 64),)),))
    return Manifest(job="j", ds="2026-01-15", attempt=ATTEMPT, triple=TRIPLE, job_spec_sha256="f" * 64,
                    runner="direct", device="cpu", started_at="2026-01-15T01:02:03.000Z",
                    finished_at="2026-01-15T01:02:04.000Z", mlflow_run_id=None,
                    totals=Totals.of(shards), shards=shards, backend="onnxruntime",
                    challengers=(challenger,))


def _shard_result() -> ShardResult:
    manifest = _manifest()
    profile = {name: ColumnStats.of(v[:100], BASELINE[name].cuts).to_dict() for name, v in VALUES.items()}
    return ShardResult(record=manifest.shards[0], seconds={"read": 0.1, "infer": 0.2},
                       model=ModelStats(rows=10, raised=1, error="boom", oom_backoffs=0,
                                        chunk_rows=500, warmup_ms=3.0, tokens=0, padded_tokens=0),
                       profile=profile,
                       quarantine=(("f1", "in_range(-10, 10)", 2), (None, "not_nullable", 1)),
                       batches=((8, 1.5), (2, 0.5)),
                       challengers={"v2": manifest.challengers[0].shards[0]},
                       preprocess=PreprocessStats(10, {"KeyError": 2}, {"KeyError": "KeyError: 'income'"},
                                                  "Traceback (most recent call last): …"))


def _baseline() -> dict:
    return {"profile_version": 1, "job": "j", "ds": "2026-01-15", "rows": 500,
            "columns": {name: col.to_dict() for name, col in BASELINE.items()}}


def _run_profile() -> dict:
    stats = {name: ColumnStats.of(v + 0.5, BASELINE[name].cuts) for name, v in VALUES.items()}
    found = drift(BASELINE, stats, {"psi": 0.1, "ks": None}, {"psi": 0.25, "ks": None})
    return {"profile_version": 1, "job": "j", "ds": "2026-01-15",
            "quarantine": [["f1", "in_range(-10, 10)", 2], [None, "not_nullable", 1]],
            "level": "fail", "baseline": {"path": "b.json", "ds": "2026-01-14",
                                          "columns": _baseline()["columns"]},
            "limits": {"warn": {"psi": 0.1, "ks": None}, "fail": {"psi": 0.25, "ks": None}},
            "drift": [d.to_dict() for d in found],
            "columns": {name: run_column(BASELINE[name].kind, s, BASELINE[name].cuts).to_dict()
                        for name, s in stats.items()}}


def _metrics() -> dict:
    return {"mlflow_run_id": None, "uploaded": False, "error": "down", "tracking_uri": "sqlite:///x.db",
            "experiment": "j", "run_name": "j-2026-01-15", "params": {"job": "j", "ds": "2026-01-15"},
            "metrics": {"rows_in": 10.0, "stage_seconds_read": 0.1, "model_latency_ms_p95": math.nan},
            "tags": {"batchinfer.drift": "ok"}}


# -- mutations of a JSON document ---------------------------------------------------------------

ODD = [None, "x", "", -1, 0, 1.5, -0.5, True, False, 10**30, math.nan, math.inf, -math.inf, [],
       {}, [1, "a"], {"a": 1}, [None], {"": None}]


@st.composite
def mutated(draw, document: Any) -> Any:
    """``document`` with one to three of its values (at any depth) dropped or replaced."""
    doc = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, 3))):
        parent, key = None, None
        node = doc
        while isinstance(node, (dict, list)) and node and draw(st.booleans()):
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            key = draw(st.sampled_from(keys))
            parent, node = node, node[key]
        how = draw(st.sampled_from(["drop", "replace", "replace", "as_list", "as_dict"]))
        odd = copy.deepcopy(draw(st.sampled_from(ODD)))
        if parent is None:  # the whole document
            doc = odd if how == "replace" else [doc]
            continue
        if how == "drop" and isinstance(parent, dict):
            del parent[key]
        elif how == "as_list" and isinstance(node, dict):
            parent[key] = list(node.values())
        elif how == "as_dict" and isinstance(node, list):
            parent[key] = {str(i): v for i, v in enumerate(node)}
        else:
            parent[key] = odd
    return doc


def _text(document: Any) -> str:
    return json.dumps(document)   # NaN and Infinity as Python writes them


def _root() -> tuple[Any, str]:
    root = f"memory://readback-{uuid.uuid4().hex}"
    return fsspec.filesystem("memory"), root[len("memory://"):]


def _reads(call, error: type[BatchInferError]):
    """``call()``'s result, None when it raised ``error`` with a one-line message."""
    try:
        found = call()
    except BatchInferError as exc:
        assert isinstance(exc, error), (type(exc), exc.message)
        assert exc.message and "\n" not in exc.message
        event(f"refused: {type(exc).__name__}")
        return None
    event("read")
    return found


EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_the_unmutated_documents_read():
    fs, root = _root()
    fs.pipe_file(f"{root}/{MANIFEST}", manifest_bytes(_manifest()))
    assert read_manifest(fs, root) == _manifest()
    fs.pipe_file(f"{root}/b.json", _text(_baseline()).encode())
    assert read_profile(f"memory://{root}/b.json", "b.json").columns["term"].cuts == BASELINE["term"].cuts
    fs.pipe_file(f"{root}/{PROFILE}", _text(_run_profile()).encode())
    fs.pipe_file(f"{root}/{METRICS}", _text(_metrics()).encode())
    assert "Drift against the baseline" in fs.cat_file(rebuild_report(f"memory://{root}")).decode()


@given(mutated(json.loads(manifest_bytes(_manifest()))))
@EXAMPLES
def test_manifest_reader(document):
    fs, root = _root()
    fs.pipe_file(f"{root}/{MANIFEST}", _text(document).encode())
    manifest = _reads(lambda: read_manifest(fs, root), ContractError)
    if manifest is not None:
        manifest.to_dict(), manifest.files()
        render_report(manifest, {}, {})


@given(mutated(_shard_result().to_dict()))
@EXAMPLES
def test_shard_result_reader(document):
    fs, root = _root()
    attempt = PartitionCommit(f"memory://{root}").begin(ATTEMPT)
    fs.pipe_file(attempt.layout.shard_result(0), _text(document).encode())
    results = _reads(lambda: attempt.results(1), StorageError)
    if results is not None:
        run_columns([r.profile for r in results], ["f0", "term"], {})
        health_metrics(fold(results), None)
        Totals.of([r.record for r in results])


def test_scratch_records_read_back_whole():
    """What a shard and the commit step leave in scratch is read back with every field: the
    schema at the edge checks them, and must not drop one it does not know (the preprocessing's
    statistics were dropped once, and with them the preprocessing-fault rule)."""
    fs, root = _root()
    attempt = PartitionCommit(f"memory://{root}").begin(ATTEMPT)
    result = _shard_result()
    fs.pipe_file(attempt.layout.shard_result(0), json.dumps(result.to_dict()).encode())
    assert attempt.results(1) == [result]
    outcome = CommitOutcome("refused", _manifest(), 4, "too many", fold([result]))
    attempt.record(outcome)
    assert attempt.outcome(TRIPLE) == outcome
    # as an outcome written before the fold had them: every shard's result, folded on read
    older = {**outcome.to_dict(), "results": [result.to_dict()]}
    del older["summary"]
    fs.pipe_file(attempt.layout.outcome, json.dumps(older).encode())
    assert attempt.outcome(TRIPLE) == outcome


@given(mutated(CommitOutcome("refused", _manifest(), 4, "too many", fold([_shard_result()])).to_dict()))
@EXAMPLES
def test_outcome_reader(document):
    fs, root = _root()
    attempt = PartitionCommit(f"memory://{root}").begin(ATTEMPT)
    fs.pipe_file(attempt.layout.outcome, _text(document).encode())
    _reads(lambda: attempt.outcome(TRIPLE), StorageError)


def _older_outcome() -> dict:
    """An outcome as written before the commit step folded its shards' results: every result."""
    older = CommitOutcome("refused", _manifest(), 4, "too many").to_dict()
    del older["summary"]
    return {**older, "results": [_shard_result().to_dict(), _shard_result().to_dict()]}


@given(mutated(_older_outcome()))
@EXAMPLES
def test_older_outcome_reader(document):
    fs, root = _root()
    attempt = PartitionCommit(f"memory://{root}").begin(ATTEMPT)
    fs.pipe_file(attempt.layout.outcome, _text(document).encode())
    outcome = _reads(lambda: attempt.outcome(TRIPLE), StorageError)
    if outcome is not None and outcome.summary is not None:
        health_metrics(outcome.summary, None)


@given(mutated(_baseline()))
@EXAMPLES
def test_baseline_reader(document):
    fs, root = _root()
    fs.pipe_file(f"{root}/b.json", _text(document).encode())
    baseline = _reads(lambda: read_profile(f"memory://{root}/b.json", "b.json"), SpecError)
    if baseline is None:
        return
    fitted = _reads(lambda: baseline.for_run(["f0", "term", "y"]), SpecError)
    if fitted is None:
        return
    current = {name: ColumnStats.of(VALUES[name] * 2, col.cuts) for name, col in fitted.columns.items()}
    for d in drift(fitted.columns, current, {"psi": 0.1}, {"psi": 0.25}):
        d.to_dict()
    for name, col in fitted.columns.items():
        run_column(col.kind, current[name], col.cuts)


@given(mutated(_run_profile()), mutated(_metrics()))
@EXAMPLES
def test_report_readers(profile, record):
    fs, root = _root()
    fs.pipe_file(f"{root}/{MANIFEST}", manifest_bytes(_manifest()))
    fs.pipe_file(f"{root}/{PROFILE}", _text(profile).encode())
    fs.pipe_file(f"{root}/{METRICS}", _text(record).encode())
    _reads(lambda: rebuild_report(f"memory://{root}"), SpecError)


def test_a_drift_entry_without_its_optional_breached_list_still_renders():
    """Found by test_report_readers: ``breached`` may be absent (the reader defaults it), and
    the report, which shows the record as the run wrote it, raised KeyError."""
    profile = _run_profile()
    for entry in profile["drift"]:
        del entry["breached"]
    fs, root = _root()
    fs.pipe_file(f"{root}/{MANIFEST}", manifest_bytes(_manifest()))
    fs.pipe_file(f"{root}/{PROFILE}", _text(profile).encode())
    fs.pipe_file(f"{root}/{METRICS}", _text(_metrics()).encode())
    assert rebuild_report(f"memory://{root}")


@given(mutated(_metrics()))
@EXAMPLES
def test_track_reader(record):
    fs, root = _root()
    fs.pipe_file(f"{root}/{MANIFEST}", manifest_bytes(_manifest()))
    fs.pipe_file(f"{root}/{METRICS}", _text(record).encode())
    # MLflow is not what is tested: what the record says is handed to a stub.
    with mock.patch("batchinfer.io.tracking.upload_pending", return_value="run-1"):
        _reads(lambda: upload_tracking(f"memory://{root}"), SpecError)


@pytest.mark.parametrize("document, message", [
    ({**_baseline(), "columns": []}, "b.json: columns: Input should be an object"),
    ({**_baseline(), "profile_version": 2}, "b.json: profile_version: Input should be 1"),
    ({"profile_version": 1}, "b.json: columns: missing"),
])
def test_baseline_messages_name_the_file_and_field(document, message):
    fs, root = _root()
    fs.pipe_file(f"{root}/b.json", _text(document).encode())
    with pytest.raises(SpecError) as info:
        read_profile(f"memory://{root}/b.json", "b.json")
    assert info.value.message.startswith("monitor.baseline ") and message in info.value.message
