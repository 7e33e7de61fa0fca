"""The columns batchinfer writes, as rows/columns.py declares them: the one writer (champion and
challenger policies) writes exactly the declared columns, in order, with the declared Arrow types
and Parquet encodings; quarantine files hold the declared quarantine columns; ``diff``'s
exemptions and the collision check derive from the declarations; the triple's columns are the
triple's fields."""
from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinfer.beam_compat import PredictionResult
from batchinfer.commands import diff
from batchinfer.errors import SpecError
from batchinfer.handlers.base import Inference, Prepared
from batchinfer.io.outputs import QUARANTINE
from batchinfer.io.records import PreprocessStats
from batchinfer.pipeline.shard_reports import BatchRecord, ChallengerBatchRecord
from batchinfer.pipeline.transforms import ModelRun, ScoringPlan, WritePredictions, build
from batchinfer.pipeline.writer.audit import AuditColumns
from batchinfer.pipeline.writer.policy import WritePolicy
from batchinfer.pipeline.writer.scored import Payload, ScoredBatch
from batchinfer.redaction import Deferred
from batchinfer.rows import columns
from batchinfer.rows.quarantine import QUARANTINE_SCHEMA, Failure, build_quarantine
from batchinfer.triple.contract import Triple

ROWS = 40
NAMES = {"y": "score", "z": "vec"}
TRIPLE = Triple("m:1", "d" * 64, "s:1", "p" * 64)


def _result() -> PredictionResult:
    """A batch of ROWS valid rows (and two quarantined before the model); the model raised on
    rows 3 and 7 and gave a NaN score on another."""
    rng = np.random.default_rng(3)
    valid = pa.record_batch({"id": pa.array(np.arange(ROWS)), "f1": pa.array(rng.standard_normal(ROWS))})
    early = build_quarantine("s0.parquet", np.array([ROWS, ROWS + 1]),
                             [[Failure("f1", "type", "bad")]] * 2,
                             pa.record_batch({"id": pa.array([ROWS, ROWS + 1]),
                                              "f1": pa.array([1.0, 2.0])}))
    payload = Payload(0, ROWS + 2, valid, np.arange(ROWS, dtype=np.int64), [early], {"read": 0.0},
                      PreprocessStats(ROWS))
    ok = np.array([i for i in range(ROWS) if i not in (3, 7)], dtype=np.int64)
    y = rng.standard_normal(ok.size).astype(np.float32)
    y[5] = np.nan
    inference = Inference(ok_rows=ok, outputs={"y": y, "z": rng.standard_normal((ok.size, 3))},
                          failed=[(3, "boom"), (7, "bang")], compute_ms=2.5)
    return PredictionResult(Prepared(key=(0, 0), rows=ROWS, features=None, payload=payload), inference)


def _run(rejects: str) -> ModelRun:
    name = "" if rejects == "quarantine" else "c"
    return ModelRun(name=name, triple=TRIPLE, handler=None, device="cpu",  # type: ignore[arg-type]
                    backend="onnxruntime", model_options={},
                    policy=WritePolicy.champion() if rejects == "quarantine" else WritePolicy.challenger(name),
                    prediction_names=NAMES)


def _write(tmp_path, run: ModelRun):
    plan = ScoringPlan(shard_urls=(Deferred("s0.parquet"),), shard_names=("s0.parquet",),
                       output_url=Deferred(str(tmp_path)), attempt="A1", batch_rows=100,
                       schema=None, preprocessor=None,  # type: ignore[arg-type]
                       id_columns=("id",), hash_columns=("id", "f1"), profile_features=("f1",))
    writer = WritePredictions(plan, run)
    writer.setup()
    try:
        _, record, _ = writer._complete(_result())
    finally:
        writer.teardown()
    return record


@pytest.mark.parametrize("rejects", ["quarantine", "count"])
def test_prediction_files_hold_exactly_the_declared_columns(tmp_path, rejects):
    record = _write(tmp_path, _run(rejects))
    (predictions,) = [f for f in record.files if not f.path.startswith(QUARANTINE)]
    metadata = pq.ParquetFile(tmp_path / predictions.path).metadata
    schema = pq.read_schema(tmp_path / predictions.path)
    assert schema.names == ["id", *NAMES.values(), *columns.AUDIT_COLUMNS]
    for declared in columns.AUDIT:
        assert str(schema.field(declared.name).type) == declared.type, declared.name
    encoding = columns.prediction_encoding(["id"])
    group = metadata.row_group(0)
    for i in range(group.num_columns):
        chunk = group.column(i)
        name = chunk.path_in_schema.split(".")[0]
        dictionary = any("DICTIONARY" in e for e in chunk.encodings)
        assert dictionary == (name in encoding["dictionary"]), name
        assert chunk.is_stats_set == (name in encoding["statistics"]), name
        assert chunk.compression == ("UNCOMPRESSED" if name in encoding["uncompressed"] else "SNAPPY"), name
    assert set(encoding["dictionary"]) == {c.name for c in columns.AUDIT if c.encoding == "dictionary"}
    assert encoding["statistics"] == ["id", columns.SOURCE_ROW.name]
    assert encoding["uncompressed"] == [columns.INPUT_HASH.name]


def test_the_audit_part_computes_every_declared_audit_column_and_no_other():
    """A new audit column is its declaration (rows/columns.py) and its entry in
    ``AuditColumns.values`` (pipeline/writer/audit.py): one without the other fails here."""
    result = _result()
    batch = ScoredBatch.of(result.example, result.inference, shard_names=("s0.parquet",),
                           hash_columns=("id", "f1"), explain=None)
    values = AuditColumns("A1", TRIPLE).values(batch)
    assert sorted(values) == sorted(columns.AUDIT_COLUMNS)
    for declared in columns.AUDIT:
        assert str(values[declared.name].type) == declared.type, declared.name
        assert len(values[declared.name]) == batch.ok.size, declared.name
    assert list(AuditColumns("A1", TRIPLE).columns(batch)) == list(columns.AUDIT_COLUMNS)


def test_the_champion_quarantines_what_a_challenger_only_counts(tmp_path):
    champion = _write(tmp_path / "a", _run("quarantine"))
    challenger = _write(tmp_path / "b", _run("count"))
    assert isinstance(champion, BatchRecord) and isinstance(challenger, ChallengerBatchRecord)
    # raised on 2, a NaN on 1: the champion quarantines them beside the 2 rows already there
    assert (champion.rows_scored, champion.rows_quarantined) == (ROWS - 3, 5)
    assert champion.profile and set(champion.profile) >= {"f1", "score"}
    assert (challenger.rows_scored, challenger.rows_rejected, challenger.name) == (ROWS - 3, 3, "c")
    assert [f.path.split("/")[0] for f in challenger.files] == ["challengers"]
    (quarantine,) = [f for f in champion.files if f.path.startswith(QUARANTINE)]
    schema = pq.read_schema(tmp_path / "a" / quarantine.path)
    assert schema.names == list(columns.QUARANTINE_COLUMNS)
    for declared in columns.QUARANTINE:   # Parquet names a list's items "element"
        read = str(schema.field(declared.name).type).replace("list<element: ", "list<item: ")
        assert read == declared.type, declared.name


def test_the_quarantine_schema_is_the_declared_one():
    assert QUARANTINE_SCHEMA.names == list(columns.QUARANTINE_COLUMNS)
    assert [str(f.type) for f in QUARANTINE_SCHEMA] == [c.type for c in columns.QUARANTINE]


def test_the_triple_columns_are_the_triples_fields():
    assert list(columns.TRIPLE) == [f.name for f in dataclasses.fields(Triple)]


def test_diff_compares_what_the_declarations_say():
    assert diff.EXEMPT == {c.name for c in columns.AUDIT if not c.compared}
    assert diff.EXEMPT == {"_source_shard", "_source_row", "_inference_id", "_compute_ms",
                           "_model_version", "_model_digest", "_schema_version", "_preprocess_hash"}
    assert columns.INPUT_HASH.name not in diff.EXEMPT


@pytest.mark.parametrize("name", sorted(columns.RESERVED))
def test_no_declared_column_can_be_taken(name):
    assert name in columns.AUDIT_COLUMNS + columns.QUARANTINE_COLUMNS + columns.EXPLAINED_COLUMNS
    with pytest.raises(SpecError, match="writes itself"):
        columns.check_output_columns([name], {})
    with pytest.raises(SpecError, match="writes itself"):
        columns.check_output_columns(["id"], {"y": name})


def test_build_takes_the_champion_first():
    with pytest.raises(ValueError, match="champion first"):
        build(None, None, None, models=(_run("count"), _run("quarantine")))  # type: ignore[arg-type]
    assert _run("quarantine").labels == ("RunInference", "WriteBatch")
    assert _run("count").labels == ("RunInference[c]", "WriteChallenger[c]")


def test_the_writer_does_not_carry_the_handler():
    writer = WritePredictions(ScoringPlan(
        shard_urls=(), shard_names=(), output_url=Deferred("memory://x"), attempt="A", batch_rows=1,
        schema=None, preprocessor=None, id_columns=()),  # type: ignore[arg-type]
        dataclasses.replace(_run("count"), handler=object()))  # type: ignore[arg-type]
    assert not any(v is not None and type(v) is object for v in vars(writer).values())


def test_a_table_outputs_partition_column_may_not_be_a_column_the_job_writes():
    with pytest.raises(SpecError, match="output.partition_column 'dt' is also a column"):
        columns.check_output_columns(["id", "dt"], {}, partition="dt")
    with pytest.raises(SpecError, match="output.partition_column 'dt' is also a column"):
        columns.check_output_columns(["id"], {"y": "dt"}, partition="dt")
    columns.check_output_columns(["id", "dt"], {"y": "score"})            # files: no such column
    columns.check_output_columns(["id"], {"y": "score"}, partition="dt")

