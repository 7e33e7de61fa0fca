"""Resume after a crash (contract §5.3 "Resume"): a clean run of an N-shard partition, then the
same partition killed (``BATCHINFER_FAULT=shard_done:K``, SIGKILL once K shards are finished)
and rerun. Prints the wall time of the clean run and of the rerun, and their ratio; the goal is
the unfinished work plus a small fixed cost (re-hashing the finished shards and their files).

    .venv/bin/python bench/resume.py                      # 64 shards x 20,000 rows, killed at 58
    .venv/bin/python bench/resume.py --shards 16 --rows 50000 --kill-at 14

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--kill-at", type=int, default=58, help="finished shards at the kill")
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench" / "out" / "resume")
    args = parser.parse_args()
    folder = args.workdir
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    write_schema(folder / "schemas")
    make_shards(folder / "data" / f"dt={DS}", shards=args.shards, rows=args.rows, seed=1)
    make_mlp_onnx(folder / "models" / "model.onnx")
    write_job(folder, batch={"rows": 8192}, tracking={"uri": "sqlite:///mlflow.db", "experiment": "resume"})
    rc, _, out = cli(folder, "stamp", "models/model.onnx", "--job", "job.yaml", "--model-version", "model:1")
    assert rc == 0, out
    base = ("run", "job.yaml", "--ds", DS)
    rc, clean_s, out = cli(folder, *base, "--set", "output.path=clean")
    assert rc == 0, out
    rc, killed_s, out = cli(folder, *base, "--set", "output.path=resumed", fault=f"shard_done:{args.kill_at}")
    assert rc == -9, out
    rc, resume_s, out = cli(folder, *base, "--set", "output.path=resumed")
    assert rc == 0, out
    metrics = json.loads((folder / "resumed" / "_metrics.json").read_text())["metrics"]
    print(next(line for line in out.splitlines() if line.startswith("reusing")))
    print(f"{args.shards} shards x {args.rows:,} rows: clean {clean_s:.1f} s; killed after "
          f"{killed_s:.1f} s; resumed {resume_s:.1f} s ({metrics['shards_reused']:.0f} shards "
          f"reused, {args.shards - metrics['shards_reused']:.0f} scored); resume / clean = "
          f"{resume_s / clean_s:.2f}")


if __name__ == "__main__":
    main()
