"""Nightly scoring: one Airflow DAG per batchinfer job, each scoring the DAG run's date (``{{ ds }}``).

Jobs are found at parse time as ``<jobs folder>/<job>/job.yaml``; the folder is
``$BATCHINFER_JOBS_DIR`` or, when unset, ``pipelines/`` beside this file's folder. An environment
variable, not an Airflow Variable: which DAGs exist is decided while the file is parsed, and
Airflow advises against metastore look-ups in top-level DAG code. An optional
``<job>/nightly.yaml`` tunes one job's DAG (see :class:`Nightly`): schedule, start date, retries,
and ``marker`` — the file the upstream writes into the input partition when the partition is
complete (e.g. ``_SUCCESS``); with it, a sensor waits for that file before scoring — and
``update``.

Late data: the score task runs ``batchinfer run JOB --ds DS --update`` (``update: false`` in
``nightly.yaml`` leaves ``--update`` out). A date whose partition is committed, run again
(cleared, or caught up) after shards arrived late or were rewritten upstream, gets only those
shards scored and the removed ones dropped (docs/contract.md §5.3 "Update"), where a plain run
would fail its task (exit 3: another set of shards); with no shard changed it is the no-op it
always was. ``update: false`` is for a job whose partitions must never change once committed.

History: after ``score``, the ``history`` task runs ``batchinfer history JOB --start S --end DS``
for the last ``history_days`` dates (30 by default, none before the DAG's start date): one page
of the job over time, written beside that date's report (README "History"). It reads what the
runs committed and recomputes nothing, so it takes a second or two. ``history_days: 0`` leaves
the task out. A failed history task fails the DAG run although the date was scored: its page
is how the model's owner sees the job, and a store it cannot write is worth a look.

Why one DAG per job, not one DAG for all: each job keeps its own run history, catch-up and
failure state. A job added to the folder later catches up from its own start date (in a shared
DAG, runs already done would never get its task); one job's contract failure fails its own run
only; ``airflow dags backfill`` and "clear" act on one job.

One job's mistake breaks that job's DAG only. A folder name that cannot be a DAG id, a
``nightly.yaml`` that is not valid (read as strictly as a job spec: safe YAML, no key twice,
strict types, no unknown key), or a ``job.yaml`` that fails batchinfer's check of the spec before
``${NAME}`` and ``{ds}`` are filled in (so the DAG processor needs none of the jobs' variables)
gives a stand-in DAG under the job's id: no schedule, and one task, ``configuration_error``, that
fails at once with the one-line error, also the DAG's description. Why not an import error:
Airflow 3.3 keeps import errors per file and stops scheduling every DAG of a file that has one
(``has_import_errors``): one bad job would stop all of them. Why no schedule: runs of the
stand-in would take the job's dates, so that, once fixed, its DAG would not catch them up.

Why a Python task that runs ``python -m batchinfer run JOB --ds DS`` as a child process:

- the CLI is the contract (docs/contract.md): its exit code, and the error's class that it writes
  to ``$BATCHINFER_ERROR_FILE``, say what went wrong, and the task maps them to Airflow's retry
  semantics. 0 succeeds (a committed partition is a no-op, so a retried or re-run task commits
  nothing twice). Only what can fix itself raises AirflowException, which retries: exit 5 (model
  or runtime) and anything else (a kill), and "no shard matches" (``NoShardsError``, exit 2) while
  no marker says the partition is complete — at night that usually means it has not arrived. The
  job's own mistakes raise AirflowFailException and fail at once: exit 3 (contract), 4 (data
  quality), and every other exit 2 (a spec error, an unset ``${NAME}``, a missing schema or
  preprocessing module). The sensor fails at once too when it cannot read the job.
- a BashOperator fails every non-zero exit the same way (retried), and the Apache Beam
  provider's operators launch a Beam pipeline file with runner flags — batchinfer's run is more
  than a pipeline (contract check, commit, tracking) and picks its runner from the job spec.
- in a child process Beam, ONNX Runtime and MLflow load there and leave with it: the worker's
  process stays small, and a crash in native code fails one try instead of the worker. When
  Airflow stops the task (SIGTERM), the child gets Ctrl-C and stops with nothing committed (the
  shards it finished kept: the retry, like the retry of a failed try, resumes them); even a
  child that outlived its task is harmless: the commit is exclusive, so a retry racing it either
  commits or finds the partition committed (exit 0), never both. (``airflow dags test`` itself
  does not stop on SIGTERM once a task ran: it runs tasks in its own process, and Airflow's task
  runner leaves its SIGTERM handler installed there. Ctrl-C stops it.)

Parsing this file imports PyYAML, pydantic, Airflow's SDK and batchinfer's spec module (with
fsspec) only — never Beam, torch, ONNX Runtime or MLflow: tests/e2e/test_airflow.py checks it.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from datetime import date, datetime, timedelta, timezone
from hashlib import sha256
from pathlib import Path
from typing import Any, Iterator

from airflow.sdk import DAG, CronDataIntervalTimetable, task
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

log = logging.getLogger(__name__)

JOBS_DIR_ENV = "BATCHINFER_JOBS_DIR"
DEFAULT_JOBS_DIR = Path(__file__).resolve().parents[1] / "pipelines"
CONFIG_FILE = "nightly.yaml"
# batchinfer writes its failure there, {exit_code, error, message} (docs/contract.md §2).
ERROR_FILE_ENV = "BATCHINFER_ERROR_FILE"
NO_RETRY = {3: "contract", 4: "data quality"}
# A job folder's name makes its DAG's id, nightly_<name>: within Airflow's 250 characters.
_FOLDER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,242}")  # fullmatch: `$` would take a trailing newline
_GLOB = re.compile(r"[*?\[]")
# One file name: no folder separator, no glob character, no control character (a newline).
_MARKER = re.compile(r"[^/\\*?\[\]\x00-\x1f\x7f]+")  # fullmatch


class Nightly(BaseModel):
    """A job's ``nightly.yaml``: every key is optional (these are the defaults), and values are
    checked as strictly as a job spec's: ``true`` is not 1, ``1.5`` is not a number of retries,
    ``'no'`` is not false, and an unknown key is an error."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # Cron, read with data intervals: the run for 2026-01-15 starts once that day is over.
    schedule: str = "0 2 * * *"
    start_date: date = date(2026, 1, 1)
    catchup: bool = True
    # One date at a time, oldest first (like `batchinfer backfill`): a catch-up of many dates
    # must not start as many Beam pipelines at once on one worker.
    max_active_runs: int = Field(default=1, ge=1)
    retries: int = Field(default=3, ge=0)
    retry_delay_minutes: float = Field(default=10, ge=0, allow_inf_nan=False)
    marker: str | None = None          # e.g. "_SUCCESS": the file the sensor waits for
    marker_poke_minutes: float = Field(default=5, gt=0, allow_inf_nan=False)
    marker_timeout_hours: float = Field(default=12, gt=0, allow_inf_nan=False)
    # Shards that arrive after the commit are scored when the date runs again (run --update).
    update: bool = True
    # The history task's page covers this many dates, ending at the run's (0: no history task).
    history_days: int = Field(default=30, ge=0, le=3660)

    @field_validator("start_date", mode="before")
    @classmethod
    def _quoted_date(cls, value: Any) -> Any:
        # YAML reads an unquoted 2026-01-01 as a date, a quoted one as text: both are fine.
        if isinstance(value, str) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
            try:
                return date.fromisoformat(value)
            except ValueError:
                raise ValueError("not a calendar date") from None
        return value

    @field_validator("schedule")
    @classmethod
    def _cron(cls, value: str) -> str:
        try:  # Airflow's own check, here so that it fails this job and not the file
            CronDataIntervalTimetable(value, timezone="UTC").validate()
        except AirflowException as exc:
            raise ValueError(f"not a cron expression ({exc})") from None
        return value

    @field_validator("marker")
    @classmethod
    def _file_name(cls, value: str | None) -> str | None:
        # "", "." and ".." name the partition folder itself, which always exists: the sensor
        # would be satisfied before the partition is complete.
        if value is not None and (value in (".", "..") or value != value.strip()
                                  or not _MARKER.fullmatch(value)):
            raise ValueError("must be one file name such as _SUCCESS (not '.' or '..', "
                             "no '/', '\\', '*', '?', '[' or ']')")
        return value


def jobs_dir() -> Path:
    configured = os.environ.get(JOBS_DIR_ENV)
    return Path(configured).resolve() if configured else DEFAULT_JOBS_DIR


def read_config(job_folder: Path) -> Nightly:
    """The job's :class:`Nightly` settings; ValueError naming the file and the key otherwise."""
    from batchinfer.errors import SpecError
    from batchinfer.spec import read_mapping

    path = job_folder / CONFIG_FILE
    if not path.exists():
        return Nightly()
    try:
        return Nightly.model_validate(read_mapping(path, "the DAG's settings", allow_empty=True))
    except SpecError as exc:
        raise ValueError(exc.message) from None
    except ValidationError as exc:
        raise ValueError(f"{CONFIG_FILE}: {_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            parts.append(f"unknown key {key!r} (known: {', '.join(Nightly.model_fields)})")
        else:
            parts.append(f"{key}: {error['msg'].removeprefix('Value error, ')} (got {error['input']!r})")
    return "; ".join(parts)


def check_job(job_file: Path) -> None:
    """batchinfer's own check of the job spec, the one it makes before ``${NAME}`` and ``{ds}``
    are filled in: no variable of the job is needed where the DAG file is parsed. It imports
    pydantic and fsspec (Airflow has), never Beam or MLflow. ValueError naming the key."""
    from batchinfer.errors import SpecError
    from batchinfer.spec import parse_spec, read_mapping

    try:
        parse_spec(read_mapping(job_file, "a job spec"), source=job_file.name)
    except SpecError as exc:
        raise ValueError(exc.message) from None


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
    from batchinfer.errors import SpecError
    from batchinfer.io.storage import url_to_fs
    from batchinfer.spec import load_job

    try:
        job = load_job(job_file, ds=ds)
    except SpecError as exc:  # an unset ${NAME}, a bad spec: waiting cannot fix it
        raise AirflowFailException(f"usage or spec error, not retried: {exc}") from None
    folder = partition_folder(job.spec.input.path)
    fs, path = url_to_fs(folder)
    if not _GLOB.search(job.spec.input.path) and fs.isfile(path):
        path = path.rsplit("/", 1)[0]  # input.path names one file: its folder is the partition
    found = fs.exists(f"{path}/{marker}")
    log.info("%s %s in %s", marker, "found" if found else "not yet", job.display(folder))
    return bool(found)


def run_args(job_file: str, ds: str, *, update: bool) -> list[str]:
    """The score task's ``batchinfer`` arguments: ``run JOB --ds DS``, with ``--update`` (late
    data, see the module docstring) unless the job's ``nightly.yaml`` says ``update: false``."""
    return ["run", job_file, "--ds", ds, *(["--update"] if update else [])]


# The task's run, as batchinfer's OpenLineage events name their parent (docs/contract.md §6
# "Lineage"): `namespace/job/run id`, the names dbt's OpenLineage integration reads too.
PARENT_ENV, ROOT_ENV = "OPENLINEAGE_PARENT_ID", "OPENLINEAGE_ROOT_PARENT_ID"


def lineage_parent(ti: Any, dag_run: Any) -> dict[str, str]:
    """The task's run and its DAG run as Airflow's OpenLineage provider names them, for the
    child's events to join the provider's: its macros ``lineage_parent_id`` and
    ``lineage_root_parent_id`` when the provider is installed; else the same names made the way
    it makes them (namespace ``[openlineage] namespace``, else ``$OPENLINEAGE_NAMESPACE``, else
    ``default``; job ``<dag_id>.<task_id>`` and ``<dag_id>``; run ids the client's
    ``generate_static_uuid`` of the logical date and ``<namespace>.<dag_id>.<task_id>.<try>.<map
    index>`` or ``<namespace>.<dag_id>.<clear number>``). {} without the OpenLineage client."""
    try:
        from airflow.providers.openlineage.plugins import macros

        return {PARENT_ENV: macros.lineage_parent_id(ti), ROOT_ENV: macros.lineage_root_parent_id(ti)}
    except ImportError:
        pass
    try:
        from openlineage.client.uuid import generate_static_uuid
    except ImportError:
        return {}
    namespace = _lineage_namespace()
    when = getattr(dag_run, "logical_date", None) or dag_run.run_after
    task_run = generate_static_uuid(
        instant=when, data=f"{namespace}.{ti.dag_id}.{ti.task_id}.{ti.try_number}.{ti.map_index}".encode())
    dag_run_id = generate_static_uuid(
        instant=when, data=f"{namespace}.{ti.dag_id}.{getattr(dag_run, 'clear_number', 0) or 0}".encode())
    return {PARENT_ENV: f"{namespace}/{ti.dag_id}.{ti.task_id}/{task_run}",
            ROOT_ENV: f"{namespace}/{ti.dag_id}/{dag_run_id}"}


def _lineage_namespace() -> str:
    try:
        from airflow.configuration import conf

        configured = conf.get("openlineage", "namespace", fallback="")
    except Exception:  # no Airflow configuration to read: the environment's, as the provider falls back
        configured = ""
    return configured or os.getenv("OPENLINEAGE_NAMESPACE", "default")


def history_args(job_file: str, ds: str, *, days: int, first: date) -> list[str]:
    """The history task's ``batchinfer`` arguments: the ``days`` dates ending at ``ds``, none
    before ``first`` (the DAG's start date: earlier dates would all be gaps)."""
    end = date.fromisoformat(ds)
    start = max(end - timedelta(days=days - 1), min(first, end))
    return ["history", job_file, "--start", start.isoformat(), "--end", ds]


def run_batchinfer(job_file: str, args: list[str], *, env: dict[str, str] | None = None,
                   ) -> tuple[int, str, str, dict]:
    """``python -m batchinfer ARGS`` in a child process, in the job's folder, with
    ``$BATCHINFER_ERROR_FILE`` and ``env`` added to this process's environment; its output
    logged. Returns its exit code, stdout, stderr and error record (:func:`read_error`)."""
    command = [sys.executable, "-m", "batchinfer", *args]
    log.info("running %s", " ".join(command))
    with tempfile.TemporaryDirectory(prefix="batchinfer-task-") as scratch:
        error_file = Path(scratch) / "error.json"
        child = subprocess.Popen(command, cwd=Path(job_file).parent, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, **(env or {}), ERROR_FILE_ENV: str(error_file)})
        with stop_child_on_sigterm(child):
            stdout, stderr = child.communicate()
        error = read_error(error_file)
    for line in stdout.splitlines():
        log.info("%s", line)
    for line in stderr.splitlines():
        log.warning("%s", line)
    return child.returncode, stdout, stderr, error


def score_partition(job_file: str, ds: str, *, marker_checked: bool, update: bool = True,
                    lineage: dict[str, str] | None = None) -> str:
    """``batchinfer run JOB --ds DS [--update]`` in a child process (``lineage``: its events'
    parent, :func:`lineage_parent`); how it ended decides retry or not (:func:`outcome`)."""
    code, stdout, stderr, error = run_batchinfer(job_file, run_args(job_file, ds, update=update),
                                                 env=lineage)
    return outcome(code, stdout, stderr, error, marker_checked=marker_checked)


def history_page(job_file: str, ds: str, *, days: int, first: date) -> str:
    """``batchinfer history`` of the last ``days`` dates (:func:`history_args`) in a child
    process: its summary line, or exit 2 (the job's mistake) failing at once, anything else
    retried (a store that could not be read or written)."""
    code, stdout, stderr, _ = run_batchinfer(job_file, history_args(job_file, ds, days=days, first=first))
    if code == 0:
        return stdout.strip()
    why = (stderr.strip().splitlines() or [f"batchinfer exited {code}"])[-1]
    if code == 2:
        raise AirflowFailException(f"usage or spec error (exit 2), not retried: {why}")
    raise AirflowException(f"exit {code}, will retry if tries are left: {why}")


def outcome(code: int, stdout: str, stderr: str, error: dict, *, marker_checked: bool) -> str:
    """The score task's result for a ``batchinfer run`` that exited ``code``, printed ``stdout``
    and ``stderr`` and wrote ``error`` (:func:`read_error`): its output when it succeeded, else
    the exception of :func:`failure` is raised, with the last line of stderr."""
    if code == 0:
        return stdout.strip()  # what was committed, or "already committed" (the XCom)
    why = (stderr.strip().splitlines() or [f"batchinfer exited {code}"])[-1]
    raise failure(code, error.get("error"), why, marker_checked=marker_checked)


def read_error(path: Path) -> dict:
    """What batchinfer wrote to ``$BATCHINFER_ERROR_FILE``; {} if nothing (a kill, a crash)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def failure(code: int, error: str | None, why: str, *, marker_checked: bool) -> AirflowException:
    """The exception for a ``batchinfer run`` that exited ``code`` with ``error`` (its class):
    AirflowFailException (fail now) for the job's own mistakes, AirflowException (retried) for
    what can fix itself: a partition that has not arrived yet, the system failing (exit 5), a kill."""
    if code in NO_RETRY:
        return AirflowFailException(f"{NO_RETRY[code]} failure (exit {code}), not retried: {why}")
    if code == 2 and error == "NoShardsError" and not marker_checked:
        # At night "no shard matches" usually means the partition is not there yet.
        return AirflowException(f"no shard yet (exit 2), will retry if tries are left: {why}")
    if code == 2:  # a spec error, an unset ${NAME}, a missing schema or preprocessing module…
        complete = " with the partition complete" if error == "NoShardsError" else ""
        return AirflowFailException(f"usage or spec error (exit 2){complete}, not retried: {why}")
    return AirflowException(f"exit {code}, will retry if tries are left: {why}")


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


def build_dag(job_folder: Path, dag_id: str) -> DAG:
    """The DAG of one job folder: [wait_for_marker →] score [→ history]. ValueError for a bad
    configuration."""
    config = read_config(job_folder)
    job_file = str(job_folder / "job.yaml")
    check_job(Path(job_file))
    start = config.start_date
    marker = config.marker
    with DAG(
        dag_id=dag_id,
        description=f"batchinfer {' '.join(run_args(job_file, '{{ ds }}', update=config.update))}",
        schedule=CronDataIntervalTimetable(config.schedule, timezone="UTC"),
        start_date=datetime(start.year, start.month, start.day, tzinfo=timezone.utc),
        catchup=config.catchup,
        max_active_runs=config.max_active_runs,
        default_args={"retries": config.retries,
                      "retry_delay": timedelta(minutes=config.retry_delay_minutes)},
        tags=["batchinfer"],
    ) as dag:
        if marker is not None:
            # reschedule: between pokes the sensor gives its worker slot back (waits are hours).
            @task.sensor(task_id="wait_for_marker", mode="reschedule",
                         poke_interval=config.marker_poke_minutes * 60,
                         timeout=config.marker_timeout_hours * 3600)
            def wait_for_marker(ds: str | None = None) -> bool:
                assert ds is not None
                return marker_present(job_file, ds, marker)

            waited = wait_for_marker()

        @task(task_id="score")
        def score(ds: str | None = None, ti: Any = None, dag_run: Any = None) -> str:
            assert ds is not None  # Airflow passes the run's date (and task instance) by name
            return score_partition(job_file, ds, marker_checked=marker is not None,
                                   update=config.update, lineage=lineage_parent(ti, dag_run))

        scored = score()
        if marker is not None:
            waited >> scored
        if config.history_days:
            @task(task_id="history")
            def history(ds: str | None = None) -> str:
                assert ds is not None
                return history_page(job_file, ds, days=config.history_days, first=start)

            scored >> history()
    dag.validate()  # what the DagBag checks before it takes a DAG: here it fails this job only
    return dag


def stand_in_dag(dag_id: str, job_folder: Path, error: str) -> DAG:
    """The DAG of a job whose configuration is wrong: no schedule, and one task that fails at
    once, without retry, with the one-line ``error``; the description says it too."""
    message = f"configuration error in job {job_folder}: {error}"
    log.error("%s", message)  # the DAG processor's log
    with DAG(dag_id=dag_id, description=message, doc_md=f"**{message}**", schedule=None,
             catchup=False, tags=["batchinfer", "configuration error"]) as dag:
        @task(task_id="configuration_error", retries=0)
        def configuration_error() -> None:
            raise AirflowFailException(message)

        configuration_error()
    return dag


def job_dag(job_folder: Path) -> DAG:
    """The job's DAG, ``nightly_<folder>``, or its stand-in when its configuration is wrong."""
    name = job_folder.name
    if not _FOLDER_NAME.fullmatch(name):
        # Its own id, that no valid folder's can be: the name made safe, and a digest of it.
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:200]
        return stand_in_dag(f"nightly_{safe}-{sha256(name.encode()).hexdigest()[:8]}", job_folder,
                            f"the folder's name {name!r} is its DAG's id: rename the folder "
                            f"with letters, digits, '_', '.' and '-' only (at most 242)")
    dag_id = f"nightly_{name}"
    try:
        return build_dag(job_folder, dag_id)
    except ValueError as exc:
        return stand_in_dag(dag_id, job_folder, " ".join(str(exc).split()))
    except Exception as exc:  # a bug, or Airflow refusing a value: still this job's only
        return stand_in_dag(dag_id, job_folder, f"unexpected {type(exc).__name__}: {' '.join(str(exc).split())}")


def _build_all() -> None:
    folder = jobs_dir()
    if not folder.is_dir():  # no job to blame: the file's import error is the message
        raise ValueError(f"{JOBS_DIR_ENV}: {folder} is not a folder of job folders")
    for job_file in sorted(folder.glob("*/job.yaml")):
        dag = job_dag(job_file.parent)
        globals()[dag.dag_id] = dag  # Airflow collects DAGs found at module level


_build_all()
