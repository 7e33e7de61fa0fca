"""The fixtures in tests/fixtures/records/: one file of each on-disk record kind as batchinfer
at 59ab11f wrote them (tests/fixtures/records/make.py made them, once). Each reads through
today's declaration of its record (so files written before the records were declared once still
read), and a deterministic writer writes it back to the same bytes; a wrong field gives the same
one-line error as the schemas it replaced gave (the messages below are theirs, at 59ab11f). And
each record is declared once: no pydantic model in io/ mirrors a record. The model's
declaration (triple/contract.py ``Declaration``) likewise reads typed and writes back the bytes
stamp wrote.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
from pathlib import Path

import fsspec
import pytest
from pydantic import BaseModel

import batchinfer.io as io_package
from batchinfer.app import explain_plan as explain
from batchinfer.app.drift_baseline import read_profile
from batchinfer.codec import Record
from batchinfer.errors import ContractError, SpecError, StorageError
from batchinfer.io.commit import CommitOutcome
from batchinfer.io.manifest import manifest_bytes, read_manifest
from batchinfer.io.readback import check
from batchinfer.io.records import AttemptKey, Manifest, MetricsRecord, ShardResult
from batchinfer.io.sinks import Sink
from batchinfer.profile_records import RunProfile
from batchinfer.triple.contract import (
    PACKAGES,
    PACKAGES_POLICY,
    PARTS,
    SCHEMA_SHA256,
    Declaration,
    Triple,
    declaration_from_tags,
    declaration_tags,
    read_sidecar,
    write_sidecar,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "records"
DROP = object()


def scratch_bytes(record: Record) -> bytes:
    """As io/outputs.write_json writes a scratch record."""
    return (json.dumps(record.to_dict(), indent=1, sort_keys=True) + "\n").encode()


@pytest.mark.parametrize("name, kind, written", [
    ("manifest.json", Manifest, manifest_bytes),
    ("job_manifest.json", Manifest, manifest_bytes),     # a job's, written by `batchinfer run`
    ("pending.json", Manifest, scratch_bytes),           # a table commit's pending manifest
    ("attempt.json", AttemptKey, scratch_bytes),
    ("shard_result.json", ShardResult, scratch_bytes),
    ("outcome.json", CommitOutcome, scratch_bytes),
    ("sink.json", Sink, scratch_bytes),
])
def test_a_record_written_by_59ab11f_reads_and_writes_back_the_same_bytes(name, kind, written):
    data = (FIXTURES / name).read_bytes()
    record = check(kind, data, name, StorageError)
    assert type(record) is kind
    assert written(record) == data


def test_the_job_manifest_reads_as_a_committed_partition(tmp_path):
    (tmp_path / "_manifest.json").write_bytes((FIXTURES / "job_manifest.json").read_bytes())
    manifest = read_manifest(fsspec.filesystem("file"), str(tmp_path))
    assert manifest is not None and manifest.totals.rows_scored == 400 and len(manifest.files()) == 2


def test_the_profiles_and_the_metrics_record_read():
    assert read_profile(str(FIXTURES / "baseline.json"), "baseline.json").columns
    profile = check(RunProfile, (FIXTURES / "run_profile.json").read_bytes(), "p", SpecError)
    assert profile.columns
    metrics = check(MetricsRecord, (FIXTURES / "metrics.json").read_bytes(), "m", SpecError)
    assert metrics.metrics["rows_in"] == 400.0


KINDS = {"manifest.json": Manifest, "attempt.json": AttemptKey, "shard_result.json": ShardResult,
         "outcome.json": CommitOutcome}


@pytest.mark.parametrize("name, where, value, message", [
    ('manifest.json', ('shards', 0, 'rows_in'), '10',
     "shards.0.rows_in: Input should be a valid integer (got '10')"),
    ('manifest.json', ('shards', 0, 'rows_in'), 11,
     'shards.0: rows_in 11 is not rows_scored 8 + rows_quarantined 2'),
    ('manifest.json', ('shards', 0, 'files', 0, 'path'), '../x.parquet',
     "shards.0.files.0.path: '../x.parquet' is not a path inside the output folder"),
    ('manifest.json', ('shards', 0, 'files', 0, 'rows'), -1,
     'shards.0.files.0.rows: Input should be greater than or equal to 0 (got -1)'),
    ('manifest.json', ('shards', 1, 'status'), 'done',
     "shards.1.status: Input should be 'scored', 'empty', 'quarantined' or 'unreadable' (got 'done')"),
    ('manifest.json', ('manifest_version',), 2,
     'manifest_version: Input should be 1 (got 2)'),
    ('manifest.json', ('job',), DROP,
     'job: missing'),
    ('manifest.json', ('attempt',), '',
     "attempt: String should have at least 1 character (got '')"),
    ('manifest.json', ('shards',), {},
     'shards: Input should be a valid array'),
    ('manifest.json', ('totals', 'rows_in'), 1.5,
     'totals.rows_in: Input should be a valid integer (got 1.5)'),
    ('manifest.json', ('challengers', 0, 'shards', 0, 'compute_ms'), -1.0,
     'challengers.0.shards.0.compute_ms: Input should be greater than or equal to 0 (got -1.0)'),
    ('manifest.json', ('table', 'generation'), True,
     'table.generation: Input should be a valid integer (got True)'),
    ('manifest.json', ('input_table', 'version'), '5',
     "input_table.version: Input should be a valid integer (got '5')"),
    ('manifest.json', ('plugins', 0, 'kind'), 'handler',
     "plugins.0.kind: Input should be 'backend' or 'runner' (got 'handler')"),
    ('attempt.json', ('job',), '',
     "job: String should have at least 1 character (got '')"),
    ('attempt.json', ('challengers',), [3],
     'challengers.0: Input should be an object (got 3)'),
    ('shard_result.json', ('record', 'rows_scored'), None,
     'record.rows_scored: Input should be a valid integer (got None)'),
    ('shard_result.json', ('profile', 'f1', 'counts'), [1, 1],
     'profile.f1: counts sum to 2, not to count 3'),
    ('shard_result.json', ('profile', 'f1', 'mean'), 'NaN',
     "profile.f1.mean: Input should be a valid number (got 'NaN')"),
    ('shard_result.json', ('model', 'max_gap'), -0.5,
     'model.max_gap: Input should be greater than or equal to 0 (got -0.5)'),
    ('shard_result.json', ('quarantine', 0, 2), -2,
     'quarantine.0.2: Input should be greater than or equal to 0 (got -2)'),
    ('shard_result.json', ('batches', 0), [1],
     'batches.0.1: missing'),
    ('shard_result.json', ('seconds', 'read'), '0.1',
     "seconds.read: Input should be a valid number (got '0.1')"),
    ('outcome.json', ('status',), 'won',
     "status: Input should be 'committed', 'lost_race', 'conflict' or 'refused' (got 'won')"),
    ('outcome.json', ('code',), -4,
     'code: Input should be greater than or equal to 0 (got -4)'),
    ('outcome.json', ('results', 0, 'record', 'status'), None,
     "results.0.record.status: Input should be 'scored', 'empty', 'quarantined' or 'unreadable' (got None)"),
])
def test_a_wrong_field_gives_the_one_line_error_it_gave_before(name, where, value, message):
    document = json.loads((FIXTURES / name).read_bytes())
    node = document
    for key in where[:-1]:
        node = node[key]
    if value is DROP:
        del node[where[-1]]
    else:
        node[where[-1]] = value
    error = ContractError if name == "manifest.json" else StorageError
    with pytest.raises(error) as info:
        check(KINDS[name], json.dumps(document), name, error, "hint")
    assert info.value.message == f"{name}: {message}: hint"


def test_a_manifest_without_totals_counts_them_from_its_shards():
    document = json.loads((FIXTURES / "manifest.json").read_bytes())
    totals = document.pop("totals")
    assert check(Manifest, json.dumps(document), "m", ContractError).totals.to_dict() == totals
    document["totals"] = None
    assert check(Manifest, json.dumps(document), "m", ContractError).totals.to_dict() == totals


def test_a_format_the_registry_does_not_know_reads_but_an_empty_one_does_not():
    document = json.loads((FIXTURES / "manifest.json").read_bytes())
    document["table"]["format"] = document["input_table"]["format"] = "ledger"
    assert check(Manifest, json.dumps(document), "m", ContractError).table.format == "ledger"
    document["table"]["format"] = ""
    with pytest.raises(ContractError, match="m: table.format: String should have at least 1 character"):
        check(Manifest, json.dumps(document), "m", ContractError)


# -- one declaration per record ------------------------------------------------------------------

def io_classes() -> list[type]:
    found = []
    for path in sorted(Path(io_package.__file__).parent.glob("*.py")):
        module = importlib.import_module(f"batchinfer.io.{path.stem}")
        found += [c for _, c in inspect.getmembers(module, inspect.isclass)
                  if c.__module__ == module.__name__]
    return found


def test_every_record_is_a_dataclass_declared_once_and_no_model_mirrors_one():
    classes = io_classes()
    records = [c for c in classes if issubclass(c, Record) and c is not Record]
    models = [c for c in classes if issubclass(c, BaseModel)]
    assert {"Manifest", "ShardRecord", "FileRecord", "ShardResult", "AttemptKey", "CommitOutcome",
            "Sink", "InputTable", "TableCommit"} <= {c.__name__ for c in records}
    assert len({c.__name__ for c in records}) == len(records)
    for record in records:
        assert dataclasses.is_dataclass(record), record
        keys = {f.name for f in dataclasses.fields(record)}
        for model in models:
            assert model.__name__ != f"{record.__name__}Model", (model, record)
            assert set(model.model_fields) != keys, f"{model.__name__} mirrors {record.__name__}"


# -- the model's declaration ---------------------------------------------------------------------

def test_the_declaration_stamp_wrote_reads_typed_and_writes_back_the_same_bytes(tmp_path):
    data = (FIXTURES / "declaration.json").read_bytes()
    (tmp_path / "m.onnx.batchinfer.json").write_bytes(data)
    declared = read_sidecar(tmp_path / "m.onnx")
    assert isinstance(declared, Declaration) and not declared.missing()
    assert declared.backend == {"precision": "fp32"}
    assert declared.preprocess_packages_policy == "warn" and declared.baseline
    assert declared == json.loads(data)   # as a mapping: the file's keys and values
    parts = {k: v for k, v in declared.parts().items() if v is not None}
    extra = {k: v for k, v in declared.items() if k not in parts}
    path = write_sidecar(tmp_path / "again.onnx", Triple(**parts), extra)
    assert Path(path).read_bytes() == data
    tags = declaration_tags(Triple(**parts), extra)
    assert list(tags) == [f"batchinfer.{k}" for k in json.loads(data)]
    assert declaration_from_tags(tags) == declared


def test_every_key_of_a_declaration_is_one_of_its_fields_and_keeps_stamps_order():
    names = [f.name for f in dataclasses.fields(Declaration)]
    for key in (SCHEMA_SHA256, PACKAGES, PACKAGES_POLICY, explain.DECLARED, explain.BACKGROUND_SHA256,
                "baseline", *PARTS):
        assert key in names, key
    triple = Triple("m:1", "d" * 64, "s@1", "p" * 64)
    # stamp's order: the backend's options and build facts, explain, its background, the code's
    # hashes and packages, the baseline
    extra = {"precision": "fp16", "tensorrt_version": "10.1", "quantization_scheme": "int8",
             "explain": "{}", "explain_background_sha256": "b" * 64, "schema_sha256": "c" * 64,
             "preprocess_packages": "numpy==2", "preprocess_packages_policy": "refuse",
             "baseline": "/b.json"}
    declared = Declaration.stamped(triple, extra)
    assert declared.to_dict() == {**triple.as_dict(), **extra}
    assert list(declared.to_dict()) == [*triple.as_dict(), *extra]
    assert declared.backend == {"precision": "fp16", "tensorrt_version": "10.1",
                                "quantization_scheme": "int8"}
    assert Declaration.of({"model_version": "m:1"}).missing() == [p for p in PARTS if p != "model_version"]
