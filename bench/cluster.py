#!/usr/bin/env python3
"""rows/s of the bench job on a Dask cluster of 1 and 2 worker processes against the direct
runner, on this machine (issue 20 point 6; see bench/README.md "Dask workers against the direct
runner").

  python bench/cluster.py [--rows 4000000] [--shard-rows 125000] [--rounds 2]
                          [--workdir bench/out/cluster] [--workers 1 2]

The data and the stamped job are bench/run.py's (``make_data.py``: id + 32 float32 features,
the 32→256→256→1 MLP; 65,536-row batches; validation, hashing, manifest and MLflow on). A Dask
scheduler and its workers (``dask worker --nworkers N --nthreads 1``) are started once per N,
before any timed run, as a cluster is there before a job. Each round runs ``direct`` and every
``dask-N`` once, in an order that rotates each round; each run is ``python -m batchinfer run``
timed from process start to exit, into a fresh partition (a date of its own). Every Dask
partition is compared with the round's direct one (``batchinfer diff``: ``identical`` means the
same rows, predictions and ``_input_hash``), then the outputs are removed.

rows/s is the rows scored divided by that wall time (start-up, imports and the commit included).
The machine's cores and load average are printed with each run: on a machine shared with other
work, read the figures as this machine's on that day, not as the runners' speeds.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as bench  # noqa: E402  (bench/run.py: the data and the job)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    """A Dask scheduler and ``workers`` single-threaded worker processes on 127.0.0.1."""

    def __init__(self, python: str, workers: int, logs: Path):
        self.python, self.workers, self.logs = python, workers, logs
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[subprocess.Popen] = []

    def _start(self, args: list[str], log: str) -> None:
        with open(self.logs / log, "wb") as out:
            self.procs.append(subprocess.Popen([self.python, "-m", *args], stdout=out,
                                               stderr=subprocess.STDOUT, start_new_session=True))

    def __enter__(self) -> "Cluster":
        self.logs.mkdir(parents=True, exist_ok=True)
        port = self.address.rsplit(":", 1)[1]
        self._start(["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", port,
                     "--no-dashboard"], f"scheduler-{self.workers}.log")
        self._start(["distributed.cli.dask_worker", self.address, "--host", "127.0.0.1",
                     "--nworkers", str(self.workers), "--nthreads", "1", "--no-dashboard"],
                    f"workers-{self.workers}.log")
        code = (f"from distributed import Client; c = Client({self.address!r}, timeout=60); "
                f"c.wait_for_workers({self.workers}, timeout=120); c.close()")
        subprocess.run([self.python, "-c", code], check=True)
        return self

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def timed_run(python: str, folder: Path, ds: str, runner: str, address: str | None,
              log: Path) -> dict:
    sets = ["--set", f"runner.name={runner}"]
    if address:
        sets += ["--set", f"runner.options.dask_client_address={address}"]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.run([python, "-m", "batchinfer", "run", "job.yaml", "--ds", ds, *sets],
                              cwd=folder, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    manifest = folder / "out" / f"dt={ds}" / "_manifest.json"
    rows = json.loads(manifest.read_text())["totals"]["rows_scored"] if manifest.is_file() else 0
    return {"ds": ds, "rc": proc.returncode, "wall_s": round(wall, 2), "rows": rows,
            "rows_per_s": round(rows / wall) if proc.returncode == 0 else None,
            "load_before": round(load, 2)}


def verdict(python: str, folder: Path, reference: str, ds: str) -> str:
    out = subprocess.run([python, "-m", "batchinfer", "diff", f"out/dt={reference}", f"out/dt={ds}"],
                         cwd=folder, capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    return lines[-1].removeprefix("verdict: ") if out.returncode == 0 and lines else f"rc {out.returncode}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--shard-rows", type=int, default=125_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--workdir", type=Path, default=HERE / "out" / "cluster")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    work = args.workdir.resolve()
    data = work / "data" / f"rows-{args.rows}"
    bench.make_data(args.python, data, args.rows, max(1, args.rows // args.shard_rows), False)
    folder = work / "job"
    tracking = f"sqlite:///{work / 'mlflow.db'}"
    bench.create_tracking_store(args.python, tracking)
    bench.make_job(args.python, folder, data, args.rows, tracking)
    print(f"{args.rows:,} rows in {max(1, args.rows // args.shard_rows)} shards; "
          f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}", flush=True)

    programs = ["direct"] + [f"dask-{n}" for n in args.workers]
    clusters = {f"dask-{n}": Cluster(args.python, n, work / "logs") for n in args.workers}
    results = []
    day = dt.date(2030, 1, 1)
    try:
        for cluster in clusters.values():
            cluster.__enter__()
        for round_ in range(args.rounds):
            order = programs[round_ % len(programs):] + programs[:round_ % len(programs)]
            by_program = {}
            for program in order:
                ds = (day := day + dt.timedelta(days=1)).isoformat()
                cluster = clusters.get(program)
                result = timed_run(args.python, folder, ds, "dask" if cluster else "direct",
                                   cluster.address if cluster else None,
                                   work / "logs" / f"{program}-{ds}.log")
                result.update(program=program, round=round_ + 1)
                by_program[program] = result
                results.append(result)
                print(f"round {round_ + 1} {program:8} rc {result['rc']}  {result['wall_s']:7.2f} s  "
                      f"{result['rows']:>10,} rows  {result['rows_per_s'] or 0:>9,} rows/s  "
                      f"(load before {result['load_before']})", flush=True)
            reference = by_program["direct"]
            for program, result in by_program.items():
                if program != "direct" and result["rc"] == 0 and reference["rc"] == 0:
                    result["vs_direct"] = verdict(args.python, folder, reference["ds"], result["ds"])
                    print(f"round {round_ + 1} {program:8} vs direct: {result['vs_direct']}", flush=True)
            for result in by_program.values():
                shutil.rmtree(folder / "out" / f"dt={result['ds']}", ignore_errors=True)
    finally:
        for cluster in clusters.values():
            cluster.__exit__()
    (work / "results.json").write_text(json.dumps({"rows": args.rows, "cores": os.cpu_count(),
                                                   "runs": results}, indent=2))
    print(f"results: {work / 'results.json'}")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
