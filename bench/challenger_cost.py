#!/usr/bin/env python3
"""The cost of one challenger model (issue 12): the bench job of ``bench/run.py``, run as a user
runs it (``python -m batchinfer run``), without and with ``model.challengers`` naming the same
model as its own challenger — the same model work twice, so the difference is what a challenger
costs: one more model call per batch, one more ``_input_hash`` and prediction file per batch.

Runs alternate (without, with, without, …) so that a change in the machine's load falls on
both. Prints wall time and CPU per variant (median, min-max), the ratio of the medians, and the
stage seconds batchinfer measured; writes WORKDIR/challenger_cost.json.

    .venv/bin/python bench/challenger_cost.py --rows 2000000 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # noqa: E402  (bench/run.py: data, job, timing)

CHALLENGER = "model.challengers=[{name: twin, uri: models/model.onnx, device: cpu}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shard-rows", type=int, default=125_000)
    ap.add_argument("--workdir", default="bench/out")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args(argv)
    work = Path(args.workdir).resolve()
    data = work / "data" / f"rows-{args.rows}"
    bench.make_data(args.python, data, args.rows, max(1, args.rows // args.shard_rows), False)
    tracking = f"sqlite:///{work / 'mlflow.db'}"
    bench.create_tracking_store(args.python, tracking)
    job = bench.make_job(args.python, work / "jobs" / f"challenger-{args.rows}", data, args.rows,
                         tracking)
    env = {**os.environ, "MLFLOW_LOGGING_LEVEL": "WARNING"}
    runs: dict[str, list[dict]] = {"without": [], "with": []}
    for rnd in range(args.rounds):
        for variant in ("without", "with"):
            ds = f"2026-02-{rnd * 2 + (variant == 'with') + 1:02d}"
            cmd = [args.python, "-m", "batchinfer", "run", job.name, "--ds", ds, "--quiet"]
            if variant == "with":
                cmd += ["--set", CHALLENGER]
            out = job.parent / "out" / f"dt={ds}"
            log = work / "logs" / f"challenger-{variant}-{args.rows}-r{rnd}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            res = bench.measure(cmd, cwd=job.parent, log=log, env=env, timeout=1800,
                                sample_s=0.25, python=args.python)
            res.update(bench.batchinfer_result(out))
            manifest = json.loads((out / "_manifest.json").read_text()) if res["rc"] == 0 else {}
            res["challenger_rows"] = sum(c["rows_scored"] for c in manifest.get("challengers", []))
            if res["rc"] != 0 or res.get("rows_out") != args.rows:
                print(f"!! {variant} round {rnd}: rc={res['rc']} (log {log})")
                return 1
            runs[variant].append(res)
            print(f"round {rnd} {variant:<7} wall {res['wall_s']:6.2f} s  CPU {res['cpu_s']:6.2f} s"
                  f"  challenger rows {res['challenger_rows']}", flush=True)
            bench.shutil.rmtree(out, ignore_errors=True)
    summary = {v: _summary(r) for v, r in runs.items()}
    summary["ratio_wall"] = summary["with"]["wall_s"] / summary["without"]["wall_s"]
    summary["ratio_cpu"] = summary["with"]["cpu_s"] / summary["without"]["cpu_s"]
    summary["rows"] = args.rows
    summary["command"] = " ".join(["bench/challenger_cost.py", *(argv or sys.argv[1:])])
    for variant in ("without", "with"):
        s = summary[variant]
        print(f"{variant:<7} wall {s['wall_s']:.2f} s ({s['wall_min']:.2f}-{s['wall_max']:.2f}), "
              f"CPU {s['cpu_s']:.2f} s; stages (s): "
              + ", ".join(f"{k} {v:.2f}" for k, v in s["stages"].items()))
    print(f"with/without (medians): wall {summary['ratio_wall']:.2f}x, CPU {summary['ratio_cpu']:.2f}x")
    (work / "challenger_cost.json").write_text(json.dumps({"summary": summary, "runs": runs},
                                                          indent=1, default=str))
    return 0


def _summary(runs: list[dict]) -> dict:
    walls = [r["wall_s"] for r in runs]
    stages: dict[str, list[float]] = {}
    for r in runs:
        for key, value in r.get("job_metrics", {}).items():
            if key.startswith("stage_seconds_"):
                stages.setdefault(key[len("stage_seconds_"):], []).append(value)
    return {"wall_s": statistics.median(walls), "wall_min": min(walls), "wall_max": max(walls),
            "cpu_s": statistics.median(r["cpu_s"] for r in runs),
            "stages": {k: statistics.median(v) for k, v in stages.items()}}


if __name__ == "__main__":
    sys.exit(main())
