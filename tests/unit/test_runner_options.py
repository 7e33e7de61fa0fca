"""Runner options (SPEC §3 ``runner``) and the commit step at the end of the pipeline
(docs/runners.md): built and checked in process, no cluster needed. The runners themselves run
for real in tests/with_servers/test_distributed_runners.py and tests/e2e/test_dataflow_dry_run.py."""
from __future__ import annotations

import dataclasses
import json

import pytest

from batchinfer.pipeline.runners import beam_args, pipeline_options
from factories import (
    DS,
    NoTracking,
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
    from batchinfer.commands.resolve import resolve
    from batchinfer.io.commit import PartitionCommit
    from batchinfer.spec import load_job

    job = load_job(folder / "job.yaml", ds=DS)
    resolved = resolve(job)
    handler, device = run_mod.load_handler(resolved)
    started = run_mod.utc_now()
    attempt = PartitionCommit(job.spec.output.path).begin(run_mod.new_attempt(started))
    run_mod._score(resolved, handler, attempt, run_mod._header(job, resolved, attempt, device,
                                                               started, None))
    return job, attempt


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
    """Above the thresholds the commit step removes the attempt's files itself (its launcher may
    be gone) and records the exit code and message; nothing is committed."""
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
    assert not (out / "_manifest.json").exists()
    assert not (out / "predictions" / attempt.attempt).exists()
    outcome = attempt.outcome({})
    assert outcome.status == "refused" and outcome.code == DataQualityError.exit_code
    assert outcome.message.startswith("data quality: ")
    with pytest.raises(DataQualityError, match="^data quality: "):
        run_mod.run_job(load_job(job_folder / "job.yaml", ds=DS))
    assert not (out / "_manifest.json").exists()
    # The launcher that read its refusal removed its record; the one that never did (above)
    # left one, which the next commit removes with the rest of the scratch.
    assert [p.name for p in (out / "_tmp").iterdir()] == [attempt.attempt]
    assert not any((out / "predictions").iterdir())


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
    shard = ShardRecord("s0", "abc", 1, 1, 0, "scored", None, (FileRecord(data_file, 1, digest),))
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

