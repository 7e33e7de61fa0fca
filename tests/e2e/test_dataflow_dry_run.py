"""``runner.name: dataflow`` built for real, submitted never: ``run --dry-run`` adds Beam's
``dry_run`` option, so Beam's DataflowRunner builds the job (the graph translated, every DoFn
pickled, the options validated, the worker image chosen) and returns before calling the
Dataflow API. No network or credentials are needed, and nothing is written."""
from __future__ import annotations

import re

import pytest

from factories import DS, numeric_project, one_line_error, run_cli, snapshot

pytestmark = pytest.mark.slow

DATAFLOW = {"project": "my-project-123", "region": "europe-west4",
            "temp_location": "gs://my-bucket-123/tmp",
            "sdk_container_image": "europe-docker.pkg.dev/my-project-123/batchinfer/worker:1.0",
            "dataflow_service_options": "worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver"}
# No GroupByKey between the writer and a shard's result (issue 34): the writer writes it; the
# commit's AllShards is the one barrier.
STEPS = ("Shards → Spread → ReadShard → Batches → ShardEnded → Prepare → RunInference → WriteBatch → "
         "Finished → Seed → WithSeed → OnePartition → AllShards → Commit")


def sets(options: dict) -> list[str]:
    args = ["--set", "runner.name=dataflow"]
    for key, value in options.items():
        args += ["--set", f"runner.options.{key}={value}"]
    return args


def test_dry_run_builds_the_dataflow_job_and_submits_nothing(tmp_path):
    numeric_project(tmp_path, shards=2, rows=100)
    before = snapshot(tmp_path)
    result = run_cli("run", "job.yaml", "--ds", DS, "--dry-run", *sets(DATAFLOW), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    print(result.stdout)
    summary = re.search(r"dataflow job '[^']+' \(batch\) built, not submitted: (\d+) transforms "
                        r"\((\d+) primitive\), (\d+) PCollections, \d+ coders, ([\d,]+) bytes of "
                        r"pickled transforms; worker image (\S+)\nsteps: (.+)", result.stdout)
    assert summary, result.stdout
    transforms, primitive, _pcollections, pickled, image, steps = summary.groups()
    assert int(primitive) >= 14 and int(transforms) > int(primitive)
    assert int(pickled.replace(",", "")) > 1000   # the DoFns (plans, handler) really were pickled
    assert image == DATAFLOW["sdk_container_image"]
    assert steps == STEPS
    assert snapshot(tmp_path) == before, "a dry run writes nothing"


@pytest.mark.parametrize("change, says", [
    ({"project": "p"}, "Invalid Project ID (p)"),
    ({"temp_location": None}, "runner.options.temp_location"),
])
def test_options_dataflow_refuses_are_exit_2_before_any_work(tmp_path, change, says):
    numeric_project(tmp_path, shards=1, rows=10)
    options = {k: v for k, v in {**DATAFLOW, **change}.items() if v is not None}
    before = snapshot(tmp_path)
    result = run_cli("run", "job.yaml", "--ds", DS, *sets(options), cwd=tmp_path)
    assert result.returncode == 2
    assert says in one_line_error(result)
    assert snapshot(tmp_path) == before
