"""Secrets never leak (contract §3, §6 "`${NAME}` values"): not in outputs, logs, MLflow; and values
that are not secrets are recorded in full.

Distinctive secrets are used where users put credentials: ``${BI_TOKEN}`` (a secret by its name)
in an S3 prefix of the input and output paths, ``${DB_PASSWORD}`` in a Beam runner option, a
password inside the MLflow URI's userinfo that comes from a variable whose name says nothing
(``${BI_MLFLOW_URL}``), and AWS's secret key in the environment. After each run every byte the
job could have written is searched for them: stdout, stderr (``--debug`` too), every object
under the output, the local job folder, the MLflow server's sqlite store, artifacts and log. A
plain ``${FEATURES}`` prefix of the input is no secret: ``plan``, ``_source_shard`` and the
manifest show where the data came from.
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from factories import DS, read_partition, run_cli
from servers import closed_port, copy_project, env_for

pytestmark = [pytest.mark.server, pytest.mark.slow]


@pytest.fixture
def secrets():
    token = f"tok3n{uuid.uuid4().hex[:16]}"
    aws_secret = f"awsKEY{uuid.uuid4().hex[:16]}"
    return token, aws_secret


@pytest.fixture
def passwords():
    """(``${DB_PASSWORD}``'s value, the password inside ``${BI_MLFLOW_URL}``)."""
    return f"dbPw{uuid.uuid4().hex[:16]}", f"urlPw{uuid.uuid4().hex[:16]}"


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
                                                    stamped_template, secrets, passwords):
    token, aws_secret = secrets
    db_password, url_password = passwords
    needles = [token.encode(), aws_secret.encode(), db_password.encode(), url_password.encode()]
    fs = s3_server.s3fs()
    features = f"s3://{new_bucket}/features-{uuid.uuid4().hex[:8]}"   # no secret: shown in full
    for shard in sorted((stamped_template / "data" / f"dt={DS}").glob("*.parquet")):
        fs.pipe_file(f"{features}/in-{token}/dt={DS}/{shard.name}", shard.read_bytes())
    job = copy_project(
        stamped_template, tmp_path,
        input={"path": "${FEATURES}/in-${BI_TOKEN}/dt={ds}/*.parquet"},
        output={"path": f"s3://{new_bucket}/out-${{BI_TOKEN}}/dt={{ds}}", "id_columns": ["id"]},
        tracking={"uri": "${BI_MLFLOW_URL}", "experiment": f"secrets-{uuid.uuid4().hex[:8]}"},
        runner={"name": "direct", "options": {"job_name": "nightly-${DB_PASSWORD}"}})
    assert token.encode() not in job.read_bytes()  # the job file names the variable only
    env = {**secret_env(s3_server.endpoint, token, aws_secret), "FEATURES": features,
           "DB_PASSWORD": db_password,
           "BI_MLFLOW_URL": f"http://batchinfer:{url_password}@127.0.0.1:{mlflow_live.port}"}
    shown_input = f"{features}/in-${{BI_TOKEN}}/dt={DS}"   # the plain value, the secret's name
    plan = run_cli("--debug", "plan", str(job), "--ds", DS, cwd=tmp_path, env=env)
    assert plan.returncode == 0, plan.stderr
    assert f"input:      {shown_input}/*.parquet  (3 shards)" in plan.stdout
    assert f"  {shown_input}/part-00000.parquet" in plan.stdout
    result = run_cli("--debug", "run", str(job), "--ds", DS, cwd=tmp_path, env=env, track=True)
    assert result.returncode == 0, result.stderr
    # the secret-bearing URI really was used, and is shown with its password hidden
    assert f"in http://batchinfer:***@127.0.0.1:{mlflow_live.port}" in result.stdout
    output = f"{new_bucket}/out-{token}/dt={DS}"
    manifest = json.loads(fs.cat_file(f"{output}/_manifest.json"))
    assert sorted(s["path"] for s in manifest["shards"]) == [
        f"{shown_input}/part-{i:05d}.parquet" for i in range(3)]
    preds, _, _ = read_partition(output, fs)
    assert set(preds["_source_shard"].to_pylist()) == {s["path"] for s in manifest["shards"]}
    metrics = json.loads(fs.cat_file(f"{output}/_metrics.json"))
    assert metrics["tracking_uri"] == f"http://batchinfer:***@127.0.0.1:{mlflow_live.port}"

    hits = (text_hits("plan stdout", plan.stdout, needles) + text_hits("plan stderr", plan.stderr, needles)
            + text_hits("stdout", result.stdout, needles) + text_hits("stderr", result.stderr, needles)
            + s3_hits(fs, output, needles)
            + local_hits(tmp_path, needles)
            + local_hits(mlflow_live.workdir, needles))  # sqlite store, artifacts, server log
    assert hits == []
    assert "DEBUG" in result.stderr or "INFO" in result.stderr   # --debug did log
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
                  "experiment": f"secrets-{uuid.uuid4().hex[:8]}"},
        secrets=["BI_MLFLOW_PORT"])   # a secret by the job's say: kept as ${NAME} for `track`
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
    assert '"uploaded": false' in metrics
    assert '"tracking_uri": "http://batchinfer:${BI_TOKEN}@127.0.0.1:${BI_MLFLOW_PORT}"' in metrics
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
