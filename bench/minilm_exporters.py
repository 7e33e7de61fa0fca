#!/usr/bin/env python3
"""all-MiniLM-L6-v2 under ONNX Runtime alone, by how it was exported and optimised (issue 24's
two levers): torch's dynamo exporter (from the ``torch.export`` program, as prepare.py made it
before) vs its TorchScript exporter (``dynamo=False``, from the module, as prepare.py makes it
now), each with and without ONNX Runtime's transformer optimizer, and the INT8 recipe.

  .venv/bin/python bench/minilm_exporters.py [--docs 300] [--rounds 3] [--threads 1]

The documents are bench/embeddings.py's (``--docs`` of a 2,000-document set), tokenized by the
job's preprocessing and scored in the job's calls (longest first, at most 4,096 padded tokens a
call). The models take turns, order reversed every other round; each is timed in CPU seconds
of this process (``time.process_time``: on a shared machine less disturbed by other work than
wall time) and wall seconds, one intra-op thread by default. Printed: docs per CPU second,
the ratio to the dynamo export, and each model's min/median cosine with the dynamo export.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from pipelines.text_embeddings import prepare  # noqa: E402


def export_both(folder: Path, example: dict) -> dict[str, Path]:
    import torch

    source = folder / "source"
    with zipfile.ZipFile(prepare.model_zip()) as zf:
        zf.extractall(source)
    module = prepare.embedder(source)
    paths = {"dynamo": folder / "dynamo.onnx", "torchscript": folder / "torchscript.onnx"}
    program = prepare.export_program(module, example)
    args = (torch.from_numpy(example["input_ids"]), torch.from_numpy(example["attention_mask"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(program, args, str(paths["dynamo"]), dynamo=True, external_data=False,
                          input_names=["input_ids", "attention_mask"], output_names=[prepare.OUTPUT_NAME])
    prepare.export_onnx(module, example, paths["torchscript"])   # prepare.py's own export
    return paths


def optimized(path: Path) -> Path:
    from onnxruntime.transformers import optimizer

    model = optimizer.optimize_model(str(path), model_type="bert", num_heads=12, hidden_size=384)
    out = path.with_name(path.stem + "-opt.onnx")
    model.save_model_to_file(str(out))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--workdir", type=Path, default=HERE / "out" / "minilm_exporters")
    args = ap.parse_args()
    import embeddings  # bench/embeddings.py: the documents
    import onnx
    import onnxruntime as ort

    from batchinfer.convert import quantize, smoothing

    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    docs = work / "docs-2000"
    if not docs.exists():
        embeddings.make_documents(docs, 2000, 64.0, 0.9, 1000, 7)
    texts = pq.read_table(docs, columns=["text"]).column("text").to_pylist()[:args.docs]
    preprocess = prepare.load_preprocess(REPO / "pipelines" / "text_embeddings")
    feats = preprocess.transform(pa.record_batch({"text": pa.array(texts, pa.string())}))
    lengths = feats["attention_mask"].sum(1)
    order = np.argsort(-lengths, kind="stable")
    ids, mask = feats["input_ids"][order], feats["attention_mask"][order]
    calls, lo = [], 0
    while lo < len(ids):
        width = int(lengths[order[lo]])
        hi = min(len(ids), lo + max(1, args.tokens // width))
        calls.append((lo, hi, width))
        lo = hi

    with tempfile.TemporaryDirectory(dir=work) as tmp:
        folder = Path(tmp)
        example = {k: v[:2, :8].copy() for k, v in feats.items()}
        paths = export_both(folder, example)
        models = {"dynamo": paths["dynamo"], "dynamo+opt": optimized(paths["dynamo"]),
                  "torchscript": paths["torchscript"], "torchscript+opt": optimized(paths["torchscript"])}
        # the INT8 recipe (bench/embeddings.py's INT8_ARGS) by batchinfer export's own code,
        # calibrated on these documents; its gate is bench/embeddings.py's business
        int8 = folder / "int8.onnx"
        source = onnx.load(str(paths["torchscript"]))
        maxima = smoothing.activation_maxima(source, feats, tokens=args.tokens,
                                             lengths_from="attention_mask",
                                             sequences=["attention_mask", "input_ids"])
        onnx.save(smoothing.smooth(source, maxima, 0.7)[0], str(folder / "smoothed.onnx"))
        kept = quantize._kept_fp32(paths["torchscript"], "dynamic", [r"layer\.[05]/output/dense"])
        settings = quantize._quantize(folder / "smoothed.onnx", int8, "dynamic", {}, kept)
        os.replace(settings["_scratch"], int8)
        models["torchscript int8 (recipe)"] = int8
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        sessions = {k: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
                    for k, p in models.items()}

        def run(session) -> np.ndarray:
            return np.concatenate([session.run(None, {"input_ids": ids[a:b, :w],
                                                      "attention_mask": mask[a:b, :w]})[0]
                                   for a, b, w in calls]).astype(np.float64)

        reference = run(sessions["dynamo"])
        cpu: dict[str, list[float]] = {k: [] for k in sessions}
        wall: dict[str, list[float]] = {k: [] for k in sessions}
        cosine = {}
        for rnd in range(args.rounds):
            for name in (list(sessions) if rnd % 2 == 0 else list(sessions)[::-1]):
                t0, c0 = time.perf_counter(), time.process_time()
                got = run(sessions[name])
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                cos = (got * reference).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1))
                cosine[name] = (float(cos.min()), float(np.median(cos)))
    base = float(np.median(cpu["dynamo"]))
    print(f"{args.docs} documents, {len(calls)} calls, {args.threads} thread(s), {args.rounds} rounds "
          f"(median CPU s)")
    print(f"{'model':<28} {'CPU s':>7} {'docs/CPU s':>11} {'x dynamo':>9} {'wall s (best)':>14} "
          f"{'min cos':>9} {'median cos':>11}")
    for name in sessions:
        c = float(np.median(cpu[name]))
        print(f"{name:<28} {c:>7.2f} {args.docs / c:>11.1f} {base / c:>9.2f} {min(wall[name]):>14.2f} "
              f"{cosine[name][0]:>9.5f} {cosine[name][1]:>11.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
