"""Nothing secret or local in the job graph (contract §6 "`${NAME}` values and secrets",
docs/runners.md "What travels to the workers").

What Beam would submit is built for real and searched, byte for byte: the Dataflow job of a
``--dry-run`` (the pipeline proto Dataflow would stage, and the job request around it) and the
pipeline proto that a Beam job service receives from the portable runner (caught by a job
service that records ``Prepare`` and runs nothing). Beam pickles every DoFn and coder, compresses
the pickle with zlib and base64-encodes it; the search opens every such layer, at any depth.

The job puts a distinctive ``${BI_TOKEN}`` value (a secret by its name) in the input and output
paths and in the baseline's, and a ``${BI_MLFLOW_URL}`` holding a password (a secret because the
job lists it) in ``tracking.uri``. Its data, outputs and baseline are in an object store
(fsspec's ``memory://``: nothing is run) and its model on a shared mount, so nothing the workers
need is in the job's folder: its path (a distinctive ``launcher-only-…`` name) and batchinfer's
launcher temp folders must not appear either, nor the job's spec, nor the launcher's commands
(the report and the run's record are the launcher's, made from what the commit step leaves).
Both tests fail on the code before this file (the shard and output URLs, the drift gate's
baseline and the schema's and preprocessing's files all held one or the other).
"""
from __future__ import annotations

import base64
import binascii
import bz2
import json
import lzma
import pickle
import re
import shutil
import tempfile
import uuid
import zlib
from pathlib import Path

import fsspec
import numpy as np
import pytest

from batchinfer import redaction
from batchinfer.commands.profile import PROFILE_VERSION
from batchinfer.commands.run import run_job
from batchinfer.commands.stamp import stamp
from batchinfer.rows.column_profiles import baseline_column
from batchinfer.spec import load_job
from factories import DS, make_mlp_onnx, make_shards, write_job, write_schema

pytestmark = pytest.mark.usefixtures("no_tracking")

TOKEN = f"tok3n{uuid.uuid4().hex[:12]}"
PASSWORD = f"mlPw{uuid.uuid4().hex[:12]}"
STORE = f"memory://graph-{uuid.uuid4().hex[:8]}"
DATAFLOW = {"project": "my-project-123", "region": "europe-west4",
            "temp_location": "gs://my-bucket-123/tmp",
            "sdk_container_image": "europe-docker.pkg.dev/my-project-123/batchinfer/worker:1.0"}

# -- the search -------------------------------------------------------------------------------

_BASE64 = re.compile(rb"[A-Za-z0-9+/_-]{24,}={0,2}")
# Where a compressed stream starts: zlib (Beam's pickles before 2.66), bzip2 (Beam's now), gzip, xz.
_COMPRESSED = re.compile(rb"\x78[\x01\x5e\x9c\xda]|BZh[1-9]1AY&SY|\x1f\x8b\x08|\xfd7zXZ\x00")


def _decompress(data: bytes) -> bytes | None:
    """The stream that starts ``data`` (one of :data:`_COMPRESSED`), decompressed; None if it
    is not one."""
    if data.startswith(b"BZh"):
        opener = bz2.BZ2Decompressor()
    elif data.startswith(b"\x1f\x8b"):
        opener = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif data.startswith(b"\xfd7zXZ"):
        opener = lzma.LZMADecompressor()
    else:
        opener = zlib.decompressobj()
    try:
        return opener.decompress(data)
    except (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError):
        return None


def layers(data: bytes, depth: int = 0) -> list[bytes]:
    """``data`` and every layer inside it that Beam's encodings hide: compressed streams (Beam
    compresses its pickles) and base64 text (Beam encodes them), opened recursively."""
    found = [data]
    if depth > 8:
        return found
    for match in _COMPRESSED.finditer(data):
        inner = _decompress(data[match.start():])
        if inner is not None and len(inner) > 16:
            found += layers(inner, depth + 1)
    for match in _BASE64.finditer(data):
        text = match.group()
        for decode in (base64.b64decode, base64.urlsafe_b64decode):
            try:
                inner = decode(text + b"=" * (-len(text) % 4))
            except (binascii.Error, ValueError):
                continue
            if _COMPRESSED.match(inner) or inner[:1] == b"\x80":   # compressed, or a pickle
                found += layers(inner, depth + 1)
                break
    return found


def hits(what: str, data: bytes, needles: dict[str, bytes]) -> list[str]:
    """Where each needle occurs in ``data`` or in a layer inside it, with a little context
    (each place once)."""
    out: dict[str, None] = {}
    for layer in layers(data):
        for name, needle in needles.items():
            at = layer.find(needle)
            while at != -1:
                context = layer[max(0, at - 60): at + len(needle) + 40]
                out[f"{what}: {name}: {context!r}"] = None
                at = layer.find(needle, at + 1)
    return list(out)


# -- the job ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """(job file, environment, needles): a job whose data, outputs and baseline are in the store."""
    root = tmp_path_factory.mktemp("graph")
    folder = root / f"launcher-only-{uuid.uuid4().hex[:8]}"
    shared = root / "shared-mount"
    schema = write_schema(folder / "schemas")   # with a check of its own: a function of the module
    schema.write_text(schema.read_text().replace(
        '"id": pa.Column(pl.Int64, nullable=False)',
        '"id": pa.Column(pl.Int64, nullable=False, checks=pa.Check(lambda d: d.lazyframe.select(pl.col("id") >= 0)))'))
    (folder / "prep.py").write_text("import numpy as np\n\n"
                                    "def transform(batch):\n"
                                    "    return np.stack([batch.column(f'f{i}').to_numpy() "
                                    "for i in range(4)], axis=1).astype(np.float32)\n")
    make_mlp_onnx(shared / "model.onnx")
    fs = fsspec.filesystem("memory")
    shards = make_shards(root / "shards", shards=2, rows=50)
    data = f"{STORE}/in-{TOKEN}/dt={DS}"
    for shard in shards:
        fs.pipe_file(f"{data}/{shard.name}", shard.read_bytes())
    rng = np.random.default_rng(0)
    columns = {f"f{i}": baseline_column("feature", rng.normal(size=500)).to_dict() for i in range(4)}
    columns["score"] = baseline_column("prediction", rng.uniform(size=500)).to_dict()
    fs.pipe_file(f"{STORE}/base-{TOKEN}/baseline.json", json.dumps(
        {"profile_version": PROFILE_VERSION, "job": "graphjob", "ds": DS,
         "output": str(folder / "out"), "attempt": "a", "triple": {}, "rows": 500,
         "columns": columns}).encode())
    job = write_job(folder, name="graphjob", model=str(shared / "model.onnx"),
                    preprocess="prep:transform",
                    input={"path": f"{STORE}/in-${{BI_TOKEN}}/dt={{ds}}/*.parquet"},
                    output={"path": f"{STORE}/out-${{BI_TOKEN}}/dt={{ds}}", "id_columns": ["id"]},
                    tracking={"uri": "${BI_MLFLOW_URL}", "experiment": "graph"},
                    monitor={"baseline": f"{STORE}/base-${{BI_TOKEN}}/baseline.json"},
                    secrets=["BI_MLFLOW_URL"])
    env = {"BI_TOKEN": TOKEN, "BI_MLFLOW_URL": f"http://ci:{PASSWORD}@mlflow.internal:5000"}
    with redaction.scope():
        stamp(load_job(job, environ=env, require_ds=False), None, "model:1")
    needles = {"the secret ${BI_TOKEN}": TOKEN.encode(), "the MLflow password": PASSWORD.encode(),
               "the job's folder": folder.name.encode(),
               "a batchinfer temp folder": str(Path(tempfile.gettempdir()) / "batchinfer-").encode(),
               # Nothing of the launcher's: not the job (its spec holds every ${NAME} value), not
               # the code that renders the report and the record (the launcher does, from what
               # the commit step leaves in scratch).
               "the job's spec": b"JobSpec", "the launcher's commands": b"batchinfer.commands",
               "the launcher's application layer": b"batchinfer.app"}
    return job, env, needles


def load(job: Path, env: dict, *sets: str):
    return load_job(job, ds=DS, environ=env, overrides=list(sets))


def dataflow_job(job_path: Path, env: dict, monkeypatch, *sets: str):
    """The Dataflow job that ``run --dry-run`` builds for the job (Beam's DataflowRunner, which
    returns before calling the Dataflow API)."""
    from batchinfer.pipeline import runner_options as runners

    built = []
    summary = runners.job_summary

    def keep(result):
        built.append(result.job)
        return summary(result)

    monkeypatch.setattr(runners, "job_summary", keep)
    options = [f"runner.options.{k}={v}" for k, v in DATAFLOW.items()]
    with redaction.scope():
        outcome = run_job(load(job_path, env, "runner.name=dataflow", *options, *sets), dry_run=True)
    assert "built, not submitted" in outcome.message
    [job] = built
    assert len(job.proto_pipeline.components.transforms) > 14
    return job


def dataflow_hits(job, needles: dict[str, bytes]) -> list[str]:
    return (hits("the pipeline proto", job.proto_pipeline.SerializeToString(), needles)
            + hits("the job request", json.dumps(job.json()).encode(), needles))


def test_the_dataflow_job_holds_no_secret_and_no_launcher_path(project, monkeypatch):
    job_path, env, needles = project
    found = dataflow_hits(dataflow_job(job_path, env, monkeypatch), needles)
    assert found == [], "\n".join(found)


def test_the_search_finds_a_launcher_temp_folder_planted_in_the_graph(project, monkeypatch):
    """A model in a batchinfer temp folder (where ``models:/`` downloads went) is found: the
    handler pickled inside RunInference's DoFn, compressed and encoded, names it."""
    job_path, env, needles = project
    temp = Path(tempfile.mkdtemp(prefix="batchinfer-model-"))
    try:
        shared = job_path.parent.parent / "shared-mount"
        for file in shared.iterdir():
            (temp / file.name).write_bytes(file.read_bytes())
        found = dataflow_hits(dataflow_job(job_path, env, monkeypatch, f"model.uri={temp / 'model.onnx'}"),
                              needles)
    finally:
        shutil.rmtree(temp)
    assert found and all(": a batchinfer temp folder: " in line for line in found), found
    assert any(b"model_path" in line.encode() for line in found), found


class RecordingJobService:
    """Beam's own job service (``LocalJobServicer``) that keeps each ``Prepare`` request — what
    the portable runner submits: the pipeline proto and its options — and runs nothing."""

    def __init__(self):
        import grpc
        from apache_beam.runners.portability.local_job_service import LocalJobServicer

        self.requests: list = []
        recorded = self.requests

        class Recording(LocalJobServicer):
            def Prepare(self, request, context=None, timeout=None):
                recorded.append(request)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "recorded, not run")

        self.servicer = Recording()
        self.port = self.servicer.start_grpc_server(0)

    def close(self):
        self.servicer.stop()


def test_the_job_service_receives_no_secret_and_no_launcher_path(project):
    from batchinfer.errors import RuntimeFailure

    job_path, env, needles = project
    service = RecordingJobService()
    try:
        with redaction.scope(), pytest.raises(RuntimeFailure):
            run_job(load(job_path, env, "runner.name=portable",
                         f"runner.options.job_endpoint=localhost:{service.port}",
                         "runner.options.environment_type=EXTERNAL",
                         "runner.options.environment_config=localhost:1"))
    finally:
        service.close()
    [request] = service.requests
    assert len(request.pipeline.components.transforms) > 14
    found = (hits("the pipeline proto", request.pipeline.SerializeToString(), needles)
             + hits("the pipeline options", request.pipeline_options.SerializeToString(), needles))
    assert found == [], "\n".join(found)


def test_a_worker_fills_in_the_secrets_from_its_own_environment():
    from batchinfer.errors import RuntimeFailure
    from batchinfer.redaction import Deferred

    url = f"s3://bucket/out-{TOKEN}/dt={DS}"
    deferred = Deferred.of(url, {"BI_TOKEN": TOKEN, "UNUSED_KEY": "elsewhere"})
    assert (deferred.template, deferred.names) == (f"s3://bucket/out-${{BI_TOKEN}}/dt={DS}", ("BI_TOKEN",))
    assert TOKEN.encode() not in pickle.dumps(deferred)
    with redaction.scope():
        assert deferred.value({"BI_TOKEN": TOKEN}) == url
        assert redaction.redact(f"cannot write {url}") == f"cannot write {deferred.template}"
    with pytest.raises(RuntimeFailure, match=r"environment has no \$\{BI_TOKEN\}, which s3://bucket/"
                                             r"out-\$\{BI_TOKEN\}/dt=.* uses: give every worker"):
        deferred.value({})


def test_a_table_sink_travels_without_its_catalogs_secret(project, monkeypatch, tmp_path):
    """``output.format: iceberg``: the sink (io/sinks.py) pickles into the job with the
    catalog's properties as ``${NAME}`` templates, filled in by the worker that commits."""
    job_path, env, needles = project
    monkeypatch.setenv("BI_TOKEN", TOKEN)    # the launcher's own environment, as the CLI's
    catalog = f"sqlite:///{tmp_path}/cat-${{BI_TOKEN}}.db"
    found = dataflow_hits(dataflow_job(
        job_path, env, monkeypatch, "output.format=iceberg",
        f"output.path={STORE}/tables-${{BI_TOKEN}}",
        f'output.catalog={{uri: "{catalog}", properties: {{token: "${{BI_TOKEN}}"}}}}'),
        {k: v for k, v in needles.items() if k != "the job's folder"})
    assert found == [], "\n".join(found)
