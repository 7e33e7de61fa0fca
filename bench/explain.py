#!/usr/bin/env python3
"""The cost of explanations (issue 23): the bench job of ``bench/run.py`` run as a user runs it
(``python -m batchinfer run``), without ``explain`` and with each method, on the backend the
method needs — gradient × input and integrated gradients on the torch backend (the same MLP as
a ``torch.export`` program), permutation Shapley values on ONNX Runtime — each as a ratio to
the same backend's run without explanations.

Each variant has its own job folder and model copy, stamped with its ``explain`` (a model file
has one declaration). Runs alternate within each round (every variant once per round, in
order) so that a change in the machine's load falls on all. Prints wall time and CPU per
variant (median, min-max), the ratio of the medians to the backend's plain run, the rows
explained and ``stage_seconds_explain``; writes WORKDIR/explain_cost.json.

    .venv/bin/python bench/explain.py --rows 200000 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # noqa: E402  (bench/run.py: data, job, timing)

# name → (backend, explain section or None)
VARIANTS: dict[str, tuple[str, str | None]] = {
    "torch": ("torch", None),
    "torch_gradient_x_input": ("torch", "{method: gradient_x_input}"),
    "torch_integrated_gradients": ("torch", "{method: integrated_gradients, steps: 50, fraction: FRACTION}"),
    "onnx": ("onnxruntime", None),
    "onnx_permutation": ("onnxruntime", "{method: permutation, samples: 8, fraction: FRACTION}"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shard-rows", type=int, default=100_000)
    ap.add_argument("--fraction", type=float, default=0.02,
                    help="explain.fraction of the sampled methods (integrated gradients, permutation)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--workdir", default="bench/out")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args(argv)
    work = Path(args.workdir).resolve()
    data = work / "data" / f"rows-{args.rows}"
    bench.make_data(args.python, data, args.rows, max(1, args.rows // args.shard_rows), False)
    tracking = f"sqlite:///{work / 'mlflow.db'}"
    bench.create_tracking_store(args.python, tracking)
    jobs, sets = {}, {}
    for name in args.variants:
        backend, section = VARIANTS[name]
        job = bench.make_job(args.python, work / "jobs" / f"explain-{name}-{args.rows}", data,
                             args.rows, tracking, backend=backend)
        sets[name] = [] if section is None else [
            "--set", f"explain={section.replace('FRACTION', str(args.fraction))}"]
        if sets[name]:   # the model declares its explanation: stamp it again with it
            model = "model.pt2" if backend == "torch" else "model.onnx"
            subprocess.run([args.python, "-m", "batchinfer", "stamp", f"models/{model}", "--job",
                            job.name, *sets[name]], cwd=job.parent, check=True,
                           stdout=subprocess.DEVNULL)
        jobs[name] = job
    env = {**os.environ, "MLFLOW_LOGGING_LEVEL": "WARNING"}
    runs: dict[str, list[dict]] = {name: [] for name in args.variants}
    for rnd in range(args.rounds):
        for name in args.variants:
            job = jobs[name]
            ds = f"2026-03-{rnd + 1:02d}"
            cmd = [args.python, "-m", "batchinfer", "run", job.name, "--ds", ds, "--quiet", *sets[name]]
            out = job.parent / "out" / f"dt={ds}"
            log = work / "logs" / f"explain-{name}-{args.rows}-r{rnd}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            res = bench.measure(cmd, cwd=job.parent, log=log, env=env, timeout=3600,
                                sample_s=0.25, python=args.python)
            res.update(bench.batchinfer_result(out))
            metrics = {}
            if res["rc"] == 0:
                metrics = json.loads((out / "_metrics.json").read_text())["metrics"]
            res["explain_rows"] = metrics.get("explain_rows", 0.0)
            res["explain_s"] = metrics.get("stage_seconds_explain", 0.0)
            if res["rc"] != 0 or res.get("rows_out") != args.rows:
                print(f"!! {name} round {rnd}: rc={res['rc']} (log {log})")
                return 1
            runs[name].append(res)
            print(f"round {rnd} {name:<27} wall {res['wall_s']:7.2f} s  CPU {res['cpu_s']:7.2f} s"
                  f"  explained {int(res['explain_rows'])} rows ({res['explain_s']:.2f} s)", flush=True)
            bench.shutil.rmtree(out, ignore_errors=True)
    summary: dict = {name: _summary(r) for name, r in runs.items()}
    for name in args.variants:
        plain = "torch" if VARIANTS[name][0] == "torch" else "onnx"
        if plain in summary and name != plain:
            summary[name]["x_wall"] = summary[name]["wall_s"] / summary[plain]["wall_s"]
            summary[name]["x_cpu"] = summary[name]["cpu_s"] / summary[plain]["cpu_s"]
    summary["rows"], summary["fraction"] = args.rows, args.fraction
    summary["command"] = " ".join(["bench/explain.py", *(argv or sys.argv[1:])])
    for name in args.variants:
        s = summary[name]
        ratio = f", {s['x_wall']:.2f}x wall / {s['x_cpu']:.2f}x CPU of its plain run" if "x_wall" in s else ""
        print(f"{name:<27} wall {s['wall_s']:.2f} s ({s['wall_min']:.2f}-{s['wall_max']:.2f}), "
              f"CPU {s['cpu_s']:.2f} s, explained {int(s['explain_rows'])} rows{ratio}")
    (work / "explain_cost.json").write_text(json.dumps({"summary": summary, "runs": runs},
                                                       indent=1, default=str))
    return 0


def _summary(runs: list[dict]) -> dict:
    walls = [r["wall_s"] for r in runs]
    return {"wall_s": statistics.median(walls), "wall_min": min(walls), "wall_max": max(walls),
            "cpu_s": statistics.median(r["cpu_s"] for r in runs),
            "explain_rows": statistics.median(r["explain_rows"] for r in runs),
            "explain_s": statistics.median(r["explain_s"] for r in runs)}


if __name__ == "__main__":
    sys.exit(main())
