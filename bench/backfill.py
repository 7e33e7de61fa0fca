"""Backfill's cost per date (issue 34 item 5): ``batchinfer backfill`` of N small dates, as one
``python -m batchinfer`` process, tracking to a local sqlite MLflow store.

    .venv/bin/python bench/backfill.py                     # 10 dates x 2,000 rows (1 shard each)
    .venv/bin/python bench/backfill.py --dates 30 --rows 500 --shards 2 --rounds 3

Prints, for each round:

- the whole backfill's wall, its CPU seconds (user + sys of the process tree, from
  ``getrusage(RUSAGE_CHILDREN)``; this process is made the subreaper of the tree, so the MLflow
  helper, which the CLI kills at its end without waiting for it, is counted too) and the peak
  RSS of its largest process;
- per date: wall as printed (the time from one date's line to the next; the first date's also
  holds the start and the imports), the median of the dates after the first, and CPU: all in
  (the backfill's CPU over N) and marginal (less a one-date backfill's, over N - 1: the start
  and the imports taken out).

Each round writes a fresh output and a fresh MLflow experiment (the store is created before any
timed run, so no run pays for its migrations) and checks that every date was committed as its
own partition (its own attempt) under its own FINISHED MLflow run. Data, model and job come from
tests/factories.py; ``cli`` is bench/resume.py's. ``results.json`` in the workdir holds every
figure.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time
from datetime import date, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from resume import cli  # noqa: E402

from factories import make_mlp_onnx, make_shards, write_job, write_schema  # noqa: E402

FIRST = date(2026, 1, 1)


def adopt_orphans() -> bool:
    """Make this process the subreaper of its descendants (Linux): the MLflow helper that a
    ``batchinfer`` process kills at its end, without waiting for it, is reparented here and
    reaped by :func:`reap`, so its CPU is in RUSAGE_CHILDREN too."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap(timeout: float = 5.0) -> None:
    """Wait for the orphans this process adopted (see :func:`adopt_orphans`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.02)


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def backfill(folder: Path, dates: list[str], output: str, experiment: str) -> dict:
    """One ``batchinfer backfill`` of ``dates``: its wall, CPU, peak RSS and each date's line time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("BATCHINFER_FAULT", None)
    args = [sys.executable, "-m", "batchinfer", "backfill", "job.yaml", "--start", dates[0],
            "--end", dates[-1], "--quiet", "--set", f"output.path={output}/dt={{ds}}",
            "--set", f"tracking.experiment={experiment}"]
    cpu0 = children_cpu()
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    stamps, lines = [], []
    for line in proc.stdout:
        lines.append(line)
        if line[:10] in dates:
            stamps.append(time.perf_counter() - t0)
    err = proc.stderr.read() if proc.stderr else ""
    rc = proc.wait()
    wall = time.perf_counter() - t0
    reap()
    cpu = children_cpu() - cpu0
    out = "".join(lines)
    assert rc == 0, out + err
    assert f"{len(dates)} committed" in out, out + err
    per_date = [b - a for a, b in zip([0.0, *stamps], stamps)]
    return {"wall_s": wall, "cpu_s": cpu, "per_date_wall_s": per_date,
            "max_rss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}


def check(folder: Path, dates: list[str], output: str, experiment: str) -> None:
    """Every date committed as its own partition, under its own MLflow run."""
    attempts = set()
    for ds in dates:
        manifest = json.loads((folder / output / f"dt={ds}" / "_manifest.json").read_text())
        assert manifest["ds"] == ds
        attempts.add(manifest["attempt"])
    assert len(attempts) == len(dates)
    with sqlite3.connect(folder / "mlflow.db") as db:
        runs = db.execute("select count(*), count(distinct r.run_uuid) from runs r join experiments e "
                          "on r.experiment_id = e.experiment_id where e.name = ? and "
                          "r.status = 'FINISHED'", (experiment,)).fetchone()
    assert runs == (len(dates), len(dates)), runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dates", type=int, default=10)
    parser.add_argument("--rows", type=int, default=2_000, help="rows a date")
    parser.add_argument("--shards", type=int, default=1, help="shards a date")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench" / "out" / "backfill")
    args = parser.parse_args()
    tree = adopt_orphans()
    folder = args.workdir
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    dates = [(FIRST + timedelta(days=n)).isoformat() for n in range(args.dates)]
    write_schema(folder / "schemas")
    for n, ds in enumerate(dates):
        make_shards(folder / "data" / f"dt={ds}", shards=args.shards,
                    rows=args.rows // args.shards, seed=n)
    make_mlp_onnx(folder / "models" / "model.onnx")
    write_job(folder, tracking={"uri": "sqlite:///mlflow.db", "experiment": "warmup"})
    rc, _, out = cli(folder, "stamp", "models/model.onnx", "--job", "job.yaml", "--model-version", "model:1")
    assert rc == 0, out
    # The store's migrations, the imports' first compile: before any timed run.
    backfill(folder, dates[:1], "warmup", "warmup")
    rounds = []
    for r in range(args.rounds):
        whole = backfill(folder, dates, f"out{r}", f"bench{r}")
        check(folder, dates, f"out{r}", f"bench{r}")
        one = backfill(folder, dates[:1], f"one{r}", f"one{r}")
        marginal_cpu = (whole["cpu_s"] - one["cpu_s"]) / max(1, len(dates) - 1)
        marginal_wall = (whole["wall_s"] - one["wall_s"]) / max(1, len(dates) - 1)
        rounds.append({**whole, "one_date_wall_s": one["wall_s"], "one_date_cpu_s": one["cpu_s"],
                       "per_date_cpu_s": marginal_cpu, "marginal_wall_s": marginal_wall})
        later = whole["per_date_wall_s"][1:] or whole["per_date_wall_s"]
        print(f"round {r + 1}: {len(dates)} dates x {args.rows:,} rows ({args.shards} shard(s)): "
              f"wall {whole['wall_s']:.1f} s, CPU {whole['cpu_s']:.1f} s, peak RSS "
              f"{whole['max_rss_kb'] / 1024:.0f} MB; one date alone: wall {one['wall_s']:.1f} s, "
              f"CPU {one['cpu_s']:.1f} s")
        print(f"  per date: wall {whole['wall_s'] / len(dates):.2f} s (all in), "
              f"{statistics.median(later):.2f} s median after the first "
              f"(first {whole['per_date_wall_s'][0]:.2f} s), marginal {marginal_wall:.2f} s; "
              f"CPU {whole['cpu_s'] / len(dates):.2f} s (all in), marginal {marginal_cpu:.2f} s")
    if not tree:
        print("CPU: the batchinfer process only (no subreaper here: its MLflow helper is left out)")
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1, 5, 15 min) at the end")
    (folder / "results.json").write_text(json.dumps(
        {"dates": args.dates, "rows": args.rows, "shards": args.shards, "rounds": rounds,
         "loadavg": load}, indent=2))


if __name__ == "__main__":
    main()
