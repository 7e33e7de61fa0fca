"""Job metrics to MLflow (contract §4 ``mlflow_run_id``, §5.7): a real ``mlflow server``, an outage
and its later upload with ``batchinfer track``, and concurrent runs on one sqlite store."""
from __future__ import annotations

import json
import shutil
import signal
import time
import uuid
from datetime import datetime
from pathlib import Path

import pytest

from factories import DS, run_cli
from servers import closed_port, copy_project, finish_all, start_cli

pytestmark = pytest.mark.slow

ROWS_IN = 3000


def output_dir(project: Path, ds: str = DS) -> Path:
    return project / "out" / f"dt={ds}"


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def millis(rfc3339: str) -> int:
    """A manifest's ``started_at``/``finished_at`` in epoch milliseconds, as MLflow keeps times."""
    return int(datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp() * 1000)


# MLflow's start may be the job's start to the millisecond; a run opened when MLflow's helper is
# ready (after its import and the model's load) starts seconds later.
START_SLACK_MS = 250


def assert_spans_the_job(run, manifest: dict, before_ms: int, after_ms: int) -> None:
    """The MLflow run starts when the job starts and ends after its commit, within the CLI run."""
    started, finished = millis(manifest["started_at"]), millis(manifest["finished_at"])
    assert before_ms <= run.info.start_time <= started + START_SLACK_MS, (run.info, manifest)
    assert finished <= run.info.end_time <= after_ms, (run.info, manifest)


@pytest.mark.server
def test_one_run_per_job_with_triple_counts_and_manifest(tmp_path, mlflow_live, stamped_template):
    experiment = f"tracking-{uuid.uuid4().hex[:8]}"
    job = copy_project(stamped_template, tmp_path,
                       tracking={"uri": mlflow_live.uri, "experiment": experiment})
    before = int(time.time() * 1000)
    result = run_cli("run", str(job), "--ds", DS, cwd=tmp_path, track=True)
    after = int(time.time() * 1000)
    assert result.returncode == 0, result.stderr
    out = output_dir(tmp_path)
    manifest = read_json(out / "_manifest.json")
    run_id = manifest["mlflow_run_id"]
    assert run_id and f"tracking: MLflow run {run_id}" in result.stdout

    client = mlflow_live.client()
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # one run per job
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert_spans_the_job(run, manifest, before, after)
    # A server keeps artifacts where it is told to (here --artifacts-destination), not batchinfer.
    assert run.info.artifact_uri.startswith("mlflow-artifacts:"), run.info.artifact_uri
    params = run.data.params
    for part, value in manifest["triple"].items():
        assert params[f"triple.{part}"] == value
    assert params["job_spec_sha256"] == manifest["job_spec_sha256"]
    metrics = run.data.metrics
    assert (metrics["rows_in"], metrics["rows_scored"], metrics["rows_quarantined"]) == (ROWS_IN, ROWS_IN, 0)
    artifact = Path(client.download_artifacts(run_id, "manifest.json", str(tmp_path / "dl")))
    assert json.loads(artifact.read_text()) == manifest
    record = read_json(out / "_metrics.json")
    assert record["uploaded"] is True and record["mlflow_run_id"] == run_id


@pytest.mark.server
def test_outage_commits_then_track_uploads(tmp_path, mlflow_live, stamped_template):
    experiment = f"outage-{uuid.uuid4().hex[:8]}"
    job = copy_project(stamped_template, tmp_path,
                       tracking={"uri": f"http://127.0.0.1:{closed_port()}", "experiment": experiment})
    result = run_cli("run", str(job), "--ds", DS, cwd=tmp_path, track=True)
    assert result.returncode == 0, result.stderr
    out = output_dir(tmp_path)
    manifest = read_json(out / "_manifest.json")  # committed despite the outage
    assert manifest["mlflow_run_id"] is None
    assert manifest["totals"]["rows_scored"] == ROWS_IN
    said = [line for line in result.stdout.splitlines() if "MLflow unavailable" in line]
    assert len(said) == 1, result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    record = read_json(out / "_metrics.json")
    assert record["uploaded"] is False and record["error"]
    assert record["metrics"]["rows_in"] == ROWS_IN

    track = run_cli("track", str(out), "--tracking-uri", mlflow_live.uri, cwd=tmp_path, track=True)
    assert track.returncode == 0, track.stderr
    record = read_json(out / "_metrics.json")
    assert record["uploaded"] is True and record["error"] is None
    run_id = record["mlflow_run_id"]
    assert run_id and run_id in track.stdout
    run = mlflow_live.client().get_run(run_id)
    assert run.data.metrics["rows_in"] == ROWS_IN and run.data.metrics["rows_scored"] == ROWS_IN
    # Uploaded later, the run still spans the job: the manifest's start to its commit.
    assert (run.info.start_time, run.info.end_time) == (millis(manifest["started_at"]),
                                                       millis(manifest["finished_at"]))
    assert run.data.params["triple.model_digest"] == manifest["triple"]["model_digest"]
    artifacts = {a.path for a in mlflow_live.client().list_artifacts(run_id)}
    assert {"manifest.json", "report.html"} <= artifacts, artifacts   # as a run would have logged
    exp = mlflow_live.client().get_experiment_by_name(experiment)
    assert run.info.experiment_id == exp.experiment_id
    # Uploading again is a no-op: still one run.
    again = run_cli("track", str(out), "--tracking-uri", mlflow_live.uri, cwd=tmp_path, track=True)
    assert again.returncode == 0 and run_id in again.stdout
    assert len(mlflow_live.client().search_runs([exp.experiment_id])) == 1


def partitions_project(template: Path, dest: Path, dates: list[str], *, store: bool) -> Path:
    """One job over many partitions (one 1000-row shard each), tracking to ``dest/mlflow.db``."""
    job = copy_project(template, dest, store=store,
                       input={"path": "data/dt={ds}/part-00000.parquet"})
    shard = template / "data" / f"dt={DS}" / "part-00000.parquet"
    for ds in dates:
        (dest / "data" / f"dt={ds}").mkdir(parents=True, exist_ok=True)
        shutil.copy(shard, dest / "data" / f"dt={ds}" / "part-00000.parquet")
    return job


def run_concurrently(job: Path, dates: list[str], cwd: Path) -> dict[str, tuple[int, str, str]]:
    procs = [start_cli("run", str(job), "--ds", ds, cwd=cwd) for ds in dates]
    return dict(zip(dates, finish_all(procs)))


def sqlite_runs(db: Path) -> dict[str, dict]:
    """run id → {status, metrics} straight from the store (no MLflow involved)."""
    import sqlite3

    con = sqlite3.connect(db)
    try:
        runs = {rid: {"status": status, "metrics": {}} for rid, status in
                con.execute("select run_uuid, status from runs")}
        for rid, key, value in con.execute("select run_uuid, key, value from latest_metrics"):
            runs[rid]["metrics"][key] = value
    finally:
        con.close()
    return runs


def test_six_concurrent_runs_on_an_existing_sqlite_store(tmp_path, stamped_template):
    dates = [f"2026-02-{d:02d}" for d in range(1, 7)]
    job = partitions_project(stamped_template, tmp_path, dates, store=True)
    results = run_concurrently(job, dates, tmp_path)
    runs = sqlite_runs(tmp_path / "mlflow.db")
    for ds, (rc, _out, err) in results.items():
        assert rc == 0, (ds, err)
        manifest = read_json(output_dir(tmp_path, ds) / "_manifest.json")
        assert manifest["totals"]["rows_scored"] == 1000
        record = read_json(output_dir(tmp_path, ds) / "_metrics.json")
        # The store existed: every run is tracked, once, with its metrics.
        assert record["uploaded"] is True, (ds, record["error"])
        run = runs[manifest["mlflow_run_id"]]
        assert run["status"] == "FINISHED" and run["metrics"]["rows_in"] == 1000
    assert len(runs) == len(dates)


def test_two_runs_racing_on_a_new_sqlite_store_still_commit(tmp_path, stamped_template):
    """Measured: two processes creating a *new* sqlite store at once can fail. Whatever tracking
    does then, both partitions commit; a run that could not track says so, keeps its metrics
    beside the manifest, and `batchinfer track` uploads them afterwards."""
    dates = ["2026-03-01", "2026-03-02"]
    job = partitions_project(stamped_template, tmp_path, dates, store=False)
    assert not (tmp_path / "mlflow.db").exists()
    results = run_concurrently(job, dates, tmp_path)
    outcome = {}
    for ds, (rc, out, err) in results.items():
        assert rc == 0, (ds, err)
        out_dir = output_dir(tmp_path, ds)
        manifest = read_json(out_dir / "_manifest.json")
        assert manifest["totals"]["rows_scored"] == 1000
        record = read_json(out_dir / "_metrics.json")
        outcome[ds] = (record["uploaded"], record["error"])
        # The first use of a new sqlite store is locked (tracking.sqlite_first_use_lock).
        assert record["uploaded"], record["error"]
        if record["uploaded"]:
            assert manifest["mlflow_run_id"] in sqlite_runs(tmp_path / "mlflow.db")
        else:
            assert sum("MLflow unavailable" in line for line in out.splitlines()) == 1, out
            track = run_cli("track", str(out_dir), cwd=tmp_path, track=True)
            assert track.returncode == 0, track.stderr
            assert read_json(out_dir / "_metrics.json")["uploaded"] is True
    print(f"new-store race: {outcome}")  # reported by the test run (-s / -rA)


def test_concurrent_jobs_racing_to_create_the_experiment_share_it():
    """Two jobs of one experiment on a store that lacks it: the second create fails (UNIQUE
    constraint); the job must then use the experiment the other one created."""
    from types import SimpleNamespace

    from batchinfer.io.tracking import experiment_id_for

    class RacingClient:
        created = False

        def get_experiment_by_name(self, name):
            return SimpleNamespace(experiment_id="7") if self.created else None

        def create_experiment(self, name, artifact_location=None):
            self.created = True  # the other job got there first
            raise RuntimeError(f"Experiment(name={name}) already exists")

    assert experiment_id_for(RacingClient(), "testjob") == "7"

    class Broken(RacingClient):
        def create_experiment(self, name, artifact_location=None):
            raise RuntimeError("store unavailable")

    with pytest.raises(RuntimeError, match="store unavailable"):
        experiment_id_for(Broken(), "testjob")


def test_a_sqlite_run_spans_the_job_and_keeps_its_artifacts_beside_the_store(tmp_path, stamped_template):
    """A sqlite store in its own folder, a job run from a third folder: the experiment the run
    creates keeps its artifacts in ``mlartifacts/`` beside the database (not ``./mlruns`` of the
    run's working directory), and the run's times are the job's."""
    from mlflow.tracking import MlflowClient

    project, store, elsewhere = tmp_path / "project", tmp_path / "store", tmp_path / "elsewhere"
    store.mkdir()
    elsewhere.mkdir()
    shutil.copy(stamped_template / "mlflow.db", store / "mlflow.db")  # a store without the experiment
    uri = f"sqlite:///{store / 'mlflow.db'}"
    job = copy_project(stamped_template, project, store=False,
                       tracking={"uri": uri, "experiment": "beside the store"})
    before = int(time.time() * 1000)
    result = run_cli("run", str(job), "--ds", DS, cwd=elsewhere, track=True)
    after = int(time.time() * 1000)
    assert result.returncode == 0, result.stderr
    manifest = read_json(output_dir(project) / "_manifest.json")
    run = MlflowClient(tracking_uri=uri).get_run(manifest["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert_spans_the_job(run, manifest, before, after)
    folder = store / "mlartifacts" / "beside_the_store" / run.info.run_id / "artifacts"
    assert run.info.artifact_uri.removeprefix("file://") == str(folder), run.info.artifact_uri
    assert json.loads((folder / "manifest.json").read_text()) == manifest
    assert (folder / "report.html").is_file()
    assert not list(elsewhere.iterdir()) and not (project / "mlruns").exists()


def test_artifact_location_is_beside_a_sqlite_store_and_left_to_other_stores(tmp_path, monkeypatch):
    from batchinfer.io.tracking import artifact_location

    assert artifact_location("sqlite:////data/mlflow.db", "credit risk") == "/data/mlartifacts/credit_risk"
    assert artifact_location("sqlite:////data/m.db?timeout=5", "../up/x") == "/data/mlartifacts/_up_x"
    monkeypatch.chdir(tmp_path)  # a relative store (batchinfer track --tracking-uri) is the cwd's
    assert artifact_location("sqlite:///m.db", "e") == str(tmp_path / "mlartifacts" / "e")
    assert artifact_location("http://127.0.0.1:5000", "e") is None
    assert artifact_location("sqlite:///:memory:", "e") is None
    assert artifact_location(str(tmp_path / "mlruns"), "e") is None


def not_tracked_here(*folders: Path) -> None:
    """No MLflow folder in any of ``folders``: a run writes only under output.path, the store's
    folder and its scratch (the hardening issue, item 13)."""
    for folder in folders:
        found = [p for p in folder.rglob("*") if p.name in ("mlruns", "mlartifacts")]
        assert not found, found


def artifacts_beside(uri: str, store: Path, run_id: str, manifest: dict) -> None:
    """The run's artifacts are in the store's ``mlartifacts/`` and MLflow reads them back."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(store / "mlartifacts"), \
        run.info.artifact_uri
    assert {a.path for a in client.list_artifacts(run_id)} == {"manifest.json", "report.html"}
    read = store.parent / "read" / run_id
    read.mkdir(parents=True)
    assert json.loads(Path(client.download_artifacts(run_id, "manifest.json", str(read))).read_text()) == manifest


def two_folders_one_store(tmp_path: Path, template: Path, experiment: str
                          ) -> tuple[Path, Path, str, list[Path]]:
    """A job folder, a store in a folder of its own and two working directories to run from."""
    project, store = tmp_path / "project", tmp_path / "store"
    cwds = [tmp_path / "ann", tmp_path / "bob"]
    for folder in (store, *cwds):
        folder.mkdir()
    uri = f"sqlite:///{store / 'mlflow.db'}"
    copy_project(template, project, store=False, tracking={"uri": uri, "experiment": experiment})
    return project, store, uri, cwds


@pytest.mark.parametrize("experiment", ["Default", "nightly"])
def test_runs_from_two_folders_keep_their_artifacts_beside_a_new_sqlite_store(
        tmp_path, stamped_template, experiment):
    """A store the first run makes: MLflow's ``Default`` experiment (made with the store) used to
    keep its artifacts in ``./mlruns`` of whoever ran first, so a run from another folder wrote
    into theirs. Now every run's artifacts are beside the store, wherever it runs from."""
    from mlflow.tracking import MlflowClient

    project, store, uri, cwds = two_folders_one_store(tmp_path, stamped_template, experiment)
    for i, cwd in enumerate(cwds):
        result = run_cli("run", str(project / "job.yaml"), "--ds", DS, "--set",
                         f"output.path=out/{i}/dt={{ds}}", cwd=cwd, track=True)
        assert result.returncode == 0, result.stderr
        manifest = read_json(project / "out" / str(i) / f"dt={DS}" / "_manifest.json")
        assert manifest["mlflow_run_id"], result.stdout
        artifacts_beside(uri, store, manifest["mlflow_run_id"], manifest)
        assert not list(cwd.iterdir()), list(cwd.iterdir())
    not_tracked_here(project, *cwds)
    default = MlflowClient(tracking_uri=uri).get_experiment("0")
    assert default.artifact_location.removeprefix("file://") == str(store / "mlartifacts" / "0")


def test_an_experiment_made_elsewhere_keeps_its_location_and_our_runs_stay_beside_the_store(
        tmp_path, stamped_template, monkeypatch):
    """A store MLflow made from a third folder (its ``Default`` experiment there), and an
    experiment an older batchinfer created there without a location: their locations are
    ``<that folder>/mlruns/<id>``. Runs from two other folders, and a run's later upload
    (``batchinfer track``), put their artifacts beside the store; the experiments keep theirs."""
    from mlflow.tracking import MlflowClient

    project, store, uri, cwds = two_folders_one_store(tmp_path, stamped_template, "old")
    creator = tmp_path / "creator"
    creator.mkdir()
    monkeypatch.chdir(creator)   # where MLflow takes its default artifact root from
    client = MlflowClient(tracking_uri=uri)
    old = client.create_experiment("old")   # as batchinfer did before artifact_location()
    locations = {e.experiment_id: e.artifact_location for e in client.search_experiments()}
    assert locations == {"0": str(creator / "mlruns" / "0"), old: str(creator / "mlruns" / old)}
    monkeypatch.chdir(tmp_path)
    runs = []
    for i, (cwd, experiment) in enumerate(zip(cwds, ("old", "Default"))):
        result = run_cli("run", str(project / "job.yaml"), "--ds", DS, "--set",
                         f"output.path=out/{i}/dt={{ds}}", "--set",
                         f"tracking.experiment={experiment}", cwd=cwd, track=True)
        assert result.returncode == 0, result.stderr
        manifest = read_json(project / "out" / str(i) / f"dt={DS}" / "_manifest.json")
        runs.append(manifest["mlflow_run_id"])
        artifacts_beside(uri, store, manifest["mlflow_run_id"], manifest)
    # Uploaded later by `batchinfer track`, from another folder: the same.
    late = run_cli("run", str(project / "job.yaml"), "--ds", DS, "--set", "output.path=out/late/dt={ds}",
                   "--set", f"tracking.uri=http://127.0.0.1:{closed_port()}", cwd=cwds[0], track=True)
    assert late.returncode == 0, late.stderr
    out = project / "out" / "late" / f"dt={DS}"
    track = run_cli("track", str(out), "--tracking-uri", uri, cwd=cwds[1], track=True)
    assert track.returncode == 0, track.stderr
    record = read_json(out / "_metrics.json")
    assert record["uploaded"] is True
    artifacts_beside(uri, store, record["mlflow_run_id"], read_json(out / "_manifest.json"))
    assert record["mlflow_run_id"] in {r.info.run_id for r in client.search_runs([old])}
    for cwd in cwds:
        assert not list(cwd.iterdir()), list(cwd.iterdir())
    not_tracked_here(project, creator, *cwds)
    assert {e.experiment_id: e.artifact_location for e in client.search_experiments()} == locations


def test_which_locations_are_mlflows_default_from_another_folder():
    from batchinfer.io.tracking import misplaced

    store = "sqlite:////data/mlflow.db"
    assert misplaced("/home/ann/mlruns/0", "0", store)             # Default, made from ann's folder
    assert misplaced("file:///home/ann/mlartifacts/3", "3", store)
    assert misplaced("mlruns/3", "3", store)                       # relative: every run's own cwd
    assert not misplaced("/data/mlartifacts/0", "0", store)         # beside the store
    assert not misplaced("/data/mlruns/3", "3", store)
    assert not misplaced("/data/mlartifacts/nightly", "3", store)  # batchinfer's
    assert not misplaced("/shared/artifacts/credit", "3", store)   # chosen
    assert not misplaced("s3://bucket/mlruns/3", "3", store)
    assert not misplaced("/home/ann/mlruns/0", "0", "http://127.0.0.1:5000")   # the server decides


def test_a_store_path_from_the_environment_is_not_sent_to_mlflow():
    """contract §3: MLflow receives no ``${NAME}`` value, so a sqlite store whose path holds one
    leaves the location to MLflow rather than writing it into the experiment."""
    from batchinfer import redaction
    from batchinfer.io.tracking import TrackingRun, spec_free

    with redaction.scope():
        redaction.register({"BI_STORES": "/private/stores"})
        assert spec_free("/private/stores/mlartifacts/e") is None
        assert spec_free("/data/mlartifacts/e") == "/data/mlartifacts/e" and spec_free(None) is None
        run = TrackingRun("sqlite:////private/stores/mlflow.db", "e")
        try:
            assert run.artifacts is None
        finally:
            run.close()


# -- MLflow's settings: in the environment for batchinfer's MLflow calls only -------------------

def test_mlflow_settings_hold_while_a_block_runs_and_a_users_own_win(monkeypatch):
    """MLflow reads its settings from the environment alone; batchinfer's are there while its
    MLflow calls run and gone afterwards, overlapping blocks (threads) included."""
    import os
    import threading

    from mlflow.environment_variables import (
        MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR,
        MLFLOW_HTTP_REQUEST_MAX_RETRIES,
        MLFLOW_HTTP_REQUEST_TIMEOUT,
    )

    from batchinfer.io.tracking import MLFLOW_DEFAULTS
    from batchinfer.io.tracking import mlflow_settings as settings
    from batchinfer.triple.models import QUIET_DOWNLOADS

    for name in [*MLFLOW_DEFAULTS, *QUIET_DOWNLOADS]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "99")   # the user's own
    before = dict(os.environ)
    with settings(QUIET_DOWNLOADS):
        assert (MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_TIMEOUT.get()) == (2, 99)
        assert MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.get() is False
        with settings():
            pass
        assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 2   # the inner block left the outer's
    assert dict(os.environ) == before
    entered, leave = threading.Event(), threading.Event()

    def other() -> None:
        with settings():
            entered.set()
            leave.wait(30)

    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(30)
    with settings():
        leave.set()
        thread.join()
        assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 2   # the other block ended first
    assert dict(os.environ) == before


def test_the_registry_is_read_and_written_without_leaving_mlflow_settings_behind(tmp_path, monkeypatch):
    """A model registered, declared and resolved in process (``stamp``, ``run``) as before; the
    process environment is as it was."""
    import os

    import polars  # noqa: F401  (its first import sets _RJEM_MALLOC_CONF: not ours to compare)

    from batchinfer.io.tracking import MLFLOW_DEFAULTS
    from batchinfer.triple.contract import Triple
    from batchinfer.triple.models import QUIET_DOWNLOADS, declare, register_model, resolve_model
    from factories import make_mlp_onnx

    for name in [*MLFLOW_DEFAULTS, *QUIET_DOWNLOADS]:
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    make_mlp_onnx(tmp_path / "model" / "model.onnx")
    uri = register_model(tmp_path / "model", "settings-check", store)
    assert uri == "models:/settings-check/1" and dict(os.environ) == before
    resolved = resolve_model(uri, "onnxruntime", store)
    triple = Triple("settings-check:1", "d" * 64, "feats@1", "p" * 64)
    assert declare(resolved, triple, store) == f"tags of {uri}" and dict(os.environ) == before
    again = resolve_model(uri, "onnxruntime", store)
    assert again.path.name == "model.onnx" and again.declaration == triple.as_dict()
    assert dict(os.environ) == before


# -- one helper for a process's runs (backfill dates, in-process callers of the CLI) -------------

def tracked(uri: str, experiment: str, name: str, status: str = "FINISHED"):
    """One TrackingRun through prepare, open and finish, as a job makes it; returns its helper,
    run id, whether all was uploaded, and the bounds of its finish call (epoch ms)."""
    from batchinfer.io.tracking import TrackingRun

    run = TrackingRun(uri, experiment)
    helper = run._child
    run.prepare()
    run.open(name, {"batchinfer.job": name}, started=datetime.now().astimezone())
    run_id = run.wait()
    before = int(time.time() * 1000)
    ok = run.finish({"attempt": name}, {"rows": float(len(name))}, {"note.txt": name}, status,
                    tags={"batchinfer.ds": name})
    return helper, run_id, ok, (before, int(time.time() * 1000))


def sqlite_store(stamped_template: Path, folder: Path) -> str:
    shutil.copy(stamped_template / "mlflow.db", folder / "mlflow.db")  # migrated already
    return f"sqlite:///{folder / 'mlflow.db'}"


def test_runs_in_one_process_share_one_helper_and_each_gets_its_own_mlflow_run(tmp_path, stamped_template):
    """The second run takes the helper the first one finished with (no MLflow import again);
    each MLflow run is complete and its own: params, metrics, tags, artifact, start and end."""
    from mlflow.tracking import MlflowClient

    uri = sqlite_store(stamped_template, tmp_path)
    first = tracked(uri, "shared-helper", "first")
    second = tracked(uri, "shared-helper", "second")
    assert second[0] is first[0] and second[0].pid == first[0].pid
    assert first[2] and second[2] and first[1] != second[1]
    client = MlflowClient(tracking_uri=uri)
    for name, (_, run_id, _, (before, after)) in (("first", first), ("second", second)):
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.info.run_name == name
        assert run.data.params == {"attempt": name} and run.data.metrics == {"rows": len(name)}
        assert run.data.tags["batchinfer.job"] == name and run.data.tags["batchinfer.ds"] == name
        assert client.download_artifacts(run_id, "note.txt", str(tmp_path)) and (
            (tmp_path / "note.txt").read_text() == name)
        assert run.info.start_time < before <= run.info.end_time <= after, run.info
    assert client.get_run(second[1]).info.start_time >= client.get_run(first[1]).info.end_time


def test_a_changed_environment_gets_a_new_helper_and_a_failed_run_hands_none_on(
        tmp_path, stamped_template, monkeypatch):
    """A helper is reused only by a run that would start the same one, and only after a run
    that ended well. A kept helper that the next run cannot use is killed (it holds nothing); a
    failed run's own helper is stopped (it exits: its stdin was closed)."""
    uri = sqlite_store(stamped_template, tmp_path)
    first = tracked(uri, "new-helper", "first")
    monkeypatch.setenv("BATCHINFER_TEST_HELPER", "changed")
    changed = tracked(uri, "new-helper", "changed")
    assert changed[0] is not first[0] and changed[1] and changed[2]
    assert first[0].wait(timeout=30) == -signal.SIGKILL
    failed = tracked(uri, "new-helper", "failed", status="FAILED")
    assert failed[0] is changed[0] and failed[1] and failed[2]   # the same environment: reused
    assert failed[0].wait(timeout=30) == 0                        # then stopped, not kept


def test_a_run_whose_tracking_failed_does_not_hand_its_helper_on(tmp_path, stamped_template):
    """MLflow failed for the run (its store cannot be created: a file where its folder should
    be): its helper is stopped, and the next run, on a good store, gets a new one and tracks
    normally."""
    (tmp_path / "file").write_text("")
    broken = tracked(f"sqlite:///{tmp_path / 'file' / 'mlflow.db'}", "broken", "broken")
    assert broken[1] is None and not broken[2]
    assert broken[0].wait(timeout=30) == 0
    good_uri = sqlite_store(stamped_template, tmp_path)
    good = tracked(good_uri, "broken", "good")
    assert good[0] is not broken[0] and good[1] and good[2]
    assert tracked(good_uri, "broken", "again")[0] is good[0]   # and that one is reused


def test_a_helper_never_asked_anything_is_kept_for_the_next_run(tmp_path, stamped_template,
                                                               monkeypatch):
    """A run that stopped before touching the store (a no-op date of a backfill, a refused job)
    hands its helper, which did nothing yet, to the next run; one that the next run cannot use
    is killed, and so is the kept helper at the process's end."""
    from batchinfer.io.tracking import TrackingRun, stop_kept_helper

    refused = TrackingRun("sqlite:////nowhere/mlflow.db", "unused")
    other_environment = refused._child
    refused.close()
    monkeypatch.setenv("BATCHINFER_TEST_HELPER", "other")
    unused = TrackingRun("sqlite:////nowhere/mlflow.db", "unused")
    helper = unused._child
    # Killed, not stopped: a closed stdin would let it finish importing MLflow (~2 s of CPU).
    assert helper is not other_environment and other_environment.wait(timeout=30) == -signal.SIGKILL
    unused.close()
    used = tracked(sqlite_store(stamped_template, tmp_path), "unused", "used")
    assert used[0] is helper and used[1] and used[2]
    # The CLI's end (cli.run) kills the kept helper: it would otherwise finish the MLflow import
    # of a refused or no-op run before noticing its stdin closed.
    stop_kept_helper()
    assert helper.wait(timeout=30) == -signal.SIGKILL
