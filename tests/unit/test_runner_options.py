"""Runner options (contract §3 ``runner``) and the commit step at the end of the pipeline
(docs/runners.md): built and checked in process, no cluster needed. The runners themselves run
for real in tests/with_servers/test_distributed_runners.py and tests/e2e/test_dataflow_dry_run.py."""
from __future__ import annotations

import dataclasses
import json

import pytest

from batchinfer.pipeline.runner_options import beam_args, pipeline_options
from factories import (
    DS,
    NoTracking,
    kept_for_resume,
    make_mlp_onnx,
    make_shards,
    numeric_project,
    one_line_error,
    run_cli,
    write_job,
    write_schema,
)

FLINK = {"flink_master": "flink-jobmanager:8081", "environment_type": "DOCKER",
         "environment_config": "registry.example.com/batchinfer-worker:1.4", "parallelism": 8,
         "setup_file": "./setup.py", "requirements_file": "requirements.txt"}


def test_flink_takes_flink_master_and_the_portable_options():
    from apache_beam.options.pipeline_options import (
        FlinkRunnerOptions,
        PortableOptions,
        SetupOptions,
        StandardOptions,
    )
    from apache_beam.runners.portability.flink_runner import FlinkRunner
    from apache_beam.runners.runner import create_runner

    options = pipeline_options("flink", FLINK)
    assert options.view_as(StandardOptions).runner == "FlinkRunner"
    assert isinstance(create_runner("FlinkRunner"), FlinkRunner)
    flink = options.view_as(FlinkRunnerOptions)
    assert (flink.flink_master, flink.parallelism) == ("flink-jobmanager:8081", 8)
    portable = options.view_as(PortableOptions)
    assert (portable.environment_type, portable.environment_config) == (
        "DOCKER", "registry.example.com/batchinfer-worker:1.4")
    setup = options.view_as(SetupOptions)
    assert (setup.setup_file, setup.requirements_file) == ("./setup.py", "requirements.txt")
    # Beam would read an option it does not know as an error only when the runner runs; the
    # flags are exactly the spec's options.
    assert sorted(beam_args("flink", FLINK)[1:]) == sorted(f"--{k}={v}" for k, v in FLINK.items())


def test_dask_gets_one_shard_per_partition_unless_told_otherwise():
    from apache_beam.runners.runner import create_runner

    from batchinfer.pipeline.dask import DaskRunner

    args = beam_args("dask", {"dask_client_address": "tcp://127.0.0.1:8786"})
    assert args == ["--runner=batchinfer.pipeline.dask.DaskRunner", "--dask_partition_size=1",
                    "--dask_client_address=tcp://127.0.0.1:8786"]
    assert "--dask_partition_size=1" not in beam_args("dask", {"dask_npartitions": 4})
    assert isinstance(create_runner("batchinfer.pipeline.dask.DaskRunner"), DaskRunner)


@pytest.mark.parametrize("runner, missing", [("flink", "flink_master"), ("portable", "job_endpoint"),
                                             ("dataflow", "project")])
def test_a_remote_runner_without_its_address_is_a_spec_error(tmp_path, runner, missing):
    """Beam would otherwise start an embedded Flink or a Docker job server, or fail after the
    work began: exit 2 before anything runs, naming the option."""
    numeric_project(tmp_path, shards=1, rows=10, stamp=False)
    result = run_cli("plan", "job.yaml", "--ds", DS, "--set", f"runner.name={runner}", cwd=tmp_path)
    assert result.returncode == 2
    assert f"runner.options.{missing}" in one_line_error(result, "plan")


def test_unknown_runner_names_the_known_ones(tmp_path):
    numeric_project(tmp_path, shards=1, rows=10, stamp=False)
    result = run_cli("plan", "job.yaml", "--ds", DS, "--set", "runner.name=spark", cwd=tmp_path)
    assert result.returncode == 2
    assert "dask" in one_line_error(result, "plan")


# -- option names: Beam only warns about a flag it does not know, and runs without it ----------

DASK = {"dask_client_address": "tcp://127.0.0.1:8786"}
DATAFLOW = {"project": "my-project", "region": "europe-west4", "temp_location": "gs://my-bucket/tmp"}


@pytest.mark.parametrize("runner, options, expected", [
    # A local Dask cluster started inside the launcher, which then committed there.
    ("dask", {"dask_client_adress": "tcp://127.0.0.1:8786"},
     "unknown option runner.options.dask_client_adress (did you mean dask_client_address"),
    ("direct", {"direct_num_worker": 2}, "(did you mean direct_num_workers"),
    ("direct", {"totally_bogus": 1, "direct_num_workers": 2}, "unknown option runner.options.totally_bogus."),
    ("dataflow", {**DATAFLOW, "num_worker": 4}, "(did you mean num_workers"),
])
def test_an_option_beam_does_not_know_is_refused_with_the_closest_names(runner, options, expected):
    from batchinfer.errors import SpecError
    from batchinfer.pipeline.runner_options import check

    with pytest.raises(SpecError) as caught:
        check(runner, options)
    message = caught.value.message
    assert message.startswith(f"runner {runner}: ") and expected in message, message
    assert "\n" not in message and "apache_beam/options/pipeline_options.py" in message
    if runner == "dask":  # the runner's own options are listed: its options class was imported
        assert "Runner dask's own options: dask_client_address, dask_connection_timeout" in message


@pytest.mark.parametrize("runner, options, expected", [
    ("dask", {**DASK, "flink_master": "flink-jm:8081"},
     "runner.options.flink_master is an option of runner flink or portable (Beam's "
     "FlinkRunnerOptions), which runner dask ignores"),
    # Not the workers of the Dask cluster: the direct runner's processes.
    ("dask", {**DASK, "direct_num_workers": 4}, "runner.options.direct_num_workers is an option of "
     "runner direct or portable (Beam's DirectOptions), which runner dask ignores"),
    ("flink", {"flink_master": "flink-jm:8081", "direct_num_workers": 4}, "which runner flink ignores"),
    ("direct", {"flink_master": "flink-jm:8081"}, "which runner direct ignores"),
    ("direct", {"runner": "DataflowRunner"}, "runner.options.runner: set runner.name instead"),
])
def test_an_option_of_another_runner_is_refused(runner, options, expected):
    """Known to Beam but read only by another runner: it would do nothing here, which is the
    same surprise as a misspelt option (``parallelism`` on Dask, ``direct_num_workers`` on
    Dask). Exit 2, naming the runner it belongs to and how to clear a file's options."""
    from batchinfer.errors import SpecError
    from batchinfer.pipeline.runner_options import check

    with pytest.raises(SpecError) as caught:
        check(runner, options)
    assert expected in caught.value.message, caught.value.message


@pytest.mark.parametrize("runner, options", [
    ("direct", {}),
    ("direct", {"direct_num_workers": 2, "direct_running_mode": "multi_processing",
                "experiments": ["a", "b"], "no_direct_runner_use_stacked_bundle": True}),
    ("dask", DASK),
    ("dask", {**DASK, "dask_npartitions": 4}),
    ("dataflow", {**DATAFLOW, "num_workers": 4, "sdk_container_image": "img:1"}),
    # A job service may be Flink's or Beam's Python one (an FnApiRunner): both are its options.
    ("portable", {"job_endpoint": "localhost:8099", "environment_type": "EXTERNAL",
                  "environment_config": "localhost:50000", "parallelism": 4, "direct_num_workers": 2}),
    ("flink", FLINK),
])
def test_options_of_the_runner_and_batchinfers_defaults_pass(runner, options, caplog):
    from batchinfer.pipeline.runner_options import check

    check(runner, options)
    assert not [r for r in caplog.records if r.name == "batchinfer"]
    if runner == "dask":  # batchinfer's own default is one of Beam's Dask options
        assert ("--dask_partition_size=1" in beam_args(runner, options)) == ("dask_npartitions" not in options)


@pytest.mark.parametrize("runner, options", [
    ("flink", {"flink_master": "flink-jm:8081", "checkpointing_interval": 60000}),
    ("portable", {"job_endpoint": "localhost:8099", "checkpointing_interval": 60000}),
])
def test_a_job_service_runner_warns_about_an_option_only_its_job_service_may_know(runner, options, caplog):
    """Beam's PortableRunner adds the options its job service describes when the job is
    submitted (the Java Flink runner's ``checkpointing_interval``): they cannot be known before,
    so a name Beam's Python SDK does not know is a warning there, not an error."""
    from batchinfer.pipeline.runner_options import check

    check(runner, options)
    [warning] = [r.getMessage() for r in caplog.records if r.name == "batchinfer"]
    assert warning.startswith(f"runner {runner}: runner.options.checkpointing_interval is not an "
                              f"option Beam knows here; it goes to the job service"), warning


def test_checked_once_checks_a_runner_and_options_once_and_says_its_warnings_each_time(
        monkeypatch, caplog):
    """``backfill``'s block (pipeline/runner_options.checked_once): the same runner and options
    are checked once; another set is checked too; a refusal is not remembered (raised each
    time); the warnings are logged at each check; outside the block every check is done."""
    from batchinfer.errors import SpecError
    from batchinfer.pipeline import runner_options

    done = []
    real = runner_options._check
    monkeypatch.setattr(runner_options, "_check", lambda name, options: done.append(name) or real(name, options))
    service = {"job_endpoint": "localhost:8099", "checkpointing_interval": 60000}
    with runner_options.checked_once():
        for _ in range(3):
            runner_options.check("portable", service)
            runner_options.check("direct", {})
            with pytest.raises(SpecError):
                runner_options.check("direct", {"totally_bogus": 1})
    assert done == ["portable", "direct", "direct", "direct", "direct"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "batchinfer"]
    assert len(warnings) == 3 and len(set(warnings)) == 1, warnings
    runner_options.check("direct", {})
    runner_options.check("direct", {})
    assert done[5:] == ["direct", "direct"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runner-options")
    numeric_project(folder, shards=2, rows=100)
    return folder


@pytest.mark.parametrize("sets, expected", [
    (["runner.name=dask", "runner.options.dask_client_adress=tcp://127.0.0.1:8786"],
     "(did you mean dask_client_address?)"),
    (["runner.options.direct_num_worker=2"], "(did you mean direct_num_workers?)"),
    (["runner.options.totally_bogus=1"], "unknown option runner.options.totally_bogus."),
    (["runner.name=dask", "runner.options.flink_master=flink-jm:8081"],
     "runner.options.flink_master is an option of runner flink or portable"),
])
def test_run_with_an_option_the_runner_does_not_take_exits_2_before_any_work(project, sets, expected):
    args = [a for item in sets for a in ("--set", item)]
    result = run_cli("run", "job.yaml", "--ds", DS, *args, "--set", "output.path=out_refused", cwd=project)
    assert result.returncode == 2, result.stderr
    assert expected in one_line_error(result)
    assert not (project / "out_refused").exists()


def test_run_with_the_runners_own_options_commits(tmp_path):
    """A job file written for Dask, switched to the direct runner as the refusal says
    (``runner.options={}`` clears the file's options), with the direct runner's own options:
    two threads in one process, sharing the model (docs/runners.md "Threads sharing a model")."""
    numeric_project(tmp_path, shards=2, rows=100,
                    runner={"name": "dask", "options": {"dask_client_address": "tcp://x:8786"}})
    result = run_cli("run", "job.yaml", "--ds", DS, "--set", "runner.name=direct",
                     "--set", "runner.options={}", "--set", "runner.options.direct_num_workers=2",
                     "--set", "runner.options.direct_running_mode=multi_threading", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / f"dt={DS}" / "_manifest.json").read_text())
    assert (manifest["runner"], manifest["totals"]["rows_scored"]) == ("direct", 200)


# -- the commit step ----------------------------------------------------------------------------

@pytest.fixture
def job_folder(tmp_path, monkeypatch):
    import batchinfer.io.tracking
    from batchinfer.commands.stamp import stamp
    from batchinfer.spec import load_job

    monkeypatch.setattr(batchinfer.io.tracking, "TrackingRun", NoTracking)
    make_shards(tmp_path / "data" / f"dt={DS}", shards=2, rows=300)
    write_schema(tmp_path / "schemas")
    make_mlp_onnx(tmp_path / "models" / "model.onnx")
    write_job(tmp_path, batch={"rows": 100})
    stamp(load_job(tmp_path / "job.yaml", require_ds=False), None, "model:1")
    return tmp_path


def _pipeline_alone(folder):
    """Run only what a remote runner runs: the pipeline, commit step included, with no launcher
    reading its outcome afterwards (as if the launcher died once the job was submitted)."""
    import batchinfer.commands.run as run_mod
    from batchinfer.app import model_runs as models
    from batchinfer.app import pipeline_run as scoring
    from batchinfer.app.resolve import resolve
    from batchinfer.clock import utc_now
    from batchinfer.io.commit import PartitionCommit
    from batchinfer.spec import load_job

    job = load_job(folder / "job.yaml", ds=DS)
    resolved = resolve(job)
    champion = models.load_champion(resolved)
    started = utc_now()
    attempt = PartitionCommit(job.spec.output.path).begin(run_mod.new_attempt(started))
    scoring.run_pipeline(resolved, champion, attempt,
                         scoring.manifest_header(job, attempt, champion, started, None))
    return job, attempt


def test_the_champions_columns_come_from_its_one_load(job_folder, monkeypatch):
    """The champion's prediction columns (what the baseline and each challenger are matched
    on) are the loaded model's outputs, or ``output.predictions``' columns, known from the one
    load: the handler is built once, not again to ask for its outputs."""
    import onnxruntime as ort

    from batchinfer.app import model_runs as models
    from batchinfer.app.resolve import resolve
    from batchinfer.spec import load_job

    built: list[str] = []
    real_class = models.backend_class

    def counting(backend):
        built.append(backend)
        return real_class(backend)

    monkeypatch.setattr(models, "backend_class", counting)
    outputs = [o.name for o in ort.InferenceSession(str(job_folder / "models" / "model.onnx"))
               .get_outputs()]
    champion = models.load_champion(resolve(load_job(job_folder / "job.yaml", ds=DS)))
    assert champion.columns == tuple(outputs) == ("y",) and built == ["onnxruntime"]
    mapped = load_job(job_folder / "job.yaml", ds=DS, overrides=["output.predictions={y: score}"])
    assert models.load_champion(resolve(mapped)).columns == ("score",)


def test_the_pipeline_commits_without_its_launcher_and_the_rerun_is_a_noop(job_folder):
    from batchinfer.commands.run import run_job

    job, attempt = _pipeline_alone(job_folder)
    out = job_folder / "out" / f"dt={DS}"
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["attempt"] == attempt.attempt and manifest["totals"]["rows_scored"] == 600
    record = json.loads((out / "_tmp" / attempt.attempt / "outcome.json").read_text())
    assert record["status"] == "committed" and record["manifest"] == manifest
    rerun = run_job(job)
    assert rerun.status == "noop" and rerun.manifest.attempt == attempt.attempt
    assert not (out / "_tmp").exists(), "the rerun tidies what the dead launcher never read"


def test_a_refusal_is_recorded_for_the_launcher_and_commits_nothing(job_folder):
    """Above the thresholds the commit step records the exit code and message itself (its
    launcher may be gone) and keeps the attempt's finished shards for a rerun (contract §5.3);
    nothing is committed."""
    import batchinfer.commands.run as run_mod
    from batchinfer.errors import DataQualityError

    write_job(job_folder, batch={"rows": 100}, quarantine={"max_bad_fraction": 0.0},
              schema="feats@1")
    # f0 of every shard lies in [-3, 3]: a schema limit of 2 makes a few rows bad.
    write_schema(job_folder / "schemas", low=-2, high=2)
    from batchinfer.commands.stamp import stamp
    from batchinfer.spec import load_job

    stamp(load_job(job_folder / "job.yaml", require_ds=False), None, "model:1")
    _, attempt = _pipeline_alone(job_folder)
    out = job_folder / "out" / f"dt={DS}"
    assert kept_for_resume(out)
    outcome = attempt.outcome({})
    assert outcome.status == "refused" and outcome.code == DataQualityError.exit_code
    assert outcome.message.startswith("data quality: ")
    with pytest.raises(DataQualityError, match="^data quality: "):
        run_mod.run_job(load_job(job_folder / "job.yaml", ds=DS))
    assert not (out / "_manifest.json").exists()
    # The run was refused the same way, and kept its finished shards too (the pipeline alone,
    # above, has no attempt key for it to adopt): the next commit removes both.
    assert attempt.attempt in {p.name for p in (out / "_tmp").iterdir()}
    assert kept_for_resume(out)


def test_a_retried_commit_step_is_its_own_commit_never_aborted(tmp_path):
    """Runners retry a step whose worker died; if the first try had created the manifest, the
    second must report that commit (and finish its cleanup), not take it for another run's and
    remove its own files."""
    from batchinfer.io.commit import PartitionCommit
    from batchinfer.io.outputs import write_file
    from batchinfer.io.records import FileRecord, Manifest, ShardRecord, Totals

    attempt = PartitionCommit(str(tmp_path / "out")).begin("20260115T000000Z-0000000a")
    data_file = f"predictions/{attempt.attempt}/part-00000-00000.parquet"
    digest = write_file(attempt.layout.fs, attempt.layout.abs(data_file), b"rows")
    shard = ShardRecord(path="s0", sha256="abc", rows_in=1, rows_scored=1, rows_quarantined=0,
                        status="scored", reason=None, files=(FileRecord(data_file, 1, digest),))
    manifest = Manifest(job="j", ds=DS, attempt=attempt.attempt, triple={"model_version": "m:1"},
                        job_spec_sha256="h", runner="dask", device="cpu", started_at="t0",
                        finished_at="t1", mlflow_run_id=None, totals=Totals.of([shard]),
                        shards=(shard,))
    assert attempt.commit(manifest).status == "committed"
    write_file(attempt.layout.fs, attempt.layout.shard_result(0), b"{}")  # the retry's scratch
    again = attempt.commit(dataclasses.replace(manifest, finished_at="t2"))
    assert (again.status, again.manifest) == ("committed", manifest)
    assert (tmp_path / "out" / data_file).read_bytes() == b"rows"
    assert not (tmp_path / "out" / "_tmp").exists()



def test_the_commit_step_in_this_process_asks_for_the_mlflow_run_id_when_it_writes_the_manifest():
    """Beam pickles the commit step as the graph is built: what travels is a key, so building
    never waits for the helper; the id is asked for when the step needs it, and a copy in a
    process that has no entry (not the launcher's) gets None, as when tracking failed."""
    import pickle

    from batchinfer.pipeline.commit_step import InThisProcess

    asked = []
    later = InThisProcess(lambda: asked.append(1) or "run-42")
    copy = pickle.loads(pickle.dumps(later))
    assert asked == []                                    # pickling asked nothing
    assert copy.value() == "run-42" and asked == [1]      # asked when the step needs it
    later.forget()
    assert copy.value() is None                           # elsewhere (or after the run): None
