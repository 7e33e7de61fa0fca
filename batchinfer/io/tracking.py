"""Job metrics to MLflow, without ever losing results (contract §5.7).

The run is opened by a helper process as soon as a job starts, so MLflow's import and a new
store's migrations (2.5 s or more here) run on another core while the job scores. After the commit, metrics and the
manifest are logged. Whatever MLflow does, the same record is written beside the manifest as
``_metrics.json``; when MLflow failed it says ``"uploaded": false`` and
``batchinfer track OUTPUT`` uploads it later.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
import urllib.parse
from datetime import datetime
from typing import Any, Iterator, Mapping, Protocol

from ..errors import one_line
from ..redaction import redact

# MLflow's HTTP client retries for minutes by default; a nightly job should say "tracking is
# down" in seconds and commit anyway. MLflow logs store migrations at INFO; batchinfer reports
# tracking in its own summary line. A user's own settings win.
MLFLOW_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
                   "MLFLOW_LOGGING_LEVEL": "WARNING"}

_settings_lock = threading.Lock()
_settings_held: dict[str, int] = {}   # variable → open mlflow_settings() blocks that set it


@contextlib.contextmanager
def mlflow_settings(extra: Mapping[str, str] | None = None) -> Iterator[None]:
    """:data:`MLFLOW_DEFAULTS` (and ``extra``) for the MLflow calls made in the block, where the
    user set nothing.

    MLflow takes these settings from the process environment only, and reads them late (its
    logging level when it is imported, retries and timeouts at each request, the progress bar
    at each download), so they are in ``os.environ`` while the block runs — and only then: they
    are not left behind for the rest of the process and every child it starts. The tracking
    helper gets them in its own environment instead. Blocks may overlap (threads, nesting): a
    variable goes when the last block that set it ends.
    """
    settings = {**MLFLOW_DEFAULTS, **(extra or {})}
    with _settings_lock:
        mine = [name for name in settings if _settings_held.get(name) or name not in os.environ]
        for name in mine:
            if not _settings_held.get(name):
                os.environ[name] = settings[name]
            _settings_held[name] = _settings_held.get(name, 0) + 1
    try:
        yield
    finally:
        with _settings_lock:
            for name in mine:
                _settings_held[name] -= 1
                if not _settings_held[name]:
                    del _settings_held[name]
                    os.environ.pop(name, None)


def mlflow_client(uri: str):
    """An MLflow client for ``uri`` (tracking and registry); use it inside :func:`mlflow_settings`
    (the tracking helper's environment has them already). A sqlite store it is the first to
    use is made with its artifacts beside it (:func:`make_store`): the registry's client (``stamp``
    of a ``models:/`` model, the demo) may be a store's first user as well as a run's."""
    if _new_store(uri):
        with sqlite_first_use_lock(uri):
            make_store(uri, spec_free(artifact_root(uri)))
    return _client(uri)


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {one_line(exc, 200)}"


class Helper(Protocol):
    """What :class:`TrackingRun` uses of its helper process."""
    stdin: Any   # text, line-buffered: one JSON request per line
    stdout: Any  # text: one JSON reply per line

    def kill(self) -> None: ...


def start_helper(env: Mapping[str, str]) -> Helper:
    """Start the helper process: a new interpreter that runs :func:`_serve`.

    Looked up at each start, so that the test suite's fork server, whose interpreter has
    already imported MLflow, can fork it instead (tests/forkserver.py): the same protocol and
    the same ``_serve``, without an MLflow import per tracked run."""
    return subprocess.Popen([sys.executable, "-m", "batchinfer.io.tracking"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, bufsize=1, env=dict(env))


# A process that runs jobs one after another (`batchinfer backfill`, a run per date; callers of
# batchinfer.cli.main such as bench/gpu_check.py) would start a helper per run and pay MLflow's
# import each time: 2.5 s of CPU, most of it waited for before the manifest's header. So a
# helper whose run ended well, or that was never asked anything, is kept for the process's next
# run (_serve takes another prepare/open after a finish). At most one is kept, and only for a run
# that would start an identical one; it exits with the process, whose end closes its stdin.
_kept_lock = threading.Lock()
_kept: list[tuple[tuple, Helper]] = []   # (what it was started with, the helper): one at most


# Set in this process, where unset, by its first run's imports (polars: its allocator's
# settings; pandera: pyspark's), to these values. A helper behaves alike with or without them
# (MLflow's import sets polars' the same; it never imports pyspark), so they do not stop one
# started before from being reused.
_SET_BY_IMPORTS = {"_RJEM_MALLOC_CONF": "dirty_decay_ms:500,muzzy_decay_ms:1000",
                   "SPARK_LOCAL_IP": "127.0.0.1", "PYARROW_IGNORE_TIMEZONE": "1"}


def _helper_key(env: Mapping[str, str]) -> tuple:
    """What a helper is started with: its environment (but :data:`_SET_BY_IMPORTS`); the pid: a
    forked child must not share its parent's pipes; the working directory: a relative sqlite or
    folder store is the helper's cwd's; the starter: tests/forkserver.py puts its own."""
    cwd: object
    try:
        cwd = os.getcwd()
    except OSError:  # removed: no helper matches
        cwd = object()
    started_with = sorted((k, v) for k, v in env.items() if _SET_BY_IMPORTS.get(k) != v)
    return os.getpid(), start_helper, cwd, tuple(started_with)


def _swap_kept(new: list[tuple[tuple, Helper]]) -> list[tuple[tuple, Helper]]:
    """Put ``new`` in the slot; return what it held (the caller reuses or stops it)."""
    with _kept_lock:
        old, _kept[:] = list(_kept), new
    return old


def _take_helper(env: Mapping[str, str]) -> Helper:
    """The kept helper, if it was started with ``env`` here and is still there; else a new one
    (the kept one is killed, see :func:`stop_kept_helper`)."""
    key = _helper_key(env)
    for started_with, helper in _swap_kept([]):
        if started_with == key and _idle(helper):
            return helper
        helper.kill()
    return start_helper(env)


def _keep(helper: Helper, env: Mapping[str, str]) -> None:
    """Keep ``helper`` (started with ``env``) for the next run, killing one kept before."""
    for _, old in _swap_kept([(_helper_key(env), helper)]):
        old.kill()


def stop_kept_helper() -> None:
    """Kill the kept helper: for a process about to exit (the CLI's end). A kept helper holds
    nothing: its run's finish was answered, or it was never asked anything — then it is still
    importing MLflow for a run that was refused or had nothing to do, and closing its stdin
    would let it finish that import (about 2 s of CPU) before it notices. So a kept helper that
    is not reused is killed too (:func:`_take_helper`, :func:`_keep`)."""
    for _, helper in _swap_kept([]):
        helper.kill()


def _idle(helper: Helper) -> bool:
    """True if the helper has nothing to say: one that ended (its stdout at end of file) or
    wrote out of turn is not reused."""
    try:
        ready, _, _ = select.select([helper.stdout], [], [], 0)
    except (OSError, ValueError):
        return False
    return not ready


def _stop(helper: Helper) -> None:
    """Close the helper's stdin; it exits by itself. Not waited for: its interpreter's shutdown
    (SQLAlchemy, MLflow) takes most of a second and holds nothing of ours."""
    try:
        helper.stdin.close()
    except OSError:
        helper.kill()


class TrackingRun:
    """An MLflow run opened by a helper process; :meth:`finish` logs and closes it.

    MLflow's import costs 1.5–3 s of CPU and a new sqlite store about 1 s more. In a thread
    that time would compete with scoring for the GIL; in a child process it runs on another
    core while the job imports Beam and scores. The child speaks one JSON object per line on
    its stdin/stdout (see :func:`_serve`).

    The helper starts at construction (or the process's kept one is taken: :func:`_take_helper`)
    and imports MLflow; :meth:`prepare` lets it connect to the store (creating the experiment if
    missing); no run exists in MLflow until :meth:`open`.
    A job that fails its pre-flight checks never calls either, and leaves nothing behind.

    Args:
        uri: tracking URI (``sqlite:///…``, ``http://…``, a folder).
        experiment: experiment name (created if missing).
    """

    def __init__(self, uri: str, experiment: str):
        self.uri = uri
        self.experiment = experiment
        self.artifacts = spec_free(artifact_location(uri, experiment))
        self.run_id: str | None = None
        self.error: str | None = None
        self._opened = False
        self._waiting = threading.Lock()   # wait() from the commit step's thread and the launcher's
        self._asked = False   # anything sent to the helper: else close() keeps it for the next run
        self._env = {**MLFLOW_DEFAULTS, **os.environ}
        self._child: Helper | None
        try:
            self._child = _take_helper(self._env)
        except OSError as exc:
            self._child = None
            self.error = short_error(exc)

    def prepare(self) -> None:
        """Let the helper connect to the store now (its modules, a new store's migrations, the
        experiment): most of its start-up after MLflow's import. Call it once the job's checks
        have passed, so that a refused job writes nothing, not even a store."""
        if self._child is None:
            return
        try:
            self._send({"prepare": {"uri": self.uri, "experiment": self.experiment,
                                    "artifacts": self.artifacts}})
        except OSError as exc:
            self.error = short_error(exc)
            self._close()

    def open(self, run_name: str, tags: Mapping[str, str], started: datetime | None = None) -> None:
        """Ask the helper to create the run (returns at once; :meth:`wait` gets its id).

        Args:
            started: when the job started (the run's start time in MLflow; default: when the
                helper creates it, which is seconds later: after MLflow's import, the
                checks and the model's load)."""
        if self._child is None:
            return
        try:
            self._send({"open": {"uri": self.uri, "experiment": self.experiment,
                                 "artifacts": self.artifacts, "run_name": run_name, "tags": dict(tags),
                                 "start_time": _millis(started) if started else None}})
        except OSError as exc:
            self.error = short_error(exc)
            self._close()

    def close(self) -> None:
        """Stop the helper without creating or finishing a run (one that was never asked
        anything is kept for the process's next run instead)."""
        if self._child is not None and not self._asked:
            self._hand_on()
        self._close()

    def _pipes(self) -> tuple[Any, Any]:
        """The helper's stdin and stdout (only called while the helper runs)."""
        assert self._child is not None
        return self._child.stdin, self._child.stdout

    def _send(self, message: dict) -> None:
        self._asked = True
        stdin, _ = self._pipes()
        stdin.write(json.dumps(message) + "\n")
        stdin.flush()

    def _receive(self, timeout: float) -> dict:
        _, stdout = self._pipes()
        ready, _, _ = select.select([stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"MLflow at {self.uri} did not answer within {timeout:.0f} s")
        line = stdout.readline()
        if not line:
            raise ConnectionError("the MLflow helper process ended unexpectedly")
        return json.loads(line)

    def wait(self, timeout: float = 120.0) -> str | None:
        """Wait for the run to open; return its id (None if MLflow failed)."""
        with self._waiting:
            if self._child is None or self._opened:
                return self.run_id
            self._opened = True
            try:
                reply = self._receive(timeout)
                self.run_id, self.error = reply.get("run_id"), reply.get("error")
            except (TimeoutError, ConnectionError, ValueError, OSError) as exc:
                self.error = short_error(exc)
                self._close()
            return self.run_id

    def finish(self, params: Mapping[str, Any], metrics: Mapping[str, float],
               artifacts: Mapping[str, str], status: str = "FINISHED",
               timeout: float = 120.0, tags: Mapping[str, str] | None = None,
               dataset: Mapping[str, str] | None = None) -> bool:
        """Log params, metrics, tags and text artifacts (and the input partition as an MLflow
        dataset, see :func:`log_dataset`); close the run, ending it now (the time of this call,
        not of the helper's upload). True if all was uploaded.
        ``timeout`` bounds each wait for the helper (the run's opening, then the upload)."""
        ended = int(time.time() * 1000)
        if self.wait(timeout) is None:
            self._close()
            return False
        try:
            self._send({"finish": {"params": dict(params), "metrics": dict(metrics),
                                   "artifacts": dict(artifacts), "status": status,
                                   "tags": dict(tags or {}), "dataset": dict(dataset or {}),
                                   "end_time": ended}})
            reply = self._receive(timeout)
            self.error = reply.get("error")
        except (TimeoutError, ConnectionError, ValueError, OSError) as exc:
            self.error = short_error(exc)
        if self.error is None and status == "FINISHED":  # a failed or killed run's is not reused
            self._hand_on()
        self._close()
        return self.error is None

    def _hand_on(self) -> None:
        """Keep the helper for the process's next run (see :func:`_take_helper`)."""
        assert self._child is not None
        _keep(self._child, self._env)
        self._child = None

    def _close(self) -> None:
        """Stop the helper (see :func:`_stop`), if this run still has it."""
        if self._child is not None:
            _stop(self._child)
            self._child = None


def _serve() -> None:
    """The helper process: open a run on request, then log what ``finish`` sends."""
    client: Any = None
    run_id: Any = None
    # Only replies go to the pipe: MLflow prints to sys.stdout ("View run … at: URL" after
    # set_terminated against a server), which would corrupt the JSON protocol.
    replies, sys.stdout = sys.stdout, sys.stderr
    try:  # imported before the first request, while the job does its own start-up
        import mlflow.tracking  # noqa: F401
    except Exception:  # reported when a run is asked for
        pass
    # Scoring keeps both cores busy (ONNX Runtime's threads); tracking can wait for them. Not
    # MLflow's import: the job's first run waits for it (the run's id is in the manifest's
    # header), while its own start-up uses one core.
    os.nice(10)
    experiment_id = prepared = None
    for line in sys.stdin:
        message = json.loads(line)
        try:
            if "prepare" in message:  # no reply: the outcome is the answer to "open"
                prepared = message["prepare"]
                try:
                    client, experiment_id = connect(prepared["uri"], prepared["experiment"],
                                                    prepared.get("artifacts"))
                except Exception as exc:
                    prepared["error"] = exc
                continue
            if "open" in message:
                req = message["open"]
                if prepared is None or (prepared["uri"], prepared["experiment"]) != (
                        req["uri"], req["experiment"]):
                    client, experiment_id = connect(req["uri"], req["experiment"], req.get("artifacts"))
                elif "error" in prepared:  # not retried: MLflow's client already retried
                    raise prepared["error"]
                run_id = create_run(client, req["uri"], experiment_id, req.get("artifacts"),
                                    run_name=req["run_name"], tags=req["tags"],
                                    start_time=req.get("start_time"))
                reply: dict = {"run_id": run_id}
            else:
                req = message["finish"]
                args = (client, run_id, req["params"], req["metrics"], req["artifacts"],
                        req["status"], req.get("tags"), req.get("dataset"), req.get("end_time"))
                try:
                    upload(*args)
                except Exception:
                    # Runs of one partition at once share a sqlite store, and a write can fail
                    # on its lock; every step of upload() is safe to repeat (the same params,
                    # tags and texts again, metrics at the same step), so once more after a pause.
                    time.sleep(1.0)
                    upload(*args)
                reply = {"ok": True}
        except Exception as exc:  # reported to the job, which carries on without tracking
            reply = {"error": short_error(exc)}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


@contextlib.contextmanager
def sqlite_first_use_lock(uri: str):
    """Serialise processes that open a local sqlite store, on a lock file beside it.

    MLflow migrates a new sqlite store on first use, and two processes doing that at once fail
    ("duplicate column name") or leave the store half-migrated (measured on this project's machines). Holding an
    exclusive lock while the client is created and the experiment looked up makes the first
    user migrate alone; later users wait only for that. Other stores need no lock.
    """
    if not uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    path = uri[len("sqlite:///"):]
    try:
        handle = open(f"{path}.lock", "a")
    except OSError:  # read-only folder, odd path: carry on unlocked
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def connect(uri: str, experiment: str, artifacts: str | None = None):
    """An MLflow client for ``uri`` and the id of ``experiment`` (created if missing, with its
    artifacts at ``artifacts``: see :func:`artifact_location`; a new store is made with its
    artifacts in the folder above, :func:`make_store`)."""
    with sqlite_first_use_lock(uri):
        make_store(uri, os.path.dirname(artifacts) if artifacts else None)
        client = _client(uri)
        return client, experiment_id_for(client, experiment, artifacts)


def _sqlite_file(uri: str) -> str | None:
    """The database file of a ``sqlite:///PATH`` store (absolute), None for any other store."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    if not path or path == ":memory:":
        return None
    return os.path.abspath(path)


def _new_store(uri: str) -> bool:
    """A sqlite store whose database is not there yet (or empty: created, never migrated)."""
    path = _sqlite_file(uri)
    return path is not None and (not os.path.exists(path) or os.path.getsize(path) == 0)


def make_store(uri: str, root: str | None) -> None:
    """Create a new sqlite store (MLflow's tables) with ``root`` as its default artifact root;
    nothing for a store that exists, another kind of store, or no ``root``. Call it holding
    :func:`sqlite_first_use_lock`.

    MLflow makes a sqlite store on its first use with the artifact root ``./mlruns`` of the
    working directory of that use, and writes it into the store's ``Default`` experiment (and
    any experiment created without a location): every later run of it, from wherever it runs,
    then writes into the folder of whoever ran first. Made here, ``Default``'s artifacts are in
    ``<root>/0``, beside the store.
    """
    if root is None or not _new_store(uri):
        return
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    SqlAlchemyStore(uri, root)


def spec_free(location: str | None) -> str | None:
    """``location`` unless it holds a ``${NAME}`` value of the job spec: MLflow receives no spec
    values (contract §3), so such a store's experiment gets MLflow's default location instead."""
    return location if location is None or redact(location) == location else None


def artifact_root(uri: str) -> str | None:
    """Where a sqlite store's artifacts are: ``mlartifacts/`` in the database file's folder;
    None for any other store (its server or folder decides).

    Example:
        >>> artifact_root("sqlite:////data/mlflow.db")
        '/data/mlartifacts'
    """
    path = _sqlite_file(uri)
    return None if path is None else os.path.join(os.path.dirname(path), "mlartifacts")


def artifact_location(uri: str, experiment: str) -> str | None:
    """Where a new experiment of store ``uri`` keeps its runs' artifacts: for a sqlite store,
    ``mlartifacts/<experiment>/`` in the database file's folder (the name with characters other
    than letters, digits, ``_``, ``.`` and ``-`` as ``_``); None for any other store, whose
    server or folder decides.

    Without it MLflow puts a sqlite store's artifacts under ``./mlruns`` of the working
    directory of whichever process created the experiment, away from the store.

    Example:
        >>> artifact_location("sqlite:////data/mlflow.db", "credit risk")
        '/data/mlartifacts/credit_risk'
    """
    root = artifact_root(uri)
    if root is None:
        return None
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", experiment).lstrip(".") or "_"
    return os.path.join(root, safe)


def misplaced(location: str | None, experiment_id: str, uri: str) -> bool:
    """Whether an experiment's artifact location was MLflow's default taken from some process's
    working directory rather than a place anyone chose: a relative local path (each run would
    resolve it against its own working directory), or ``<folder>/mlruns/<id>`` or
    ``<folder>/mlartifacts/<id>`` in another folder than the sqlite store's — MLflow's
    ``Default`` experiment of a store that MLflow made, or an experiment an older batchinfer
    created without a location. A location of another scheme, or anything else, was chosen.

    Example:
        >>> misplaced("/home/ann/mlruns/0", "0", "sqlite:////data/mlflow.db")
        True
        >>> misplaced("/data/mlartifacts/0", "0", "sqlite:////data/mlflow.db")
        False
    """
    store = _sqlite_file(uri)
    if store is None or not location:
        return False
    parsed = urllib.parse.urlparse(location)
    if parsed.scheme not in ("", "file") or parsed.netloc not in ("", "localhost"):
        return False
    path = urllib.parse.unquote(parsed.path) if parsed.scheme else location
    if not os.path.isabs(path):
        return True
    kind = os.path.dirname(os.path.normpath(path))
    return (os.path.basename(os.path.normpath(path)) == str(experiment_id)
            and os.path.basename(kind) in ("mlruns", "mlartifacts")
            and os.path.dirname(kind) != os.path.dirname(store))


def create_run(client, uri: str, experiment_id: Any, artifacts: str | None, **fields) -> str:
    """Create a run of the experiment (``fields``: ``create_run``'s) and return its id. In an
    experiment whose location is :func:`misplaced`, the run's artifacts go beside the store as
    they would in an experiment batchinfer made, ``<artifacts>/<run id>/artifacts``: a run writes
    only under ``output.path``, the store's own folder and its scratch (the experiment keeps its
    location for other clients' runs). MLflow sets a run's artifact URI from its experiment's at
    creation and offers no call to set another, so the run's row is given it in the store."""
    beside = artifacts if artifacts is not None and misplaced(
        client.get_experiment(experiment_id).artifact_location, str(experiment_id), uri) else None
    run_id = client.create_run(experiment_id, **fields).info.run_id
    if beside is not None:
        try:
            _set_artifact_uri(uri, run_id, os.path.join(beside, run_id, "artifacts"))
        except Exception:
            client.set_terminated(run_id, "FAILED")   # never logged into someone's folder
            raise
    return run_id


def _set_artifact_uri(uri: str, run_id: str, artifact_uri: str) -> None:
    """Point a sqlite store's run at ``artifact_uri`` (its row in MLflow's ``runs`` table)."""
    from mlflow.store.tracking.dbmodels.models import SqlRun
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(uri, os.path.dirname(os.path.dirname(artifact_uri)))
    with store.ManagedSessionMaker() as session:
        updated = session.query(SqlRun).filter(SqlRun.run_uuid == run_id).update(
            {SqlRun.artifact_uri: artifact_uri})
    if updated != 1:
        raise RuntimeError(f"run {run_id} is not in {uri}: its artifacts have no place")


def experiment_id_for(client, name: str, location: str | None = None) -> str:
    """Get or create the experiment (its artifacts at ``location``, or where the store puts
    them); concurrent jobs may race to create it (the loser reads it). An experiment that exists
    keeps the location it was created with."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


# MLflow's log_batch takes at most 1000 metrics, 100 params and 100 tags per call (1000
# entities in all); a run with many drift columns and quarantine checks has more.
BATCH_METRICS, BATCH_PARAMS, BATCH_TAGS = 1000, 100, 100


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def log_dataset(client, run_id: str, dataset: Mapping[str, str]) -> None:
    """The input partition as an MLflow dataset input of the run (name, digest, source)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    profile = json.dumps({k: v for k, v in dataset.items() if k not in ("name", "digest", "source")})
    entity = Dataset(name=dataset["name"], digest=dataset["digest"], source_type="local"
                     if "://" not in dataset.get("source", "") else "external",
                     source=json.dumps({"uri": dataset.get("source", "")}), profile=profile)
    client.log_inputs(run_id, [DatasetInput(entity, [InputTag("mlflow.data.context", "inference")])])


def _log_dataset_once(client, run_id: str, dataset: Mapping[str, str]) -> None:
    """The input partition as an MLflow dataset — a nicety that must not cost the run.

    Runs of one partition at once (a race, or ``--set output.path=…`` beside the nightly run)
    log the same dataset (name, digest) into one store, and the loser of the insert gets an
    integrity error; a second try finds the dataset there. Should that fail too, the run is still
    finished (``set_terminated`` comes after this) and says why in a tag.
    """
    for attempt in (1, 2):
        try:
            log_dataset(client, run_id, dataset)
            return
        except Exception as exc:
            if attempt == 2:
                client.set_tag(run_id, "batchinfer.dataset", f"not logged: {short_error(exc)}"[:5000])


def upload(client, run_id: str, params: Mapping[str, Any], metrics: Mapping[str, float],
           artifacts: Mapping[str, str], status: str = "FINISHED",
           tags: Mapping[str, str] | None = None, dataset: Mapping[str, str] | None = None,
           end_time: int | None = None) -> None:
    """Log everything to run ``run_id`` and end it with ``status`` at ``end_time`` (epoch
    milliseconds; default now)."""

    from mlflow.entities import Metric, Param, RunTag

    now = int(time.time() * 1000)
    for chunk in _chunks([Metric(k, float(v), now, 0) for k, v in sorted(metrics.items())], BATCH_METRICS):
        client.log_batch(run_id, metrics=chunk)
    for chunk in _chunks([Param(k, str(v)[:6000]) for k, v in sorted(params.items())], BATCH_PARAMS):
        client.log_batch(run_id, params=chunk)
    for chunk in _chunks([RunTag(k, str(v)[:5000]) for k, v in sorted((tags or {}).items())], BATCH_TAGS):
        client.log_batch(run_id, tags=chunk)
    if dataset:
        _log_dataset_once(client, run_id, dataset)
    for name, text in artifacts.items():
        client.log_text(run_id, text, name)
    # MLflow prints "View run … at: <tracking URI>" here, which may hold a ${NAME} value.
    with contextlib.redirect_stdout(io.StringIO()):
        client.set_terminated(run_id, status, end_time=end_time)


def upload_pending(uri: str, experiment: str, record: dict) -> str:
    """Upload a ``_metrics.json`` record that could not be uploaded at run time; return run id."""
    with mlflow_settings():
        # The record shows ${NAME} where the job's tracking.uri had a value from the environment;
        # such a value is not sent to MLflow (a --tracking-uri given to `track` is no spec value).
        shown = record.get("tracking_uri", "")
        from_spec = "${" in shown and uri == os.path.expandvars(shown)
        location = None if from_spec else artifact_location(uri, experiment)
        client, experiment_id = connect(uri, experiment, location)
        run_id = record.get("mlflow_run_id")
        # The run spans the job, as at run time: from the manifest's start to its commit.
        manifest = json.loads(record.get("manifest_text") or "{}")
        started, finished = (_millis_of(manifest.get(k)) for k in ("started_at", "finished_at"))
        if run_id is None:
            run_id = create_run(client, uri, experiment_id, location,
                                run_name=record.get("run_name"), tags=record.get("tags", {}),
                                start_time=started)
        artifacts = {"manifest.json": record.get("manifest_text", "")}
        if record.get("report_text"):
            artifacts["report.html"] = record["report_text"]
        upload(client, run_id, record["params"], record["metrics"], artifacts, tags=record.get("tags"),
               end_time=finished)
        return run_id


def _millis(moment: datetime) -> int:
    """Epoch milliseconds, as MLflow keeps a run's start and end."""
    return int(moment.timestamp() * 1000)


def _millis_of(text: str | None) -> int | None:
    """Epoch milliseconds of an RFC 3339 time (a manifest's ``started_at``), None if none."""
    if not text:
        return None
    try:
        return _millis(datetime.fromisoformat(text.replace("Z", "+00:00")))
    except ValueError:
        return None


if __name__ == "__main__":
    _serve()
