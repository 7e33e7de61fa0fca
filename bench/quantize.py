"""INT8 vs FP32 through ``batchinfer run``: the bench MLP (``../shared/bench/make_data.py``, 32
features, 256-256-1) at each size, the same data, runs alternating FP32 / INT8.

  .venv/bin/python bench/quantize.py --rows 1000000 8000000 --rounds 1

For each size: the FP32 job as bench/run.py writes it (stamped), the INT8 model made from it by
``batchinfer export --to onnx --quantize int8 --sample`` (its gate's figures printed), stamped
with ``model.options.precision=int8`` in a job folder of its own, then ``--rounds`` rounds of
one FP32 run and one INT8 run (order alternating between rounds). Printed per run: wall s,
rows/s end to end, the model's own rows/s (``_metrics.json``'s model compute time) and the
stage times. ``WORKDIR/quantize.json`` keeps everything. Tracking is on (sqlite), as in run.py.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run as bench  # noqa: E402  (bench/run.py: data, jobs, tracking store)

INT8_JOB = """\
# INT8 twin of bench_{rows}: written by bench/quantize.py.
name: bench_{rows}_int8
input: {{path: "{data}/*.parquet"}}
schema: bench_features@1
schemas: {{root: schemas}}
model: {{uri: models/model-int8.onnx, backend: onnxruntime, device: cpu, version: "bench_mlp:1-int8",
        options: {{precision: int8}}}}
output: {{path: "out/dt={{ds}}", id_columns: [id], predictions: {{y: score}}}}
tracking: {{uri: "{tracking}", experiment: batchinfer_bench}}
"""


def sh(cmd: list[str], cwd: Path) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} (in {cwd}) exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def prepare(python: str, work: Path, rows: int, shard_rows: int, tracking: str) -> tuple[Path, Path, dict]:
    data = work / "data" / f"rows-{rows}"
    bench.make_data(python, data, rows, max(1, rows // shard_rows), regen=False)
    fp32 = bench.make_job(python, work / "jobs" / f"fp32-{rows}", data, rows, tracking)
    folder = work / "jobs" / f"int8-{rows}"
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "models").mkdir(parents=True)
    shutil.copytree(fp32.parent / "schemas", folder / "schemas")
    job = folder / "job.yaml"
    job.write_text(INT8_JOB.format(rows=rows, data=data / "data", tracking=tracking))
    t0 = time.perf_counter()
    printed = sh([python, "-m", "batchinfer", "export", str(fp32.parent / "models" / "model.onnx"),
                  "--to", "onnx", "--quantize", "int8", "--out", "models/model-int8.onnx",
                  "--sample", "job.yaml", "--ds", "2026-01-01", "--max-flip-rate", "0.01"], folder)
    export_s = time.perf_counter() - t0
    sh([python, "-m", "batchinfer", "stamp", "models/model-int8.onnx", "--job", "job.yaml"], folder)
    gate = json.loads((folder / "models" / "model-int8.onnx.quantization.json").read_text())
    print(printed.strip())
    print(f"  export took {export_s:.1f} s")
    return fp32, job, {**gate, "export_s": export_s}


def prepare_demo(python: str, work: Path, rows: int) -> tuple[Path, Path, dict]:
    """The credit-risk demo (``batchinfer demo``'s job, data and model) at ``rows`` rows: its
    FP32 job stamped, and ``job-int8.yaml`` running its INT8 export."""
    import yaml

    folder = work / "demo"
    shutil.rmtree(folder, ignore_errors=True)
    sh([python, "-c", f"import pathlib; from batchinfer.demo import write_demo; "
                      f"write_demo(pathlib.Path({str(folder)!r}), rows={rows})"], work)
    fp32 = folder / "job.yaml"
    spec = yaml.safe_load(fp32.read_text())
    spec["model"]["device"] = "cpu"
    fp32.write_text(yaml.safe_dump(spec, sort_keys=False))
    sh([python, "-m", "batchinfer", "stamp", "models/credit_risk.onnx", "--job", "job.yaml"], folder)
    spec["model"].update(uri="models/credit_risk-int8.onnx", version="credit_risk:1-int8",
                         options={"precision": "int8"})
    int8 = folder / "job-int8.yaml"
    int8.write_text(yaml.safe_dump(spec, sort_keys=False))
    t0 = time.perf_counter()
    printed = sh([python, "-m", "batchinfer", "export", "models/credit_risk.onnx", "--to", "onnx",
                  "--quantize", "int8", "--out", "models/credit_risk-int8.onnx", "--sample",
                  "job.yaml", "--ds", "2026-01-31", "--max-flip-rate", "0.01"], folder)
    export_s = time.perf_counter() - t0
    sh([python, "-m", "batchinfer", "stamp", "models/credit_risk-int8.onnx", "--job", "job-int8.yaml"],
       folder)
    print(printed.strip())
    gate = json.loads((folder / "models" / "credit_risk-int8.onnx.quantization.json").read_text())
    return fp32, int8, {**gate, "export_s": export_s}


def one_run(python: str, job: Path, ds: str) -> dict:
    out = job.parent / "out" / f"dt={ds}"
    shutil.rmtree(job.parent / "out", ignore_errors=True)
    t0 = time.perf_counter()
    done = subprocess.run([python, "-m", "batchinfer", "run", job.name, "--ds", ds], cwd=job.parent,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"run {job} exited {done.returncode}: {done.stderr.strip()}")
    record = json.loads((out / "_metrics.json").read_text())
    manifest = json.loads((out / "_manifest.json").read_text())
    metrics = record["metrics"]
    shutil.rmtree(job.parent / "out", ignore_errors=True)
    return {"wall_s": wall, "rows": manifest["totals"]["rows_scored"],
            "precision": manifest["model_options"].get("precision"), "metrics": metrics}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[1_000_000, 8_000_000])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--shard-rows", type=int, default=125_000)
    ap.add_argument("--workdir", default="bench/out-quantize")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--demo-rows", type=int, default=0,
                    help="also the credit-risk demo at this many rows (a multiple of 6)")
    args = ap.parse_args(argv)
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tracking = f"sqlite:///{work / 'mlflow.db'}"
    bench.create_tracking_store(args.python, tracking)
    results = []
    sizes = [("mlp", rows) for rows in args.rows] + ([("demo", args.demo_rows)] if args.demo_rows else [])
    for what, rows in sizes:
        print(f"== {what}, {rows:,} rows", flush=True)
        if what == "demo":
            fp32, int8, gate = prepare_demo(args.python, work, rows)
        else:
            fp32, int8, gate = prepare(args.python, work, rows, args.shard_rows, tracking)
        runs: dict[str, list[dict]] = {"fp32": [], "int8": []}
        for rnd in range(args.rounds):
            order = [("fp32", fp32), ("int8", int8)]
            for name, job in (order if rnd % 2 == 0 else order[::-1]):
                r = one_run(args.python, job, "2026-01-31" if what == "demo" else f"2026-02-{rnd + 1:02d}")
                runs[name].append(r)
                m = r["metrics"]
                stages = {k[len("stage_seconds_"):]: round(v, 2) for k, v in m.items()
                          if k.startswith("stage_seconds_")}
                model_s = next((v for k, v in stages.items() if "model" in k or "infer" in k), None)
                model_rps = f"{r['rows'] / model_s:,.0f}" if model_s else "?"
                print(f"  {name} round {rnd}: {r['wall_s']:.2f} s wall, {r['rows'] / r['wall_s']:,.0f} "
                      f"rows/s end to end, model {model_rps} rows/s; stage seconds {stages}", flush=True)
        best = {k: min(r["wall_s"] for r in v) for k, v in runs.items()}
        print(f"  INT8 / FP32 rows/s (best runs): {best['fp32'] / best['int8']:.2f}x; gate KL "
              f"{gate['parity_kl']:.3g}, flip rate {gate['parity_flip_rate']:.3g}, max |Δ| "
              f"{gate['parity_max_abs_diff']:.3g}", flush=True)
        results.append({"model": what, "rows": rows, "gate": gate, "runs": runs,
                        "speedup": best["fp32"] / best["int8"]})
        (work / "quantize.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
