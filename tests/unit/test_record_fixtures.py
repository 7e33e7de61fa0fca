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
from batchinfer.io.records import AttemptKey, Manifest, MetricsRecord, ShardResult, Totals, fold
from batchinfer.io.sinks import Sink
from batchinfer.profile_records import Profile, RunProfile
from batchinfer.rows.column_profiles import ColumnProfile
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
    # as io/outputs.write_json writes them: a baseline (batchinfer profile), a run's profile, the
    # metrics record
    ("baseline.json", Profile, scratch_bytes),
    ("run_profile.json", RunProfile, scratch_bytes),
    ("metrics.json", MetricsRecord, scratch_bytes),
])
def test_a_record_written_by_59ab11f_reads_and_writes_back_the_same_bytes(name, kind, written):
    data = (FIXTURES / name).read_bytes()
    record = check(kind, data, name, StorageError)
    assert type(record) is kind
    # On purpose: the commit step's record holds its shards' results folded since issue 34 (an
    # older one's are folded as it is read), so it is written back as the folded kind's fixture.
    assert written(record) == (FIXTURES / WRITTEN_AS.get(name, name)).read_bytes()


WRITTEN_AS = {"outcome.json": "outcome_folded.json"}


def test_an_outcome_with_every_shards_result_reads_folded_and_the_folded_one_writes_back():
    """59ab11f's commit record held every shard's result; read now, they are folded into the
    summary the commit step writes instead (its fixture: make.py --folded), which reads and
    writes back to the same bytes."""
    old = json.loads((FIXTURES / "outcome.json").read_bytes())
    outcome = check(CommitOutcome, json.dumps(old), "outcome.json", StorageError)
    results = [ShardResult.from_dict(r) for r in old["results"]]
    assert outcome.summary == fold(results) and outcome.results == ()
    assert outcome.summary.totals == Totals.of([r.record for r in results])
    assert outcome.summary.profiles == (results[0].profile,)
    data = (FIXTURES / "outcome_folded.json").read_bytes()
    folded = check(CommitOutcome, data, "outcome_folded.json", StorageError)
    assert folded == outcome and scratch_bytes(folded) == data
    assert "results" not in json.loads(data) and "summary" in json.loads(data)


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


def test_a_baseline_read_and_written_through_its_columns_profiles_is_the_same_bytes():
    data = (FIXTURES / "baseline.json").read_bytes()
    baseline = check(Profile, data, "b", SpecError)
    columns = {k: ColumnProfile.of_record(c).record() for k, c in baseline.columns.items()}
    assert scratch_bytes(dataclasses.replace(baseline, columns=columns)) == data
    read = read_profile(str(FIXTURES / "baseline.json"), "baseline.json")
    assert {k: c.to_dict() for k, c in read.columns.items()} == json.loads(data)["columns"]


def test_a_run_profile_keeps_every_key_of_its_baseline_beside_its_path_as_before(tmp_path):
    from batchinfer.app.run_record import profile_record
    from batchinfer.rows.drift import observe

    document = json.loads((FIXTURES / "baseline.json").read_bytes())
    document["made_by"] = "a newer batchinfer"   # a key this one does not know is kept too
    (tmp_path / "b.json").write_text(json.dumps(document))
    baseline = dataclasses.replace(read_profile(str(tmp_path / "b.json"), "b.json"),
                                   warn={"psi": 0.1, "ks": None}, fail={"psi": 0.25})
    run = json.loads((FIXTURES / "run_profile.json").read_bytes())
    shards = [{k: c.stats.to_dict() for k, c in baseline.columns.items()}]
    verdict = observe(shards, ["f0", "f1", "f2", "f3"], baseline)
    job = type("J", (), {"spec": type("S", (), {"name": run["job"]})(), "ds": run["ds"],
                         "display": staticmethod(lambda p: "shown")})()
    written = profile_record(job, verdict, baseline)   # type: ignore[arg-type]
    # what 59ab11f's profile_record wrote
    assert written == {
        "profile_version": 1, "job": run["job"], "ds": run["ds"], "quarantine": [], "level": "ok",
        "baseline": {"path": "shown", **{k: v for k, v in document.items() if k != "columns"},
                     "columns": {k: v.to_dict() for k, v in baseline.columns.items()}},
        "limits": {"warn": {"psi": 0.1, "ks": None}, "fail": {"psi": 0.25}},
        "drift": [d.to_dict() for d in verdict.drifts],
        "columns": {k: v.to_dict() for k, v in verdict.columns.items()}}
    assert written["drift"][0] == {"column": written["drift"][0]["column"], "kind": "feature",
                                   "psi": 0.0, "ks": 0.0, "level": "ok", "breached": []}
    assert check(RunProfile, json.dumps(written), "p", SpecError).baseline.path == "shown"


KINDS = {"manifest.json": Manifest, "attempt.json": AttemptKey, "shard_result.json": ShardResult,
         "outcome.json": CommitOutcome, "outcome_folded.json": CommitOutcome,
         "baseline.json": Profile, "run_profile.json": RunProfile,
         "metrics.json": MetricsRecord}
ERRORS = {"manifest.json": ContractError, "baseline.json": SpecError, "run_profile.json": SpecError,
          "metrics.json": SpecError}


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
    ('outcome_folded.json', ('summary', 'totals', 'rows_in'), -1,
     'summary.totals.rows_in: Input should be greater than or equal to 0 (got -1)'),
    ('outcome_folded.json', ('summary', 'profiles', 0, 'f1', 'counts'), [1, 1],
     'summary.profiles.0.f1: counts sum to 2, not to count 3'),
    ('outcome_folded.json', ('summary', 'batches', 0), [1],
     'summary.batches.0.1: missing'),
    ('outcome_folded.json', ('summary', 'challengers', 'v2', 'compute_ms'), -1.0,
     'summary.challengers.v2.compute_ms: Input should be greater than or equal to 0 (got -1.0)'),
    # the profiles and the metrics record (the messages of io/readback.py's schemas at e211ced)
    ('baseline.json', ('columns', 'f0', 'count'), '400',
     "columns.f0.count: Input should be a valid integer (got '400')"),
    ('baseline.json', ('columns', 'f0', 'counts'), [1, 2],
     'columns.f0: 2 counts for 19 cuts (a histogram has len(cuts) + 1 bins; no cuts, no counts)'),
    ('baseline.json', ('columns', 'f0', 'cuts'), [2.0, 1.0],
     'columns.f0: cuts are not strictly increasing'),
    ('baseline.json', ('columns', 'f0', 'kind'), 'label',
     "columns.f0.kind: Input should be 'feature' or 'prediction' (got 'label')"),
    ('baseline.json', ('columns', 'f0', 'std'), -1.0,
     'columns.f0.std: Input should be greater than or equal to 0 (got -1.0)'),
    ('baseline.json', ('columns', 'f0', 'min'), 5.0,
     'columns.f0: min 5.0 is above max 2.3665623664855957'),
    ('baseline.json', ('columns', 'f0', 'nulls'), DROP,
     'columns.f0.nulls: missing'),
    ('baseline.json', ('profile_version',), 2,
     'profile_version: Input should be 1 (got 2)'),
    ('baseline.json', ('columns',), DROP,
     'columns: missing'),
    ('baseline.json', ('columns', 'f0'), 3,
     'columns.f0: Input should be an object (got 3)'),
    ('baseline.json', ('columns', 'f0', 'at_cuts'), [1],
     'columns.f0: 1 at_cuts for 19 cuts'),
    ('baseline.json', ('columns', 'f0', 'quantiles', '0.5'), 'x',
     "columns.f0.quantiles.0.5: Input should be a valid number (got 'x')"),
    ('run_profile.json', ('level',), 'bad',
     "level: Input should be 'none', 'ok', 'warn' or 'fail' (got 'bad')"),
    ('run_profile.json', ('quarantine',), [['c', 'k', -1]],
     'quarantine.0.2: Input should be greater than or equal to 0 (got -1)'),
    ('run_profile.json', ('drift',), [{'column': 'f0', 'kind': 'feature', 'psi': None, 'ks': 0.1, 'level': 'meh'}],
     "drift.0.level: Input should be 'ok', 'warn' or 'fail' (got 'meh')"),
    ('run_profile.json', ('drift',), [{'column': 'f0', 'kind': 'feature', 'psi': None, 'level': 'ok'}],
     'drift.0.ks: missing'),
    ('run_profile.json', ('limits', 'warn'), {'psi': '0.1'},
     "limits.warn.psi: Input should be a valid number (got '0.1')"),
    ('run_profile.json', ('baseline',), {'path': 3},
     'baseline.path: Input should be a valid string (got 3)'),
    ('run_profile.json', ('columns', 'f0', 'count'), -1,
     'columns.f0.count: Input should be greater than or equal to 0 (got -1)'),
    ('run_profile.json', ('profile_version',), DROP,
     'profile_version: missing'),
    ('metrics.json', ('tracking_uri',), '',
     "tracking_uri: String should have at least 1 character (got '')"),
    ('metrics.json', ('experiment',), DROP,
     'experiment: missing'),
    ('metrics.json', ('uploaded',), 'yes',
     "uploaded: Input should be a valid boolean (got 'yes')"),
    ('metrics.json', ('params', 'job'), [1],
     'params.job.str: Input should be a valid string'),
    ('metrics.json', ('metrics', 'rows_in'), '400',
     "metrics.rows_in: Input should be a valid number (got '400')"),
    ('metrics.json', ('tags', 'batchinfer.job'), 1,
     'tags.batchinfer.job: Input should be a valid string (got 1)'),
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
    error = ERRORS.get(name, StorageError)
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

def classes_of(*modules: str) -> list[type]:
    found = []
    for name in modules:
        module = importlib.import_module(name)
        found += [c for _, c in inspect.getmembers(module, inspect.isclass)
                  if c.__module__ == module.__name__]
    return found


def io_classes() -> list[type]:
    return classes_of(*(f"batchinfer.io.{path.stem}"
                        for path in sorted(Path(io_package.__file__).parent.glob("*.py"))))


def mirrors(model: type[BaseModel], record: type) -> bool:
    """Whether ``model`` declares ``record`` again: by name (``X``, ``XModel``, ``ColumnProfileModel``
    for ``ColumnProfileRecord``), or by its keys — the record's, or some of them that hold all
    the record's required ones."""
    fields = dataclasses.fields(record)
    keys = {f.name for f in fields}
    required = {f.name for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    names = {record.__name__, f"{record.__name__}Model", f"{record.__name__.removesuffix('Record')}Model"}
    return model.__name__ in names or required <= set(model.model_fields) <= keys


def test_every_record_is_a_dataclass_declared_once_and_no_model_mirrors_one():
    classes = io_classes() + classes_of("batchinfer.codec", "batchinfer.profile_records")
    records = [c for c in classes if issubclass(c, Record) and c is not Record]
    models = [c for c in classes if issubclass(c, BaseModel)]
    assert {"Manifest", "ShardRecord", "FileRecord", "ShardResult", "AttemptKey", "CommitOutcome",
            "ResultsSummary", "ChallengerSums", "ScoredBy",
            "Sink", "InputTable", "TableCommit", "MetricsRecord", "ColumnStatsRecord",
            "ColumnProfileRecord", "Profile", "RunProfile", "DriftRecord", "LimitsRecord",
            "BaselineAbout"} <= {c.__name__ for c in records}
    assert len({c.__name__ for c in records}) == len(records)
    for record in records:
        assert dataclasses.is_dataclass(record), record
        for model in models:
            assert not mirrors(model, record), f"{model.__name__} mirrors {record.__name__}"


def test_a_mirror_of_a_profile_record_would_be_found():
    from pydantic import BaseModel as Model

    from batchinfer.io.records import MetricsRecord as Metrics
    from batchinfer.profile_records import ColumnProfileRecord, LimitsRecord

    class ProfileModel(Model):   # the schema io/readback.py had: fewer keys than Profile
        profile_version: int
        columns: dict

    class LimitsModel(Model):
        warn: dict = {}
        fail: dict = {}

    class MetricsRecordModel(Model):
        tracking_uri: str

    class Settings(Model):   # a key no profile has: something else
        profile_version: int
        columns: dict
        retries: int

    assert mirrors(ProfileModel, Profile) and mirrors(LimitsModel, LimitsRecord)
    assert mirrors(MetricsRecordModel, Metrics)
    assert not mirrors(LimitsModel, ColumnProfileRecord) and not mirrors(Settings, Profile)


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


# -- export --quantize's record ------------------------------------------------------------------

def test_a_quantization_record_written_before_it_described_its_sample_still_reads(tmp_path):
    """d4487dd's record (its sample the first rows of the first shard: no ``sample_rows``,
    ``sample_seed``, … ) reads as the facts stamp declares, and a run reports them."""
    from batchinfer.app.run_record import model_facts
    from batchinfer.handlers.onnx import QUANTIZATION_SUFFIX, quantization_facts

    model = tmp_path / "q8.onnx"
    model.write_bytes((FIXTURES / "quantization.onnx").read_bytes())
    record = json.loads((FIXTURES / "quantization.json").read_text())
    (tmp_path / f"q8.onnx{QUANTIZATION_SUFFIX}").write_text(json.dumps(record))
    facts = quantization_facts(str(model))
    assert not any(k.startswith("sample_") and k != "sample_sha256" for k in facts)
    assert facts["precision"] == "int8" and facts["sample_sha256"] == record["sample_sha256"]
    assert facts["quantization_per_channel"] == "true" and facts["parity_rows"] == "200"
    assert "model_sha256" not in facts and len(facts) == len(record) - 1
    declared = Declaration.stamped(Triple("m:1-int8", "d" * 64, "feats@1", "p" * 64), facts)
    assert declared.backend == facts
    assert model_facts(declared)["model.sample_sha256"] == record["sample_sha256"]
    assert model_facts(declared)["model.parity_kl"] == str(record["parity_kl"])
