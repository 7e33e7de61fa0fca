"""Many small shards (issue 34 item 4): the same rows as 24, 1,000, 4,000 and 20,000 shards,
direct runner, to measure what a shard costs apart from its rows.

    .venv/bin/python bench/shards.py                              # 960,000 rows; 24 1000 4000 20000
    .venv/bin/python bench/shards.py --shards 24 1000 4000 --rows 960000

For every size: the partition is written once (tests/factories.py's make_shards, 4 features),
then ``batchinfer run`` scores it, each run a fresh ``python -m batchinfer`` process measured by
bench/rss.py (``getrusage(RUSAGE_CHILDREN)`` of a small wrapper: CPU-seconds = user + sys of the
whole process tree it waited for, peak RSS = the largest resident set of any one process of the
tree). Then ``batchinfer plan`` and ``batchinfer inspect`` of the same partition, measured the
same way. Printed per size: CPU-s, peak RSS, wall, manifest size, per-shard overhead in ms of CPU
(``(CPU - CPU@first size) / (shards - shards@first size)``), the walls of plan and inspect, and
the run's own commit timing where _metrics.json has it. Everything also goes to
``WORKDIR/results.json``.

Tracking goes to a local sqlite store (created by a one-row warm-up run, so the first size does
not pay for creating it). The machine is shared: CPU-seconds and peak RSS are the figures;
wall is secondary.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from factories import DS, make_mlp_onnx, make_shards, write_job, write_schema  # noqa: E402

RSS = ROOT / "bench" / "rss.py"


def measured(folder: Path, *args: str) -> dict[str, Any]:
    """``python -m batchinfer ARGS`` in ``folder`` under bench/rss.py: its wall, CPU and peak RSS
    (and its output, for an error message)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("BATCHINFER_FAULT", None)
    out = folder / "_rss.json"
    done = subprocess.run([sys.executable, str(RSS), str(out), sys.executable, "-m", "batchinfer",
                           *args], cwd=folder, env=env, capture_output=True, text=True)
    ru = json.loads(out.read_text())
    out.unlink()
    if done.returncode != 0:
        raise SystemExit(f"batchinfer {' '.join(args)} exited {done.returncode}:\n"
                         f"{done.stdout}{done.stderr}")
    return {"wall_s": ru["wall_s"], "cpu_s": ru["user_s"] + ru["sys_s"],
            "rss_mb": ru["max_rss_kb"] / 1024, "output": done.stdout + done.stderr}


def one_size(folder: Path, shards: int, rows: int, keep: bool) -> dict[str, Any]:
    per_shard = max(1, rows // shards)
    data = folder / "data" / f"dt={DS}"
    shutil.rmtree(data, ignore_errors=True)
    t0 = time.perf_counter()
    make_shards(data, shards=shards, rows=per_shard, seed=1)
    made_s = time.perf_counter() - t0
    output = f"out-{shards}"
    shutil.rmtree(folder / output, ignore_errors=True)
    base = ("job.yaml", "--ds", DS, "--set", f"output.path={output}")
    run = measured(folder, "run", *base)
    plan = measured(folder, "plan", *base)
    inspect = measured(folder, "inspect", output)
    manifest = folder / output / "_manifest.json"
    metrics_file = folder / output / "_metrics.json"
    metrics = json.loads(metrics_file.read_text()).get("metrics", {}) if metrics_file.exists() else {}
    result = {
        "shards": shards, "rows_a_shard": per_shard, "rows": per_shard * shards,
        "data_written_s": made_s,
        "cpu_s": run["cpu_s"], "rss_mb": run["rss_mb"], "wall_s": run["wall_s"],
        "manifest_kb": manifest.stat().st_size / 1024 if manifest.exists() else None,
        "plan_wall_s": plan["wall_s"], "plan_cpu_s": plan["cpu_s"], "plan_rss_mb": plan["rss_mb"],
        "inspect_wall_s": inspect["wall_s"], "inspect_cpu_s": inspect["cpu_s"],
        "inspect_rss_mb": inspect["rss_mb"],
        "stage_s": {k: v for k, v in metrics.items() if k.endswith("_seconds")},
    }
    if not keep:
        shutil.rmtree(folder / output, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[24, 1000, 4000, 20000])
    parser.add_argument("--rows", type=int, default=960_000, help="rows in all, every size")
    parser.add_argument("--batch-rows", type=int, default=20_000, help="the job's batch.rows")
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench" / "out" / "shards")
    parser.add_argument("--keep", action="store_true", help="keep each size's data and output")
    args = parser.parse_args()
    folder = args.workdir
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    write_schema(folder / "schemas")
    make_mlp_onnx(folder / "models" / "model.onnx")
    write_job(folder, batch={"rows": args.batch_rows},
              tracking={"uri": "sqlite:///mlflow.db", "experiment": "shards"})
    measured(folder, "stamp", "models/model.onnx", "--job", "job.yaml", "--model-version", "model:1")
    make_shards(folder / "data" / f"dt={DS}", shards=1, rows=1, seed=1)  # warm-up: the store
    measured(folder, "run", "job.yaml", "--ds", DS, "--set", "output.path=warmup")
    shutil.rmtree(folder / "warmup")

    results = []
    head = (f"{'shards':>7} {'rows/shard':>10} {'CPU s':>7} {'peak RSS':>9} {'wall s':>7} "
            f"{'manifest':>9} {'ms/shard':>8} {'plan s':>7} {'inspect s':>9}")
    print(head, flush=True)
    for shards in args.shards:
        r = one_size(folder, shards, args.rows, args.keep)
        first = results[0] if results else None
        r["overhead_ms_a_shard"] = (
            (r["cpu_s"] - first["cpu_s"]) / (shards - first["shards"]) * 1000
            if first and shards != first["shards"] else None)
        results.append(r)
        over = f"{r['overhead_ms_a_shard']:.1f}" if r["overhead_ms_a_shard"] is not None else "-"
        manifest = f"{r['manifest_kb']:.0f} KB" if r["manifest_kb"] is not None else "-"
        print(f"{shards:>7} {r['rows_a_shard']:>10,} {r['cpu_s']:>7.1f} {r['rss_mb']:>6.0f} MB "
              f"{r['wall_s']:>7.1f} {manifest:>9} {over:>8} {r['plan_wall_s']:>7.1f} "
              f"{r['inspect_wall_s']:>9.1f}", flush=True)
    (folder / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results: {folder / 'results.json'}")


if __name__ == "__main__":
    main()
