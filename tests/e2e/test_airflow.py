"""airflow_dags/nightly_scoring.py under real Airflow (issue 11): the DAG file parsed by a DagBag in
a fresh process, and `airflow dags test` runs of the demo job in a temporary AIRFLOW_HOME with its
own sqlite metadata database. Task states and tries are read from that database."""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factories import REPO, check_partition, snapshot

pytestmark = pytest.mark.slow

DAGS = REPO / "airflow_dags"
AIRFLOW = Path(sys.executable).parent / "airflow"
DAG_ID = "nightly_credit_risk_demo"
ROWS, SHARDS, BAD_ROWS = 1200, 6, 5       # the demo's data: 5 deliberately bad rows
HEAVY = ("apache_beam", "torch", "tensorrt", "onnxruntime", "mlflow")
# Fast sensor and retries for the tests; the defaults are minutes.
NIGHTLY = {"marker": "_SUCCESS", "retries": 2, "retry_delay_minutes": 0, "marker_poke_minutes": 0.02,
           "marker_timeout_hours": 0.5}


@pytest.fixture(scope="module")
def airflow(tmp_path_factory) -> dict:
    """A jobs folder holding the stamped demo job and a second job without nightly.yaml, and an
    AIRFLOW_HOME with a migrated sqlite database; returns the environment for Airflow commands."""
    from batchinfer.commands.stamp import stamp
    from batchinfer.demo import write_demo
    from batchinfer.spec import load_job
    from batchinfer.triple.schemas import lock_schemas

    root = tmp_path_factory.mktemp("airflow")
    job = root / "jobs" / "credit_risk_demo"
    paths = write_demo(job, rows=ROWS, shards=SHARDS)
    lock_schemas(job / "schemas")
    stamp(load_job(paths["job"], require_ds=False), None, None)
    write_nightly(job, NIGHTLY)
    plain = root / "jobs" / "plain"
    plain.mkdir()
    shutil.copy(paths["job"], plain / "job.yaml")
    home = root / "home"
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "BATCHINFER_JOBS_DIR": str(root / "jobs")}
    migrated = subprocess.run([str(AIRFLOW), "db", "migrate"], env=env, capture_output=True, text=True,
                              timeout=300)
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    return {"env": env, "job": job, "home": home, "data": paths["data"]}


def write_nightly(job: Path, settings: dict) -> None:
    (job / "nightly.yaml").write_text(json.dumps(settings))  # JSON is YAML


def partition(airflow: dict, ds: str, *, marker: bool = True) -> Path:
    """The demo's data copied to date ``ds`` (with the completion marker unless told not to)."""
    folder = airflow["job"] / "data" / f"dt={ds}"
    shutil.copytree(airflow["data"], folder)
    if marker:
        (folder / "_SUCCESS").write_text("")
    return folder


def dags_test(airflow: dict, ds: str, *, when_waiting=None) -> str:
    """`airflow dags test` of the demo DAG for ``ds``; its output. ``when_waiting`` is called once
    the sensor has reported the marker missing."""
    log = airflow["home"].parent / f"dags-test-{ds}-{time.monotonic_ns()}.log"
    with log.open("w") as out:
        process = subprocess.Popen([str(AIRFLOW), "dags", "test", DAG_ID, ds], env=airflow["env"],
                                   stdout=out, stderr=subprocess.STDOUT)
        try:
            if when_waiting is not None:
                deadline = time.monotonic() + 120
                while "_SUCCESS not yet in" not in log.read_text():
                    assert process.poll() is None, log.read_text()
                    assert time.monotonic() < deadline, "the sensor never reported the marker missing"
                    time.sleep(0.2)
                when_waiting()
            process.wait(timeout=300)
        finally:
            process.kill()
    return log.read_text()


def tries(airflow: dict, ds: str) -> dict[str, tuple[str, int]]:
    """task id → (state, try number) of the demo DAG's run for ``ds`` (`dags test` keeps one)."""
    with sqlite3.connect(airflow["home"] / "airflow.db") as db:
        rows = db.execute(
            "SELECT ti.task_id, ti.state, ti.try_number FROM task_instance ti JOIN dag_run dr "
            "ON ti.dag_id = dr.dag_id AND ti.run_id = dr.run_id WHERE dr.dag_id = ? AND dr.logical_date LIKE ?",
            (DAG_ID, f"{ds} %")).fetchall()
    return {task: (state, number) for task, state, number in rows}


def shards_of(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.parquet"))


# -- parsing --------------------------------------------------------------------------------------

PARSE = textwrap.dedent("""\
    import json, sys
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=sys.argv[1])
    dags = {}
    for dag_id, dag in bag.dags.items():
        dags[dag_id] = {
            "schedule": repr(dag.timetable), "catchup": dag.catchup, "start": dag.start_date.isoformat(),
            "max_active_runs": dag.max_active_runs,
            "tasks": {t.task_id: {"retries": t.retries, "retry_delay": t.retry_delay.total_seconds(),
                                  "downstream": sorted(t.downstream_task_ids),
                                  "mode": getattr(t, "mode", None)} for t in dag.tasks}}
    heavy = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[2].split(",")))
    print(json.dumps({"errors": {k: str(v) for k, v in bag.import_errors.items()}, "dags": dags,
                      "heavy": heavy}))
    """)


def parse(env: dict) -> dict:
    """The DAG folder parsed by Airflow's DagBag in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-c", PARSE, str(DAGS), ",".join(HEAVY)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def parsed(airflow) -> dict:
    return parse(airflow["env"])


def test_dagbag_has_one_dag_per_job_with_retries_schedule_and_catchup(parsed):
    assert parsed["errors"] == {}
    assert set(parsed["dags"]) == {DAG_ID, "nightly_plain"}
    demo, plain = parsed["dags"][DAG_ID], parsed["dags"]["nightly_plain"]
    assert demo["tasks"] == {
        "wait_for_marker": {"retries": 2, "retry_delay": 0.0, "downstream": ["score"], "mode": "reschedule"},
        "score": {"retries": 2, "retry_delay": 0.0, "downstream": [], "mode": None}}
    # Without nightly.yaml: no marker, no sensor, the defaults.
    assert plain["tasks"] == {"score": {"retries": 3, "retry_delay": 600.0, "downstream": [], "mode": None}}
    for dag in (demo, plain):
        assert dag["schedule"] == "CronDataIntervalTimetable(expression='0 2 * * *', timezone='UTC')"
        assert dag["catchup"] is True and dag["max_active_runs"] == 1
        assert dag["start"] == "2026-01-01T00:00:00+00:00"


def test_parsing_the_dag_file_imports_no_heavy_library(parsed):
    assert parsed["dags"]  # something was parsed
    assert parsed["heavy"] == []


def test_the_repository_jobs_folder_is_the_default(airflow):
    env = {k: v for k, v in airflow["env"].items() if k != "BATCHINFER_JOBS_DIR"}
    parsed = parse(env)
    assert parsed["errors"] == {}
    assert sorted(parsed["dags"]) == ["nightly_credit_risk", "nightly_text_embeddings"]
    assert sorted(parsed["dags"]["nightly_credit_risk"]["tasks"]) == ["score", "wait_for_marker"]
    assert sorted(parsed["dags"]["nightly_text_embeddings"]["tasks"]) == ["score"]


def test_a_bad_nightly_yaml_is_an_import_error_naming_the_key(airflow, tmp_path):
    job = tmp_path / "jobs" / "broken"
    job.mkdir(parents=True)
    shutil.copy(airflow["job"] / "job.yaml", job / "job.yaml")
    write_nightly(job, {"retires": 2})
    parsed = parse({**airflow["env"], "BATCHINFER_JOBS_DIR": str(tmp_path / "jobs")})
    [error] = parsed["errors"].values()
    assert "unknown key(s) retires" in error and "nightly.yaml" in error
    assert parsed["dags"] == {}


STOP = textwrap.dedent("""\
    import importlib.util, os, signal, subprocess, sys, threading

    spec = importlib.util.spec_from_file_location("nightly_scoring", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2]], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\\n"
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()  # as Airflow stops a task
    with module.stop_child_on_sigterm(child):
        child.wait()
    print("child exit", child.returncode)
    """)
# Stands in for batchinfer, whose own answer to Ctrl-C is tested in tests/faults/test_interrupt.py.
CHILD = ("import sys, time\nprint('ready', flush=True)\ntry:\n    time.sleep(60)\n"
         "except KeyboardInterrupt:\n    sys.exit(130)\n")


def test_sigterm_to_the_task_reaches_batchinfer_as_ctrl_c(airflow):
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", STOP, str(DAGS / "nightly_scoring.py"), CHILD],
                            env=airflow["env"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr  # SIGTERM did not kill the task's process
    assert result.stdout.strip().splitlines()[-1] == "child exit 130"
    assert time.monotonic() - started < 60  # the child was stopped, not waited out


# -- runs -----------------------------------------------------------------------------------------

def test_nightly_run_waits_for_the_marker_commits_reruns_as_a_no_op_and_refuses_a_late_shard(airflow):
    ds = "2026-01-15"
    data = partition(airflow, ds, marker=False)
    out = airflow["job"] / "out" / f"dt={ds}"

    def marker_arrives():
        assert not out.exists(), "scored before the marker was there"
        (data / "_SUCCESS").write_text("")

    log = dags_test(airflow, ds, when_waiting=marker_arrives)
    assert tries(airflow, ds) == {"wait_for_marker": ("success", 1), "score": ("success", 1)}, log
    assert f"committed {out} (attempt" in log
    predictions, quarantine, manifest = check_partition(out, shards_of(data))
    assert manifest["ds"] == ds and manifest["job"] == "credit_risk_demo"
    assert manifest["totals"]["rows_in"] == ROWS and manifest["totals"]["shards"] == SHARDS
    assert (predictions.num_rows, quarantine.num_rows) == (ROWS - BAD_ROWS, BAD_ROWS)

    before = snapshot(out)
    again = dags_test(airflow, ds)
    assert tries(airflow, ds) == {"wait_for_marker": ("success", 1), "score": ("success", 1)}, again
    assert "is already committed with this triple" in again
    assert snapshot(out) == before

    # A shard that arrives after the commit makes another set of shards: exit 3, not retried.
    shutil.copy(data / "part-00000.parquet", data / "part-00006.parquet")
    late = dags_test(airflow, ds)
    assert tries(airflow, ds) == {"wait_for_marker": ("success", 1), "score": ("failed", 1)}, late
    assert "contract failure (exit 3), not retried: batchinfer run: " in late
    assert snapshot(out) == before


def test_a_contract_violation_fails_once_without_retry_and_commits_nothing(airflow):
    ds = "2026-01-16"
    data = partition(airflow, ds)
    shard = data / "part-00002.parquet"
    table = pq.read_table(shard)  # age as text: every row of the shard fails the schema
    column = table.schema.get_field_index("age")
    pq.write_table(table.set_column(column, "age", pa.array([str(v) for v in table.column("age").to_pylist()])),
                   shard)
    log = dags_test(airflow, ds)
    assert tries(airflow, ds) == {"wait_for_marker": ("success", 1), "score": ("failed", 1)}, log
    assert "data quality failure (exit 4), not retried: batchinfer run: data quality:" in log
    out = airflow["job"] / "out" / f"dt={ds}"
    assert not (out / "_manifest.json").exists()
    assert not [p for p in out.rglob("*") if p.is_file()], "files left in a failed partition"


def test_a_runtime_failure_is_retried(airflow):
    ds = "2026-01-17"
    partition(airflow, ds)
    out = airflow["job"] / "out" / f"dt={ds}"
    out.mkdir(parents=True)
    (out / "predictions").write_text("a file where a folder must go\n")  # exit 5 on every try
    log = dags_test(airflow, ds)
    assert tries(airflow, ds) == {"wait_for_marker": ("success", 1), "score": ("failed", 3)}, log
    assert log.count("exit 5, will retry if tries are left: batchinfer run: cannot write") == 3
    assert not (out / "_manifest.json").exists()


def test_a_marker_that_never_comes_times_out_and_nothing_runs(airflow):
    ds = "2026-01-18"
    partition(airflow, ds, marker=False)
    write_nightly(airflow["job"], {**NIGHTLY, "marker_timeout_hours": 0.001})  # 3.6 s
    try:
        log = dags_test(airflow, ds)
    finally:
        write_nightly(airflow["job"], NIGHTLY)
    assert tries(airflow, ds) == {"wait_for_marker": ("failed", 1), "score": ("upstream_failed", 0)}, log
    assert not (airflow["job"] / "out" / f"dt={ds}").exists()


def test_exit_2_after_the_marker_is_not_retried(airflow):
    ds = "2026-01-19"
    folder = airflow["job"] / "data" / f"dt={ds}"
    folder.mkdir(parents=True)
    (folder / "_SUCCESS").write_text("")  # complete, and empty: retrying cannot make shards appear
    log = dags_test(airflow, ds)
    assert tries(airflow, ds) == {"wait_for_marker": ("success", 1), "score": ("failed", 1)}, log
    assert "usage or spec error (exit 2) with the partition complete, not retried: " in log
    assert "no shard matches" in log
    assert not (airflow["job"] / "out" / f"dt={ds}").exists()
