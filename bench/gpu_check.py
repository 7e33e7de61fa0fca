#!/usr/bin/env python3
"""The torch backend on a GPU: the model alone against ``batchinfer run`` end to end.

  gpu_check.py [--device cuda|cpu] [--quick] [--out DIR]

For two MLPs — the bench model (32-256-256-1) and a larger one (32-4096-4096-1) — and two
precisions (fp32, bf16) it measures:

- **model alone**: rows/s of the ``torch.export`` program called directly under
  ``torch.inference_mode()``, inputs taken from host memory each call (pinned, copied to the
  device, outputs copied back: what any batch job must do), at batch 64k / 256k / 1M rows;
- **end to end**: ``batchinfer run`` (its CLI, called in this process) of a job over Parquet shards of the same features
  with the same program (``backend: torch``, ``device`` as given, ``batch.rows`` = the model's
  best batch size), rows/s from the job's own ``wall_seconds`` (validation, hashing, audit
  columns, writing and the commit included), and its ratio to the best model-alone figure;
- **device parity**: max |GPU - CPU| of the fp32 program on 65,536 rows, and the bf16 outputs'
  KL divergence from fp32 (batchinfer.parity).

``--device cpu`` runs the same on the CPU (so the script is tested where there is no GPU);
``--quick`` shrinks every size for a test. Prints one table; ``--out`` also gets results.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FEATURES = 32

SCHEMA = '''\
import pandera.polars as pa
import polars as pl

FEATURES = [f"f{i}" for i in range(32)]
SCHEMA = pa.DataFrameSchema(
    {"id": pa.Column(pl.Int64, nullable=False),
     **{name: pa.Column(pl.Float32, pa.Check.in_range(-100.0, 100.0)) for name in FEATURES}},
    strict=True, name="gpu_features@1")
'''

JOB = """\
name: gpu_check_{label}
input: {{path: "{data}/*.parquet"}}
schema: gpu_features@1
schemas: {{root: schemas}}
model: {{uri: {model}, backend: torch, device: {device}, version: "{label}:1", options: {{precision: {precision}}}}}
batch: {{rows: {rows}}}
output: {{path: "out/{label}/dt={{ds}}", id_columns: [id], predictions: {{sigmoid: score}}}}
tracking: {{uri: "sqlite:///{work}/mlflow.db"}}
"""


def mlp(torch, hidden: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(), torch.nn.Linear(hidden, 1), torch.nn.Sigmoid()).eval()


def export(torch, module, path: Path) -> Path:
    program = torch.export.export(module, (torch.randn(8, FEATURES),),
                                  dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, str(path))
    return path


def model_alone(torch, path: Path, device: str, precision: str, batch: int, repeats: int) -> float:
    """rows/s of the program called directly, host memory in and out."""
    dev = torch.device(device)
    program = torch.export.load(str(path))
    if dev.type == "cuda":
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, dev)
    module = program.module()
    x = np.random.default_rng(1).standard_normal((batch, FEATURES)).astype(np.float32)
    host = torch.from_numpy(x)
    if dev.type == "cuda":
        host = host.pin_memory()
    dtype = {"fp32": None, "bf16": torch.bfloat16}[precision]

    def once():
        with torch.inference_mode():
            inputs = host.to(dev, non_blocking=True)
            if dtype is None:
                out = module(inputs)
            else:
                with torch.autocast(device_type=dev.type, dtype=dtype):
                    out = module(inputs)
            out.float().cpu()

    once()
    once()  # warm-up: kernels chosen, memory pooled
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        once()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return batch * repeats / (time.perf_counter() - t0)


def make_data(folder: Path, rows: int, shards: int) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    per = rows // shards
    for s in range(shards):
        x = rng.standard_normal((per, FEATURES)).astype(np.float32)
        cols = {"id": np.arange(s * per, (s + 1) * per, dtype=np.int64)}
        cols.update({f"f{i}": x[:, i] for i in range(FEATURES)})
        pq.write_table(pa.table(cols), folder / f"part-{s:05d}.parquet")


def end_to_end(work: Path, label: str, model: Path, device: str, precision: str, rows: int,
               batch: int) -> dict:
    """Stamp and run the job through batchinfer's CLI, in this process (torch, Beam and the
    model are imported once for every case, not once per command); the job's metrics say how
    long it took."""
    from batchinfer import cli

    job = work / f"{label}.yaml"
    job.write_text(JOB.format(label=label, data=work / "data", model=model, device=device,
                              precision=precision, rows=batch, work=work))
    for argv in (["stamp", str(model), "--job", str(job), "--model-version", f"{label}:1"],
                 ["run", str(job), "--ds", "2026-01-31"]):
        t0 = time.perf_counter()
        code = cli.main(argv)
        if code != 0:
            raise SystemExit(f"gpu_check: batchinfer {argv[0]} failed ({code}): its error is above")
    process_s = time.perf_counter() - t0
    out = work / "out" / label / "dt=2026-01-31"
    manifest = json.loads((out / "_manifest.json").read_text())
    metrics = json.loads((out / "_metrics.json").read_text())["metrics"]
    assert manifest["totals"]["rows_scored"] == rows, manifest["totals"]
    return {"rows_per_s": rows / metrics["wall_seconds"], "job_wall_s": metrics["wall_seconds"],
            "process_s": process_s, "device": manifest["device"],
            "infer_s": metrics.get("stage_seconds_infer"), "oom_backoffs": metrics.get("model_oom_backoffs")}


def parity_check(torch, path: Path, device: str, rows: int) -> dict:
    from batchinfer import parity
    from batchinfer.handlers.base import Prepared, handler_for

    x = np.random.default_rng(2).standard_normal((rows, FEATURES)).astype(np.float32)

    def score(dev: str, precision: str) -> np.ndarray:
        handler = handler_for("torch", str(path), digest=f"{path}-{dev}-{precision}", device=dev,
                              options={"precision": precision})
        model = handler.load_model()
        return handler.infer(model, Prepared(key=(0, 0), rows=rows, features=x)).outputs["sigmoid"]

    cpu = score("cpu", "fp32")
    here = score(device, "fp32")
    reduced = score(device, "bf16")
    return {"max_abs_diff_fp32_vs_cpu": parity.max_abs_diff(cpu, here),
            "kl_bf16_vs_fp32": parity.output_kl(here, reduced),
            "max_abs_diff_bf16_vs_fp32": parity.max_abs_diff(here, reduced)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="small sizes (a test)")
    ap.add_argument("--out", help="write results.json here")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device visible to torch (use --device cpu)")
    if args.quick:
        batches, rows, shards, repeats, models = [1024, 4096], 16_384, 4, 2, {"bench": 256, "large": 512}
    elif args.device == "cpu":
        batches, rows, shards, repeats, models = [16384, 65536], 1_000_000, 8, 3, {"bench": 256, "large": 1024}
    else:
        batches, rows, shards, repeats, models = [65536, 262144, 1048576], 4_194_304, 16, 10, \
            {"bench": 256, "large": 4096}
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    (work / "schemas" / "gpu_features").mkdir(parents=True)
    (work / "schemas" / "gpu_features" / "v1.py").write_text(SCHEMA)
    make_data(work / "data", rows, shards)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"gpu_check on {where}: torch {torch.__version__}, {rows:,} rows end to end", flush=True)

    results = []
    for name, hidden in models.items():
        path = export(torch, mlp(torch, hidden), work / f"{name}.pt2")
        checked = parity_check(torch, path, args.device, min(rows, 65_536))
        for precision in ("fp32", "bf16"):
            alone = {b: model_alone(torch, path, args.device, precision, b, repeats) for b in batches}
            best = max(alone, key=lambda b: alone[b])
            e2e = end_to_end(work, f"{name}_{precision}", path, args.device, precision, rows, best)
            results.append({"model": f"{name} 32-{hidden}-{hidden}-1", "precision": precision,
                            "model_alone_rows_per_s": alone, "best_batch": best,
                            "end_to_end": e2e, "ratio": e2e["rows_per_s"] / alone[best], **checked})
            print(f"  {name} {precision}: done", flush=True)

    head = " ".join(f"{f'alone@{b // 1024}k':>12}" for b in batches)
    print(f"\n{'model':<22} {'prec':<5} {head} {'end-to-end':>12} {'e2e/best':>9} {'|gpu-cpu|':>10} {'KL bf16':>9}")
    for r in results:
        cells = " ".join(f"{r['model_alone_rows_per_s'][b] / 1e6:>10.2f} M" for b in batches)
        print(f"{r['model']:<22} {r['precision']:<5} {cells} {r['end_to_end']['rows_per_s'] / 1e6:>10.2f} M "
              f"{r['ratio']:>8.0%} {r['max_abs_diff_fp32_vs_cpu']:>10.2e} {r['kl_bf16_vs_fp32']:>9.1e}")
    print("rows/s in millions; model alone = the program called directly, host memory in and out; "
          "end to end = `batchinfer run`, its wall_seconds")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(
            {"device": where, "rows": rows, "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
