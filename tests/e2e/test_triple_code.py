"""The triple covers the code that actually runs (issue 18, items 1, 2 and 12's first case).

- a helper module the preprocessing imports from the job's folder is in ``preprocess_hash``;
- the installed packages it imports are declared by version: a difference warns, or refuses
  with ``stamp --packages refuse``;
- the schema version's source hash is declared (``schema_sha256``): an edited schema version,
  locked or not, is exit 3; ``schema publish`` / ``schema verify`` keep the lock;
- one model file has one declaration: stamping the champion's file as a challenger (or the
  champion's, when a challenger shares its file with other values) is refused.

Each case is driven through the CLI on a copy of a stamped project, as a user meets it.
"""
from __future__ import annotations

import hashlib
import json
import textwrap
from importlib.metadata import version
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from factories import DS, one_line_error, run_cli, write_job, write_schema
from servers import copy_project

pytestmark = pytest.mark.slow

PREP = "code_prep"        # the job's preprocessing module, importing HELPERS
HELPERS = "code_helpers"
PREP_SOURCE = textwrap.dedent(f'''\
    import numpy as np

    from {HELPERS} import SCALE

    COLUMNS = ("f0", "f1", "f2", "f3")


    def transform(batch):
        x = np.stack([batch.column(n).to_numpy(zero_copy_only=False) for n in COLUMNS], axis=1)
        return (x * SCALE).astype(np.float32)
    ''')
HELPERS_SOURCE = "SCALE = 1.0\n"
SIDECAR = Path("models") / "model.onnx.batchinfer.json"


@pytest.fixture
def project(tmp_path, stamped_template) -> Path:
    """A job whose preprocessing imports a helper module from the job's folder, stamped."""
    (tmp_path / f"{PREP}.py").write_text(PREP_SOURCE)
    (tmp_path / f"{HELPERS}.py").write_text(HELPERS_SOURCE)
    copy_project(stamped_template, tmp_path, preprocess=f"{PREP}:transform")
    stamp(tmp_path)
    return tmp_path


def cli(project: Path, *args: str):
    return run_cli(*args, cwd=project)


def run(project: Path, output: str = "out", command: str = "run"):
    args = [command, "job.yaml", "--ds", DS]
    if command == "run":
        args += ["--set", f"output.path={output}/dt={{ds}}"]
    return cli(project, *args)


def stamp(project: Path, *extra: str, model: str = "models/model.onnx", version: str = "model:1"):
    result = cli(project, "stamp", model, "--job", "job.yaml", "--model-version", version, *extra)
    assert result.returncode == 0, result.stderr
    return result


def declared(project: Path) -> dict:
    return json.loads((project / SIDECAR).read_text())


def edit_declaration(project: Path, **changes) -> None:
    data = declared(project)
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    (project / SIDECAR).write_text(json.dumps(data))


def scores(project: Path, output: str) -> list[float]:
    manifest = json.loads((project / output / f"dt={DS}" / "_manifest.json").read_text())
    files = [f["path"] for s in manifest["shards"] for f in s["files"]
             if f["path"].startswith("predictions/")]
    return [v for f in sorted(files)
            for v in pq.read_table(project / output / f"dt={DS}" / f)["y"].to_pylist()]


def expected_hash(prep: str, helpers: str) -> str:
    """contract §1: the module's hash, then each local module in name order."""
    h = hashlib.sha256(f"batchinfer-preprocess/1\n{PREP}:transform\n".encode() + prep.encode())
    h.update(f"\nmodule {HELPERS} {len(helpers.encode())}\n".encode() + helpers.encode())
    return h.hexdigest()


def warnings_of(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("WARNING batchinfer: ")]


# -- 1. a helper module is in the preprocess hash -------------------------------------------------

def test_an_edited_helper_module_changes_the_preprocess_hash_and_stops_the_run(project):
    assert declared(project)["preprocess_hash"] == expected_hash(PREP_SOURCE, HELPERS_SOURCE)
    plan = run(project, command="plan")
    assert plan.returncode == 0, plan.stderr
    assert f"local modules    {HELPERS}" in plan.stdout
    first = run(project, "out")
    assert first.returncode == 0, first.stderr
    assert first.stderr == ""   # a fresh declaration: nothing to warn about

    (project / f"{HELPERS}.py").write_text("SCALE = 2.0\n")   # every prediction would change
    result = run(project, "out2")
    assert result.returncode == 3, (result.stdout, result.stderr)
    line = one_line_error(result)
    assert "preprocess_hash declared" in line
    assert expected_hash(PREP_SOURCE, "SCALE = 2.0\n") in line
    assert not (project / "out2").exists()

    # re-stamped for the new helper, it runs — and the predictions are the new helper's
    stamp(project)
    again = run(project, "out2")
    assert again.returncode == 0, again.stderr
    assert scores(project, "out2") != scores(project, "out")


# -- 1. the installed packages it imports are declared -------------------------------------------

def test_the_declaration_records_the_installed_packages_the_preprocessing_imports(project):
    packages = f"numpy=={version('numpy')}"
    assert declared(project)["preprocess_packages"] == packages
    assert declared(project)["preprocess_packages_policy"] == "warn"
    plan = run(project, command="plan")
    assert f"packages         {packages}" in plan.stdout


def test_a_package_version_difference_warns_by_default(project):
    edit_declaration(project, preprocess_packages="numpy==0.0.1")
    result = run(project)
    assert result.returncode == 0, result.stderr
    [warning] = warnings_of(result)
    assert result.stderr.strip() == warning   # one line, nothing else
    assert f"numpy stamped 0.0.1, installed {version('numpy')}" in warning
    assert "re-stamp" in warning
    assert (project / "out" / f"dt={DS}" / "_manifest.json").is_file()


def test_a_package_version_difference_refuses_with_the_refuse_policy(project):
    stamp(project, "--packages", "refuse")
    assert declared(project)["preprocess_packages_policy"] == "refuse"
    edit_declaration(project, preprocess_packages="numpy==0.0.1")
    for command in ("plan", "run"):
        result = run(project, command=command)
        assert result.returncode == 3, (command, result.stdout, result.stderr)
        line = one_line_error(result, command)
        assert f"numpy stamped 0.0.1, installed {version('numpy')}" in line and "refuse" in line
    assert not (project / "out").exists()


def test_an_older_declaration_without_packages_is_not_checked(project):
    edit_declaration(project, preprocess_packages=None, preprocess_packages_policy=None)
    result = run(project)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


# -- 2. the schema's source hash is declared ------------------------------------------------------

def test_an_edited_unlocked_schema_version_stops_the_run(project):
    schema = project / "schemas" / "feats" / "v1.py"
    stamped = hashlib.sha256(schema.read_bytes()).hexdigest()
    assert declared(project)["schema_sha256"] == stamped
    assert not (project / "schemas" / "lock.json").exists()   # not published: no lock protects it
    write_schema(project / "schemas", low=-1, high=1)       # a changed check: other rows quarantined
    edited = hashlib.sha256(schema.read_bytes()).hexdigest()
    for command in ("plan", "run"):
        result = run(project, command=command)
        assert result.returncode == 3, (command, result.stdout, result.stderr)
        line = one_line_error(result, command)
        assert "schema feats@1 changed" in line
        assert stamped[:12] in line and edited[:12] in line
        assert "feats@2" in line and "re-stamp" in line
    assert not (project / "out").exists()


def test_a_declaration_without_schema_sha256_warns_and_keeps_the_lock_check(project):
    edit_declaration(project, schema_sha256=None)
    result = run(project)
    assert result.returncode == 0, result.stderr
    [warning] = warnings_of(result)
    assert result.stderr.strip() == warning
    assert "schema_sha256" in warning and "re-stamp" in warning
    # the lock still protects a published version
    assert cli(project, "schema", "publish", "feats@1", "--root", "schemas").returncode == 0
    write_schema(project / "schemas", low=-1, high=1)
    refused = run(project, "out2")
    assert refused.returncode == 3, refused.stderr
    assert "edited after it was published" in refused.stderr.strip().splitlines()[-1]


def test_schema_publish_and_verify(project):
    lock = project / "schemas" / "lock.json"
    schema = project / "schemas" / "feats" / "v1.py"
    digest = hashlib.sha256(schema.read_bytes()).hexdigest()

    published = cli(project, "schema", "publish", "feats@1", "--root", "schemas")
    assert published.returncode == 0, published.stderr
    assert json.loads(lock.read_text())["versions"] == {"feats@1": digest}
    assert digest in published.stdout
    again = cli(project, "schema", "publish", "feats@1", "--job", "job.yaml")   # a no-op
    assert again.returncode == 0, again.stderr
    assert "already published" in again.stdout
    verified = cli(project, "schema", "verify", "--job", "job.yaml")
    assert verified.returncode == 0, verified.stderr
    assert "1 published schema version(s)" in verified.stdout

    unknown = cli(project, "schema", "publish", "feats@9", "--root", "schemas")
    assert unknown.returncode == 2
    assert "feats@1" in one_line_error(unknown, "schema")   # the known versions
    write_schema(project / "schemas", version=2, low=-20, high=20)
    assert cli(project, "schema", "publish", "feats@2", "--root", "schemas").returncode == 0
    assert set(json.loads(lock.read_text())["versions"]) == {"feats@1", "feats@2"}

    write_schema(project / "schemas", low=-1, high=1)       # edit a published version
    refused = cli(project, "schema", "publish", "feats@1", "--root", "schemas")
    assert refused.returncode == 3
    assert "feats@3" in one_line_error(refused, "schema")
    assert json.loads(lock.read_text())["versions"]["feats@1"] == digest   # never changed
    broken = cli(project, "schema", "verify", "--root", "schemas")
    assert broken.returncode == 3
    assert broken.stdout.splitlines() == [f"feats@1: {Path('schemas/feats/v1.py')} changed after it was published"]
    assert "1 of 2" in one_line_error(broken, "schema")
    (project / "schemas" / "feats" / "v2.py").unlink()
    missing = cli(project, "schema", "verify", "--root", "schemas")
    assert missing.returncode == 3 and len(missing.stdout.splitlines()) == 2
    assert "feats@2" in missing.stdout and "missing" in missing.stdout

    neither = cli(project, "schema", "verify")
    assert neither.returncode == 2 and "--root" in neither.stderr


# -- 12. one model file, one declaration ----------------------------------------------------------

def with_challengers(project: Path, challengers: list[dict]) -> None:
    spec = yaml.safe_load((project / "job.yaml").read_text())
    spec["model"]["challengers"] = challengers
    (project / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def test_stamping_the_champions_model_as_a_challenger_is_refused(project):
    with_challengers(project, [{"name": "v2", "uri": "models/v2.onnx", "version": "model:2"}])
    before = (project / SIDECAR).read_bytes()
    for model in ("models/model.onnx", str(project / "models" / "model.onnx"),
                  "models/../models/model.onnx"):
        result = cli(project, "stamp", model, "--job", "job.yaml", "--challenger", "v2",
                     "--model-version", "model:2")
        assert result.returncode == 2, (model, result.stderr)
        line = one_line_error(result, "stamp")
        assert "champion's model" in line and "one declaration" in line and "copy the file" in line
    assert (project / SIDECAR).read_bytes() == before   # the champion's declaration is untouched

    # the same registry version is one declaration too (refused before the registry is asked)
    write_job(project, model="models:/credit/1",
              extra={"model": {"uri": "models:/credit/1", "backend": "onnxruntime",
                               "challengers": [{"name": "c", "uri": "models:/credit/2"}]}})
    result = cli(project, "stamp", "models:/credit/1", "--job", "job.yaml", "--challenger", "c")
    assert result.returncode == 2, result.stderr
    assert "champion's model" in one_line_error(result, "stamp")


def test_stamping_the_champion_whose_file_a_challenger_shares_with_other_values_is_refused(project):
    with_challengers(project, [{"name": "same", "uri": "models/model.onnx", "version": "model:9"}])
    before = (project / SIDECAR).read_bytes()
    result = cli(project, "stamp", "models/model.onnx", "--job", "job.yaml",
                 "--model-version", "model:1")
    assert result.returncode == 2, result.stderr
    line = one_line_error(result, "stamp")
    assert "challenger same" in line and "model:9" in line and "one declaration" in line
    assert (project / SIDECAR).read_bytes() == before
    # the same values: one declaration serves both
    with_challengers(project, [{"name": "same", "uri": "models/model.onnx", "version": "model:1"}])
    stamp(project)
