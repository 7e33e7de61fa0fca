"""OpenLineage events of real runs (issue 36, contract §6 "Lineage"), captured by an HTTP
receiver the test starts (servers.LineageReceiver) and each validated against the specification
as the installed client ships it (lineage_schemas.py): a committed run's START and COMPLETE and
its rerun's no-op, a run refused before any work, a receiver that is down, a run killed mid-way,
Ctrl-C."""
from __future__ import annotations

import json
import os
import time

import pytest

from factories import DS, REPO, run_cli, spoil_rows
from killing import kill_tree
from lineage_schemas import validate
from servers import closed_port, copy_project, start_cli

pytestmark = pytest.mark.slow

PARENT = "airflow/nightly_testjob.score/01a23b08-dcc1-7859-97ef-318fac01bd73"
ROOT = "airflow/nightly_testjob/01a23b08-0000-7000-8000-000000000001"
# A plain `python -m batchinfer` (signals are the subject) of this checkout's batchinfer.
FRESH = {"LINEAGE_TEST_KEY": "k" * 12, "PYTHONPATH": str(REPO)}


def lineage_section(url: str, **more) -> dict:
    return {"transport": "http", "url": url, "api_key": "${LINEAGE_TEST_KEY}", "namespace": "scoring",
            **more}


def test_a_committed_run_sends_start_and_complete_and_its_rerun_a_no_op(stamped_template, tmp_path,
                                                                        lineage_receiver):
    project = tmp_path / "p"
    copy_project(stamped_template, project, lineage=lineage_section(lineage_receiver.url))
    shard = project / "data" / f"dt={DS}" / "part-00001.parquet"
    spoil_rows(shard, [3, 7], column="f0")   # 2 rows quarantined: not finite
    key = "lineage-key-4b1d9e"
    env = {"LINEAGE_TEST_KEY": key, "OPENLINEAGE_PARENT_ID": PARENT, "OPENLINEAGE_ROOT_PARENT_ID": ROOT}
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=project, env=env)
    assert result.returncode == 0, result.stderr
    assert "lineage" not in result.stderr
    start, complete = lineage_receiver.events(2)
    out = project / "out" / f"dt={DS}"
    manifest = json.loads((out / "_manifest.json").read_text())
    for event in (start, complete):
        validate(event)
        assert event["job"] == {"namespace": "scoring", "name": "testjob", "facets": event["job"]["facets"]}
        assert event["run"]["runId"] == start["run"]["runId"]
        run = event["run"]["facets"]
        assert run["batchinfer_run"]["attempt"] == manifest["attempt"]
        assert {k: run["batchinfer_triple"][k] for k in manifest["triple"]} == manifest["triple"]
        assert run["batchinfer_model"]["backend"] == "onnxruntime"
        assert run["batchinfer_model"]["options"] == manifest["model_options"]
        assert (run["parent"]["job"]["namespace"], run["parent"]["job"]["name"]) == ("airflow", "nightly_testjob.score")
        assert run["parent"]["run"]["runId"] == PARENT.rsplit("/", 1)[1]
        assert run["parent"]["root"]["job"]["name"] == "nightly_testjob"
        assert run["parent"]["root"]["run"]["runId"] == ROOT.rsplit("/", 1)[1]
        [source] = event["inputs"]
        assert (source["namespace"], source["name"]) == ("file", str(project / "data" / f"dt={DS}"))
        assert [f["name"] for f in source["facets"]["schema"]["fields"]] == ["id", "f0", "f1", "f2", "f3"]
        assert key not in json.dumps(event)
    assert [e["eventType"] for e in (start, complete)] == ["START", "COMPLETE"]
    assert start["outputs"] == []
    # The api key went as the header the client sends, never in an event.
    assert all(headers.get("Authorization") == f"Bearer {key}" for _, headers, _ in lineage_receiver.received)
    assert {path for path, _, _ in lineage_receiver.received} == {"/api/v1/lineage"}

    [source] = complete["inputs"]
    quality = source["inputFacets"]
    assert quality["dataQualityMetrics"]["rowCount"] == 3000
    assert quality["batchinfer_quarantine"]["rowsQuarantined"] == 2 == manifest["totals"]["rows_quarantined"]
    assert sum(r["rows"] for r in quality["batchinfer_quarantine"]["byReason"]) == 2
    assert [a["success"] for a in quality["dataQualityAssertions"]["assertions"]] == [False]
    outputs = {o["name"]: o for o in complete["outputs"]}
    predictions, quarantine = outputs[str(out / "predictions")], outputs[str(out / "quarantine")]
    assert predictions["outputFacets"]["outputStatistics"]["rowCount"] == 2998
    assert quarantine["outputFacets"]["outputStatistics"]["rowCount"] == 2
    files = sorted((out / "predictions").rglob("*.parquet"))
    assert predictions["outputFacets"]["outputStatistics"]["size"] == sum(p.stat().st_size for p in files)
    assert predictions["outputFacets"]["outputStatistics"]["fileCount"] == len(files)
    assert predictions["facets"]["version"]["datasetVersion"] == manifest["attempt"]
    columns = [f["name"] for f in predictions["facets"]["schema"]["fields"]]
    assert columns[:2] == ["id", "y"] and "_model_version" in columns
    assert complete["run"]["facets"]["batchinfer_run"]["action"] == "score"
    metrics = json.loads((out / "_metrics.json").read_text())
    assert metrics["metrics"]["lineage_errors"] == 0.0

    # The rerun is a no-op: its own run, START and COMPLETE with the commit it found.
    again = run_cli("run", "job.yaml", "--ds", DS, cwd=project, env=env)
    assert again.returncode == 0 and "already committed" in again.stdout, again.stderr
    events = lineage_receiver.events(4)[2:]
    for event in events:
        validate(event)
    assert [e["eventType"] for e in events] == ["START", "COMPLETE"]
    assert events[0]["run"]["runId"] == events[1]["run"]["runId"] != start["run"]["runId"]
    assert events[1]["run"]["facets"]["batchinfer_run"]["action"] == "noop"
    assert events[1]["run"]["facets"]["batchinfer_run"]["committedBy"] == manifest["attempt"]
    assert {o["name"] for o in events[1]["outputs"]} == set(outputs)


def test_a_run_refused_before_any_work_sends_one_fail(stamped_template, tmp_path, lineage_receiver):
    project = tmp_path / "p"
    copy_project(stamped_template, project, lineage=lineage_section(lineage_receiver.url))
    result = run_cli("run", "job.yaml", "--ds", DS, "--set", "schema=feats@9", cwd=project,
                     env={"LINEAGE_TEST_KEY": "k" * 12})
    assert result.returncode == 2, result.stderr
    time.sleep(0.5)   # anything else it would have sent
    [fail] = lineage_receiver.events(1)
    validate(fail)
    assert fail["eventType"] == "FAIL"
    run = fail["run"]["facets"]
    assert run["batchinfer_run"]["exitCode"] == 2 and run["batchinfer_run"]["error"] == "UnknownSchemaError"
    assert "feats@9" in run["errorMessage"]["message"]
    assert run["errorMessage"]["message"] in result.stderr   # the line the CLI printed
    assert not (project / "out").exists()


def test_a_receiver_that_is_down_never_fails_the_run(stamped_template, tmp_path):
    project = tmp_path / "p"
    copy_project(stamped_template, project,
                 lineage=lineage_section(f"http://127.0.0.1:{closed_port()}", timeout_s=1.0))
    started = time.monotonic()
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=project, env={"LINEAGE_TEST_KEY": "k" * 12})
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "lineage" in line]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING batchinfer: lineage: could not send"), result.stderr
    assert "metric lineage_errors" in warnings[0]
    metrics = json.loads((project / "out" / f"dt={DS}" / "_metrics.json").read_text())
    assert metrics["metrics"]["lineage_errors"] == 2.0   # START and COMPLETE
    assert time.monotonic() - started < 60


def test_a_run_killed_mid_way_sends_no_complete(stamped_template, tmp_path, lineage_receiver):
    project = tmp_path / "p"
    copy_project(stamped_template, project, lineage=lineage_section(lineage_receiver.url),
                 batch={"rows": 50})   # many batches: the kill lands while it scores
    proc = start_cli("run", "job.yaml", "--ds", DS, cwd=project, env=FRESH, fresh=True)
    try:
        [start] = lineage_receiver.events(1, timeout=120)
        assert proc.poll() is None, "the run ended before it could be killed"
    finally:
        kill_tree(proc.pid)
        proc.wait()
    time.sleep(1.0)
    events = lineage_receiver.events()
    assert [e["eventType"] for e in events] == ["START"]
    validate(start)
    assert not (project / "out" / f"dt={DS}" / "_manifest.json").exists()


def test_ctrl_c_sends_abort(stamped_template, tmp_path, lineage_receiver):
    import signal

    project = tmp_path / "p"
    copy_project(stamped_template, project, lineage=lineage_section(lineage_receiver.url),
                 batch={"rows": 50})
    proc = start_cli("run", "job.yaml", "--ds", DS, cwd=project, env=FRESH, fresh=True)
    lineage_receiver.events(1, timeout=120)
    os.kill(proc.pid, signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 130
    start, abort = lineage_receiver.events(2)
    assert [start["eventType"], abort["eventType"]] == ["START", "ABORT"]
    assert abort["run"]["runId"] == start["run"]["runId"]
    validate(abort)
