"""Safe loading (contract §5.6, §1 declaration): pickle-based formats refused by default; model,
external-data and engine bytes checked against the digest recorded at stamp time, before any
output is written; ONNX external-data paths may not leave the model's folder (``../`` or a
symlink), for ``stamp`` and ``run`` alike.

Every CLI case is a process of its own running what ``python -m batchinfer`` runs (a child of
the fork server, tests/forkserver.py); they are started together to save time. Rerun with
``.venv/bin/pytest tests/unit/test_safe_loading.py -q``.
"""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import forkserver
import pytest

from factories import DS, make_mlp_onnx, make_shards, point_external_data, write_job, write_schema

pytestmark = pytest.mark.slow

FEATURES = ("f0", "f1", "f2", "f3")


class _Exploit:
    """Unpickling this creates a marker file: proof that a pickle was loaded."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def project(folder: Path, model: str) -> Path:
    write_schema(folder / "schemas")
    make_shards(folder / "data" / f"dt={DS}", shards=1, rows=50)
    return write_job(folder, model=model)


def stamp_in_process(job: Path) -> None:
    from batchinfer.commands.stamp import stamp
    from batchinfer.spec import load_job

    stamp(load_job(job, require_ds=False), None, "model:1")


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def to_external(model: Path, location: str) -> Path:
    """Rewrite ``model`` with every initializer in one external-data file ``location``."""
    import onnx

    proto = onnx.load(str(model))
    onnx.save_model(proto, str(model), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=0)
    return model.parent / location


def hand_declaration(model: Path, files: list[Path]) -> None:
    """A declaration matching the bytes exactly, written without batchinfer's checks: so a
    refusal can only come from the path check, not from a missing or wrong declaration."""
    from batchinfer.triple.contract import Triple, default_preprocess_hash, digest_files, write_sidecar

    write_sidecar(model, Triple("hand:0", digest_files([model, *files]), "feats@1",
                                default_preprocess_hash(FEATURES)))


def cli(folder: Path, *args: str) -> forkserver.Run:
    return forkserver.shared().start(*args, cwd=folder)


RUN = ("run", "job.yaml", "--ds", DS)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Build every case, then run all their CLI commands at once."""
    base = tmp_path_factory.mktemp("safe_loading")
    procs: dict[str, tuple[Path, forkserver.Run]] = {}

    # 1. a pickle model (that would write a marker file if it were ever unpickled)
    f = base / "pickle"
    project(f, "models/model.pkl")
    (f / "models").mkdir()
    (f / "models" / "model.pkl").write_bytes(pickle.dumps(_Exploit(f / "PWNED")))
    procs["pickle_run"] = (f, cli(f, *RUN))
    procs["pickle_stamp"] = (f, cli(f, "stamp", "models/model.pkl", "--job", "job.yaml",
                                    "--model-version", "model:1"))

    # 2. model bytes changed after stamping
    f = base / "digest_model"
    job = project(f, "models/model.onnx")
    make_mlp_onnx(f / "models" / "model.onnx")
    stamp_in_process(job)
    flip_byte(f / "models" / "model.onnx")
    procs["digest_model"] = (f, cli(f, *RUN))

    # 3. external-data bytes changed after stamping (they are part of model_digest)
    f = base / "digest_external"
    job = project(f, "models/model.onnx")
    make_mlp_onnx(f / "models" / "model.onnx")
    weights = to_external(f / "models" / "model.onnx", "weights.bin")
    stamp_in_process(job)
    flip_byte(weights, 3)
    procs["digest_external"] = (f, cli(f, *RUN))

    # 4. a TensorRT engine file changed after stamping (checked before the backend is touched)
    f = base / "digest_engine"
    job = project(f, "models/model.engine")
    text = job.read_text().replace("backend: onnxruntime", "backend: tensorrt")
    job.write_text(text)
    (f / "models").mkdir()
    (f / "models" / "model.engine").write_bytes(os.urandom(4096))
    # what `export --to tensorrt` writes beside an engine; stamp declares it (no GPU needed)
    (f / "models" / "model.engine.build.json").write_text(
        json.dumps({"tensorrt_version": "10.13.0", "compute_capability": "9.0"}))
    stamp_in_process(job)
    flip_byte(f / "models" / "model.engine")
    procs["digest_engine"] = (f, cli(f, *RUN))

    # 5. external data at ../outside.bin
    f = base / "dotdot"
    project(f, "models/model.onnx")
    model = make_mlp_onnx(f / "models" / "model.onnx")
    weights = to_external(model, "weights.bin")
    outside = f / "outside.bin"
    weights.rename(outside)
    point_external_data(model, "../outside.bin")
    hand_declaration(model, [outside])
    procs["dotdot_stamp"] = (f, cli(f, "stamp", "models/model.onnx", "--job", "job.yaml",
                                    "--model-version", "model:1"))
    procs["dotdot_run"] = (f, cli(f, *RUN))

    # 6. external data whose file in the model's folder is a symlink to a file outside it
    f = base / "symlink"
    project(f, "models/model.onnx")
    model = make_mlp_onnx(f / "models" / "model.onnx")
    weights = to_external(model, "weights.bin")
    (f / "elsewhere").mkdir()
    target = f / "elsewhere" / "weights.bin"
    weights.rename(target)
    weights.symlink_to(target)
    hand_declaration(model, [target])
    procs["symlink_stamp"] = (f, cli(f, "stamp", "models/model.onnx", "--job", "job.yaml",
                                     "--model-version", "model:1"))
    procs["symlink_run"] = (f, cli(f, *RUN))

    # 7. control: the same external-data layout, kept inside the folder, stamps and runs
    f = base / "external_ok"
    job = project(f, "models/model.onnx")
    make_mlp_onnx(f / "models" / "model.onnx")
    to_external(f / "models" / "model.onnx", "weights.bin")
    stamp_in_process(job)
    procs["external_ok"] = (f, cli(f, *RUN))

    results = {}
    for name, (folder, proc) in procs.items():
        proc.wait(timeout=300)
        results[name] = (folder, proc.returncode, proc.stdout, proc.stderr)
    return results


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def assert_nothing_written(folder: Path) -> None:
    assert not (folder / "out").exists(), "output written before the check"
    assert not (folder / "mlflow.db").exists()


@pytest.mark.parametrize("name", ["pickle_run", "pickle_stamp"])
def test_pickle_model_refused(cases, name):
    folder, rc, _, err = cases[name]
    assert rc == 3, err
    line = one_line(err)
    assert "pickle" in line and "model.pkl" in line
    assert not (folder / "PWNED").exists(), "the pickle was loaded"
    assert not (folder / "models" / "model.pkl.batchinfer.json").exists()
    assert_nothing_written(folder)


@pytest.mark.parametrize("suffix", [".pickle", ".pt", ".pth", ".joblib", ".ckpt"])
def test_other_pickle_formats_refused_in_process(tmp_path, suffix):
    from batchinfer.commands.run import run_job
    from batchinfer.errors import ContractError
    from batchinfer.spec import load_job

    job = project(tmp_path, f"models/model{suffix}")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / f"model{suffix}").write_bytes(pickle.dumps(_Exploit(tmp_path / "PWNED")))
    with pytest.raises(ContractError, match="pickle"):
        run_job(load_job(job, ds=DS))
    assert not (tmp_path / "PWNED").exists()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["digest_model", "digest_external", "digest_engine"])
def test_changed_model_bytes_refused_before_any_output(cases, name):
    folder, rc, _, err = cases[name]
    assert rc == 3, err
    line = one_line(err)
    assert "model_digest declared" in line and "found" in line
    declared = json.loads(next((folder / "models").glob("*.batchinfer.json")).read_text())
    assert declared["model_digest"] in line
    assert_nothing_written(folder)


@pytest.mark.parametrize("name", ["dotdot_stamp", "dotdot_run", "symlink_stamp", "symlink_run"])
def test_external_data_outside_model_folder_refused(cases, name):
    folder, rc, _, err = cases[name]
    assert rc == 3, err
    line = one_line(err)
    assert "leaves the model's folder" in line
    assert_nothing_written(folder)
    if name.endswith("stamp"):   # the hand-written declaration was not replaced
        sidecar = json.loads((folder / "models" / "model.onnx.batchinfer.json").read_text())
        assert sidecar["model_version"] == "hand:0"


def test_external_data_inside_model_folder_is_fine(cases):
    folder, rc, out, err = cases["external_ok"]
    assert rc == 0, err
    assert "committed" in out
    manifest = json.loads((folder / "out" / f"dt={DS}" / "_manifest.json").read_text())
    from batchinfer.triple.contract import digest_files

    models = folder / "models"
    assert manifest["triple"]["model_digest"] == digest_files([models / "model.onnx",
                                                               models / "weights.bin"])
    assert manifest["totals"]["rows_scored"] == 50
