"""The model cache (triple/model_cache.py): a model in a store fetched once per digest into a
content-addressed folder, verified, and refused when it is not what the run checked. Against
fsspec's ``memory://`` store (the S3 server's turn is tests/with_servers/test_model_store.py)."""
from __future__ import annotations

import hashlib
import pickle
import uuid

import fsspec
import numpy as np
import pytest

from batchinfer.errors import ContractError, ModelFileError
from batchinfer.io.storage import local_path
from batchinfer.triple.contract import model_digest
from batchinfer.triple.model_cache import CACHE_ENV, ModelSource, cache_root, entry_file, fetch
from factories import make_mlp_onnx, mlp_reference


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory) -> tuple[bytes, bytes]:
    """Two different small ONNX models' bytes (seed 0 and seed 1)."""
    folder = tmp_path_factory.mktemp("models")
    return tuple(make_mlp_onnx(folder / f"m{seed}.onnx", seed=seed).read_bytes() for seed in (0, 1))


@pytest.fixture
def store(model_bytes) -> str:
    """``memory://…/model.onnx`` holding the seed-0 model; its folder is removed afterwards."""
    folder = f"memory://store-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"{folder}/model.onnx", model_bytes[0])
    yield f"{folder}/model.onnx"
    fs.rm(folder, recursive=True)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_cache_root_is_the_environment_s_else_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv(CACHE_ENV)
    assert cache_root().parts[-3:] == (".cache", "batchinfer", "models")
    assert entry_file(tmp_path, "ab" * 32, "s3://b/m/model.onnx") == tmp_path / ("ab" * 32) / "model.onnx"


@pytest.mark.parametrize("url, local", [
    ("models/m.onnx", "models/m.onnx"), ("/abs/m.onnx", "/abs/m.onnx"),
    ("file:///abs/m.onnx", "/abs/m.onnx"), ("s3://b/m.onnx", None), ("gs://b/m.onnx", None),
    ("http://h:1/m.onnx", None), ("simplecache::s3://b/m.onnx", None), ("C:\\m.onnx", "C:\\m.onnx")])
def test_local_path_tells_files_from_stores(url, local):
    assert local_path(url) == local


def test_first_fetch_downloads_and_verifies_then_the_entry_is_reused(store, model_bytes, tmp_path):
    first = fetch(store, sha(model_bytes[0]), tmp_path)
    assert first.downloaded and first.digest == sha(model_bytes[0])
    assert first.path == tmp_path / first.digest / "model.onnx"
    assert first.path.read_bytes() == model_bytes[0]
    stamp = first.path.stat().st_mtime_ns
    again = fetch(store, first.digest, tmp_path)
    assert not again.downloaded and again.path == first.path
    assert first.path.stat().st_mtime_ns == stamp
    # Nothing but the entry (and its lock, and the URL's record) is left in the cache.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.digest, f"{first.digest}.lock",
                                                                 "sources"])


def test_an_entry_damaged_on_disk_is_hashed_before_use_and_fetched_again(store, model_bytes,
                                                                         tmp_path):
    first = fetch(store, sha(model_bytes[0]), tmp_path)
    first.path.write_bytes(first.path.read_bytes()[:-1] + b"\0")   # one byte flipped on disk
    again = fetch(store, first.digest, tmp_path)
    assert again.downloaded and again.path.read_bytes() == model_bytes[0]
    first.path.write_bytes(b"\xff" * 7)   # past reading as ONNX
    assert fetch(store, first.digest, tmp_path).path.read_bytes() == model_bytes[0]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_a_worker_refuses_bytes_other_than_those_the_run_checked(store, model_bytes, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    fsspec.filesystem("memory").pipe_file(store, model_bytes[1])   # changed in the store
    with pytest.raises(ContractError, match="model_digest declared .* changed since the run"):
        ModelSource(store, sha(model_bytes[0])).local_path()
    # What was fetched is cached under its own digest (content-addressed), never the expected one.
    assert not (tmp_path / sha(model_bytes[0])).exists()
    assert (tmp_path / sha(model_bytes[1]) / "model.onnx").read_bytes() == model_bytes[1]


def test_revalidation_fetches_again_when_the_store_changed(store, model_bytes, tmp_path):
    digest = fetch(store, None, tmp_path).digest
    assert not fetch(store, digest, tmp_path, revalidate=True).downloaded   # unchanged: a hit
    fsspec.filesystem("memory").pipe_file(store, model_bytes[1])
    assert not fetch(store, digest, tmp_path).downloaded    # a worker trusts the checked entry
    changed = fetch(store, digest, tmp_path, revalidate=True)
    assert changed.downloaded and changed.digest == sha(model_bytes[1])


def test_a_missing_model_is_the_user_s_mistake(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        fetch(f"memory://nothing-{uuid.uuid4().hex}/model.onnx", None, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == []   # no half-made entry


def test_external_data_comes_along_and_is_in_the_digest(tmp_path):
    import onnx

    local = make_mlp_onnx(tmp_path / "src" / "model.onnx")
    (local.parent / "weights").mkdir()
    onnx.save_model(onnx.load(str(local)), str(local), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights/w.bin", size_threshold=0)
    fs = fsspec.filesystem("memory")
    folder = f"memory://ext-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(f"{folder}/model.onnx", local.read_bytes())
    fs.pipe_file(f"{folder}/weights/w.bin", (local.parent / "weights" / "w.bin").read_bytes())
    fs.pipe_file(f"{folder}/other.onnx", b"not part of this model")
    got = fetch(f"{folder}/model.onnx", None, tmp_path / "cache")
    assert got.digest == model_digest(local)   # the digest covers the external data
    assert sorted(str(p.relative_to(got.path.parent)) for p in got.path.parent.rglob("*")
                  if p.is_file()) == ["model.onnx", "weights/w.bin"]   # only what it names
    fs.pipe_file(f"{folder}/weights/w.bin", b"\0" * fs.size(f"{folder}/weights/w.bin"))
    tampered = fetch(f"{folder}/model.onnx", got.digest, tmp_path / "cache", revalidate=True)
    assert tampered.downloaded and tampered.digest != got.digest
    fs.rm(folder, recursive=True)


def test_a_handler_loads_through_the_cache_and_pickles_the_url(tmp_path, monkeypatch):
    from batchinfer.handlers.base import handler_for

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    # A model no other test loads (a live handler of the same digest would be reused instead).
    data = make_mlp_onnx(tmp_path / "m.onnx", hidden=7, seed=11).read_bytes()
    url = f"memory://handler-{uuid.uuid4().hex[:8]}/model.onnx"
    fsspec.filesystem("memory").pipe_file(url, data)
    digest = sha(data)
    handler = handler_for("onnxruntime", url, digest=digest, device="cpu", source=ModelSource(url, digest))
    model = handler.load_model()
    assert handler.model_path == str(tmp_path / "cache" / digest / "model.onnx")
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_allclose(model.predict({"x": x})["y"][:, 0],
                               mlp_reference(x, hidden=7, seed=11), atol=1e-5)
    # What travels to a worker names the store, not this machine's cache.
    assert pickle.loads(pickle.dumps(handler)).model_path == url
    fsspec.filesystem("memory").rm(url)
