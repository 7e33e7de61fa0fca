"""Models from the MLflow registry (``models:/name/version``, contract §1 declaration by tags)
against a real ``mlflow server``."""
from __future__ import annotations

import hashlib
import json
import uuid

import pytest

from factories import DS, run_cli
from servers import copy_project

pytestmark = [pytest.mark.server, pytest.mark.slow]

TAGS = ("batchinfer.model_version", "batchinfer.model_digest", "batchinfer.schema_version",
        "batchinfer.preprocess_hash")


@pytest.fixture
def registered(tmp_path, mlflow_live, stamped_template):
    """The template's ONNX model logged as a run artifact and registered as version 1."""
    client = mlflow_live.client()
    name = f"mlp_{uuid.uuid4().hex[:8]}"
    experiment = client.create_experiment(f"registry-{name}")
    run = client.create_run(experiment)
    model = stamped_template / "models" / "model.onnx"
    client.log_artifact(run.info.run_id, str(model), "model")
    client.set_terminated(run.info.run_id)
    client.create_registered_model(name)
    version = client.create_model_version(name, source=f"{run.info.artifact_uri}/model",
                                          run_id=run.info.run_id)
    assert version.version == "1"
    return name, hashlib.sha256(model.read_bytes()).hexdigest()


def test_stamp_run_and_contract_through_the_registry(tmp_path, mlflow_live, stamped_template,
                                                     registered):
    name, digest = registered
    client = mlflow_live.client()
    uri = f"models:/{name}/1"
    job = copy_project(stamped_template, tmp_path,
                       model=uri,
                       tracking={"uri": mlflow_live.uri, "experiment": f"run-{name}"})
    (tmp_path / "mlflow.db").unlink()  # the job tracks to the server: no local store may appear

    stamp = run_cli("stamp", uri, "--job", str(job), "--model-version", f"{name}:1", cwd=tmp_path, track=True)
    assert stamp.returncode == 0, stamp.stderr
    sidecar = json.loads((stamped_template / "models" / "model.onnx.batchinfer.json").read_text())
    tags = client.get_model_version(name, "1").tags
    assert {k: tags.get(k) for k in TAGS} == {
        "batchinfer.model_version": f"{name}:1", "batchinfer.model_digest": digest,
        "batchinfer.schema_version": "feats@1",
        "batchinfer.preprocess_hash": sidecar["preprocess_hash"]}

    run = run_cli("run", str(job), "--ds", DS, cwd=tmp_path, track=True)
    assert run.returncode == 0, run.stderr
    manifest = json.loads((tmp_path / "out" / f"dt={DS}" / "_manifest.json").read_text())
    assert manifest["triple"]["model_version"] == f"{name}:1"
    assert manifest["triple"]["model_digest"] == digest
    assert manifest["totals"]["rows_scored"] == 3000
    assert manifest["mlflow_run_id"]  # tracked in the same server
    # The model came from this job's registry, not MLflow's default one (./mlflow.db).
    assert not (tmp_path / "mlflow.db").exists()

    # A declaration with a part missing is a contract failure (exit 3), checked before any work.
    client.delete_model_version_tag(name, "1", "batchinfer.preprocess_hash")
    broken = run_cli("run", str(job), "--ds", DS, "--set", "output.path=out2/dt={ds}", cwd=tmp_path, track=True)
    assert broken.returncode == 3, (broken.stdout, broken.stderr)
    lines = broken.stderr.strip().splitlines()
    assert len(lines) == 1 and "preprocess_hash" in lines[0], broken.stderr
    assert not (tmp_path / "out2").exists()

    # A version that does not exist: exit 2 (the job's mistake, not retried), one line naming it.
    missing = run_cli("run", str(job), "--ds", DS, "--set", f"model.uri=models:/{name}/7",
                      cwd=tmp_path, track=True)
    assert missing.returncode == 2, (missing.stdout, missing.stderr)
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and f"models:/{name}/7" in lines[0], missing.stderr
    assert "Traceback" not in missing.stderr
