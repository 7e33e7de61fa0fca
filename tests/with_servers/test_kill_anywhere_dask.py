"""Crash anywhere on a real Dask cluster (issue 34, contract §5.3): a scheduler and two worker
processes, killed from this process at half of a clean run's scoring by the clock
(tests/killing.py) — counted from the run's first data file, since the launcher's and the
workers' start-up vary by seconds.

- The launcher and the whole cluster (scheduler, nanny, workers) die at once, as when the nodes
  of a nightly job are lost: the rerun, on a new cluster, reuses every shard whose rows were all
  on disk at the kill (counted from the files), commits what the clean run committed, and says
  so (the run's line, ``shards_reused``, ``rows_reused``).
- One worker process dies: the scheduler gives its tasks to a worker again, and the same run
  commits what the clean run committed.

Before issue 34 a shard's result came after a GroupByKey (on Dask: after every partition of the
bag was scored), so the first case reused nothing.
"""
from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from factories import DS, assert_same_result, numeric_project
from killing import complete_on_disk, data_files, kill_at, kill_tree, scoring_of
from servers import DaskCluster, processes_of, start_cli

pytestmark = [pytest.mark.slow, pytest.mark.server]

SHARDS, ROWS, BATCH = 8, 40_000, 10_000


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> tuple[Path, list[Path]]:
    folder = tmp_path_factory.mktemp("kill_dask")
    numeric_project(folder, shards=SHARDS, rows=ROWS, batch={"rows": BATCH},
                    tracking={"uri": "sqlite:///mlflow.db", "experiment": "kill"})
    return folder, sorted((folder / "data" / f"dt={DS}").glob("*.parquet"))


def args(out: str, cluster: DaskCluster) -> tuple[str, ...]:
    return ("run", "job.yaml", "--ds", DS, "--set", f"output.path={out}",
            "--set", "runner.name=dask", "--set", f"runner.options.dask_client_address={cluster.address}")


def run(folder: Path, out: str, cluster: DaskCluster):
    done = start_cli(*args(out, cluster), cwd=folder, track=True)
    stdout, stderr = done.communicate(timeout=600)
    assert done.returncode == 0, stderr
    return stdout


@pytest.fixture(scope="module")
def reference(project, tmp_path_factory):
    """A clean run on a cluster of its own: its output, and its scoring span."""
    folder, _ = project
    with DaskCluster(tmp_path_factory.mktemp("dask-ref")) as cluster:
        started = time.time()
        run(folder, "ref", cluster)
    return scoring_of(folder / "ref", started)


def test_launcher_and_cluster_killed_half_way_the_rerun_reuses_every_shard_on_disk(
        project, reference, tmp_path):
    folder, shards = project
    out = folder / "out_lost"
    with DaskCluster(tmp_path / "doomed") as doomed:
        roots = [doomed.proc.pid, doomed.nanny.pid]

        def start():
            return start_cli(*args("out_lost", doomed), cwd=folder, track=False)

        def everything(launcher) -> int:   # the launcher, then the cluster's processes
            for root in roots:
                kill_tree(root)
            return launcher.pid

        victim, at = kill_at(start, everything,
                             0.5 * (reference.last - reference.first),
                             since=lambda: bool(data_files(out)))
        victim.wait()
        assert victim.returncode == -signal.SIGKILL
        assert doomed.proc.wait(30) == doomed.nanny.wait(30) == -signal.SIGKILL
    assert not (out / "_manifest.json").exists(), f"killed at {at:.2f} s: after the commit"
    on_disk = complete_on_disk(out, shards)
    with DaskCluster(tmp_path / "new") as cluster:
        stdout = run(folder, "out_lost", cluster)
    manifest = assert_same_result(out, folder / "ref", shards)
    reused = {s["path"] for s in manifest["shards"] if s["scored_by"] != manifest["attempt"]}
    print(f"\nkilled at {at:.2f} s: {len(on_disk)} of {SHARDS} shards whole on disk, "
          f"{len(reused)} reused")
    assert on_disk <= reused, f"whole on disk but scored again: {sorted(on_disk - reused)}"
    metrics = json.loads((out / "_metrics.json").read_text())["metrics"]
    assert metrics["shards_reused"] == len(reused)
    assert metrics["rows_reused"] == len(reused) * ROWS
    if reused:
        assert re.search(rf"reusing {len(reused)} of {SHARDS} shards \({len(reused) * ROWS:,} rows\)",
                         stdout), stdout


def test_a_worker_killed_half_way_the_same_run_commits_what_a_clean_run_commits(
        project, reference, tmp_path):
    folder, shards = project
    out = folder / "out_worker"
    with DaskCluster(tmp_path / "cluster") as cluster:
        launcher = start_cli(*args("out_worker", cluster), cwd=folder, track=False)
        deadline = time.monotonic() + 300
        while not data_files(out):
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "no data file within 300 s"
            time.sleep(0.005)
        time.sleep(0.5 * (reference.last - reference.first))
        workers = [p for p in processes_of(cluster.nanny.pid) if p != cluster.nanny.pid]
        assert workers, "no worker process under the nanny"
        kill_tree(workers[0])
        _, stderr = launcher.communicate(timeout=600)
        assert launcher.returncode == 0, stderr
    manifest = assert_same_result(out, folder / "ref", shards)
    assert all(s["scored_by"] == manifest["attempt"] for s in manifest["shards"])
