#!/usr/bin/env python3
"""batchinfer against its peers, on the same data, in one run (see bench/README.md).

  python bench/run.py [--rows 1000000 2000000 8000000] [--rounds 3] [--shard-rows 125000]
                      [--workdir bench/out] [--all-peers] [--programs floor batchinfer ...]

For each size the data is generated once with ``make_data.py`` (``--shards rows/shard_rows``:
the shard size is the same at every size, so peak memory can be compared across sizes). Then,
round after round, every program runs on every size as its own process, in an order that
rotates each round: the raw-model floor, stock Beam RunInference (smallest size only unless
``--all-peers``), Ray Data, Daft and PySpark (each when it imports) and batchinfer, run as a user runs it
(``python -m batchinfer run job.yaml --ds …`` in a job folder with a schema, a stamped model and
an MLflow sqlite store created beforehand). A one-row partition measures start-up.

Each run is timed around the whole process (``perf_counter`` around the subprocess), and its
peak memory is taken from GNU ``/usr/bin/time -v`` (or ``bench/rss.py`` where that is missing):
the largest resident set of any one process. The memory of the whole process tree is
also sampled every ``--sample`` seconds (``tree MB``: the RSS of a lone process, the sum of the
proportional set sizes — shared pages split among the processes mapping them — when there are
several): that is what counts for multi-process programs such as Ray. Sampling can miss a short
peak; ``peak RSS`` cannot. The harness's own CPU time during each run is recorded
(``harness_cpu_s``) so its perturbation is known.

After every size of every round, each other program's output is checked against batchinfer's
output of that round (``output_check.py``: every id once, scores within 1e-5); a program that
fails its check counts as failed. Results: a table on stdout and everything, raw runs included,
in ``WORKDIR/results.json``.
Outputs are removed after every run; the generated data is kept and reused by later runs with
the same parameters (``make_data.py`` is deterministic; ``--regen`` forces it).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = Path(os.environ.get("BATCHINFER_PEERS", HERE.parent.parent / "shared" / "bench"))
FEATURES = 32
STARTUP_ROWS = 1
PAGE = os.sysconf("SC_PAGE_SIZE")
PSS_EVERY_S = 1.0  # multi-process trees: PSS at most this often (it is costly to read)
PROGRAMS = ("floor", "batchinfer", "batchinfer_torch", "ray", "stock_beam", "daft", "spark")
# Optional peers: the module each needs; without it the program is "not installed" and skipped.
OPTIONAL = {"ray": "ray", "daft": "daft", "spark": "pyspark"}
PEER_SCRIPTS = {"floor": PEERS / "peer_floor.py", "stock_beam": PEERS / "peer_stock_beam.py",
                "ray": PEERS / "peer_ray.py", "daft": HERE / "peer_daft.py", "spark": HERE / "peer_spark.py"}
BATCHINFERS = ("batchinfer", "batchinfer_torch")
SLOPE_PROGRAMS = ("floor", "batchinfer", "ray", "stock_beam", "daft", "spark")
# Run by --peer-python: pyspark in the project's venv would slow batchinfer down (mlflow imports
# pyspark whenever it is installed: 0.2 s of every start-up), and daft pins tqdm<4.68 (bench/README.md).
PEER_VENV_PROGRAMS = ("daft", "spark")

SCHEMA_SOURCE = '''\
"""bench_features, version 1: what make_data.py writes (id + 32 standard-normal float32s)."""
import pandera.polars as pa
import polars as pl

FEATURES = [f"f{i}" for i in range(%d)]

SCHEMA = pa.DataFrameSchema(
    {"id": pa.Column(pl.Int64, nullable=False),
     **{name: pa.Column(pl.Float32, pa.Check.in_range(-100.0, 100.0)) for name in FEATURES}},
    strict=True,
    name="bench_features@1",
)
''' % FEATURES

JOB_TEMPLATE = """\
# batchinfer benchmark job ({rows} rows): written by bench/run.py.
name: bench_{rows}
input: {{path: "{data}/*.parquet"}}
schema: bench_features@1
schemas: {{root: schemas}}
model: {{uri: models/{model}, backend: {backend}, device: cpu, version: "bench_mlp:1"}}
output: {{path: "out/dt={{ds}}", id_columns: [id], predictions: {{{output}: score}}}}
tracking: {{uri: "{tracking}", experiment: batchinfer_bench}}
"""


# -- running one program -----------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    kids = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids.extend(int(x) for x in f.read().split())
    except OSError:
        pass
    return kids


def _pss(pid: int) -> int:
    """Proportional set size in bytes (shared pages split among their users); RSS as fallback."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _descendants(root: int) -> list[int]:
    pids, todo = [], _children(root)
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(_children(pid))
    return pids


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def _tree_mem(root: int, pss_ok: bool, cpu: dict[int, int]) -> int | None:
    """Memory of ``root``'s descendants (not ``root``: the timing wrapper): the RSS of a lone
    process (cheap), the sum of PSS when there are several. ``smaps_rollup`` walks the page
    tables (milliseconds for a large process, more for Ray's object store), so a caller allows
    it only now and then (``pss_ok``); None means "not sampled this time". Each descendant's
    CPU time so far is recorded in ``cpu`` (pid → clock ticks)."""
    pids = _descendants(root)
    for pid in pids:
        try:
            cpu[pid] = _cpu_ticks(pid)
        except (OSError, IndexError, ValueError):
            pass
    if len(pids) > 1 and not pss_ok:
        return None
    measure_one = _rss if len(pids) == 1 else _pss
    total = 0
    for pid in pids:
        try:
            total += measure_one(pid)
        except OSError:
            continue
    return total


def _parse_gnu_time(text: str) -> dict:
    def field(label, cast=float):
        m = re.search(rf"^\s*{re.escape(label)}:\s*(\S+)", text, re.M)
        return cast(m.group(1)) if m else None

    return {"user_s": field("User time (seconds)"), "sys_s": field("System time (seconds)"),
            "max_rss_kb": field("Maximum resident set size (kbytes)", int),
            "rc": field("Exit status", int)}


def measure(cmd: list[str], *, cwd: Path, log: Path, env: dict, timeout: float,
            sample_s: float, python: str) -> dict:
    """Run ``cmd`` as its own process; return wall, CPU, peak RSS and tree RSS."""
    stats = log.with_suffix(".time")
    if Path("/usr/bin/time").exists():
        wrapped = ["/usr/bin/time", "-v", "-o", str(stats), *cmd]
        parse = lambda: _parse_gnu_time(stats.read_text())  # noqa: E731
    else:
        wrapped = [python, str(HERE / "rss.py"), str(stats), *cmd]
        parse = lambda: json.loads(stats.read_text())  # noqa: E731
    load_before = os.getloadavg()[0]
    self_before = resource.getrusage(resource.RUSAGE_SELF)
    tree_peak = 0
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(wrapped, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        timed_out = False
        next_pss = 0.0
        cpu_ticks: dict[int, int] = {}
        while proc.poll() is None:
            now = time.perf_counter()
            mem = _tree_mem(proc.pid, pss_ok=now >= next_pss, cpu=cpu_ticks)
            if mem is not None:
                tree_peak = max(tree_peak, mem)
                if now >= next_pss:
                    next_pss = now + PSS_EVERY_S
            if now - t0 > timeout:
                timed_out = True
                # This run's processes only: its group, and descendants that left it (Ray's
                # workers start their own sessions).
                strays = _descendants(proc.pid)
                os.killpg(proc.pid, signal.SIGKILL)
                for pid in strays:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                proc.wait()
                break
            time.sleep(sample_s)
        wall = time.perf_counter() - t0
    self_after = resource.getrusage(resource.RUSAGE_SELF)
    result = {"wall_s": wall, "rc": proc.returncode, "timed_out": timed_out,
              "tree_mb": tree_peak / 2**20, "load1_before": load_before,
              "load1_after": os.getloadavg()[0],
              # this harness's own CPU while the program ran (sampling memory): the perturbation
              "harness_cpu_s": (self_after.ru_utime + self_after.ru_stime
                                - self_before.ru_utime - self_before.ru_stime)}
    try:
        parsed = parse()
        result.update({k: v for k, v in parsed.items() if k != "rc" and v is not None})
        if parsed.get("rc") is not None and not timed_out:
            result["rc"] = parsed["rc"]
        stats.unlink()
    except (OSError, ValueError):
        pass
    if "max_rss_kb" in result:
        result["max_rss_mb"] = result.pop("max_rss_kb") / 1024
    # CPU: what the wrapper saw of the processes it waited for (exact) and the sampled sum over
    # the tree (catches processes nobody waits for, such as Ray's workers; misses each one's
    # last sampling interval). The larger is the better lower bound.
    result["tree_cpu_s"] = sum(cpu_ticks.values()) / os.sysconf("SC_CLK_TCK")
    waited = (result.get("user_s") or 0.0) + (result.get("sys_s") or 0.0)
    result["cpu_s"] = max(waited, result["tree_cpu_s"])
    return result


# -- counting what a program wrote -------------------------------------------------------------

def parquet_rows(folder: Path, pattern: str) -> int:
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(p).num_rows for p in folder.rglob(pattern) if p.is_file())


def batchinfer_result(out: Path) -> dict:
    info = {}
    manifest = out / "_manifest.json"
    if manifest.is_file():
        totals = json.loads(manifest.read_text())["totals"]
        info["rows_out"] = totals["rows_scored"]
        info["rows_quarantined"] = totals["rows_quarantined"]
    metrics = out / "_metrics.json"
    if metrics.is_file():
        info["job_metrics"] = json.loads(metrics.read_text()).get("metrics", {})
    return info


# -- preparing data and jobs -------------------------------------------------------------------

def make_data(python: str, folder: Path, rows: int, shards: int, regen: bool) -> float:
    params = {"rows": rows, "shards": shards, "features": FEATURES}
    marker = folder / "params.json"
    if not regen and marker.is_file() and json.loads(marker.read_text()) == params \
            and (folder / "model.onnx").is_file():
        return 0.0
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([python, str(PEERS / "make_data.py"), str(folder), "--rows", str(rows),
                    "--shards", str(shards), "--features", str(FEATURES)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    marker.write_text(json.dumps(params))
    return time.perf_counter() - t0


def make_job(python: str, folder: Path, data: Path, rows: int, tracking: str,
             backend: str = "onnxruntime") -> Path:
    """A stamped job over ``data``; for the torch backend, the same MLP as a .pt2 program."""
    schema = folder / "schemas" / "bench_features" / "v1.py"
    schema.parent.mkdir(parents=True, exist_ok=True)
    schema.write_text(SCHEMA_SOURCE)
    model = folder / "models" / ("model.pt2" if backend == "torch" else "model.onnx")
    model.parent.mkdir(parents=True, exist_ok=True)
    if backend == "torch":
        subprocess.run([python, str(HERE / "onnx_to_pt2.py"), str(data / "model.onnx"), str(model)],
                       check=True, stdout=subprocess.DEVNULL)
    else:
        shutil.copyfile(data / "model.onnx", model)
    job = folder / "job.yaml"
    job.write_text(JOB_TEMPLATE.format(rows=rows, data=data / "data", tracking=tracking, model=model.name,
                                       backend=backend, output="sigmoid" if backend == "torch" else "y"))
    shutil.rmtree(folder / "out", ignore_errors=True)
    subprocess.run([python, "-m", "batchinfer", "stamp", f"models/{model.name}", "--job", "job.yaml"],
                   cwd=folder, check=True, stdout=subprocess.DEVNULL)
    return job


def create_tracking_store(python: str, uri: str) -> None:
    """Create the sqlite store (migrations) and the experiment once, before any timed run."""
    code = textwrap.dedent(f"""
        from mlflow.tracking import MlflowClient
        c = MlflowClient(tracking_uri={uri!r})
        if c.get_experiment_by_name("batchinfer_bench") is None:
            c.create_experiment("batchinfer_bench")
    """)
    subprocess.run([python, "-c", code], check=True, env={**os.environ, "MLFLOW_LOGGING_LEVEL": "WARNING"})


def has_module(python: str, name: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is None)"
    return subprocess.run([python, "-c", code]).returncode == 0


def versions(python: str) -> dict:
    code = textwrap.dedent("""
        import importlib.metadata as m, json, sys
        out = {"python": sys.version.split()[0]}
        for name in ("batchinfer", "apache-beam", "pyarrow", "onnxruntime", "numpy", "polars",
                     "pandera", "mlflow", "ray", "torch", "daft", "pyspark"):
            try:
                out[name] = m.version(name)
            except m.PackageNotFoundError:
                out[name] = None
        print(json.dumps(out))
    """)
    return json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True,
                                     text=True).stdout)


def package_fingerprint(python: str) -> dict:
    """sha256 over the installed batchinfer package's .py files: ties figures to a code state
    (the package is edited while benchmarks run; a changed fingerprint flags a mixed run)."""
    code = textwrap.dedent("""
        import hashlib, json, pathlib, batchinfer
        root = pathlib.Path(batchinfer.__file__).parent
        h = hashlib.sha256()
        files = sorted(root.rglob("*.py"))
        for f in files:
            h.update(str(f.relative_to(root)).encode() + b"\\0" + f.read_bytes() + b"\\0")
        print(json.dumps({"path": str(root), "files": len(files), "sha256": h.hexdigest()}))
    """)
    done = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-300:]}


def machine() -> dict:
    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), "")
        mem = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        mem = 0
    return {"cpus": os.cpu_count(), "cpu": cpu, "mem_gb": round(mem / 2**20, 1),
            "platform": platform.platform()}


# -- the run -----------------------------------------------------------------------------------

def plan_programs(args, sizes: list[int], missing: set[str]) -> dict[int, list[str]]:
    wanted = [p for p in PROGRAMS if p in args.programs]
    plan = {}
    for rows in sizes:
        progs = []
        for p in wanted:
            if p in missing:
                continue
            if p == "stock_beam" and rows != min(sizes) and not args.all_peers:
                continue
            progs.append(p)
        plan[rows] = progs
    if args.startup:
        plan[STARTUP_ROWS] = [p for p in ("floor", "batchinfer") if p in wanted]
    return plan


def command(program: str, python: str, data: Path, job: Path | None, out: Path, ds: str,
            peer_python: str | None = None):
    glob = str(data / "data" / "*.parquet")
    model = str(data / "model.onnx")
    if program in BATCHINFERS:
        return [python, "-m", "batchinfer", "run", job.name, "--ds", ds], job.parent
    if program in PEER_VENV_PROGRAMS and peer_python:
        python = peer_python
    return [python, str(PEER_SCRIPTS[program]), glob, model, str(out)], out.parent


def run_one(program, rows, rnd, args, python, work, data, job, env) -> tuple[dict, Path]:
    """One timed run; returns its record and its output folder (kept for ``check_outputs``)."""
    ds = f"2026-01-{rnd + 1:02d}"
    if program in BATCHINFERS:
        out = job.parent / "out" / f"dt={ds}"
    else:
        out = work / "runs" / f"{program}-{rows}-r{rnd}"
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd, cwd = command(program, python, data, job, out, ds, args.peer_python)
    log = work / "logs" / f"{program}-{rows}-r{rnd}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    res = measure(cmd, cwd=cwd, log=log, env=env, timeout=args.timeout, sample_s=args.sample,
                  python=python)
    res.update({"program": program, "rows": rows, "round": rnd, "cmd": shlex.join(cmd),
                "cwd": str(cwd)})
    try:
        if program in BATCHINFERS:
            res.update(batchinfer_result(out))
        elif out.exists():
            res["rows_out"] = parquet_rows(out, "*.parquet" if program != "stock_beam" else "part-*")
    except Exception as exc:  # a count that fails is reported, not fatal
        res["count_error"] = f"{type(exc).__name__}: {exc}"
    res["ok"] = res["rc"] == 0 and res.get("rows_out") == rows
    if not res["ok"]:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        res["log_tail"] = tail
        print(f"    !! {program} at {rows} rows, round {rnd}: rc={res['rc']} "
              f"rows_out={res.get('rows_out')} (log {log})", flush=True)
        for line in tail:
            print(f"       {line}", flush=True)
    return res, out


def check_outputs(group: list[tuple[dict, Path]]) -> None:
    """Every program's output of one size in one round against batchinfer's (output_check.py);
    the verdict goes into each run's record (``check``) and a failed check fails the run. Then
    the outputs are removed."""
    import output_check

    outs = {res["program"]: (res, out) for res, out in group}
    reference = None
    if "batchinfer" in outs and outs["batchinfer"][0]["ok"]:
        try:
            reference = output_check.read_columns(output_check.batchinfer_files(outs["batchinfer"][1]),
                                                   "id", "score")
        except Exception as exc:  # an unreadable reference: no check, said so
            outs["batchinfer"][0]["check_error"] = f"{type(exc).__name__}: {exc}"
    for program, (res, out) in outs.items():
        if program == "batchinfer" or reference is None or res["rc"] != 0:
            continue
        try:
            files = (output_check.batchinfer_files(out) if program in BATCHINFERS else
                     output_check.peer_files(out, "part-*" if program == "stock_beam" else "*.parquet"))
            res["check"] = output_check.compare(reference, output_check.read_columns(files, "id", "score"),
                                                "score")
        except Exception as exc:
            res["check"] = {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}
        if not res["check"]["ok"]:
            res["ok"] = False
            print(f"    !! {program} at {res['rows']} rows, round {res['round']}: output check failed: "
                  f"{ {k: v for k, v in res['check'].items() if k != 'ok'} }", flush=True)
    for program, (_, out) in outs.items():
        shutil.rmtree(out, ignore_errors=True)
        if program in BATCHINFERS:
            shutil.rmtree(out.parent, ignore_errors=True)


def summarise(runs: list[dict], sizes: list[int], slope_pair: tuple[int, int] | None) -> dict:
    by: dict[tuple[int, str], list[dict]] = {}
    for r in runs:
        by.setdefault((r["rows"], r["program"]), []).append(r)
    table = {}
    for (rows, prog), rs in sorted(by.items()):
        good = [r for r in rs if r["ok"]]
        entry = {"runs": len(rs), "ok": len(good)}
        checked = [r["check"] for r in rs if "check" in r]
        if checked:
            entry["checks_passed"] = sum(bool(c.get("ok")) for c in checked)
            entry["checks_run"] = len(checked)
            diffs = [c["max_abs_diff"] for c in checked if "max_abs_diff" in c]
            if diffs:
                entry["worst_abs_diff"] = max(diffs)
        if good:
            walls = [r["wall_s"] for r in good]
            entry.update({
                "median_wall_s": statistics.median(walls), "min_wall_s": min(walls),
                "max_wall_s": max(walls), "walls_s": walls,
                "median_cpu_s": statistics.median(r["cpu_s"] for r in good),
                "peak_rss_mb": max(r.get("max_rss_mb") or 0 for r in good),
                "peak_tree_mb": max(r["tree_mb"] for r in good),
                "median_load1": statistics.median(r["load1_before"] for r in good)})
            # cost per row of the whole process (start-up included): flat across sizes when a
            # program's cost grows with the rows alone
            entry["wall_us_per_row"] = entry["median_wall_s"] / rows * 1e6
            entry["cpu_us_per_row"] = entry["median_cpu_s"] / rows * 1e6
            if prog == "batchinfer":
                inner = [r["job_metrics"].get("wall_seconds") for r in good
                         if r.get("job_metrics", {}).get("wall_seconds")]
                if inner:
                    entry["median_run_job_wall_s"] = statistics.median(inner)
        table.setdefault(str(rows), {})[prog] = entry
    for progs in table.values():
        floor = progs.get("floor", {}).get("median_wall_s")
        floor_min = progs.get("floor", {}).get("min_wall_s")
        for entry in progs.values():
            if floor and "median_wall_s" in entry:
                entry["x_floor"] = entry["median_wall_s"] / floor
                entry["x_floor_best"] = entry["min_wall_s"] / floor_min
        # the torch backend against ONNX Runtime, both through batchinfer (issue: within 1.3x)
        onnx_wall = progs.get("batchinfer", {}).get("median_wall_s")
        torch_entry = progs.get("batchinfer_torch", {})
        if onnx_wall and "median_wall_s" in torch_entry:
            torch_entry["x_onnxruntime"] = torch_entry["median_wall_s"] / onnx_wall
    summary = {"table": table}

    def med(rows, prog):
        return table.get(str(rows), {}).get(prog, {}).get("median_wall_s")

    def best(rows, prog):
        return table.get(str(rows), {}).get(prog, {}).get("min_wall_s")

    summary["startup"] = {p: med(STARTUP_ROWS, p) for p in ("batchinfer", "floor")}
    summary["startup_best"] = {p: best(STARTUP_ROWS, p) for p in ("batchinfer", "floor")}
    if slope_pair:
        lo, hi = slope_pair
        per_row = {"between_rows": [lo, hi]}
        for suffix, get in (("", med), ("_best", best)):
            for p in SLOPE_PROGRAMS:
                a, b = get(lo, p), get(hi, p)
                if a is not None and b is not None and b > a:
                    per_row[f"{p}_rows_per_s{suffix}"] = (hi - lo) / (b - a)
            if suffix == "":
                # CPU time is far less sensitive than wall time to other work on the machine.
                for p in SLOPE_PROGRAMS:
                    a = table.get(str(lo), {}).get(p, {}).get("median_cpu_s")
                    b = table.get(str(hi), {}).get(p, {}).get("median_cpu_s")
                    if a is not None and b is not None:
                        per_row[f"{p}_cpu_us_per_row"] = (b - a) / (hi - lo) * 1e6
            if f"floor_rows_per_s{suffix}" in per_row and f"batchinfer_rows_per_s{suffix}" in per_row:
                per_row[f"batchinfer_throughput_vs_floor{suffix}"] = (
                    per_row[f"batchinfer_rows_per_s{suffix}"] / per_row[f"floor_rows_per_s{suffix}"])
        summary["per_row"] = per_row
    big, small = max(sizes), min(sizes)
    bi = table.get(str(big), {}).get("batchinfer", {})
    bs = table.get(str(small), {}).get("batchinfer", {})
    if bi.get("peak_rss_mb") and bs.get("peak_rss_mb") and big != small:
        summary["batchinfer_rss_growth"] = {"rows": [small, big],
                                            "ratio": bi["peak_rss_mb"] / bs["peak_rss_mb"]}
    return summary


def print_table(summary: dict, sizes: list[int]) -> None:
    head = (f"{'rows':>9}  {'program':<11} {'wall s':>8} {'min-max':>13} {'x floor':>8} {'x best':>7} "
            f"{'CPU s':>7} {'wall us/row':>11} {'CPU us/row':>10} {'peak RSS MB':>11} {'tree MB':>8} "
            f"{'ok':>5} {'load':>5} {'check':>5}")
    print(head)
    print("-" * len(head))
    for rows in [STARTUP_ROWS, *sizes]:
        progs = summary["table"].get(str(rows))
        if not progs:
            continue
        for prog in PROGRAMS:
            e = progs.get(prog)
            if e is None:
                continue
            check = "-"
            if e.get("checks_run"):
                check = "ok" if e["checks_passed"] == e["checks_run"] else "FAIL"
            if "median_wall_s" not in e:
                print(f"{rows:>9,}  {prog:<11} {'failed':>8} {'':>13} {'':>8} {'':>7} {'':>7} {'':>11} "
                      f"{'':>10} {'':>11} {'':>8} {e['ok']}/{e['runs']:<3} {'':>5} {check:>5}")
                continue
            rng = f"{e['min_wall_s']:.2f}-{e['max_wall_s']:.2f}"
            x = f"{e['x_floor']:.2f}" if "x_floor" in e else "-"
            xb = f"{e['x_floor_best']:.2f}" if "x_floor_best" in e else "-"
            print(f"{rows:>9,}  {prog:<11} {e['median_wall_s']:>8.2f} {rng:>13} {x:>8} {xb:>7} "
                  f"{e['median_cpu_s']:>7.2f} {e['wall_us_per_row']:>11.2f} {e['cpu_us_per_row']:>10.2f} "
                  f"{e['peak_rss_mb']:>11.0f} {e['peak_tree_mb']:>8.0f} "
                  f"{e['ok']}/{e['runs']:<3} {e['median_load1']:>5.1f} {check:>5}")
    print()
    print("wall s: median of rounds; x floor: median / floor's median; x best: min / floor's min;")
    print("CPU s: user+sys of the whole process tree; us/row: median wall or CPU / rows (start-up "
          "included); peak RSS: largest single process; tree MB: sampled sum over the tree (PSS when "
          "several processes); load: 1-min load average; check: output vs batchinfer's of the same "
          "round (every id once, |score diff| <= 1e-5; a failed check fails the run)")
    print()
    st, sb = summary["startup"], summary["startup_best"]
    if st.get("batchinfer") is not None:
        floor = (f" (floor {st['floor']:.2f} s, best {sb['floor']:.2f} s)"
                 if st.get("floor") is not None else "")
        print(f"start-up, {STARTUP_ROWS}-row partition end to end: batchinfer {st['batchinfer']:.2f} s, "
              f"best {sb['batchinfer']:.2f} s{floor}   [goal <= 4 s]")
    pr = summary.get("per_row")
    if pr:
        lo, hi = pr["between_rows"]
        for suffix, what in (("", "medians"), ("_best", "best runs")):
            parts = [f"{p} {pr[f'{p}_rows_per_s{suffix}']:,.0f}"
                     for p in SLOPE_PROGRAMS if f"{p}_rows_per_s{suffix}" in pr]
            print(f"per-row cost, slope {lo:,} -> {hi:,} rows, {what} (rows/s): " + ", ".join(parts))
            key = f"batchinfer_throughput_vs_floor{suffix}"
            if key in pr:
                print(f"  throughput batchinfer / floor ({what}): {pr[key]:.2f}   [goal >= 0.90]")
        parts = [f"{p} {pr[f'{p}_cpu_us_per_row']:.2f}" for p in SLOPE_PROGRAMS
                 if f"{p}_cpu_us_per_row" in pr]
        if parts:
            print(f"CPU per row, slope {lo:,} -> {hi:,} rows, medians (us/row): " + ", ".join(parts))
    big = str(max(sizes))
    bi = summary["table"].get(big, {}).get("batchinfer", {})
    if "x_floor" in bi:
        print(f"whole at {int(big):,} rows: batchinfer {bi['x_floor']:.2f}x the floor   [goal <= 1.15]")
    g = summary.get("batchinfer_rss_growth")
    if g:
        print(f"batchinfer peak RSS {g['rows'][1]:,} vs {g['rows'][0]:,} rows: {g['ratio']:.2f}x   "
              f"[goal <= 1.10]")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 2_000_000, 8_000_000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shard-rows", type=int, default=125_000)
    ap.add_argument("--workdir", default="bench/out")
    ap.add_argument("--all-peers", action="store_true", help="stock Beam at every size, not only the smallest")
    ap.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=PROGRAMS)
    ap.add_argument("--no-startup", dest="startup", action="store_false",
                    help="skip the one-row start-up runs")
    ap.add_argument("--python", default=sys.executable, help="interpreter for every program")
    ap.add_argument("--peer-python", default=os.environ.get("BATCHINFER_PEER_PYTHON"),
                    help="interpreter for daft and spark (default $BATCHINFER_PEER_PYTHON, else "
                         "--python): the peers' venv of bench/README.md")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed")
    ap.add_argument("--sample", type=float, default=0.25, help="seconds between tree-RSS samples")
    ap.add_argument("--regen", action="store_true", help="regenerate data even if present")
    ap.add_argument("--datadir", help="where generated data lives (default: WORKDIR/data); "
                                      "workdirs can share it")
    args = ap.parse_args(argv)

    sizes = sorted(set(args.rows))
    for rows in sizes:
        if rows % args.shard_rows:
            ap.error(f"--rows {rows} is not a multiple of --shard-rows {args.shard_rows}")
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data_root = Path(args.datadir).resolve() if args.datadir else work / "data"
    python = args.python
    started = dt.datetime.now(dt.timezone.utc)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONWARNINGS": "ignore"}

    print(f"batchinfer bench: rows {sizes}, {args.rounds} rounds, {args.shard_rows:,} rows per shard, "
          f"workdir {work}", flush=True)
    args.peer_python = args.peer_python or python
    missing = {p for p in OPTIONAL if p in args.programs and not has_module(
        args.peer_python if p in PEER_VENV_PROGRAMS else python, OPTIONAL[p])}
    if "spark" in args.programs and "spark" not in missing and shutil.which("java") is None:
        missing.add("spark")   # pyspark without a JVM cannot start
    code_before = package_fingerprint(python)
    vers = versions(python)
    if args.peer_python != python:
        vers["peer_python"] = {"path": args.peer_python, **versions(args.peer_python)}
    for p in sorted(missing):
        print(f"{p}: not installed (left out; bench/README.md has the install line)", flush=True)

    # data and jobs, once per size
    tracking = f"sqlite:///{work / 'mlflow.db'}"
    create_tracking_store(python, tracking)
    data_dirs, jobs, torch_jobs, gen_s = {}, {}, {}, {}
    all_sizes = ([STARTUP_ROWS] if args.startup else []) + sizes
    for rows in all_sizes:
        shards = 1 if rows == STARTUP_ROWS else rows // args.shard_rows
        data_dirs[rows] = data_root / f"rows-{rows}"
        gen_s[rows] = make_data(python, data_dirs[rows], rows, shards, args.regen)
        print(f"  data {rows:>10,} rows in {shards:>3} shards: "
              f"{'generated in %.1f s' % gen_s[rows] if gen_s[rows] else 'reused'}", flush=True)
        if "batchinfer" in args.programs:
            jobs[rows] = make_job(python, work / "jobs" / f"rows-{rows}", data_dirs[rows], rows, tracking)
        if "batchinfer_torch" in args.programs and rows != STARTUP_ROWS:
            torch_jobs[rows] = make_job(python, work / "jobs" / f"torch-{rows}", data_dirs[rows], rows,
                                        tracking, backend="torch")

    plan = plan_programs(args, sizes, missing)
    order = ([STARTUP_ROWS] if args.startup else []) + sizes
    runs = []
    for rnd in range(args.rounds):
        for rows in order:
            progs = plan.get(rows, [])
            if not progs:
                continue
            k = rnd % len(progs)
            rotated = progs[k:] + progs[:k]  # each round starts with the next program
            group = []
            for prog in rotated:
                job = torch_jobs.get(rows) if prog == "batchinfer_torch" else jobs.get(rows)
                res, out = run_one(prog, rows, rnd, args, python, work, data_dirs[rows], job, env)
                runs.append(res)
                group.append((res, out))
                print(f"  round {rnd + 1}/{args.rounds}  {rows:>10,} rows  {prog:<11} "
                      f"{res['wall_s']:7.2f} s  {res.get('max_rss_mb', 0):6.0f} MB  "
                      f"load {res['load1_before']:.1f}{'' if res['ok'] else '  FAILED'}", flush=True)
            check_outputs(group)   # after the round's last program: the order does not matter

    slope_pair = None
    if 2_000_000 in sizes and 8_000_000 in sizes:
        slope_pair = (2_000_000, 8_000_000)
    elif len(sizes) >= 2:
        slope_pair = (sizes[-2], sizes[-1])
    summary = summarise(runs, sizes, slope_pair)
    code_after = package_fingerprint(python)
    finished = dt.datetime.now(dt.timezone.utc)
    print()
    print(f"batchinfer bench {started:%Y-%m-%d %H:%M} UTC, {machine()['cpus']} CPUs, "
          f"medians of {args.rounds} rounds (wall = whole process)")
    print_table(summary, sizes)
    for rows in sizes:
        entry = summary["table"].get(str(rows), {}).get("batchinfer_torch", {})
        if "x_onnxruntime" in entry:
            print(f"torch backend / onnxruntime backend at {rows:,} rows: {entry['x_onnxruntime']:.2f}x whole-job wall")
    for p in sorted(missing):
        print(f"{p}: not installed")
    print(f"batchinfer code {code_before.get('sha256', '?')[:12]}"
          + ("" if code_after == code_before else
             f" -> {code_after.get('sha256', '?')[:12]}: the package CHANGED during this run"))

    results = {
        "started": started.isoformat(timespec="seconds"), "finished": finished.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "params": {"rows": sizes, "rounds": args.rounds, "shard_rows": args.shard_rows,
                   "features": FEATURES, "all_peers": args.all_peers, "programs": args.programs,
                   "startup_rows": STARTUP_ROWS if args.startup else None},
        "machine": machine(), "versions": vers,
        "batchinfer_code": {"before": code_before, "after": code_after,
                            "changed_during_run": code_after != code_before},
        "ray": "not installed" if "ray" in missing else "installed",
        "not_installed": sorted(missing),
        "data_generation_s": {str(k): v for k, v in gen_s.items()},
        "summary": summary, "runs": runs,
    }
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\nresults: {work / 'results.json'}  (logs under {work / 'logs'})")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
