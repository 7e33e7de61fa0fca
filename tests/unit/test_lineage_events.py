"""batchinfer.io.lineage's builders (contract §6 "Lineage"), without a run: dataset names as
OpenLineage's naming spec has them, the parent as the DAG passes it, the job spec's section, and
every kind of event validated against the specification as the client ships it
(lineage_schemas.py), and that validator refusing broken events."""
from __future__ import annotations

import copy
from datetime import datetime, timezone

import pytest

from batchinfer.errors import SpecError
from batchinfer.io import lineage as ol
from batchinfer.spec import load_job
from factories import write_job
from lineage_schemas import Invalid, validate

WHEN = datetime(2026, 1, 15, 2, 0, tzinfo=timezone.utc)


def test_dataset_names_follow_the_naming_spec(tmp_path):
    assert ol.dataset_name("s3://ak:pw@bucket/in/dt=2026-01-15") == ol.DatasetRef("s3://bucket", "in/dt=2026-01-15")
    assert ol.dataset_name("gs://b/x") == ol.DatasetRef("gs://b", "x")
    assert ol.dataset_name(str(tmp_path / "a")) == ol.DatasetRef("file", str(tmp_path / "a"))
    assert ol.dataset_name(f"file://{tmp_path}/a") == ol.DatasetRef("file", str(tmp_path / "a"))
    assert ol.RunRef.parse("airflow/dag.task/01a23b08-dcc1-7859-97ef-318fac01bd73") == ol.RunRef(
        "airflow", "dag.task", "01a23b08-dcc1-7859-97ef-318fac01bd73")
    for bad in (None, "", "a/b", "a/b/not-a-uuid", "a//01a23b08-dcc1-7859-97ef-318fac01bd73"):
        assert ol.RunRef.parse(bad) is None
    # stable for the attempt, another for another attempt
    first = ol.run_id_of("n", "j", "a1", WHEN)
    assert first == ol.run_id_of("n", "j", "a1", WHEN) != ol.run_id_of("n", "j", "a2", WHEN)


def test_the_lineage_section_is_checked_with_the_spec(tmp_path):
    job = write_job(tmp_path, lineage={"transport": "file", "path": "events.jsonl"})
    assert load_job(job, ds="2026-01-15").spec.lineage.path == str(tmp_path / "events.jsonl")
    for section, says in (({"transport": "http"}, "lineage.transport http needs lineage.url"),
                          ({"transport": "file", "path": "x", "url": "http://h"}, "lineage.url is for"),
                          ({"transport": "kafka"}, "lineage.transport")):
        with pytest.raises(SpecError, match=says):
            load_job(write_job(tmp_path, lineage=section), ds="2026-01-15")
    # where events go does not change what an attempt scores (resume)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    plain, sent = (load_job(write_job(tmp_path / n, **s), ds="2026-01-15")
                   for n, s in (("a", {}), ("b", {"lineage": {"transport": "console"}})))
    assert plain.work_sha256 == sent.work_sha256 and plain.spec_sha256 != sent.spec_sha256
    assert not ol.configured(None, {}) and ol.configured(None, {"OPENLINEAGE_URL": "http://h"})
    assert not ol.configured(plain.spec.lineage, {"OPENLINEAGE_DISABLED": "true", "OPENLINEAGE_URL": "x"})


def _events() -> tuple[ol.RunLineage, list]:
    """One run's START, COMPLETE (with every facet batchinfer has), FAIL and ABORT."""
    lineage = ol.RunLineage(
        namespace="batchinfer", job="credit", run_id=ol.run_id_of("batchinfer", "credit", "a1", WHEN),
        attempt="a1", ds="2026-01-15",
        triple={"model_version": "m:1", "model_digest": "d", "schema_version": "s@1", "preprocess_hash": "p"},
        backend="onnxruntime", model_options={"precision": "fp32"},
        challengers=[("c1", {"model_version": "m:2"}, {})], schema="s@1", fields=[("age", "Int64")],
        inputs=[ol.DatasetRef("s3://bucket", "in/dt=2026-01-15")],
        parent=ol.RunRef.parse("default/dag.score/01a23b08-dcc1-7859-97ef-318fac01bd73"))
    committed = ol.Committed(
        action="score", attempt="a1", rows_in=10, rows_scored=8, rows_quarantined=2, shards=1,
        quarantine=[("age", "not_nullable", 1), (None, "row", 1)], drift_level="warn",
        drift=[{"column": "age", "kind": "numeric", "psi": 0.12, "ks": None, "level": "warn", "breached": []}],
        challengers={"c1": (8, 0)},
        outputs=[ol.Output(kind="predictions", dataset=ol.DatasetRef("s3://bucket", "out/predictions"), rows=8,
                           files=1, size=100, version="a1")],
        output_fields=[("age", "int64")])
    events = [ol.start_event(lineage, WHEN), ol.complete_event(lineage, WHEN, committed),
              ol.fail_event(lineage, WHEN, "data quality: 2 of 10 rows", 4, "DataQualityError"),
              ol.abort_event(lineage, WHEN)]
    return lineage, events


def test_every_event_matches_the_specification():
    from openlineage.client.serde import Serde

    lineage, events = _events()
    for event in events:
        data = Serde.to_dict(event)
        validate(data)
        assert data["run"]["runId"] == lineage.run_id
        assert data["run"]["facets"]["parent"]["root"]["run"]["runId"] == "01a23b08-dcc1-7859-97ef-318fac01bd73"
    complete = Serde.to_dict(events[1])
    assert complete["run"]["facets"]["batchinfer_drift"]["level"] == "warn"
    assert complete["run"]["facets"]["batchinfer_challengers"]["challengers"][0]["rowsScored"] == 8
    # a row-level check has no column (the client leaves out nulls)
    assert complete["inputs"][0]["inputFacets"]["batchinfer_quarantine"]["byReason"][1] == {"check": "row", "rows": 1}


def test_the_validator_refuses_a_broken_event():
    from openlineage.client.serde import Serde

    good = Serde.to_dict(_events()[1][1])   # COMPLETE: every kind of facet
    validate(good)
    run, inputs, outputs = "run", "inputs", "outputs"

    def dig(event, *path):
        for step in path:
            event = event[step]
        return event

    breakages = [   # (what is broken, where, the change, what the validator says)
        ("a run id that is not a UUID", (run,), lambda d: d.update(runId="run-1"), "Run refuses it"),
        ("a date without a time", (), lambda d: d.update(eventTime="2026-01-15"), "has to contain time"),
        ("an event type outside the spec", (), lambda d: d.update(eventType="DONE"), "not one of"),
        ("a field the facet has not", (run, "facets", "processing_engine"), lambda d: d.update(engine="beam"),
         "ProcessingEngineRunFacet has no field 'engine'"),
        ("a required field missing", ("job", "facets", "jobType"), lambda d: d.pop("integration"),
         r"JobTypeJobFacet needs \['integration'\]"),
        ("a string where the spec has an integer", (outputs, 0, "outputFacets", "outputStatistics"),
         lambda d: d.update(rowCount="8"), "rowCount: int, not str"),
        ("a boolean where the spec has an integer", (outputs, 0, "outputFacets", "outputStatistics"),
         lambda d: d.update(size=True), "size: int, not bool"),
        ("another version of the facet's schema", (run, "facets", "parent"),
         lambda d: d.update(_schemaURL=d["_schemaURL"].replace("1-2-0", "1-1-0")), "client's ParentRunFacet names"),
        ("a standard facet nobody can check", (run, "facets"), lambda d: d.update(nominalTme={"_producer": "x"}),
         "no standard RunFacet named 'nominalTme'"),
        ("an input facet among the dataset facets", (inputs, 0),
         lambda d: d["facets"].update(dataQualityMetrics=d["inputFacets"].pop("dataQualityMetrics")),
         "no standard DatasetFacet named 'dataQualityMetrics'"),
        ("a null the client would not send", (run, "facets", "batchinfer_run"), lambda d: d.update(ds=None),
         r"batchinfer_run.ds lost"),
        ("a field left out that the client sends", (inputs, 0, "facets", "schema", "fields", 0),
         lambda d: d.pop("fields"), r"fields\[0\].fields added"),
        ("one of batchinfer's facets off its schema", (run, "facets", "batchinfer_run"),
         lambda d: d.update(attempt=1), "does not match .*BatchinferRunFacet: 1 is not of type 'string'"),
        ("a facet of batchinfer's not in its schema", (run, "facets", "batchinfer_run"),
         lambda d: d.update(_schemaURL=d["_schemaURL"] + "X"), "is not in lineage_facets.json"),
    ]
    for what, path, change, says in breakages:
        broken = copy.deepcopy(good)
        change(dig(broken, *path))
        with pytest.raises(Invalid, match=says):
            validate(broken)
            pytest.fail(f"{what}: accepted")
