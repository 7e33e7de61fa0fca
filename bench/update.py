"""Update after late data (contract §5.3 "Update"): a committed partition of N shards, then one
shard arrives late. Times ``run --update`` (scores the late shard, keeps the N committed ones)
against a full rescore of the same partition (``run --overwrite``), alternating which goes
first, each on its own copy of the committed partition, and the no-op ``run --update`` of the
updated copy (a process's fixed cost: imports, MLflow's helper, hashing every shard). Prints
each pair, the median ratio, and the median ratio of what each costs above that no-op.

    .venv/bin/python bench/update.py                       # 64 shards x 20,000 rows, 3 pairs
    .venv/bin/python bench/update.py --rows 400000         # bench/README.md's figures (and 100000)

Every run is a fresh ``python -m batchinfer`` process (its imports are part of both walls),
tracking to a local sqlite store. ``output.path`` is ``${BENCH_OUT}``: the spec hash is taken
before ``${…}`` is filled in, so every copy is the partition of one spec. Data, model and job
come from tests/factories.py.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import resume  # noqa: E402, I001  (bench/resume.py: one way to run the CLI)
from factories import DS, make_mlp_onnx, make_shards, write_job, write_schema  # noqa: E402


def cli(folder: Path, *args: str, out: str = "base") -> tuple[int, float, str]:
    return resume.cli(folder, *args, env={"BENCH_OUT": str(folder / out)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench" / "out" / "update")
    args = parser.parse_args()
    folder = args.workdir
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    write_schema(folder / "schemas")
    data = folder / "data" / f"dt={DS}"
    make_shards(data, shards=args.shards, rows=args.rows, seed=1)
    make_mlp_onnx(folder / "models" / "model.onnx")
    write_job(folder, batch={"rows": 8192}, output={"path": "${BENCH_OUT}", "id_columns": ["id"]},
              tracking={"uri": "sqlite:///mlflow.db", "experiment": "update"})
    rc, _, log = cli(folder, "stamp", "models/model.onnx", "--job", "job.yaml", "--model-version", "model:1")
    assert rc == 0, log
    run = ("run", "job.yaml", "--ds", DS)
    rc, first_s, log = cli(folder, *run)
    assert rc == 0, log
    make_shards(folder / "late", shards=1, rows=args.rows, seed=99)    # the late shard
    (folder / "late" / "part-00000.parquet").rename(data / f"part-{args.shards:05d}.parquet")
    print(f"{args.shards} shards x {args.rows:,} rows committed in {first_s:.1f} s; one late shard")
    ratios, above = [], []
    for pair in range(args.pairs):
        walls = {}
        for mode in (("update", "overwrite") if pair % 2 == 0 else ("overwrite", "update")):
            out = f"{mode}-{pair}"
            shutil.copytree(folder / "base", folder / out)
            rc, walls[mode], log = cli(folder, *run, f"--{mode}", out=out)
            assert rc == 0, log
            metrics = json.loads((folder / out / "_metrics.json").read_text())["metrics"]
            if mode == "update":
                assert metrics["shards_reused"] == args.shards, metrics["shards_reused"]
                line = next(s for s in log.splitlines() if s.startswith("updating:"))
                rc, walls["noop"], log = cli(folder, *run, "--update", out=out)
                assert rc == 0 and "nothing to do" in log, log
            shutil.rmtree(folder / out)
        ratios.append(walls["update"] / walls["overwrite"])
        above.append((walls["update"] - walls["noop"]) / (walls["overwrite"] - walls["noop"]))
        print(f"pair {pair + 1}: --update {walls['update']:.1f} s, --overwrite {walls['overwrite']:.1f} s, "
              f"ratio {ratios[-1]:.2f}; no-op --update {walls['noop']:.1f} s, above it {above[-1]:.2f}")
    print(line)
    print(f"median --update / --overwrite = {statistics.median(ratios):.2f} over {args.pairs} pairs; "
          f"above the no-op: {statistics.median(above):.2f}")


if __name__ == "__main__":
    main()
