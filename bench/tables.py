#!/usr/bin/env python3
"""The bench job written as files, as a Delta table and as an Iceberg table (contract §4 "Tables").

    cd /tmp && python /work/main/bench/tables.py --rows 8000000 --rounds 3

The data and the stamped job are bench/run.py's (``make_data.py`` from ../shared/bench, 32
float32 features, 125,000-row shards). Each round runs the three formats in a rotating order,
each a fresh ``python -m batchinfer run`` of its own date, with ``--set output.format=…`` and,
for the tables, ``--set output.path=tables-<format>``. Per run: the wall of the whole process,
the commit step's own time (``commit_seconds`` in ``_metrics.json``: the manifest, and for the
tables their transactions), and a reader's time, in this process after its imports, to count
the partition's rows and to read it whole — files through the manifest (pyarrow), Delta through
deltalake's pyarrow dataset with a partition filter, Iceberg through a pyiceberg scan. Ratios
are to files, median over rounds; everything goes to WORKDIR/tables.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as bench  # noqa: E402  (bench/run.py: the data and the job)

FORMATS = ("files", "delta", "iceberg")


def output_of(job: Path, fmt: str) -> list[str]:
    if fmt == "files":
        return []
    return ["--set", f"output.format={fmt}", "--set", f"output.path={job.parent / f'tables-{fmt}'}"]


def records(job: Path, fmt: str, ds: str) -> Path:
    if fmt == "files":
        return job.parent / "out" / f"dt={ds}"
    return job.parent / f"tables-{fmt}" / "_batchinfer" / f"dt={ds}"


def read_partition(job: Path, fmt: str, ds: str) -> tuple[int, float, float]:
    """(rows, seconds to count them, seconds to read them all) as a reader of that format."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset  # noqa: F401  (pa.dataset)
    import pyarrow.parquet as pq

    if fmt == "files":
        folder = records(job, fmt, ds)
        t0 = time.perf_counter()
        manifest = json.loads((folder / "_manifest.json").read_text())
        paths = [folder / f["path"] for s in manifest["shards"] for f in s["files"]
                 if f["path"].startswith("predictions/")]
        rows = sum(pq.read_metadata(p).num_rows for p in paths)
        counted = time.perf_counter() - t0
        t0 = time.perf_counter()
        table = pa.dataset.dataset([str(p) for p in paths], format="parquet").to_table()   # threaded, as the others
        return table.num_rows if table.num_rows == rows else -1, counted, time.perf_counter() - t0
    if fmt == "delta":
        from deltalake import DeltaTable

        t0 = time.perf_counter()
        dataset = DeltaTable(str(job.parent / "tables-delta")).to_pyarrow_dataset()
        rows = dataset.count_rows(filter=pc.field("dt") == ds)
        counted = time.perf_counter() - t0
        t0 = time.perf_counter()
        table = DeltaTable(str(job.parent / "tables-delta")).to_pyarrow_dataset().to_table(
            filter=pc.field("dt") == ds)
        return table.num_rows if table.num_rows == rows else -1, counted, time.perf_counter() - t0
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.expressions import EqualTo

    root = job.parent / "tables-iceberg"
    catalog = SqlCatalog("batchinfer", uri=f"sqlite:///{root / '_catalog.db'}", warehouse=str(root))
    job_name = json.loads((records(job, fmt, ds) / "_manifest.json").read_text())["job"]
    t0 = time.perf_counter()   # the default identifier (app/resolve.py sink_of)
    table = catalog.load_table("batchinfer." + job_name.replace("-", "_").replace(".", "_"))
    scan = table.scan(row_filter=EqualTo("dt", ds))
    rows = sum(task.file.record_count for task in scan.plan_files())
    counted = time.perf_counter() - t0
    t0 = time.perf_counter()
    arrow = table.scan(row_filter=EqualTo("dt", ds)).to_arrow()
    return arrow.num_rows if arrow.num_rows == rows else -1, counted, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8_000_000)
    parser.add_argument("--shard-rows", type=int, default=125_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--workdir", type=Path, default=HERE / "out" / "tables")
    args = parser.parse_args()
    python = sys.executable
    work = args.workdir.resolve()
    data = work / "data" / f"rows-{args.rows}"
    bench.make_data(python, data, args.rows, args.rows // args.shard_rows, regen=False)
    folder = work / "job"
    for stale in ["out", *[f"tables-{f}" for f in FORMATS]]:
        shutil.rmtree(folder / stale, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    tracking = f"sqlite:///{folder / 'mlflow.db'}"
    bench.create_tracking_store(python, tracking)
    job = bench.make_job(python, folder, data, args.rows, tracking)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    runs = []
    for rnd in range(args.rounds):
        order = args.formats[rnd % len(args.formats):] + args.formats[:rnd % len(args.formats)]
        for fmt in order:
            ds = f"2026-02-{rnd + 1:02d}"
            t0 = time.perf_counter()
            done = subprocess.run([python, "-m", "batchinfer", "run", job.name, "--ds", ds,
                                   *output_of(job, fmt)], cwd=folder, env=env,
                                  capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if done.returncode != 0:
                raise SystemExit(f"{fmt} round {rnd}: exit {done.returncode}\n{done.stderr[-2000:]}")
            metrics = json.loads((records(job, fmt, ds) / "_metrics.json").read_text())["metrics"]
            rows, count_s, read_s = read_partition(job, fmt, ds)
            assert rows == args.rows, (fmt, rows)
            runs.append({"format": fmt, "round": rnd, "wall_s": wall,
                         "commit_s": metrics["commit_seconds"], "count_s": count_s, "read_s": read_s})
            print(f"round {rnd + 1} {fmt:8s} wall {wall:6.2f} s  commit {metrics['commit_seconds']:.3f} s  "
                  f"count {count_s:.3f} s  read {read_s:.3f} s", flush=True)
    (work / "tables.json").write_text(json.dumps(runs, indent=1))
    median = {fmt: {k: statistics.median(r[k] for r in runs if r["format"] == fmt)
                    for k in ("wall_s", "commit_s", "count_s", "read_s")} for fmt in args.formats}
    print(f"\n{args.rows:,} rows, median of {args.rounds} round(s); ratio to files in brackets")
    print("| format | wall s | commit s | count rows s | read partition s |")
    print("| --- | --- | --- | --- | --- |")
    base = median.get("files")
    for fmt, m in median.items():
        cells = []
        for key in ("wall_s", "commit_s", "count_s", "read_s"):
            ratio = f" ({m[key] / base[key]:.2f}×)" if base and fmt != "files" and base[key] else ""
            cells.append(f"{m[key]:.{2 if key == 'wall_s' else 3}f}{ratio}")
        print(f"| {fmt} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
