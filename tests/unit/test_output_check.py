"""bench/output_check.py: a peer's output against batchinfer's, on Parquet files written here —
a missing, doubled or foreign row, a score off by more than 1e-5 or an embedding turned away
fails the check; the same rows in another order and file layout pass."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from factories import REPO

spec = importlib.util.spec_from_file_location("output_check", REPO / "bench" / "output_check.py")
output_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(output_check)


def write_batchinfer(out, ids, scores):
    """batchinfer's layout: the manifest lists its predictions/ files (audit columns beside)."""
    (out / "predictions").mkdir(parents=True)
    half = len(ids) // 2
    files = []
    for n, part in enumerate((slice(0, half), slice(half, None))):
        path = f"predictions/part-{n}.parquet"
        pq.write_table(pa.table({"id": ids[part], "score": scores[part],
                                 "_model_version": ["m:1"] * len(ids[part])}), out / path)
        files.append({"path": path})
    (out / "_manifest.json").write_text(json.dumps({"shards": [{"files": files}]}))


def write_peer(out, ids, scores, parts=3):
    out.mkdir(parents=True)
    for n, chunk in enumerate(np.array_split(np.arange(len(ids)), parts)):
        pq.write_table(pa.table({"id": ids[chunk], "score": scores[chunk]}), out / f"{n:03d}-uuid.parquet")
    (out / "_SUCCESS").write_text("")                       # Spark's marker: not a data file
    (out / ".part-0.parquet.crc").write_bytes(b"\0")         # nor its checksums


def check(tmp_path, peer_ids, peer_scores, ids, scores):
    write_batchinfer(tmp_path / "bi", ids, scores)
    write_peer(tmp_path / "peer", peer_ids, peer_scores)
    reference = output_check.read_columns(output_check.batchinfer_files(tmp_path / "bi"), "id", "score")
    candidate = output_check.read_columns(output_check.peer_files(tmp_path / "peer"), "id", "score")
    return output_check.compare(reference, candidate, "score")


rng = np.random.default_rng(0)
IDS = np.arange(1000, dtype=np.int64)
SCORES = rng.random(1000, dtype=np.float32)


def test_same_rows_in_another_order_pass(tmp_path):
    order = rng.permutation(1000)
    result = check(tmp_path, IDS[order], SCORES[order] + np.float32(4e-6), IDS, SCORES)
    assert result["ok"] and result["rows"] == 1000
    assert 3e-6 < result["max_abs_diff"] <= 1e-5


def test_a_score_off_by_more_than_the_bound_fails(tmp_path):
    scores = SCORES.copy()
    scores[617] += np.float32(1e-4)
    result = check(tmp_path, IDS, scores, IDS, SCORES)
    assert not result["ok"] and result["max_abs_diff"] > 1e-5


def test_a_missing_row_fails(tmp_path):
    result = check(tmp_path, IDS[1:], SCORES[1:], IDS, SCORES)
    assert not result["ok"] and result["missing"] == 1


def test_a_row_written_twice_fails_though_every_id_is_there(tmp_path):
    ids, scores = np.append(IDS, 5), np.append(SCORES, SCORES[5])
    result = check(tmp_path, ids, scores, IDS, SCORES)
    assert not result["ok"] and result["duplicates"] == 1 and result["missing"] == 0


def test_a_foreign_row_fails(tmp_path):
    ids = IDS.copy()
    ids[3] = 5000                          # outside the reference's ids: row 3 missing, one extra
    result = check(tmp_path, ids, SCORES, IDS, SCORES)
    assert not result["ok"] and result["extra"] == 1 and result["missing"] == 1


def test_string_ids_and_embeddings_by_cosine():
    ids = np.array([f"doc-{i:04d}" for i in range(50)])
    ref = rng.standard_normal((50, 8))
    order = rng.permutation(50)
    close = output_check.compare((ids, ref), (ids[order], ref[order] * 3.0), "embedding")
    assert close["ok"] and close["min_cosine"] > 0.999999   # scale does not matter, direction does
    turned = ref.copy()
    turned[7] = rng.standard_normal(8)
    far = output_check.compare((ids, ref), (ids, turned), "embedding")
    assert not far["ok"] and far["min_cosine"] < 0.9999
    missing = output_check.compare((ids, ref), (ids[:-1], ref[:-1]), "embedding")
    assert not missing["ok"] and missing["missing"] == 1


def test_embeddings_read_from_fixed_size_lists(tmp_path):
    values = rng.standard_normal((4, 3)).astype(np.float32)
    column = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), 3)
    pq.write_table(pa.table({"doc_id": ["a", "b", "c", "d"], "embedding": column}), tmp_path / "x.parquet")
    ids, read = output_check.read_columns([tmp_path / "x.parquet"], "doc_id", "embedding")
    assert list(ids) == ["a", "b", "c", "d"] and np.allclose(read, values)

