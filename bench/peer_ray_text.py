#!/usr/bin/env python3
"""Ray Data's offline batch inference on the text job: ``read_parquet`` -> ``map_batches`` with
a callable class (an actor pool; the model loaded once per actor) -> ``write_parquet``, on a
local Ray instance.

  peer_ray_text.py DOCS_GLOB MODEL.onnx TOKENIZER.json OUT_DIR [--batch 1024] [--actors 1]

Each actor holds ``peer_text_model.MiniLM`` (the job's ONNX file and tokenizer, encode's sorted
32-document calls) and turns a ``pyarrow`` batch of ``doc_id`` + ``text`` into ``doc_id`` +
``embedding`` (``fixed_size_list<float>[384]``). One actor by default (``concurrency=1``, as
the tabular ``peer_ray.py``): its ONNX Runtime session already uses both cores; Ray's read and
write tasks run beside it. Batches of 1,024 documents: Ray Data's default ``batch_size``.
See https://docs.ray.io/en/latest/data/batch_inference.html and
https://docs.ray.io/en/latest/data/api/doc/ray.data.Dataset.map_batches.html
"""
import argparse
import glob
import os
import time

t0 = time.perf_counter()
ap = argparse.ArgumentParser()
ap.add_argument("data")
ap.add_argument("model")
ap.add_argument("tokenizer")
ap.add_argument("out")
ap.add_argument("--batch", type=int, default=1024)
ap.add_argument("--actors", type=int, default=1)
ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: auto)")
a = ap.parse_args()
HERE = os.path.dirname(os.path.abspath(__file__))

import ray  # noqa: E402

# The actors import peer_text_model from beside this file.
ray.init(include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
             filter(None, [HERE, os.environ.get("PYTHONPATH")]))}})


class Embedder:
    def __init__(self, model: str, tokenizer: str, threads: int):
        from peer_text_model import MiniLM

        self.model = MiniLM(model, tokenizer, threads=threads)

    def __call__(self, batch):
        import pyarrow as pa
        from peer_text_model import fixed_size_list

        values = self.model.embed(batch.column("text").to_pylist())
        return pa.table({"doc_id": batch.column("doc_id"), "embedding": fixed_size_list(values)})


files = sorted(glob.glob(a.data))
ds = ray.data.read_parquet(files)
ds.map_batches(Embedder, fn_constructor_args=(a.model, a.tokenizer, a.threads), batch_size=a.batch,
               batch_format="pyarrow", concurrency=a.actors).write_parquet(a.out)
print(f"ray_text files={len(files)} seconds={time.perf_counter() - t0:.2f}")
