"""``${NAME}`` values and AWS credentials never leak (SPEC §3): not in outputs, logs, MLflow.

One distinctive secret is used where users put credentials: the MLflow URI's userinfo, an S3
prefix of the input and output paths, and a Beam runner option. After each run every byte the
job could have written is searched for it: stdout, stderr, every object under the output, the
local job folder, the MLflow server's sqlite store, artifacts and log.
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from factories import DS, run_cli
from servers import closed_port, copy_project, env_for

pytestmark = [pytest.mark.server, pytest.mark.slow]


@pytest.fixture
def secrets():
    token = f"tok3n{uuid.uuid4().hex[:16]}"
    aws_secret = f"awsKEY{uuid.uuid4().hex[:16]}"
    return token, aws_secret


def local_hits(folder: Path, needles: list[bytes]) -> list[str]:
    hits = []
    for path in folder.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits += [f"{path}: {n!r}" for n in needles if n in data]
    return hits


def s3_hits(fs, root: str, needles: list[bytes]) -> list[str]:
    fs.invalidate_cache()
    hits = []
    for key in fs.find(root):
        data = fs.cat_file(key)
        hits += [f"s3://{key}: {n!r}" for n in needles if n in data]
    return hits


def text_hits(name: str, text: str, needles: list[bytes]) -> list[str]:
    return [f"{name}: {n!r}" for n in needles if n.decode() in text]


def secret_env(s3_endpoint: str, token: str, aws_secret: str) -> dict[str, str]:
    return {**env_for(s3_endpoint), "AWS_SECRET_ACCESS_KEY": aws_secret, "BI_TOKEN": token}


def test_secrets_stay_out_of_outputs_logs_and_mlflow(tmp_path, s3_server, new_bucket, mlflow_live,
                                                    stamped_template, secrets):
    token, aws_secret = secrets
    needles = [token.encode(), aws_secret.encode()]
    fs = s3_server.s3fs()
    for shard in sorted((stamped_template / "data" / f"dt={DS}").glob("*.parquet")):
        fs.pipe_file(f"{new_bucket}/in-{token}/dt={DS}/{shard.name}", shard.read_bytes())
    job = copy_project(
        stamped_template, tmp_path,
        input={"path": f"s3://{new_bucket}/in-${{BI_TOKEN}}/dt={{ds}}/*.parquet"},
        output={"path": f"s3://{new_bucket}/out-${{BI_TOKEN}}/dt={{ds}}", "id_columns": ["id"]},
        tracking={"uri": f"http://batchinfer:${{BI_TOKEN}}@127.0.0.1:{mlflow_live.port}",
                  "experiment": f"secrets-{uuid.uuid4().hex[:8]}"},
        runner={"name": "direct", "options": {"job_name": "nightly-${BI_TOKEN}"}})
    assert token.encode() not in job.read_bytes()  # the job file names the variable only
    env = secret_env(s3_server.endpoint, token, aws_secret)
    result = run_cli("run", str(job), "--ds", DS, cwd=tmp_path, env=env, track=True)
    assert result.returncode == 0, result.stderr
    assert "tracking: MLflow run" in result.stdout  # the secret-bearing URI really was used
    output = f"{new_bucket}/out-{token}/dt={DS}"
    manifest = fs.cat_file(f"{output}/_manifest.json")
    assert b"s3://%s/in-${BI_TOKEN}/dt=" % new_bucket.encode() in manifest  # shown, not expanded
    assert fs.exists(f"{output}/_metrics.json")

    hits = (text_hits("stdout", result.stdout, needles) + text_hits("stderr", result.stderr, needles)
            + s3_hits(fs, output, needles)
            + local_hits(tmp_path, needles)
            + local_hits(mlflow_live.workdir, needles))  # sqlite store, artifacts, server log
    assert hits == []
    assert len(list(mlflow_live.artifacts.rglob("manifest.json"))) >= 1  # artifacts were searched


def test_secrets_stay_out_of_error_lines_and_offline_metrics(tmp_path, s3_server, new_bucket,
                                                             mlflow_live, stamped_template, secrets):
    """Failures quote paths and URIs: they must quote them with ``${NAME}``, not the value; and
    ``batchinfer track`` expands the ``${NAME}`` kept in ``_metrics.json`` again to upload."""
    token, aws_secret = secrets
    needles = [token.encode(), aws_secret.encode()]
    env = secret_env(s3_server.endpoint, token, aws_secret)
    # 1. An error line that names an S3 path holding the secret (nothing matches: exit 2).
    job = copy_project(
        stamped_template, tmp_path,
        input={"path": f"s3://{new_bucket}/in-${{BI_TOKEN}}/dt={{ds}}/*.parquet"},
        output={"path": "out/dt={ds}", "id_columns": ["id"]},
        tracking={"uri": "http://batchinfer:${BI_TOKEN}@127.0.0.1:${BI_MLFLOW_PORT}",
                  "experiment": f"secrets-{uuid.uuid4().hex[:8]}"})
    env["BI_MLFLOW_PORT"] = str(closed_port())
    missing = run_cli("run", str(job), "--ds", DS, cwd=tmp_path, env=env, track=True)
    assert missing.returncode == 2, missing.stderr
    assert "${BI_TOKEN}" in missing.stderr  # the path is named, with the variable in its place
    # 2. MLflow unreachable at a URI holding the secret: the run commits and explains why in
    #    stdout and _metrics.json, without the secret.
    local = run_cli("run", str(job), "--ds", DS, "--set", "input.path=data/dt={ds}/*.parquet",
                    cwd=tmp_path, env=env, track=True)
    assert local.returncode == 0, local.stderr
    assert "MLflow unavailable" in local.stdout
    metrics = (tmp_path / "out" / f"dt={DS}" / "_metrics.json").read_text()
    assert '"uploaded": false' in metrics and "${BI_TOKEN}" in metrics
    # 3. Later, with MLflow reachable (the variable now names the live server's port).
    env["BI_MLFLOW_PORT"] = str(mlflow_live.port)
    track = run_cli("track", str(tmp_path / "out" / f"dt={DS}"), cwd=tmp_path, env=env, track=True)
    assert track.returncode == 0, track.stderr
    run_id = json.loads((tmp_path / "out" / f"dt={DS}" / "_metrics.json").read_text())["mlflow_run_id"]
    assert mlflow_live.client().get_run(run_id).data.metrics["rows_in"] == 3000
    hits = (text_hits("stderr (no shards)", missing.stderr + missing.stdout, needles)
            + text_hits("stdout (outage)", local.stdout + local.stderr, needles)
            + text_hits("track", track.stdout + track.stderr, needles)
            + local_hits(tmp_path, needles)
            + local_hits(mlflow_live.workdir, needles))
    assert hits == []
