"""``batch.tokens`` through the CLI: the same documents scored with row-sized and token-sized
model calls give the same partition — same rows, same order, same accounting, same quarantine,
and predictions equal bit for bit — for a model whose result cannot depend on padding (a byte
"tokenizer" and an ONNX model that sums exact small integers over a row's real tokens). The
transformer case, where padding changes float rounding, is in test_text_embeddings.py.
Rerun with ``.venv/bin/pytest tests/e2e/test_e2e_token_batches.py -q``.
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factories import DS, REPO, one_line_error, read_partition, run_cli, save_onnx, write_job

pytestmark = pytest.mark.slow  # runs of the CLI, as every end-to-end module

VOCAB = 128            # ids 1..127 are bytes; DEL (0x7f) becomes id 128, which the model rejects
EXECUTION = {"_inference_id", "_compute_ms"}

PREPROCESS = textwrap.dedent(f'''\
    """Bytes as tokens: id = byte + 1 (non-ASCII bytes folded to 127), DEL → {VOCAB} (out of
    the model's vocabulary), right-padded with 0 to the batch's longest row, 300 at most."""
    import numpy as np

    def transform(batch):
        texts = [t.encode("utf-8")[:300] for t in batch.column("text").to_pylist()]
        width = max([len(t) for t in texts] + [1])
        ids = np.zeros((len(texts), width), np.int64)
        mask = np.zeros_like(ids)
        for row, text in enumerate(texts):
            codes = np.minimum(np.frombuffer(text, np.uint8).astype(np.int64), 126) + 1
            codes[np.frombuffer(text, np.uint8) == 0x7F] = {VOCAB}
            ids[row, :len(codes)] = codes
            mask[row, :len(codes)] = 1
        return {{"input_ids": ids, "attention_mask": mask}}
    ''')


def byte_model(path: Path) -> Path:
    """``total`` = sum of a row's real ids (a Gather on a table of 0..127, so an id ≥ 128 fails
    in ONNX Runtime), ``length`` = its real tokens: small integers, exact in float32 in any
    summation order, so padding and batch shape cannot change them."""
    from onnx import TensorProto, helper

    nodes, inputs, constants = _token_total()
    graph = helper.make_graph(
        [*nodes, helper.make_node("ReduceSum", ["maskf", "axis"], ["length"], keepdims=0)],
        "bytes", inputs,
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, ["N"]),
         helper.make_tensor_value_info("length", TensorProto.FLOAT, ["N"])],
        constants)
    return save_onnx(graph, path)


def _token_total() -> tuple[list, list, list]:
    """The nodes, inputs and constants both test models share: ``total``, the sum of a row's
    real ids (``maskf``, the mask as floats, left for more outputs)."""
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.arange(VOCAB, dtype=np.float32), "table")
    axis = numpy_helper.from_array(np.array([1], np.int64), "axis")
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["values"]),
             helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["values", "maskf"], ["masked"]),
             helper.make_node("ReduceSum", ["masked", "axis"], ["total"], keepdims=0)]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", "L"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["N", "L"])]
    return nodes, inputs, [table, axis]


def documents(rng: np.random.Generator, n: int) -> list[str | None]:
    words = "token batches sort rows by length and cut model calls by padded tokens".split()
    lengths = np.clip(np.exp(rng.normal(2.5, 1.0, n)), 0, 80).astype(int)
    texts: list[str | None] = [" ".join(rng.choice(words, k)) for k in lengths]
    texts[7] = texts[300] = None                          # bad input: quarantined by the schema
    texts[11] = "ok \x7f rejected by the model"            # quarantined by the model
    texts[402] = "\x7f"
    texts[5] = ""                                          # a real, empty document
    return texts


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokens")
    (folder / "byte_preprocess.py").write_text(PREPROCESS)
    byte_model(folder / "models" / "bytes.onnx")
    data = folder / "data" / f"dt={DS}"
    data.mkdir(parents=True)
    texts = documents(np.random.default_rng(8), 700)
    ids = [f"doc-{i}" for i in range(len(texts))]
    for shard, (lo, hi) in enumerate([(0, 450), (450, 700)]):
        pq.write_table(pa.table({"doc_id": ids[lo:hi], "text": pa.array(texts[lo:hi], pa.string())}),
                       data / f"part-{shard}.parquet")
    write_job(folder, name="bytes", schema="documents@1", preprocess="byte_preprocess:transform",
              model="models/bytes.onnx", schemas={"root": str(REPO / "schemas")},
              output={"path": "out/{ds}", "id_columns": ["doc_id"]},
              quarantine={"max_bad_fraction": 0.05}, batch={"rows": 64})
    stamped = run_cli("stamp", "models/bytes.onnx", "--job", "job.yaml", "--model-version", "bytes:1",
                      cwd=folder)
    assert stamped.returncode == 0, stamped.stderr
    return folder


def _run(project: Path, out: str, *extra: str):
    result = run_cli("run", "job.yaml", "--ds", DS, "--set", f"output.path={out}", *extra, cwd=project)
    assert result.returncode == 0, result.stderr
    metrics = json.loads((project / out / "_metrics.json").read_text())["metrics"]
    return (*read_partition(project / out), metrics)


@pytest.fixture(scope="module")
def by_rows(project):
    return _run(project, "out/rows")


@pytest.fixture(scope="module")
def by_tokens(project):
    return _run(project, "out/tokens", "--set", "batch.tokens=200")


def test_same_partition_bit_for_bit(by_rows, by_tokens):
    preds_r, quar_r, manifest_r, _ = by_rows
    preds_t, quar_t, manifest_t, _ = by_tokens
    assert manifest_t["totals"] == manifest_r["totals"]
    assert manifest_r["totals"]["rows_in"] == 700 and manifest_r["totals"]["rows_quarantined"] == 4
    for shard_r, shard_t in zip(manifest_r["shards"], manifest_t["shards"]):
        assert [f["rows"] for f in shard_t["files"]] == [f["rows"] for f in shard_r["files"]]
        # scored_by names each run's own attempt, as _inference_id does
        assert {k: v for k, v in shard_t.items() if k not in ("files", "scored_by")} == \
               {k: v for k, v in shard_r.items() if k not in ("files", "scored_by")}
        assert (shard_t["scored_by"], shard_r["scored_by"]) == (manifest_t["attempt"], manifest_r["attempt"])
    # Rows in the same order, file by file, and every column equal but the execution's own.
    columns = [c for c in preds_r.column_names if c not in EXECUTION]
    assert preds_t.select(columns).equals(preds_r.select(columns))
    assert quar_t.equals(quar_r)


def test_results_are_the_rows_own(by_tokens, project):
    preds, quarantine, _, _ = by_tokens
    texts = pq.read_table(project / "data" / f"dt={DS}").to_pydict()
    by_id = dict(zip(texts["doc_id"], texts["text"]))
    for doc_id, total, length in zip(preds.column("doc_id").to_pylist(),
                                     preds.column("total").to_pylist(),
                                     preds.column("length").to_pylist()):
        raw = by_id[doc_id].encode("utf-8")[:300]
        assert length == len(raw)
        assert total == float(sum(min(b, 126) + 1 for b in raw))
    reasons = {(json.loads(r["_values"])["doc_id"], r["_check"]) for r in quarantine.to_pylist()}
    assert reasons == {("doc-7", "not_nullable"), ("doc-300", "not_nullable"),
                       ("doc-11", "model"), ("doc-402", "model")}


def test_padding_is_measured_and_token_batches_pad_less(by_rows, by_tokens):
    rows, tokens = by_rows[3], by_tokens[3]
    assert rows["model_tokens"] == tokens["model_tokens"] > 0
    assert tokens["model_padding_ratio"] < 1.3 < 2 < rows["model_padding_ratio"], rows["model_padding_ratio"]


def test_tokens_need_the_lengths_input(project):
    result = run_cli("run", "job.yaml", "--ds", DS, "--set", "output.path=out/never",
                     "--set", "batch.tokens=200", "--set", "batch.lengths_from=token_type_ids",
                     cwd=project)
    assert result.returncode == 2
    error = one_line_error(result)
    assert "batch.tokens" in error and "'token_type_ids'" in error and "attention_mask" in error
    assert not (project / "out" / "never").exists()


def test_sequence_inputs_the_job_lists(project, by_rows):
    """``batch.sequence_inputs`` names the inputs a call cuts (the lengths input is always one);
    a name the model does not take is exit 2 before any work."""
    preds, _, manifest, _ = _run(project, "out/listed", "--set", "batch.tokens=200",
                                 "--set", "batch.sequence_inputs=[input_ids]")
    columns = [c for c in by_rows[0].column_names if c not in EXECUTION]
    assert manifest["totals"] == by_rows[2]["totals"]
    assert preds.select(columns).equals(by_rows[0].select(columns))
    result = run_cli("run", "job.yaml", "--ds", DS, "--set", "output.path=out/never",
                     "--set", "batch.tokens=200", "--set", "batch.sequence_inputs=[token_ids]",
                     cwd=project)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "batch.sequence_inputs names ['token_ids'], which the model does not take" in one_line_error(result)
    assert not (project / "out" / "never").exists()


@pytest.mark.parametrize("fault", ["mid_write", "write:3", "before_commit"])
def test_killed_token_run_commits_nothing_and_its_rerun_is_the_row_partition(project, by_rows, fault):
    """Crash safety is the batch's, whatever sizes the model calls: killed (SIGKILL) while
    writing or before the commit, nothing is committed; rerun, the partition is the one the
    row-sized run committed."""
    out = f"out/killed-{fault.replace(':', '-')}"
    args = ("run", "job.yaml", "--ds", DS, "--set", f"output.path={out}", "--set", "batch.tokens=200")
    killed = run_cli(*args, cwd=project, env={"BATCHINFER_FAULT": fault})
    assert killed.returncode == -9, killed.stderr
    assert not (project / out / "_manifest.json").exists()
    rerun = run_cli(*args, cwd=project)
    assert rerun.returncode == 0, rerun.stderr
    preds, quarantine, manifest = read_partition(project / out)
    columns = [c for c in by_rows[0].column_names if c not in EXECUTION]
    assert manifest["totals"] == by_rows[2]["totals"]
    assert preds.select(columns).equals(by_rows[0].select(columns))
    assert quarantine.equals(by_rows[1])


# -- a dense input as wide as the padded batch is not a sequence ---------------------------------

WIDTH = 300   # every batch padded to it, and the dense input's fixed width

DENSE_PREPROCESS = PREPROCESS.replace(
    "width = max([len(t) for t in texts] + [1])", f"width = {WIDTH}").replace(
    '    return {"input_ids": ids, "attention_mask": mask}',
    f'''    # per-row features, as wide as the padded sequences by construction
    sizes = np.array([len(t) for t in texts], np.int64)[:, None]
    dense = ((sizes + np.arange({WIDTH})) % 5).astype(np.float32)
    return {{"input_ids": ids, "attention_mask": mask, "dense": dense}}''')
assert f"width = {WIDTH}" in DENSE_PREPROCESS and "dense" in DENSE_PREPROCESS


def dense_model(path: Path) -> Path:
    """The byte model with a third input ``dense [N, 300]`` (fixed) and a third output
    ``dense_total``, the sum of a row's dense values (small integers: exact)."""
    from onnx import TensorProto, helper

    nodes, inputs, constants = _token_total()
    graph = helper.make_graph(
        [*nodes, helper.make_node("ReduceSum", ["dense", "axis"], ["dense_total"], keepdims=0)],
        "bytes_and_dense",
        [*inputs, helper.make_tensor_value_info("dense", TensorProto.FLOAT, ["N", WIDTH])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, ["N"]),
         helper.make_tensor_value_info("dense_total", TensorProto.FLOAT, ["N"])],
        constants)
    return save_onnx(graph, path)


@pytest.fixture(scope="module")
def dense_project(project, tmp_path_factory) -> Path:
    """The same documents, padded to 300 tokens beside a dense input 300 wide."""
    import shutil

    folder = tmp_path_factory.mktemp("dense")
    shutil.copytree(project / "data", folder / "data")
    (folder / "dense_preprocess.py").write_text(DENSE_PREPROCESS)
    dense_model(folder / "models" / "dense.onnx")
    write_job(folder, name="dense", schema="documents@1", preprocess="dense_preprocess:transform",
              model="models/dense.onnx", schemas={"root": str(REPO / "schemas")},
              output={"path": "out/{ds}", "id_columns": ["doc_id"]},
              quarantine={"max_bad_fraction": 0.05}, batch={"rows": 64})
    stamped = run_cli("stamp", "models/dense.onnx", "--job", "job.yaml", "--model-version", "dense:1",
                      cwd=folder)
    assert stamped.returncode == 0, stamped.stderr
    return folder


def test_a_dense_input_as_wide_as_the_padded_sequences_is_never_cut(dense_project):
    """Before, every input whose second axis had the lengths input's length was cut like a
    sequence: ``dense`` (300 wide, as every batch is padded to 300) reached the model cut to
    each call's longest row, which ONNX Runtime refused (most rows quarantined). The model
    declares it ``[N, 300]``, fixed: it is not a sequence, and both runs commit the same."""
    preds_r, quar_r, manifest_r, _ = _run(dense_project, "out/rows")
    preds_t, quar_t, manifest_t, _ = _run(dense_project, "out/tokens", "--set", "batch.tokens=200")
    assert manifest_t["totals"] == manifest_r["totals"]
    assert manifest_r["totals"]["rows_quarantined"] == 4                # as the byte model's
    columns = [c for c in preds_r.column_names if c not in EXECUTION]
    assert preds_t.select(columns).equals(preds_r.select(columns))
    assert quar_t.equals(quar_r)
    texts = dict(zip(*pq.read_table(dense_project / "data" / f"dt={DS}").to_pydict().values()))
    for doc_id, dense_total in zip(preds_t.column("doc_id").to_pylist(),
                                   preds_t.column("dense_total").to_pylist()):
        size = len(texts[doc_id].encode("utf-8")[:300])
        assert dense_total == float(sum((size + j) % 5 for j in range(WIDTH)))
