"""airflow_dags/nightly_scoring.py under real Airflow (issues 11 and 18): the DAG file parsed by a
DagBag in a fresh process, `airflow dags test` runs of the demo job in a temporary AIRFLOW_HOME with
its own sqlite metadata database (task states and tries are read from that database), and README's
"Nightly with Airflow" commands run as a user types them in a copy of the repository.

How each way a run ends maps to Airflow's retry semantics is tested in this process, on the DAGs
the file builds (:func:`sense`, :func:`score`): the sensor's callable, and ``batchinfer run`` as
the score task runs it, whose exit code and error file ``nightly_scoring.outcome`` maps to the
task's result or exception. What Airflow makes of those exceptions is seen in real ``dags test``
runs (about 10 s of Airflow each): a success after the sensor waited and an AirflowFailException
that fails its try at once (a late shard, exit 3, for a job whose ``nightly.yaml`` says ``update:
false``), then the same late shard scored by the task's ``run --update`` (the default) when the date
runs again, in one test, and README's commands."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factories import REPO, check_partition, kept_for_resume, one_line_error, run_cli, snapshot
from lineage_schemas import read_events, validate

pytestmark = pytest.mark.slow

DAGS = REPO / "airflow_dags"
AIRFLOW = Path(sys.executable).parent / "airflow"
DAG_ID = "nightly_credit_risk_demo"
SETUP_DAG = "nightly_setup"
ROWS, SHARDS, BAD_ROWS = 1200, 6, 5       # the demo's data: 5 deliberately bad rows
HEAVY = ("apache_beam", "torch", "tensorrt", "onnxruntime", "mlflow", "pandera", "pyarrow")
# Fast sensor and retries for the tests; the defaults are minutes.
NIGHTLY = {"marker": "_SUCCESS", "retries": 2, "retry_delay_minutes": 0, "marker_poke_minutes": 0.02,
           "marker_timeout_hours": 0.5}
UNSET = "BATCHINFER_TEST_NEVER_SET"


@pytest.fixture(scope="module")
def airflow(tmp_path_factory) -> dict:
    """A jobs folder holding the stamped demo job, a second job without nightly.yaml, a third
    whose nightly.yaml is wrong, a fourth (``setup``) for the tests to break, and an AIRFLOW_HOME
    with a migrated sqlite database; returns the environment for Airflow commands, and the DAG
    file's parses (:func:`parse_then_migrate`: the interpreter that migrates parses first)."""
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
    for other in ("plain", "broken", "setup"):
        (root / "jobs" / other).mkdir()
        shutil.copy(paths["job"], root / "jobs" / other / "job.yaml")
    write_nightly(root / "jobs" / "broken", {"retries": 1.5})
    setup = root / "jobs" / "setup"
    shutil.copy(job / "credit_preprocess.py", setup)  # found beside the job file only
    write_setup_job(setup, job)
    home = root / "home"
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "BATCHINFER_JOBS_DIR": str(root / "jobs"),
           # batchinfer's OpenLineage events (contract §6 "Lineage"), configured as the client
           # reads its environment: appended to one file.
           "OPENLINEAGE__TRANSPORT__TYPE": "file", "OPENLINEAGE__TRANSPORT__APPEND": "true",
           "OPENLINEAGE__TRANSPORT__LOG_FILE_PATH": str(root / "lineage.jsonl"),
           # this checkout's batchinfer in the task's child (the venv's editable install may be another's)
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for name in ("OPENLINEAGE_URL", "OPENLINEAGE_CONFIG", "OPENLINEAGE_NAMESPACE", "OPENLINEAGE_DISABLED"):
        env.pop(name, None)
    env.pop(UNSET, None)
    bad = write_bad_jobs(root / "bad-jobs", job)
    jobs_dirs = {"demo": env["BATCHINFER_JOBS_DIR"], "default": None, "bad": str(bad)}
    parses = dict(zip(jobs_dirs, parse_then_migrate(env, list(jobs_dirs.values()))))
    return {"env": env, "job": job, "home": home, "data": paths["data"], "setup": setup,
            "parses": {"bad folder": bad, **parses}}


def write_nightly(job: Path, settings: dict) -> None:
    (job / "nightly.yaml").write_text(json.dumps(settings))  # JSON is YAML


def write_setup_job(folder: Path, demo: Path, **changes) -> None:
    """The demo job in ``folder``, its paths pointing into the demo's folder, with ``changes``."""
    import yaml

    spec = yaml.safe_load((demo / "job.yaml").read_text())
    spec.update({"name": "setup", "input": {"path": f"{demo}/data/dt={{ds}}/*.parquet"},
                 "schemas": {"root": str(demo / "schemas")},
                 "model": {**spec["model"], "uri": str(demo / "models" / "credit_risk.onnx")},
                 "tracking": {"uri": f"sqlite:///{folder}/mlflow.db"}}, **changes)
    (folder / "job.yaml").write_text(json.dumps(spec))


def partition(airflow: dict, ds: str, *, marker: bool = True) -> Path:
    """The demo's data copied to date ``ds`` (with the completion marker unless told not to)."""
    folder = airflow["job"] / "data" / f"dt={ds}"
    shutil.copytree(airflow["data"], folder)
    if marker:
        (folder / "_SUCCESS").write_text("")
    return folder


def dags_test(airflow: dict, ds: str, *, dag_id: str = DAG_ID, when_waiting=None) -> str:
    """`airflow dags test` of a DAG (the demo's unless told) for ``ds``; its output.
    ``when_waiting`` is called once the sensor has reported the marker missing."""
    log = airflow["home"].parent / f"dags-test-{ds}-{time.monotonic_ns()}.log"
    with log.open("w") as out:
        process = subprocess.Popen([str(AIRFLOW), "dags", "test", dag_id, ds], env=airflow["env"],
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


@pytest.fixture(scope="module")
def nightly(airflow):
    """airflow_dags/nightly_scoring.py imported in this process, as the DAG processor imports it,
    with the jobs folder of :func:`airflow`. Airflow's import adds a handler to the root logger
    and warning filters: they are taken back, the rest of the suite reads its own logs."""
    handlers, level, filters = list(logging.root.handlers), logging.root.level, list(warnings.filters)
    mp = pytest.MonkeyPatch()
    for name in ("AIRFLOW_HOME", "AIRFLOW__CORE__DAGS_FOLDER", "AIRFLOW__CORE__LOAD_EXAMPLES", "BATCHINFER_JOBS_DIR"):
        mp.setenv(name, airflow["env"][name])
    spec = importlib.util.spec_from_file_location("nightly_scoring", DAGS / "nightly_scoring.py")
    module = importlib.util.module_from_spec(spec)
    mp.setitem(sys.modules, "nightly_scoring", module)  # pydantic resolves the models' annotations there
    try:
        spec.loader.exec_module(module)
    finally:
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)
        warnings.filters[:] = filters
    yield module
    mp.undo()


def dag_of(nightly, airflow: dict, dag_id: str):
    """The DAG of job ``dag_id`` built from its folder as it is now (its files change in tests)."""
    return nightly.job_dag(airflow["job"].parent / dag_id.removeprefix("nightly_"))


def sense(nightly, airflow: dict, ds: str, dag_id: str = DAG_ID):
    """The DAG's wait_for_marker, poked once in this process: whether the marker is there, or
    the exception the sensor raises."""
    from airflow.sdk.exceptions import AirflowException

    try:
        return dag_of(nightly, airflow, dag_id).get_task("wait_for_marker").python_callable(ds=ds)
    except AirflowException as exc:
        return exc


def score(nightly, airflow: dict, ds: str, dag_id: str = DAG_ID):
    """The DAG's score task in this process: ``batchinfer run JOB --ds DS [--update]`` as the
    task builds it (``nightly_scoring.run_args`` with the job's ``nightly.yaml``) and runs it
    (in the job's folder, ``$BATCHINFER_ERROR_FILE`` set; a child of the fork server), then
    ``nightly_scoring.outcome`` on how it ended: the task's return value, or the exception it
    raises. Airflow retries an AirflowException and fails an AirflowFailException at once."""
    from airflow.sdk.exceptions import AirflowException

    dag = dag_of(nightly, airflow, dag_id)
    folder = airflow["job"].parent / dag_id.removeprefix("nightly_")
    error_file = airflow["home"].parent / f"error-{dag_id}-{ds}-{time.monotonic_ns()}.json"
    args = nightly.run_args(str(folder / "job.yaml"), ds, update=nightly.read_config(folder).update)
    result = run_cli(*args, cwd=folder, env={nightly.ERROR_FILE_ENV: str(error_file)})
    try:
        return nightly.outcome(result.returncode, result.stdout, result.stderr, nightly.read_error(error_file),
                               marker_checked="wait_for_marker" in dag.task_ids)
    except AirflowException as exc:
        return exc


def fails_now(exc) -> bool:
    from airflow.sdk.exceptions import AirflowFailException

    return isinstance(exc, AirflowFailException)


def retried(exc) -> bool:
    from airflow.sdk.exceptions import AirflowException

    return isinstance(exc, AirflowException) and not fails_now(exc)


def tries(airflow: dict, ds: str, dag_id: str = DAG_ID) -> dict[str, tuple[str, int]]:
    """task id → (state, try number) of a DAG's run for ``ds`` (`dags test` keeps one)."""
    return task_states(airflow["home"] / "airflow.db", dag_id, ds)


def task_states(database: Path, dag_id: str, ds: str) -> dict[str, tuple[str, int]]:
    with sqlite3.connect(database) as db:
        rows = db.execute(
            "SELECT ti.task_id, ti.state, ti.try_number FROM task_instance ti JOIN dag_run dr "
            "ON ti.dag_id = dr.dag_id AND ti.run_id = dr.run_id WHERE dr.dag_id = ? AND dr.logical_date LIKE ?",
            (dag_id, f"{ds} %")).fetchall()
    return {task: (state, number) for task, state, number in rows}


def shards_of(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.parquet"))


# -- parsing --------------------------------------------------------------------------------------

PARSE = textwrap.dedent("""\
    import json, os, sys
    from airflow.dag_processing.dagbag import DagBag

    def parse(jobs_dir):
        if jobs_dir is None:
            os.environ.pop("BATCHINFER_JOBS_DIR", None)
        else:
            os.environ["BATCHINFER_JOBS_DIR"] = jobs_dir
        bag = DagBag(dag_folder=sys.argv[1])  # imports the DAG file anew: it reads the variable
        dags = {}
        for dag_id, dag in bag.dags.items():
            dags[dag_id] = {
                "schedule": repr(dag.timetable), "catchup": dag.catchup,
                "start": dag.start_date and dag.start_date.isoformat(), "description": dag.description,
                "max_active_runs": dag.max_active_runs,
                "tasks": {t.task_id: {"retries": t.retries, "retry_delay": t.retry_delay.total_seconds(),
                                      "downstream": sorted(t.downstream_task_ids),
                                      "mode": getattr(t, "mode", None)} for t in dag.tasks}}
        # Imported so far: by this parse or an earlier one (sys.modules only grows).
        heavy = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[2].split(",")))
        return {"errors": {k: str(v) for k, v in bag.import_errors.items()}, "dags": dags, "heavy": heavy}

    parsed = [parse(jobs_dir) for jobs_dir in json.loads(sys.argv[3])]
    from airflow.__main__ import main

    sys.argv = ["airflow", "db", "migrate"]
    main()
    print(json.dumps(parsed))
    """)


def parse_then_migrate(env: dict, jobs_dirs: list[str | None]) -> list[dict]:
    """The DAG folder parsed by Airflow's DagBag once per jobs folder (``None``: with
    BATCHINFER_JOBS_DIR unset), in order, then ``airflow db migrate``, all in one fresh
    interpreter: Airflow's import (3-4 s) once for the three parses and the migration, which
    comes last, not to add its imports to those of the parses.

    Each DagBag imports the file anew (Airflow's Python importer drops its module from
    sys.modules and executes the file again), so each parse builds its own folder's DAGs: their
    ids, different in each folder, are asserted."""
    result = subprocess.run([sys.executable, "-c", PARSE, str(DAGS), ",".join(HEAVY), json.dumps(jobs_dirs)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def parses(airflow) -> dict:
    """The DAG file parsed with the jobs folder of :func:`airflow` (``demo``), with
    BATCHINFER_JOBS_DIR unset (``default``) and with the jobs of :data:`BAD_JOBS` (``bad``)."""
    return airflow["parses"]


@pytest.fixture(scope="module")
def parsed(parses) -> dict:
    return parses["demo"]


def test_dagbag_has_one_dag_per_job_with_retries_schedule_and_catchup(parsed):
    assert parsed["errors"] == {}
    assert set(parsed["dags"]) == {DAG_ID, "nightly_plain", "nightly_broken", SETUP_DAG}
    demo, plain = parsed["dags"][DAG_ID], parsed["dags"]["nightly_plain"]
    assert demo["tasks"] == {
        "wait_for_marker": {"retries": 2, "retry_delay": 0.0, "downstream": ["score"], "mode": "reschedule"},
        "score": {"retries": 2, "retry_delay": 0.0, "downstream": ["history"], "mode": None},
        "history": {"retries": 2, "retry_delay": 0.0, "downstream": [], "mode": None}}
    # Without nightly.yaml: no marker, no sensor, the defaults.
    assert plain["tasks"] == {"score": {"retries": 3, "retry_delay": 600.0, "downstream": ["history"], "mode": None},
                              "history": {"retries": 3, "retry_delay": 600.0, "downstream": [], "mode": None}}
    for dag in (demo, plain):
        assert dag["schedule"] == "CronDataIntervalTimetable(expression='0 2 * * *', timezone='UTC')"
        assert dag["catchup"] is True and dag["max_active_runs"] == 1
        assert dag["start"] == "2026-01-01T00:00:00+00:00"


def test_parsing_the_dag_file_imports_no_heavy_library(parses):
    assert parses["demo"]["dags"]  # something was parsed
    assert parses["demo"]["heavy"] == []  # the first parse: its own imports
    assert parses["default"]["heavy"] == parses["bad"]["heavy"] == []  # and after all three


def test_the_repository_jobs_folder_is_the_default(parses):
    parsed = parses["default"]
    assert parsed["errors"] == {}
    assert sorted(parsed["dags"]) == ["nightly_credit_risk", "nightly_text_embeddings"]
    assert sorted(parsed["dags"]["nightly_credit_risk"]["tasks"]) == ["history", "score", "wait_for_marker"]
    assert sorted(parsed["dags"]["nightly_text_embeddings"]["tasks"]) == ["history", "score"]


NOT_INT = "Input should be a valid integer"
# One job's bad configuration: (folder name, nightly.yaml or None, job.yaml changes, what the error says).
BAD_JOBS = {
    "space": ("my job", None, {}, "the folder's name 'my job' is its DAG's id"),
    "shell": ("a;b$(touch x)", None, {}, "the folder's name 'a;b$(touch x)' is its DAG's id"),
    "yaml tag": ("tagged", "retries: !!python/object/apply:os.system [echo hi]\n", {},
                 "nightly.yaml: not valid YAML at line 1: could not determine a constructor"),
    "impossible date": ("feb30", "start_date: 2026-02-30\n", {},
                        "nightly.yaml: not valid YAML at line 1: '2026-02-30' is not a date"),
    "impossible quoted date": ("feb30q", "start_date: '2026-02-30'\n", {},
                               "nightly.yaml: start_date: not a calendar date (got '2026-02-30')"),
    "a time, not a date": ("noon", "start_date: 2026-01-01 12:00:00\n", {},
                           "nightly.yaml: start_date: Input should be a valid date"),
    "infinite retries": ("inf", "retries: .inf\n", {}, f"nightly.yaml: retries: {NOT_INT} (got inf)"),
    "fractional retries": ("half", "retries: 1.5\n", {}, f"nightly.yaml: retries: {NOT_INT} (got 1.5)"),
    "boolean retries": ("yes", "retries: true\n", {}, f"nightly.yaml: retries: {NOT_INT} (got True)"),
    "no runs at once": ("zero", "max_active_runs: 0\n", {},
                        "nightly.yaml: max_active_runs: Input should be greater than or equal to 1 (got 0)"),
    "catchup as text": ("catchno", "catchup: 'no'\n", {},
                        "nightly.yaml: catchup: Input should be a valid boolean (got 'no')"),
    "negative delay": ("neg", "retry_delay_minutes: -1\n", {},
                       "nightly.yaml: retry_delay_minutes: Input should be greater than or equal to 0 (got -1)"),
    "not cron": ("cron", "schedule: '61 2 * * *'\n", {}, "nightly.yaml: schedule: not a cron expression"),
    "unknown key": ("typo", "retires: 2\n", {}, "nightly.yaml: unknown key 'retires' (known: schedule, start_date"),
    "key twice": ("twice", "retries: 1\nretries: 2\n", {},
                  "nightly.yaml: not valid YAML at line 2: key 'retries' is given twice"),
    "not a mapping": ("listed", "- retries\n", {}, "nightly.yaml: the DAG's settings must be a YAML mapping of keys"),
    "job.yaml type": ("rows", None, {"batch": {"rows": True}}, f"job.yaml: batch.rows: {NOT_INT}"),
    "job.yaml key": ("jobkey", None, {"outptu": {}}, "job.yaml: unknown key 'outptu'"),
}
# A marker is one plain file name (issue 18, item 12): '.', '..' and '' name the partition itself.
BAD_MARKERS = [".", "..", "", " ", "a/b", "a\\b", "*", "_SUCCESS*", "_SUCC?SS", "[_]SUCCESS", " _SUCCESS",
               "_SUCCESS\n", "/_SUCCESS"]
for number, bad in enumerate(BAD_MARKERS):
    BAD_JOBS[f"marker {bad!r}"] = (f"marker{number}", json.dumps({"marker": bad}), {},
                                   "nightly.yaml: marker: must be one file name such as _SUCCESS")


def write_bad_jobs(jobs: Path, demo: Path) -> Path:
    """In ``jobs`` (a new folder), every bad job of :data:`BAD_JOBS` and two good ones, made
    from the demo's job.yaml."""
    import yaml

    spec = yaml.safe_load((demo / "job.yaml").read_text())
    jobs.mkdir()
    for folder, nightly, changes, _ in [("good", None, {}, ""), ("dotted", '{"marker": ".done"}', {}, ""),
                                        *BAD_JOBS.values()]:
        (jobs / folder).mkdir()
        (jobs / folder / "job.yaml").write_text(json.dumps({**spec, **changes}))
        if nightly is not None:
            (jobs / folder / "nightly.yaml").write_text(nightly)
    return jobs


@pytest.fixture(scope="module")
def bad_jobs(parses) -> dict:
    """The jobs folder of :func:`write_bad_jobs`, parsed once (:func:`parse_then_migrate`)."""
    return {"folder": parses["bad folder"], **parses["bad"]}


def test_bad_jobs_do_not_stop_the_good_ones(bad_jobs):
    assert bad_jobs["errors"] == {}  # an import error would stop every DAG of the file
    assert sorted(bad_jobs["dags"]["nightly_good"]["tasks"]) == ["history", "score"]
    assert sorted(bad_jobs["dags"]["nightly_dotted"]["tasks"]) == ["history", "score", "wait_for_marker"]
    assert len(bad_jobs["dags"]) == len(BAD_JOBS) + 2
    assert bad_jobs["heavy"] == []


@pytest.mark.parametrize("case", sorted(BAD_JOBS))
def test_a_bad_job_gets_a_dag_that_names_its_error(bad_jobs, case):
    folder, _, _, says = BAD_JOBS[case]
    [(dag_id, dag)] = [(i, d) for i, d in bad_jobs["dags"].items()
                       if d["description"].startswith(f"configuration error in job {bad_jobs['folder'] / folder}:")]
    assert says in dag["description"]
    assert "\n" not in dag["description"]  # one line
    assert dag["tasks"] == {"configuration_error": {"retries": 0, "retry_delay": 300.0, "downstream": [],
                                                    "mode": None}}
    assert dag["schedule"].startswith("<airflow.sdk.definitions.timetables.simple.NullTimetable")
    if folder.isidentifier():
        assert dag_id == f"nightly_{folder}"
    else:  # a name Airflow refuses: the safe one and a digest, never another job's id
        assert dag_id.startswith("nightly_") and dag_id != "nightly_my_job"


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

def test_nightly_run_waits_for_the_marker_commits_reruns_as_a_no_op_and_updates_for_a_late_shard(airflow, nightly):
    ds = "2026-01-15"
    data = partition(airflow, ds, marker=False)
    out = airflow["job"] / "out" / f"dt={ds}"

    def marker_arrives():
        assert not out.exists(), "scored before the marker was there"
        (data / "_SUCCESS").write_text("")

    log = dags_test(airflow, ds, when_waiting=marker_arrives)
    assert tries(airflow, ds) == {"wait_for_marker": ("success", 1), "score": ("success", 1),
                                  "history": ("success", 1)}, log
    assert f"committed {out} (attempt" in log
    # The history task: the job's dates up to this one (none before the DAG's start date),
    # beside this date's report.
    assert (f"wrote {out}/history.html: 15 dates from 2026-01-01 to {ds}, 1 committed, 14 gap(s) "
            f"(14 missing)") in log
    page = (out / "history.html").read_text()
    assert "credit_risk_demo" in page and ds in page
    predictions, quarantine, manifest = check_partition(out, shards_of(data))
    # The score task's run is the parent of batchinfer's run, named as Airflow's OpenLineage
    # provider names it: these run ids are what apache-airflow-providers-openlineage 2.20.3's
    # build_task_instance_ol_run_id (try 1, map index -1) and build_dag_run_ol_run_id (clear
    # number 0) give for this DAG at 2026-01-15T00:00Z, namespace "default".
    events = read_events(airflow["home"].parent / "lineage.jsonl")
    assert [e["eventType"] for e in events] == ["START", "COMPLETE"]
    for event in events:
        validate(event)
        parent = event["run"]["facets"]["parent"]
        assert (parent["job"]["namespace"], parent["job"]["name"], parent["run"]["runId"]) == (
            "default", f"{DAG_ID}.score", "019bbef3-b000-7313-9c08-0b7915827c1c")
        assert (parent["root"]["job"]["name"], parent["root"]["run"]["runId"]) == (
            DAG_ID, "019bbef3-b000-7b78-a1f3-2abd68b8fcb9")
        assert event["job"]["name"] == "credit_risk_demo"
        assert event["run"]["facets"]["batchinfer_run"]["attempt"] == manifest["attempt"]
    assert manifest["ds"] == ds and manifest["job"] == "credit_risk_demo"
    assert manifest["totals"]["rows_in"] == ROWS and manifest["totals"]["shards"] == SHARDS
    assert (predictions.num_rows, quarantine.num_rows) == (ROWS - BAD_ROWS, BAD_ROWS)

    before = snapshot(out)
    assert sense(nightly, airflow, ds) is True
    again = score(nightly, airflow, ds)  # the task succeeds again: it returns, raises nothing
    assert isinstance(again, str) and "is already committed with this triple" in again
    assert snapshot(out) == before

    # A shard that arrives after the commit makes another set of shards: for a job whose
    # nightly.yaml says update: false, exit 3, not retried (real Airflow: one failed try).
    shutil.copy(data / "part-00000.parquet", data / "part-00006.parquet")
    write_nightly(airflow["job"], {**NIGHTLY, "update": False})
    try:
        refused = dags_test(airflow, ds)
    finally:
        write_nightly(airflow["job"], NIGHTLY)
    assert tries(airflow, ds) == {"wait_for_marker": ("success", 1), "score": ("failed", 1),
                                  "history": ("upstream_failed", 0)}, refused
    assert "contract failure (exit 3), not retried: batchinfer run: " in refused
    assert snapshot(out) == before
    # By default the score task (here in this process: its command is checked in
    # test_the_score_task_runs_update_unless_the_job_says_not, and a third `dags test` would
    # cost ~10 s for nothing more) runs --update: it scores that shard only and keeps the six
    # committed ones where they are.
    late = score(nightly, airflow, ds)
    assert isinstance(late, str) and "updating: keeping 6 of 7 shards" in late, late
    _, _, updated = check_partition(out, shards_of(data))
    assert {s["scored_by"] for s in updated["shards"][:SHARDS]} == {manifest["attempt"]}
    assert updated["shards"][SHARDS]["scored_by"] == updated["attempt"] != manifest["attempt"]
    kept = {p: v for p, v in before.items() if p.startswith(("predictions/", "quarantine/"))}
    assert {p: v for p, v in snapshot(out).items() if p in kept} == kept  # not rewritten, not moved


def test_the_score_task_runs_update_unless_the_job_says_not(airflow, nightly):
    """The command the score task builds: ``--update`` by default (a late shard is scored when
    the date runs again), left out with ``update: false`` (the late shard is then exit 3, the
    job's own mistake: not retried)."""
    ds = "2026-01-21"
    job = str(airflow["job"] / "job.yaml")
    assert nightly.run_args(job, ds, update=True) == ["run", job, "--ds", ds, "--update"]
    assert nightly.run_args(job, ds, update=False) == ["run", job, "--ds", ds]
    assert nightly.read_config(airflow["job"]).update is True  # NIGHTLY does not say
    assert dag_of(nightly, airflow, DAG_ID).description == f"batchinfer run {job} --ds {{{{ ds }}}} --update"
    write_nightly(airflow["job"], {**NIGHTLY, "update": False})
    try:
        assert dag_of(nightly, airflow, DAG_ID).description == f"batchinfer run {job} --ds {{{{ ds }}}}"
    finally:
        write_nightly(airflow["job"], NIGHTLY)


def test_the_history_task_covers_the_last_dates_from_the_start_date_and_can_be_left_out(airflow, nightly):
    """``history_days`` dates ending at the run's, none before the DAG's start date; 0: no task.
    The task fails at once on exit 2 (here: its last date has no committed partition, which
    cannot happen after a successful score, but is the command's own refusal)."""
    from datetime import date

    job = str(airflow["job"] / "job.yaml")
    first = date(2026, 1, 1)
    assert nightly.history_args(job, "2026-03-15", days=30, first=first) == [
        "history", job, "--start", "2026-02-14", "--end", "2026-03-15"]
    assert nightly.history_args(job, "2026-01-10", days=30, first=first)[2:4] == ["--start", "2026-01-01"]
    assert nightly.history_args(job, "2026-01-10", days=1, first=first)[2:4] == ["--start", "2026-01-10"]
    assert nightly.read_config(airflow["job"]).history_days == 30
    write_nightly(airflow["job"], {**NIGHTLY, "history_days": 0})
    try:
        assert dag_of(nightly, airflow, DAG_ID).task_ids == ["wait_for_marker", "score"]
    finally:
        write_nightly(airflow["job"], NIGHTLY)
    with pytest.raises(Exception) as failed:
        nightly.history_page(job, "2026-02-27", days=3, first=first)
    assert fails_now(failed.value), failed.value
    assert ("usage or spec error (exit 2), not retried: batchinfer history: the last date 2026-02-27 "
            "has no committed partition") in str(failed.value)


def test_a_contract_violation_fails_once_without_retry_and_commits_nothing(airflow, nightly):
    ds = "2026-01-16"
    data = partition(airflow, ds)
    shard = data / "part-00002.parquet"
    table = pq.read_table(shard)  # age as text: every row of the shard fails the schema
    column = table.schema.get_field_index("age")
    pq.write_table(table.set_column(column, "age", pa.array([str(v) for v in table.column("age").to_pylist()])),
                   shard)
    assert sense(nightly, airflow, ds) is True
    failed = score(nightly, airflow, ds)
    assert fails_now(failed), failed
    assert "data quality failure (exit 4), not retried: batchinfer run: data quality:" in str(failed)
    out = airflow["job"] / "out" / f"dt={ds}"
    assert not (out / "_manifest.json").exists()
    assert kept_for_resume(out), "its finished shards kept for a rerun (contract §5.3)"


def test_a_runtime_failure_is_retried(airflow, nightly):
    ds = "2026-01-17"
    partition(airflow, ds)
    out = airflow["job"] / "out" / f"dt={ds}"
    out.mkdir(parents=True)
    (out / "predictions").write_text("a file where a folder must go\n")  # exit 5 on every try
    assert dag_of(nightly, airflow, DAG_ID).get_task("score").retries == 2  # 3 tries
    assert sense(nightly, airflow, ds) is True
    for _ in range(3):  # each try: retried while tries are left
        failed = score(nightly, airflow, ds)
        assert retried(failed), failed
        assert "exit 5, will retry if tries are left: batchinfer run: cannot write" in str(failed)
    assert not (out / "_manifest.json").exists()


def test_a_marker_that_never_comes_times_out_and_nothing_runs(airflow, nightly):
    """The sensor pokes in vain until its timeout: Airflow then fails it (a sensor's timeout is
    not retried) and score, downstream, never runs."""
    ds = "2026-01-18"
    partition(airflow, ds, marker=False)
    write_nightly(airflow["job"], {**NIGHTLY, "marker_timeout_hours": 0.001})  # 3.6 s
    try:
        sensor = dag_of(nightly, airflow, DAG_ID).get_task("wait_for_marker")
        assert sense(nightly, airflow, ds) is False
    finally:
        write_nightly(airflow["job"], NIGHTLY)
    assert sensor.timeout == 3.6 and sensor.mode == "reschedule" and sensor.downstream_task_ids == {"score"}
    assert not (airflow["job"] / "out" / f"dt={ds}").exists()


def test_exit_2_after_the_marker_is_not_retried(airflow, nightly):
    ds = "2026-01-19"
    folder = airflow["job"] / "data" / f"dt={ds}"
    folder.mkdir(parents=True)
    (folder / "_SUCCESS").write_text("")  # complete, and empty: retrying cannot make shards appear
    assert sense(nightly, airflow, ds) is True
    failed = score(nightly, airflow, ds)
    assert fails_now(failed), failed
    assert "usage or spec error (exit 2) with the partition complete, not retried: " in str(failed)
    assert "no shard matches" in str(failed)
    assert not (airflow["job"] / "out" / f"dt={ds}").exists()


def test_a_bad_configuration_fails_its_dag_at_once_and_the_others_still_run(airflow, nightly):
    """The stand-in DAG's one task fails at once, without retry: its run fails."""
    dag = nightly.nightly_broken  # built when the file was imported, beside the good DAGs
    assert nightly.nightly_credit_risk_demo.task_ids == ["wait_for_marker", "score", "history"]
    assert dag.task_ids == ["configuration_error"] and dag.get_task("configuration_error").retries == 0
    with pytest.raises(Exception) as failed:
        dag.get_task("configuration_error").python_callable()
    assert fails_now(failed.value), failed.value
    assert (f"configuration error in job {airflow['job'].parent / 'broken'}: nightly.yaml: retries: "
            f"Input should be a valid integer (got 1.5)") in str(failed.value)


# -- setup mistakes fail at once (issue 18, item 6) --------------------------------------------

def test_an_unset_variable_fails_the_sensor_at_once(airflow, nightly):
    ds = "2026-01-21"
    write_setup_job(airflow["setup"], airflow["job"], input={"path": f"${{{UNSET}}}/dt={{ds}}/*.parquet"})
    write_nightly(airflow["setup"], NIGHTLY)  # retries 2, no delay
    dag = dag_of(nightly, airflow, SETUP_DAG)
    sensor = dag.get_task("wait_for_marker")
    assert sensor.retries == 2 and sensor.downstream_task_ids == {"score"}
    failed = sense(nightly, airflow, ds, SETUP_DAG)  # the sensor fails: score never runs (upstream failed)
    assert fails_now(failed), failed
    assert f"usage or spec error, not retried: input.path uses ${{{UNSET}}}, which is not set" in str(failed)


SETUP_MISTAKES = {
    "unset variable": ({"output": {"path": f"${{{UNSET}}}/dt={{ds}}", "id_columns": ["customer_id"],
                                   "predictions": {"probability": "default_probability"}}},
                       f"output.path uses ${{{UNSET}}}, which is not set in the environment"),
    "missing preprocessing module": ({"preprocess": "no_such_module:transform"}, "no_such_module"),
    "unknown schema": ({"schema": "credit_features@9"}, "credit_features@9"),
}


@pytest.mark.parametrize("case", sorted(SETUP_MISTAKES))
def test_a_setup_mistake_fails_the_task_at_once_without_a_marker(airflow, nightly, case):
    """Without a marker, exit 2 used to be retried as "the partition may not be there yet"."""
    ds = {"missing preprocessing module": "2026-01-22", "unknown schema": "2026-01-23",
          "unset variable": "2026-01-24"}[case]
    changes, says = SETUP_MISTAKES[case]
    write_setup_job(airflow["setup"], airflow["job"], **changes)
    write_nightly(airflow["setup"], {"retries": 2, "retry_delay_minutes": 0})
    partition(airflow, ds)
    dag = dag_of(nightly, airflow, SETUP_DAG)
    assert dag.task_ids == ["score", "history"] and dag.get_task("score").retries == 2
    failed = score(nightly, airflow, ds, SETUP_DAG)
    assert fails_now(failed), failed
    assert "usage or spec error (exit 2), not retried: batchinfer run: " in str(failed)
    assert says in str(failed)


def test_no_shard_yet_is_retried_without_a_marker(airflow, nightly):
    ds = "2026-01-25"  # no partition: it has not arrived
    write_setup_job(airflow["setup"], airflow["job"])
    write_nightly(airflow["setup"], {"retries": 2, "retry_delay_minutes": 0})
    dag = dag_of(nightly, airflow, SETUP_DAG)
    assert dag.task_ids == ["score", "history"] and dag.get_task("score").retries == 2  # 3 tries
    for _ in range(3):  # each try: retried while tries are left
        failed = score(nightly, airflow, ds, SETUP_DAG)
        assert retried(failed), failed
        assert "no shard yet (exit 2), will retry if tries are left: batchinfer run: " in str(failed)


# -- the error file the task reads (docs/contract.md §2) -------------------------------------------

@pytest.mark.parametrize("args, code, error", [
    (["run", "job.yaml", "--ds", "2026-02-01"], 2, "NoShardsError"),
    (["run", "job.yaml", "--ds", "2026-01-31", "--set", f"output.path=${{{UNSET}}}/x"], 2, "SpecError"),
    (["run", "job.yaml", "--ds", "2026-01-31", "--set", "schema=credit_features@9"], 2, "UnknownSchemaError"),
    (["run", "job.yaml", "--no-such-flag"], 2, "UsageError"),
])
def test_a_failing_command_writes_its_error_file(airflow, tmp_path, args, code, error):
    error_file = tmp_path / "error.json"
    result = run_cli(*args, cwd=airflow["job"], env={"BATCHINFER_ERROR_FILE": str(error_file)})
    assert result.returncode == code, result.stderr
    record = json.loads(error_file.read_text())
    assert record["exit_code"] == code and record["error"] == error
    if error != "UsageError":  # argparse's line is its own
        assert one_line_error(result) == f"batchinfer run: {record['message']}"


def test_a_command_that_succeeds_writes_no_error_file(airflow, tmp_path):
    error_file = tmp_path / "error.json"
    result = run_cli("plan", "job.yaml", "--ds", "2026-01-31", cwd=airflow["job"],
                     env={"BATCHINFER_ERROR_FILE": str(error_file)})
    assert result.returncode == 0, result.stderr
    assert not error_file.exists()


# -- README's "Nightly with Airflow", as a user types it (issue 18, item 6) ----------------------

def readme_nightly_commands() -> list[str]:
    """The command lines of the first ```bash block in README's "Nightly with Airflow"."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Nightly with Airflow\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_nightly_section_runs_as_written_after_the_demo(tmp_path):
    install, *typed = readme_nightly_commands()
    assert install.startswith('.venv/bin/pip install -e ".[cpu,airflow]"')  # done: this is that venv
    assert typed[-1].startswith("airflow dags test nightly_credit_risk 2026-01-15")
    # A fresh clone: the repository's DAG, jobs and schemas, and its .venv (this one).
    clone = tmp_path / "clone"
    for folder in ("airflow_dags", "pipelines", "schemas"):
        shutil.copytree(REPO / folder, clone / folder, symlinks=False, ignore=shutil.ignore_patterns(
            "__pycache__", "mlflow.db*", "mlruns", "model", "tokenizer.json"))
    venv = Path(sys.executable).parent.parent
    assert (venv / "bin" / "activate").is_file(), f"{sys.executable} is not a virtual environment's"
    (clone / ".venv").symlink_to(venv)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "CREDIT_", "BATCHINFER_"))}
    env["PYTHONPATH"] = str(REPO)  # this checkout's batchinfer (the venv's editable install may be another's)
    # README's first command (with fewer rows), then the section's commands as written.
    script = "set -e\n.venv/bin/python -m batchinfer demo --rows 1200\n" + "\n".join(typed) + "\n"
    result = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    ds = "2026-01-15"
    manifest = json.loads((clone / "demo" / "scores" / f"dt={ds}" / "_manifest.json").read_text())
    assert manifest["ds"] == ds and manifest["job"] == "credit_risk_nightly"
    assert manifest["totals"]["rows_in"] == 1200 and manifest["triple"]["model_version"] == "credit_risk:1"
    assert task_states(clone / "demo" / "airflow" / "airflow.db", "nightly_credit_risk", ds) == {
        "wait_for_marker": ("success", 1), "score": ("success", 1), "history": ("success", 1)}
    assert (clone / "demo" / "scores" / f"dt={ds}" / "history.html").is_file()
