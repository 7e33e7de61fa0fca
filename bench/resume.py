"""Resume after a crash (contract §5.3 "Resume"): a clean run of an N-shard partition, then the
same partition SIGKILLed from this process at a moment taken from the clock — by default half-way
through the clean run's scoring (its first to its last data file, by their modification times;
counted from the killed run's own first data file) — and rerun. Prints the wall of the clean
run and of the rerun, their ratio, how much of the partition the kill left unfinished (shards
whose rows were not all on disk, counted from the files), and the goal: the rerun within 0.6 of
the clean run and within the unfinished fraction of it plus 2 s (issue 34).

    .venv/bin/python bench/resume.py                       # 64 shards x 20,000 rows, killed at 50 %
    .venv/bin/python bench/resume.py --shards 20000 --rows 48 --at 0.5

Every run is a fresh ``python -m batchinfer`` process (its imports are part of both walls),
tracking to a local sqlite store. Data, model and job come from tests/factories.py.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from factories import DS, make_mlp_onnx, make_shards, write_job, write_schema  # noqa: E402
from killing import complete_on_disk, data_files, kill_tree, scoring_of  # noqa: E402


def cli(folder: Path, *args: str, fault: str | None = None,
        env: dict[str, str] | None = None) -> tuple[int, float, str]:
    """``python -m batchinfer ARGS`` in ``folder`` (``fault``: its BATCHINFER_FAULT; ``env``:
    more variables): (exit code, wall seconds, stdout + stderr). Also bench/update.py's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    env.pop("BATCHINFER_FAULT", None)
    if fault:
        env["BATCHINFER_FAULT"] = fault
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "batchinfer", *args], cwd=folder, env=env,
                          capture_output=True, text=True)
    return done.returncode, time.perf_counter() - t0, done.stdout + done.stderr


def killed_at(folder: Path, args: tuple[str, ...], out: Path, after: float) -> float:
    """Start ``python -m batchinfer ARGS`` and SIGKILL its process tree ``after`` seconds after
    its first data file appeared in ``out`` (the start-up before scoring varies by a second or
    more between runs: a moment counted from the start would miss a short scoring); returns
    the seconds it ran."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("BATCHINFER_FAULT", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "batchinfer", *args], cwd=folder, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not data_files(out):
        assert proc.poll() is None, "the run ended before writing a data file"
        time.sleep(0.005)
    time.sleep(after)
    kill_tree(proc.pid)
    assert proc.wait() == -9, "the run ended before the kill: kill earlier (--at)"
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--batch-rows", type=int, default=8192)
    parser.add_argument("--at", type=float, default=0.5, help="the kill, as a fraction of the "
                        "clean run's scoring")
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench" / "out" / "resume")
    args = parser.parse_args()
    folder = args.workdir
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    write_schema(folder / "schemas")
    shards = make_shards(folder / "data" / f"dt={DS}", shards=args.shards, rows=args.rows, seed=1)
    make_mlp_onnx(folder / "models" / "model.onnx")
    write_job(folder, batch={"rows": args.batch_rows},
              tracking={"uri": "sqlite:///mlflow.db", "experiment": "resume"})
    rc, _, out = cli(folder, "stamp", "models/model.onnx", "--job", "job.yaml", "--model-version", "model:1")
    assert rc == 0, out
    base = ("run", "job.yaml", "--ds", DS)
    started = time.time()
    rc, clean_s, out = cli(folder, *base, "--set", "output.path=clean")
    assert rc == 0, out
    scoring = scoring_of(folder / "clean", started)
    killed_s = killed_at(folder, (*base, "--set", "output.path=resumed"), folder / "resumed",
                         args.at * (scoring.last - scoring.first))
    whole = complete_on_disk(folder / "resumed", shards)
    unfinished = 1 - len(whole) / args.shards
    rc, resume_s, out = cli(folder, *base, "--set", "output.path=resumed")
    assert rc == 0, out
    metrics = json.loads((folder / "resumed" / "_metrics.json").read_text())["metrics"]
    print(next((line for line in out.splitlines() if line.startswith("reusing")), "reusing nothing"))
    ratio = resume_s / clean_s
    print(f"{args.shards} shards x {args.rows:,} rows: clean {clean_s:.1f} s (scoring "
          f"{scoring.first:.1f}-{scoring.last:.1f} s); killed at {killed_s:.1f} s with "
          f"{len(whole)} shards whole on disk ({unfinished:.0%} unfinished); resumed "
          f"{resume_s:.1f} s ({metrics['shards_reused']:.0f} shards reused, "
          f"{args.shards - metrics['shards_reused']:.0f} scored); resume / clean = {ratio:.2f} "
          f"(goal <= 0.6 and <= {unfinished:.2f} + 2 s / clean = "
          f"{unfinished + 2 / clean_s:.2f})")


if __name__ == "__main__":
    main()
