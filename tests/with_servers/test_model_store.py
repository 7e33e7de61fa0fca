"""Models by URL (contract §1 "Declaration", §3 ``model.uri``): a model and its sidecar in S3
(moto in server mode), fetched into the model cache by the run, stamped in the store, refused
when the store's bytes changed since stamping; ONNX external data along; several processes
fetching one model at once. Requests are counted by the fault proxy in front of moto."""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
from pathlib import Path

import numpy as np
import pytest

from factories import DS, make_mlp_onnx, mlp_reference, one_line_error, read_partition, run_cli
from servers import copy_project, env_for

pytestmark = [pytest.mark.server, pytest.mark.slow]


def model_gets(proxy, name: str) -> int:
    """GETs of the object ``…/name`` (not its sidecar) that the proxy passed on."""
    return sum(1 for method, target, status in proxy.requests("GET")
               if target.split("?")[0].endswith(f"/{name}") and status == 200)


def upload(fs, folder: Path, bucket_folder: str, *names: str) -> None:
    for name in names:
        fs.pipe_file(f"{bucket_folder}/{name}", (folder / name).read_bytes())


def expected_scores(template: Path) -> dict[int, float]:
    import pyarrow.parquet as pq

    scores = {}
    for shard in sorted((template / "data" / f"dt={DS}").glob("*.parquet")):
        table = pq.read_table(shard)
        x = np.stack([table.column(f"f{i}").to_numpy() for i in range(4)], axis=1)
        scores.update(zip(table.column("id").to_pylist(), mlp_reference(x)))
    return scores


def assert_scored_like_the_local_model(out: Path, template: Path) -> dict:
    preds, quarantine, manifest = read_partition(out)
    assert manifest["totals"]["rows_scored"] == 3000 and quarantine.num_rows == 0
    local = expected_scores(template)
    ids = preds.column("id").to_pylist()
    np.testing.assert_allclose(preds.column("y").to_numpy(), [local[i] for i in ids], atol=1e-5)
    return manifest


def test_a_model_in_s3_scores_like_the_local_one_and_is_fetched_once(
        tmp_path, s3_server, s3_proxy, new_bucket, stamped_template):
    fs = s3_server.s3fs()
    upload(fs, stamped_template / "models", f"{new_bucket}/models", "model.onnx",
           "model.onnx.batchinfer.json")
    job = copy_project(stamped_template, tmp_path, model=f"s3://{new_bucket}/models/model.onnx")
    (tmp_path / "models").rename(tmp_path / "not-the-model")   # only the store has it
    cache = tmp_path / "cache"
    env = {**env_for(s3_proxy.url), "BATCHINFER_MODEL_CACHE": str(cache)}
    first = run_cli("run", str(job), "--ds", DS, cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr
    manifest = assert_scored_like_the_local_model(tmp_path / "out" / f"dt={DS}", stamped_template)
    digest = hashlib.sha256((stamped_template / "models" / "model.onnx").read_bytes()).hexdigest()
    assert manifest["triple"]["model_digest"] == digest
    assert model_gets(s3_proxy, "model.onnx") == 1
    entry = cache / digest / "model.onnx"
    assert entry.read_bytes() == (stamped_template / "models" / "model.onnx").read_bytes()
    mtime = entry.stat().st_mtime_ns
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]

    # The second run, with the same model as a challenger's URL too, finds the entry: no model
    # GET (the launcher's revalidation is a HEAD).
    s3_proxy.reset()
    twin = f"[{{name: twin, uri: 's3://{new_bucket}/models/model.onnx', device: cpu}}]"
    again = run_cli("run", str(job), "--ds", DS, "--set", "output.path=out2/dt={ds}",
                    "--set", f"model.challengers={twin}", cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr
    assert model_gets(s3_proxy, "model.onnx") == 0, s3_proxy.requests()
    assert s3_proxy.requests("HEAD", "/models/model.onnx"), s3_proxy.requests()
    assert entry.stat().st_mtime_ns == mtime
    manifest = assert_scored_like_the_local_model(tmp_path / "out2" / f"dt={DS}", stamped_template)
    [challenger] = manifest["challengers"]
    assert challenger["name"] == "twin" and challenger["triple"]["model_digest"] == digest


def test_stamp_writes_the_sidecar_in_the_store_and_a_model_changed_after_exits_3(
        tmp_path, s3_server, new_bucket, stamped_template):
    fs = s3_server.s3fs()
    upload(fs, stamped_template / "models", f"{new_bucket}/m", "model.onnx")
    url = f"s3://{new_bucket}/m/model.onnx"
    job = copy_project(stamped_template, tmp_path, model=url)
    env = {**s3_server.env, "BATCHINFER_MODEL_CACHE": str(tmp_path / "cache")}
    stamp = run_cli("stamp", url, "--job", str(job), "--model-version", "model:1", cwd=tmp_path,
                    env=env)
    assert stamp.returncode == 0, stamp.stderr
    assert f"{url}.batchinfer.json" in stamp.stdout
    in_store = json.loads(fs.cat_file(f"{new_bucket}/m/model.onnx.batchinfer.json"))
    local = json.loads((stamped_template / "models" / "model.onnx.batchinfer.json").read_text())
    assert in_store == local   # the same declaration as stamping the local file
    assert not (tmp_path / "models" / "model.onnx.batchinfer.json.tmp").exists()

    # The store's model is replaced after stamping; the cache still holds the stamped bytes.
    fs.pipe_file(f"{new_bucket}/m/model.onnx",
                 make_mlp_onnx(tmp_path / "other.onnx", seed=1).read_bytes())
    run = run_cli("run", str(job), "--ds", DS, cwd=tmp_path, env=env)
    assert run.returncode == 3, (run.stdout, run.stderr)
    line = one_line_error(run)
    assert "model_digest declared" in line and url in line, line
    assert not (tmp_path / "out").exists()


def test_an_onnx_model_with_external_data_comes_from_s3_whole(tmp_path, s3_server, new_bucket,
                                                                stamped_template):
    import onnx

    from batchinfer.triple.contract import model_digest

    project = tmp_path / "p"
    job = copy_project(stamped_template, project)
    model = project / "models" / "model.onnx"
    onnx.save_model(onnx.load(str(model)), str(model), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.weights", size_threshold=0)
    stamp = run_cli("stamp", "models/model.onnx", "--job", "job.yaml", "--model-version",
                    "model:1", cwd=project)
    assert stamp.returncode == 0, stamp.stderr
    fs = s3_server.s3fs()
    upload(fs, project / "models", f"{new_bucket}/ext", "model.onnx", "model.weights",
           "model.onnx.batchinfer.json")
    url = f"s3://{new_bucket}/ext/model.onnx"
    env = {**s3_server.env, "BATCHINFER_MODEL_CACHE": str(tmp_path / "cache")}
    run = run_cli("run", str(job), "--ds", DS, "--set", f"model.uri={url}", cwd=project, env=env)
    assert run.returncode == 0, run.stderr
    manifest = assert_scored_like_the_local_model(project / "out" / f"dt={DS}", stamped_template)
    digest = model_digest(model)   # the model file's bytes, then the weights'
    assert manifest["triple"]["model_digest"] == digest
    assert sorted(p.name for p in (tmp_path / "cache" / digest).iterdir()) == ["model.onnx",
                                                                              "model.weights"]
    # The weights change in the store: the digest covers them, so the run refuses (exit 3).
    weights = f"{new_bucket}/ext/model.weights"
    fs.pipe_file(weights, bytes(len(fs.cat_file(weights))))
    changed = run_cli("run", str(job), "--ds", DS, "--set", f"model.uri={url}",
                      "--set", "output.path=out2/dt={ds}", cwd=project, env=env)
    assert changed.returncode == 3, (changed.stdout, changed.stderr)
    assert "model_digest declared" in one_line_error(changed)
    assert not (project / "out2").exists()


def _fetch_at_once(url: str, expected: str | None, root: str, barrier, results) -> None:
    from batchinfer.triple.model_cache import fetch

    barrier.wait()
    got = fetch(url, expected, Path(root))
    results.put((str(got.path), got.digest, got.downloaded))


@pytest.mark.parametrize("known", [True, False], ids=["digest-known", "digest-unknown"])
def test_processes_fetching_one_model_at_once_leave_one_intact_entry(
        known, tmp_path, s3_server, s3_proxy, new_bucket, stamped_template, monkeypatch):
    """With the digest known (a worker), its lock makes one download; without (stamp), each
    downloads and the first rename wins. Either way: one entry, the right bytes, no debris."""
    fs = s3_server.s3fs()
    upload(fs, stamped_template / "models", f"{new_bucket}/c", "model.onnx")
    data = (stamped_template / "models" / "model.onnx").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    for key, value in env_for(s3_proxy.url).items():
        monkeypatch.setenv(key, value)
    ctx = multiprocessing.get_context("fork")
    processes, barrier, results = 4, ctx.Barrier(4), ctx.Queue()
    workers = [ctx.Process(target=_fetch_at_once,
                           args=(f"s3://{new_bucket}/c/model.onnx", digest if known else None,
                                 str(tmp_path), barrier, results)) for _ in range(processes)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
        assert w.exitcode == 0
    got = [results.get(timeout=5) for _ in range(processes)]
    assert {(path, d) for path, d, _ in got} == {(str(tmp_path / digest / "model.onnx"), digest)}
    assert (tmp_path / digest / "model.onnx").read_bytes() == data
    downloads = sum(1 for *_, downloaded in got if downloaded)
    if known:
        assert downloads == 1 and model_gets(s3_proxy, "model.onnx") == 1
    else:
        assert downloads == model_gets(s3_proxy, "model.onnx") >= 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "sources") == \
        sorted([digest] + ([f"{digest}.lock"] if known else []))   # no .tmp- debris
    print(f"{'known' if known else 'unknown'} digest: {downloads} download(s) for {processes} "
          f"processes")


def test_registry_model_leaves_no_temp_folder(tmp_path, mlflow_live, stamped_template):
    """A ``models:/`` version whose files the tracking server serves (``mlflow-artifacts:``):
    resolved to the server's artifact URL and fetched into the cache, no launcher temp folder."""
    import tempfile
    import uuid

    client = mlflow_live.client()
    name = f"mlp_{uuid.uuid4().hex[:8]}"
    run = client.create_run(client.create_experiment(f"registry-{name}"))
    client.log_artifact(run.info.run_id, str(stamped_template / "models" / "model.onnx"), "model")
    client.create_registered_model(name)
    client.create_model_version(name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("batchinfer-model-*"))
    job = copy_project(stamped_template, tmp_path, model=f"models:/{name}/1",
                       tracking={"uri": mlflow_live.uri, "experiment": f"run-{name}"})
    cache = tmp_path / "cache"
    env = {"BATCHINFER_MODEL_CACHE": str(cache)}
    stamp = run_cli("stamp", f"models:/{name}/1", "--job", str(job), cwd=tmp_path, env=env)
    assert stamp.returncode == 0, stamp.stderr
    scored = run_cli("run", str(job), "--ds", DS, cwd=tmp_path, env=env)
    assert scored.returncode == 0, scored.stderr
    assert_scored_like_the_local_model(tmp_path / "out" / f"dt={DS}", stamped_template)
    assert set(temp.glob("batchinfer-model-*")) == before
    digest = hashlib.sha256((stamped_template / "models" / "model.onnx").read_bytes()).hexdigest()
    assert (cache / digest / "model.onnx").is_file()
    records = [json.loads(p.read_text()) for p in (cache / "sources").iterdir()]
    assert [re.sub(r"//[^/]+/", "//HOST/", r["url"]) for r in records] == [
        f"http://HOST/api/2.0/mlflow-artifacts/artifacts/{run.info.experiment_id}/"
        f"{run.info.run_id}/artifacts/model/model.onnx"]


def test_a_worker_refuses_a_model_that_changed_after_the_launcher_checked_it(
        tmp_path, mlflow_live, stamped_template, beam_job_service, model_cache):
    """Beam's job service and its worker pool (processes of their own, with their own model
    cache: the session's) run a registry model whose files the tracking server serves. The
    launcher checks the bytes it fetched; the file is then replaced on the server by one of the
    same size and its old mtime (so the server lists it as before, and the launcher's warm entry
    still counts);
    the worker fetches the new bytes, refuses them, and the job fails saying so, nothing
    committed."""
    import uuid

    client = mlflow_live.client()
    name = f"mlp_{uuid.uuid4().hex[:8]}"
    run = client.create_run(client.create_experiment(f"worker-{name}"))
    # A model no other test fetches into the session's cache (the worker pool's).
    original = make_mlp_onnx(tmp_path / "m" / "model.onnx", seed=21)
    client.log_artifact(run.info.run_id, str(original), "model")
    client.create_registered_model(name)
    client.create_model_version(name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
    job = copy_project(stamped_template, tmp_path / "job", model=f"models:/{name}/1",
                       tracking={"uri": mlflow_live.uri, "experiment": f"run-{name}"},
                       runner={"name": "portable", "options": beam_job_service.options})
    env = {"BATCHINFER_MODEL_CACHE": str(tmp_path / "launcher-cache")}
    stamp = run_cli("stamp", f"models:/{name}/1", "--job", str(job), cwd=tmp_path, env=env)
    assert stamp.returncode == 0, stamp.stderr
    served = next(mlflow_live.artifacts.rglob(f"{run.info.run_id}/**/model.onnx"))
    changed = make_mlp_onnx(tmp_path / "changed.onnx", seed=22).read_bytes()
    before = served.stat()
    assert len(changed) == before.st_size
    served.write_bytes(changed)
    # Its mtime put back: the server's listing (size, Last-Modified, ETag) says nothing changed.
    os.utime(served, ns=(before.st_atime_ns, before.st_mtime_ns))
    scored = run_cli("run", str(job), "--ds", DS, cwd=tmp_path / "job", env=env, track=True)
    assert scored.returncode != 0, scored.stdout
    line = scored.stderr.strip().splitlines()[-1]
    print(f"exit {scored.returncode}: {line}")
    assert "contract mismatch" in line and "changed since the run checked it" in line, scored.stderr
    assert hashlib.sha256(changed).hexdigest() in line
    assert not (tmp_path / "job" / "out" / f"dt={DS}" / "_manifest.json").exists()
    # The worker pool fetched into its own cache; the launcher's holds only the checked bytes.
    assert (model_cache / hashlib.sha256(changed).hexdigest() / "model.onnx").is_file()
    assert [p.name for p in (tmp_path / "launcher-cache").iterdir() if len(p.name) == 64] == [
        hashlib.sha256(original.read_bytes()).hexdigest()]
