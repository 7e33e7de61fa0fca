"""Nightly scoring: one Airflow DAG per batchinfer job, each scoring the DAG run's date (``{{ ds }}``).

Jobs are found at parse time as ``<jobs folder>/<job>/job.yaml``; the folder is
``$BATCHINFER_JOBS_DIR`` or, when unset, ``pipelines/`` beside this file's folder. An environment
variable, not an Airflow Variable: which DAGs exist is decided while the file is parsed, and
Airflow advises against metastore look-ups in top-level DAG code. An optional
``<job>/nightly.yaml`` tunes one job's DAG (see :data:`DEFAULTS`): schedule, start date, retries,
and ``marker`` — the file the upstream writes into the input partition when the partition is
complete (e.g. ``_SUCCESS``); with it, a sensor waits for that file before scoring.

Why one DAG per job, not one DAG for all: each job keeps its own run history, catch-up and
failure state. A job added to the folder later catches up from its own start date (in a shared
DAG, runs already done would never get its task); one job's contract failure fails its own run
only; ``airflow dags backfill`` and "clear" act on one job.

Why a Python task that runs ``python -m batchinfer run JOB --ds DS`` as a child process:

- the CLI is the contract (docs/contract.md): its exit code says what went wrong, and the task
  maps it to Airflow's retry semantics — 0 succeeds (a committed partition is a no-op, so a
  retried or re-run task commits nothing twice); 3 (contract) and 4 (data quality) raise
  AirflowFailException: retrying cannot fix them; 5 (model or runtime) and anything else (a kill)
  raise AirflowException, which retries. Exit 2 (usage or spec) fails without retry when a marker
  says the data is complete (then it is a mistake in the job), and retries otherwise (then the
  usual cause at night is a partition that has not arrived: "no shard matches").
- a BashOperator fails every non-zero exit the same way (retried), and the Apache Beam
  provider's operators launch a Beam pipeline file with runner flags — batchinfer's run is more
  than a pipeline (contract check, commit, tracking) and picks its runner from the job spec.
- in a child process Beam, ONNX Runtime and MLflow load there and leave with it: the worker's
  process stays small, and a crash in native code fails one try instead of the worker. When
  Airflow stops the task (SIGTERM), the child gets Ctrl-C and stops with nothing committed; even a
  child that outlived its task is harmless: the commit is exclusive, so a retry racing it either
  commits or finds the partition committed (exit 0), never both.

Parsing this file imports PyYAML and Airflow's SDK only (never Beam, torch, ONNX Runtime or
MLflow): tests/e2e/test_airflow.py checks it.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator

import yaml
from airflow.sdk import DAG, CronDataIntervalTimetable, task
from airflow.sdk.exceptions import AirflowException, AirflowFailException

log = logging.getLogger(__name__)

JOBS_DIR_ENV = "BATCHINFER_JOBS_DIR"
DEFAULT_JOBS_DIR = Path(__file__).resolve().parents[1] / "pipelines"
CONFIG_FILE = "nightly.yaml"
# Every key nightly.yaml may set, with its default.
DEFAULTS: dict[str, Any] = {
    # Cron, read with data intervals: the run for 2026-01-15 starts once that day is over.
    "schedule": "0 2 * * *",
    "start_date": "2026-01-01",
    "catchup": True,
    # One date at a time, oldest first (like `batchinfer backfill`): a catch-up of many dates
    # must not start as many Beam pipelines at once on one worker.
    "max_active_runs": 1,
    "retries": 3,
    "retry_delay_minutes": 10,
    "marker": None,                   # e.g. "_SUCCESS": the file the sensor waits for
    "marker_poke_minutes": 5,
    "marker_timeout_hours": 12,
}
NO_RETRY = {3: "contract", 4: "data quality"}
_DAG_ID = re.compile(r"^[A-Za-z0-9_.-]+$")
_GLOB = re.compile(r"[*?\[]")


def jobs_dir() -> Path:
    configured = os.environ.get(JOBS_DIR_ENV)
    return Path(configured).resolve() if configured else DEFAULT_JOBS_DIR


def read_config(job_folder: Path) -> dict[str, Any]:
    """The job's settings: :data:`DEFAULTS` updated by its nightly.yaml; ValueError on a bad file."""
    path = job_folder / CONFIG_FILE
    if not path.exists():
        return dict(DEFAULTS)
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must be a mapping of keys (known: {', '.join(DEFAULTS)})")
    unknown = sorted(set(data) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)} (known: {', '.join(DEFAULTS)})")
    config = {**DEFAULTS, **data}
    # YAML reads an unquoted 2026-01-01 as a date; both spellings are fine.
    config["start_date"] = str(config["start_date"])
    for key in ("retries", "retry_delay_minutes", "max_active_runs", "marker_poke_minutes",
                "marker_timeout_hours"):
        if not isinstance(config[key], (int, float)) or isinstance(config[key], bool) or config[key] < 0:
            raise ValueError(f"{path}: {key} must be a number >= 0, not {config[key]!r}")
    if config["marker"] is not None and (not isinstance(config["marker"], str) or "/" in config["marker"]):
        raise ValueError(f"{path}: marker must be a file name such as _SUCCESS, not {config['marker']!r}")
    return config


def partition_folder(input_path: str) -> str:
    """The folder of one partition's input: ``input.path`` up to its first glob component
    (``…/dt=2026-01-15/*.parquet`` → ``…/dt=2026-01-15``), or the path itself."""
    parts = input_path.rstrip("/").split("/")
    for i, part in enumerate(parts):
        if _GLOB.search(part):
            return "/".join(parts[:i]) or "/"
    return input_path.rstrip("/")


def marker_present(job_file: str, ds: str, marker: str) -> bool:
    """Whether ``marker`` exists in the input partition of ``job_file`` for ``ds`` (any fsspec URL)."""
    from batchinfer.io.storage import url_to_fs
    from batchinfer.spec import load_job

    job = load_job(job_file, ds=ds)
    folder = partition_folder(job.spec.input.path)
    fs, path = url_to_fs(folder)
    if not _GLOB.search(job.spec.input.path) and fs.isfile(path):
        path = path.rsplit("/", 1)[0]  # input.path names one file: its folder is the partition
    found = fs.exists(f"{path}/{marker}")
    log.info("%s %s in %s", marker, "found" if found else "not yet", job.display(folder))
    return bool(found)


def score_partition(job_file: str, ds: str, *, marker_checked: bool) -> str:
    """``batchinfer run JOB --ds DS`` in a child process; its exit code decides retry or not."""
    command = [sys.executable, "-m", "batchinfer", "run", job_file, "--ds", ds]
    log.info("running %s", " ".join(command))
    child = subprocess.Popen(command, cwd=Path(job_file).parent, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    with stop_child_on_sigterm(child):
        stdout, stderr = child.communicate()
    for line in stdout.splitlines():
        log.info("%s", line)
    for line in stderr.splitlines():
        log.warning("%s", line)
    code = child.returncode
    if code == 0:
        return stdout.strip()  # what was committed, or "already committed" (the XCom)
    why = (stderr.strip().splitlines() or [f"batchinfer exited {code}"])[-1]
    if code in NO_RETRY:
        raise AirflowFailException(f"{NO_RETRY[code]} failure (exit {code}), not retried: {why}")
    if code == 2 and marker_checked:
        raise AirflowFailException(f"usage or spec error (exit 2) with the partition complete, not retried: {why}")
    raise AirflowException(f"exit {code}, will retry if tries are left: {why}")


@contextmanager
def stop_child_on_sigterm(child: subprocess.Popen) -> Iterator[None]:
    """While the block runs, SIGTERM to this process is passed on to ``child`` as Ctrl-C.

    Airflow stops a task (timeout, "mark failed", shutdown) with SIGTERM, and its task runner then
    only calls the operator's on_kill, which a @task has none of: without this, batchinfer would
    run on as an orphan. On Ctrl-C it stops with nothing committed and its files removed (exit 130).
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; Airflow runs tasks there
        return
    previous = signal.getsignal(signal.SIGTERM)

    def stop(signum: int, frame: Any) -> None:
        child.send_signal(signal.SIGINT)
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if child.poll() is None:
            child.kill()  # leaving on an exception: never leave a run behind


def build_dag(job_folder: Path) -> DAG:
    """The DAG of one job folder: [wait_for_marker →] score."""
    config = read_config(job_folder)
    job_file = str(job_folder / "job.yaml")
    dag_id = f"nightly_{job_folder.name}"
    if not _DAG_ID.match(dag_id):
        raise ValueError(f"{job_folder}: a job folder name may hold only letters, digits, '_', '.' and '-'")
    start = datetime.strptime(config["start_date"], "%Y-%m-%d").replace(tzinfo=timezone.utc)
    marker = config["marker"]
    with DAG(
        dag_id=dag_id,
        description=f"batchinfer run {job_file} --ds {{{{ ds }}}}",
        schedule=CronDataIntervalTimetable(config["schedule"], timezone="UTC"),
        start_date=start,
        catchup=config["catchup"],
        max_active_runs=config["max_active_runs"],
        default_args={"retries": config["retries"],
                      "retry_delay": timedelta(minutes=config["retry_delay_minutes"])},
        tags=["batchinfer"],
    ) as dag:
        @task(task_id="score")
        def score(ds: str | None = None) -> str:
            assert ds is not None  # Airflow passes the run's date by name
            return score_partition(job_file, ds, marker_checked=marker is not None)

        if marker is None:
            score()
        else:
            # reschedule: between pokes the sensor gives its worker slot back (waits are hours).
            @task.sensor(task_id="wait_for_marker", mode="reschedule",
                         poke_interval=config["marker_poke_minutes"] * 60,
                         timeout=config["marker_timeout_hours"] * 3600)
            def wait_for_marker(ds: str | None = None) -> bool:
                assert ds is not None
                return marker_present(job_file, ds, marker)

            wait_for_marker() >> score()
    return dag


def _build_all() -> None:
    folder = jobs_dir()
    if not folder.is_dir():
        raise ValueError(f"{JOBS_DIR_ENV}: {folder} is not a folder of job folders")
    for job_file in sorted(folder.glob("*/job.yaml")):
        dag = build_dag(job_file.parent)
        globals()[dag.dag_id] = dag  # Airflow collects DAGs found at module level


_build_all()
