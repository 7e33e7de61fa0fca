"""Real servers for integration tests: an S3-compatible store, an MLflow tracking server, and a
fault-injecting HTTP proxy (the real components the suite runs against, started once per session).

Each server is a plain context manager (usable outside pytest) with a session-scoped pytest
fixture around it. Servers are subprocesses on 127.0.0.1, so job subprocesses reach them over
HTTP exactly as a user's jobs reach real ones, and they are always torn down: the process group
is terminated, then killed, in a ``finally``.

``conftest.py`` registers the fixtures (``pytest_plugins``); test modules import the helpers
they use by name.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import http.client
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import pytest

if TYPE_CHECKING:
    import forkserver

__all__ = ["free_port", "closed_port", "MotoServer", "moto_server", "MlflowServer", "mlflow_server",
           "FaultRule", "FaultProxy", "fault_proxy", "s3_server", "mlflow_live", "s3_proxy",
           "s3_env", "new_bucket", "env_for", "s3fs_for", "S3_CREDENTIALS",
           "stamped_template", "copy_project", "start_cli", "finish_all", "s3_proxy_session",
           "BeamJobService", "beam_job_service", "DaskCluster", "dask_cluster",
           "MountNamespace", "processes_of"]

HOST = "127.0.0.1"
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                  "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def closed_port() -> int:
    """A port where a connection is refused (bound once, then released)."""
    return free_port()


def _wait_http(url: str, proc: subprocess.Popen | None, timeout: float, log: Path | None,
               expect: bytes | None = None) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=3) as resp:
                body = resp.read()
                if resp.status == 200 and (expect is None or expect in body):
                    return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.25)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s ({last}):\n{tail}")


def _stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Terminate the process group this test started (the server and any workers it spawned)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    # Workers of a server may outlive its parent: kill whatever is left of the group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def _start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    handle = open(log, "wb")
    try:
        # A new session makes the server its own process group, so teardown reaches its workers.
        return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    finally:
        handle.close()


def _launch(cmd: list[str], log: Path, health_url: str, timeout: float,
            env: dict | None = None) -> subprocess.Popen:
    """Start a server and wait until ``health_url`` answers; stop it if it never does."""
    proc = _start(cmd, log, env)
    try:
        _wait_http(health_url, proc, timeout, log)
    except BaseException:
        _stop(proc)
        raise
    return proc


class _Served:
    """A server process owned by a ``with`` block (``__enter__`` sets ``self.proc``)."""

    proc: subprocess.Popen | None = None

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            _stop(self.proc)


# -- S3: moto in server mode -------------------------------------------------------------------

class MotoServer(_Served):
    """``python -m moto.server`` on 127.0.0.1, as s3fs's own tests run it.

    Attributes:
        endpoint: ``http://127.0.0.1:PORT``.
        env: the standard AWS_* variables a job needs to use it (and nothing else).
    """

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.port = free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        self.log = self.workdir / "moto.log"
        self.proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        return env_for(self.endpoint)

    def __enter__(self) -> "MotoServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = _launch([sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
                            self.log, f"{self.endpoint}/moto-api/", 60)
        return self

    def s3fs(self, endpoint: str | None = None):
        """A fresh s3fs file system on this server (or on ``endpoint``, e.g. a proxy)."""
        return s3fs_for(endpoint or self.endpoint)

    def make_bucket(self, name: str | None = None) -> str:
        name = name or f"bkt-{uuid.uuid4().hex[:12]}"
        # Plain CreateBucket: us-east-1 takes no LocationConstraint (s3fs's mkdir would send one).
        self.s3fs().call_s3("create_bucket", Bucket=name)
        return name


def env_for(endpoint: str) -> dict[str, str]:
    """The environment a job subprocess gets: only the standard AWS_* variables."""
    return {"AWS_ENDPOINT_URL": endpoint, **S3_CREDENTIALS}


def s3fs_for(endpoint: str):
    import s3fs

    return s3fs.S3FileSystem(key=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                             secret=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                             endpoint_url=endpoint, skip_instance_cache=True,
                             client_kwargs={"region_name": S3_CREDENTIALS["AWS_DEFAULT_REGION"]})


# -- MLflow tracking server --------------------------------------------------------------------

class MlflowServer(_Served):
    """``mlflow server`` with a sqlite backend and served artifacts, on 127.0.0.1.

    Attributes:
        uri: ``http://127.0.0.1:PORT`` (the tracking and registry URI).
        db: the sqlite store file; ``artifacts``: the artifacts folder (both for byte-level greps).
    """

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.port = free_port()
        self.uri = f"http://{HOST}:{self.port}"
        self.db = self.workdir / "mlflow.db"
        self.artifacts = self.workdir / "artifacts"
        self.log = self.workdir / "mlflow-server.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "MlflowServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "mlflow", "server",
               "--backend-store-uri", f"sqlite:///{self.db}",
               "--artifacts-destination", str(self.artifacts),
               "--host", HOST, "--port", str(self.port), "--workers", "1"]
        # The server's background job runner (huey consumers, several processes) is not needed.
        self.proc = _launch(cmd, self.log, f"{self.uri}/health", 180,
                            {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        return self

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)


# -- fault-injecting proxy ---------------------------------------------------------------------

@dataclass
class FaultRule:
    """Fault the first ``times`` requests whose method and target match (``times=None``: all).

    Attributes:
        method: HTTP method, or ``"*"``.
        contains: substring of the request target (path and query, percent-decoded).
        status: the status to answer (500, 503, ...); ignored when ``stall_s`` is set.
        stall_s: instead of answering, hold the request this long, then drop the connection.
        matched: how many requests this rule has faulted so far.
    """

    method: str = "*"
    contains: str = ""
    status: int = 503
    times: int | None = 1
    stall_s: float | None = None
    matched: int = 0

    def matches(self, method: str, target: str) -> bool:
        return (self.method in ("*", method) and self.contains in target
                and (self.times is None or self.matched < self.times))


_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade",
               "te", "trailer", "proxy-authenticate", "proxy-authorization"}


class FaultProxy:
    """A thread in the test process that forwards HTTP to ``upstream`` and injects faults.

    Bodies and headers are forwarded as received (``Host``, ``Authorization``, ``If-None-Match``,
    checksums, chunked bodies byte for byte); only hop-by-hop headers are left to each hop.

    Attributes:
        url: where clients connect, ``http://127.0.0.1:PORT``.
        log: ``(method, target, status)`` of every request; status is ``"stall"`` for stalls.
    """

    def __init__(self, upstream: str):
        host_port = upstream.split("://", 1)[-1].rstrip("/")
        self.upstream_host, _, port = host_port.partition(":")
        self.upstream_port = int(port or 80)
        self.rules: list[FaultRule] = []
        self.log: list[tuple[str, str, object]] = []
        self._lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # rules
    def add(self, **kwargs) -> FaultRule:
        rule = FaultRule(**kwargs)
        with self._lock:
            self.rules.append(rule)
        return rule

    def reset(self) -> None:
        with self._lock:
            self.rules.clear()
            self.log.clear()

    def requests(self, method: str = "*", contains: str = "") -> list[tuple[str, str, object]]:
        with self._lock:
            return [r for r in self.log if method in ("*", r[0]) and contains in r[1]]

    def _decide(self, method: str, target: str) -> FaultRule | None:
        with self._lock:
            for rule in self.rules:
                if rule.matches(method, target):
                    rule.matched += 1
                    return rule
        return None

    def _record(self, method: str, target: str, status: object) -> None:
        with self._lock:
            self.log.append((method, target, status))

    # lifecycle
    def __enter__(self) -> "FaultProxy":
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    return self._raw_chunked()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _raw_chunked(self) -> bytes:
                # Forwarded byte for byte (aws-chunked signatures and trailers included).
                raw = bytearray()
                while True:
                    line = self.rfile.readline()
                    raw += line
                    size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                    if size == 0:
                        while True:  # trailers, then the empty line
                            trailer = self.rfile.readline()
                            raw += trailer
                            if trailer in (b"\r\n", b"\n", b""):
                                return bytes(raw)
                    raw += self.rfile.read(size + 2)

            def _handle(self) -> None:
                # Rules and the log see the decoded target; the raw one is forwarded.
                method, target = self.command, urllib.parse.unquote(self.path)
                body = self._body()
                rule = proxy._decide(method, target)
                if rule is not None and rule.stall_s is not None:
                    proxy._record(method, target, "stall")
                    time.sleep(rule.stall_s)
                    self.close_connection = True
                    return
                if rule is not None:
                    proxy._record(method, target, rule.status)
                    payload = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>"
                               f"{'ServiceUnavailable' if rule.status == 503 else 'InternalError'}"
                               f"</Code><Message>injected fault</Message><RequestId>fault</RequestId>"
                               f"</Error>").encode()
                    self.send_response(rule.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if method != "HEAD":
                        self.wfile.write(payload)
                    return
                headers = [(k, v) for k, v in self.headers.items()
                           if k.lower() not in _HOP_BY_HOP or k.lower() == "transfer-encoding"]
                conn = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=120)
                try:
                    conn.putrequest(method, self.path, skip_host=True, skip_accept_encoding=True)
                    for k, v in headers:
                        conn.putheader(k, v)
                    conn.endheaders(body if body else None)
                    resp = conn.getresponse()
                    data = resp.read()
                    status = resp.status
                    out_headers = [(k, v) for k, v in resp.getheaders()
                                   if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length"]
                    upstream_length = resp.getheader("Content-Length")
                finally:
                    conn.close()
                proxy._record(method, target, status)
                self.send_response_only(status, resp.reason)
                for k, v in out_headers:
                    self.send_header(k, v)
                if method == "HEAD":
                    if upstream_length is not None:
                        self.send_header("Content-Length", upstream_length)
                else:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if method != "HEAD" and data:
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _handle

        server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        server.daemon_threads = True
        self._server = server
        self.url = f"http://{HOST}:{server.server_address[1]}"
        self._thread = threading.Thread(target=server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(10)


# -- Beam's portable job service with an external SDK worker pool; a dask.distributed cluster ----

def _wait_port(port: int, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    """Wait until something accepts TCP connections on ``port`` (gRPC and Dask's protocol have
    no plain HTTP health check)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening on {port}:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1):
            return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listened on {HOST}:{port} within {timeout:.0f} s:\n"
                       f"{log.read_text(errors='replace')[-3000:]}")


def _venv_env() -> dict[str, str]:
    """This interpreter's bin folder first on PATH: Beam's worker pool starts SDK workers as
    ``python -c …``, which must be the Python that has batchinfer installed."""
    return {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


class BeamJobService(_Served):
    """Beam's Python job service (``local_job_service_main``) and an external SDK worker pool
    (``worker_pool_main``) on 127.0.0.1: ``runner.name: portable`` with ``environment_type
    EXTERNAL``, as a user runs against a job server whose workers they started.

    With ``namespace`` both run in a :class:`MountNamespace` of their own (the SDK workers the
    pool starts with them); ``env`` is added to their environment.

    Attributes:
        options: the ``runner.options`` that point a job at them.
        logs: the pool's and the job service's output (stdout and stderr).
    """

    def __init__(self, workdir: Path, *, namespace: "MountNamespace | None" = None,
                 env: dict[str, str] | None = None):
        self.workdir = Path(workdir)
        self.job_port, self.pool_port = free_port(), free_port()
        self.pool: subprocess.Popen | None = None
        self.namespace = namespace
        self.env = {**_venv_env(), **(env or {})}
        self.logs = [self.workdir / "worker_pool.log", self.workdir / "job_service.log"]

    def _cmd(self, cmd: list[str]) -> list[str]:
        return self.namespace.command(cmd) if self.namespace is not None else cmd

    @property
    def options(self) -> dict[str, str]:
        return {"job_endpoint": f"{HOST}:{self.job_port}", "environment_type": "EXTERNAL",
                "environment_config": f"{HOST}:{self.pool_port}"}

    def __enter__(self) -> "BeamJobService":
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            log = self.logs[0]
            self.pool = _start(self._cmd([sys.executable, "-m",
                                          "apache_beam.runners.worker.worker_pool_main",
                                          "--service_port", str(self.pool_port)]), log, self.env)
            _wait_port(self.pool_port, self.pool, 60, log)
            log = self.logs[1]
            self.proc = _start(self._cmd([sys.executable, "-m",
                                          "apache_beam.runners.portability.local_job_service_main",
                                          "--port", str(self.job_port)]), log, self.env)
            _wait_port(self.job_port, self.proc, 60, log)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__()
        finally:
            if self.pool is not None:
                _stop(self.pool)


class DaskCluster(_Served):
    """A ``dask.distributed`` scheduler and ``workers`` single-threaded worker processes (``dask
    worker --nworkers``) on 127.0.0.1.

    With ``namespace`` the scheduler and the workers run in a :class:`MountNamespace` each (the
    workers, their nanny's restarts included, in one); ``env`` is added to their environment.

    Attributes:
        address: ``tcp://127.0.0.1:PORT``, for ``runner.options.dask_client_address``.
        logs: the scheduler's and the workers' output (stdout and stderr).
    """

    def __init__(self, workdir: Path, workers: int = 2, *,
                 namespace: "MountNamespace | None" = None, env: dict[str, str] | None = None):
        self.workdir = Path(workdir)
        self.workers = workers
        self.port = free_port()
        self.address = f"tcp://{HOST}:{self.port}"
        self.nanny: subprocess.Popen | None = None
        self.namespace = namespace
        self.env = {**_venv_env(), **(env or {})}
        self.logs = [self.workdir / "scheduler.log", self.workdir / "workers.log"]

    def _cmd(self, cmd: list[str]) -> list[str]:
        return self.namespace.command(cmd) if self.namespace is not None else cmd

    def __enter__(self) -> "DaskCluster":
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            log = self.logs[0]
            self.proc = _start(self._cmd([sys.executable, "-m", "distributed.cli.dask_scheduler",
                                          "--host", HOST, "--port", str(self.port), "--no-dashboard"]),
                               log, self.env)
            _wait_port(self.port, self.proc, 60, log)
            self.nanny = _start(self._cmd([sys.executable, "-m", "distributed.cli.dask_worker",
                                           self.address, "--host", HOST, "--nworkers",
                                           str(self.workers), "--nthreads", "1", "--no-dashboard"]),
                                self.logs[1], self.env)
            self.wait_for_workers(60)
        except BaseException:
            self.__exit__()
            raise
        return self

    def wait_for_workers(self, timeout: float) -> None:
        from distributed import Client

        with Client(self.address, timeout=timeout) as client:
            client.wait_for_workers(self.workers, timeout=timeout)

    def executed(self) -> dict[str, int]:
        """Tasks each worker process has run so far, by worker address."""
        from distributed import Client

        with Client(self.address, timeout=30) as client:
            return client.run(lambda dask_worker: dask_worker.state.executed_count)

    def wait_for_no_clients(self, timeout: float) -> None:
        """Wait until the scheduler has no client but the one asking (and its own
        ``fire-and-forget`` pseudo-client): a client that died has been removed."""
        from distributed import Client

        deadline = time.monotonic() + timeout
        with Client(self.address, timeout=30) as client:
            while True:
                others = set(client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.clients)))
                others -= {client.id, "fire-and-forget"}
                if not others:
                    return
                assert time.monotonic() < deadline, f"clients still connected: {others}"
                time.sleep(0.1)

    def wait_until_idle(self, timeout: float) -> None:
        """Wait until the scheduler holds no task and no worker runs one (a cancelled task that
        was running finishes first): after that nothing of an earlier job can still happen."""
        from distributed import Client

        deadline = time.monotonic() + timeout
        with Client(self.address, timeout=30) as client:
            while True:
                tasks = client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks))
                running = client.run(lambda dask_worker: len(dask_worker.state.all_running_tasks))
                if tasks == 0 and not any(running.values()):
                    return
                assert time.monotonic() < deadline, f"{tasks} tasks, running per worker {running}"
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        try:
            if self.nanny is not None:
                _stop(self.nanny)
        finally:
            super().__exit__()


# -- servers elsewhere: a mount namespace of their own -----------------------------------------

class MountNamespace:
    """A private mount namespace (``unshare -m``) for a server's processes, in which each folder of
    ``hide`` is an empty tmpfs of its own: what a launcher wrote there (its temp folders, the job's
    folder) is not there, as on a cluster's machines. Everything else (the interpreter, the
    repository, ``/dev/shm``) is the launcher's, and so is the network (moto on 127.0.0.1).
    A process the server starts (Dask's worker processes, Beam's SDK workers) inherits it.

    As root the namespace is a mount namespace only; otherwise it is made inside a user namespace
    of the caller's (``unshare -U --map-root-user``), where the kernel allows that.

    Attributes:
        hide: the folders covered, outermost only (a folder inside another is covered with it).
        keep: folders inside a covered one that stay as they are (the repository and its virtual
            environment in a checkout under /tmp, as CI's may be): each is bind-mounted to a
            holding folder in /dev/shm before its cover is mounted, and back onto itself after.
    """

    def __init__(self, hide: Iterable[Path], keep: Iterable[Path] = ()):
        folders = sorted({Path(os.path.realpath(f)) for f in hide if Path(f).is_dir()},
                         key=lambda p: len(p.parts))
        self.hide: list[Path] = []
        for folder in folders:
            if not any(folder.is_relative_to(outer) for outer in self.hide):
                self.hide.append(folder)
        kept = sorted({Path(os.path.realpath(f)) for f in keep if Path(f).is_dir()},
                      key=lambda p: len(p.parts))
        self.keep: list[Path] = []
        for folder in kept:
            if any(folder.is_relative_to(h) for h in self.hide) and not any(
                    folder.is_relative_to(outer) for outer in self.keep):
                self.keep.append(folder)
        # Empty folders of the launcher's, removed when the session ends; in the namespace each
        # holds a kept folder while its cover is mounted.
        self._holds = [Path(tempfile.mkdtemp(prefix="batchinfer-keep-", dir="/dev/shm")) for _ in self.keep]
        atexit.register(lambda: [shutil.rmtree(h, ignore_errors=True) for h in self._holds])
        flags = self.flags()
        if isinstance(flags, str):
            raise RuntimeError(flags)
        self.unshare = flags

    @staticmethod
    @functools.cache
    def flags() -> "list[str] | str":
        """The ``unshare`` command that makes a mount namespace where tmpfs can be mounted here,
        or why there is none (no ``unshare``, the kernel refuses both ways)."""
        if shutil.which("unshare") is None:
            return "no unshare(1) on PATH (util-linux)"
        tries = ([["unshare", "-m"]] if os.geteuid() == 0 else []) + [["unshare", "-U", "--map-root-user", "-m"]]
        refused = []
        for unshare in tries:
            command = [*unshare, "--propagation", "private"]
            probe = subprocess.run([*command, "sh", "-c", "mount -t tmpfs tmpfs /tmp"],
                                   capture_output=True, text=True)
            if probe.returncode == 0:
                return command
            refused.append(f"{' '.join(unshare)}: {(probe.stderr or probe.stdout).strip()[:200]}")
        return f"no mount namespace can be made here ({'; '.join(refused)})"

    @classmethod
    def unavailable(cls) -> str | None:
        """Why no mount namespace can be made here, or None."""
        flags = cls.flags()
        return flags if isinstance(flags, str) else None

    def covers(self, path: Path | str) -> bool:
        """Whether ``path`` is hidden in the namespace."""
        real = Path(os.path.realpath(path))
        return (any(real.is_relative_to(folder) for folder in self.hide)
                and not any(real.is_relative_to(folder) for folder in self.keep))

    def command(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run in a new mount namespace, once every folder of ``hide`` is covered (and
        every folder of ``keep`` put back)."""
        import shlex

        q = lambda p: shlex.quote(str(p))   # noqa: E731
        hold = [f"mount --rbind {q(k)} {q(h)}" for k, h in zip(self.keep, self._holds)]
        cover = [f"mount -t tmpfs -o mode=1777 tmpfs {q(folder)}" for folder in self.hide]
        back = [f"mkdir -p {q(k)} && mount --rbind {q(h)} {q(k)}" for k, h in zip(self.keep, self._holds)]
        return [*self.unshare, "sh", "-c", f'{" && ".join(hold + cover + back)} && exec "$@"', "sh", *cmd]


def processes_of(root: int) -> list[int]:
    """``root`` and every process descended from it that is still running (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The command (field 2) may hold spaces and parentheses: the parent comes after its ')'.
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if Path(f"/proc/{pid}").exists():
            found.append(pid)
        todo += children.get(pid, [])
    return found


# -- context managers and pytest fixtures ------------------------------------------------------

@contextlib.contextmanager
def moto_server(workdir: Path) -> Iterator[MotoServer]:
    with MotoServer(workdir) as server:
        yield server


@contextlib.contextmanager
def mlflow_server(workdir: Path) -> Iterator[MlflowServer]:
    with MlflowServer(workdir) as server:
        yield server


@contextlib.contextmanager
def fault_proxy(upstream: str) -> Iterator[FaultProxy]:
    with FaultProxy(upstream) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def beam_job_service(tmp_path_factory) -> Iterator[BeamJobService]:
    """Beam's job service and an external worker pool, for one test module."""
    with BeamJobService(tmp_path_factory.mktemp("beam-job-service")) as service:
        yield service


@pytest.fixture(scope="module")
def dask_cluster(tmp_path_factory) -> Iterator[DaskCluster]:
    """A Dask scheduler with two worker processes, for one test module."""
    with DaskCluster(tmp_path_factory.mktemp("dask-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[MotoServer]:
    """A moto S3 server for the whole session."""
    with moto_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="session")
def mlflow_live(tmp_path_factory) -> Iterator[MlflowServer]:
    """A real ``mlflow server`` (sqlite store, served artifacts) for the whole session."""
    with mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as server:
        yield server


@pytest.fixture(scope="session")
def s3_proxy_session(s3_server) -> Iterator[FaultProxy]:
    with fault_proxy(s3_server.endpoint) as proxy:
        yield proxy


@pytest.fixture
def s3_proxy(s3_proxy_session) -> Iterator[FaultProxy]:
    """The session's fault proxy in front of moto, with no rules and an empty log."""
    s3_proxy_session.reset()
    try:
        yield s3_proxy_session
    finally:
        s3_proxy_session.reset()


@pytest.fixture
def s3_env(s3_server) -> dict[str, str]:
    return s3_server.env


@pytest.fixture
def new_bucket(s3_server) -> str:
    return s3_server.make_bucket()


# -- a stamped job folder to copy (numeric_project once per session) ---------------------------

@pytest.fixture(scope="session")
def stamped_template(tmp_path_factory) -> Path:
    """One :func:`factories.numeric_project` (3 shards × 1000 rows, a stamped MLP) and a sqlite
    MLflow store created once (a *new* store must not be raced: measured), for tests to copy."""
    from factories import numeric_project

    folder = tmp_path_factory.mktemp("template")
    numeric_project(folder)
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}").search_experiments()
    (folder / "job.yaml").unlink()
    return folder


def copy_project(template: Path, dest: Path, *, store: bool = True, **job_sections) -> Path:
    """Copy the template into ``dest`` and write its ``job.yaml`` (see factories.write_job).

    Args:
        store: keep the pre-created ``mlflow.db`` (False: the job meets a new store).
    """
    from factories import write_job

    shutil.copytree(template, dest, dirs_exist_ok=True,
                    ignore=None if store else shutil.ignore_patterns("mlflow.db"))
    return write_job(dest, **job_sections)


def start_cli(*args: str, cwd: Path, env: dict | None = None, fresh: bool = False,
              track: bool = True) -> "subprocess.Popen | forkserver.Run":
    """``batchinfer ARGS`` started in the background (for concurrent runs), tracked for real
    (``track=False``: MLflow stubbed, where concurrency is the subject and tracking is not): a
    child of the session's fork server, or with ``fresh=True`` a plain ``python -m batchinfer``
    (where signals or the entry point are the subject). Both answer ``poll``, ``communicate``,
    ``send_signal``, ``kill``, ``wait`` and ``returncode`` alike."""
    full_env = {**os.environ, **(env or {})}
    if not fresh:
        import forkserver

        return forkserver.shared().start(*args, cwd=Path(cwd), env=full_env, track=track)
    return subprocess.Popen([sys.executable, "-m", "batchinfer", *args], cwd=cwd, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_all(procs: "list[subprocess.Popen] | list[forkserver.Run]",
               timeout: float = 600) -> list[tuple[int, str, str]]:
    """Wait for every process (killing the ones still running on the way out)."""
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


class LineageReceiver:
    """An HTTP server in this process that takes OpenLineage events as Marquez does (``POST
    /api/v1/lineage``, 201) and keeps each one with its path and headers; ``events()`` waits for
    at least ``count`` of them."""

    def __init__(self) -> None:
        received: list[tuple[str, dict, dict]] = []
        self.received = received
        arrived = threading.Condition()
        self._arrived = arrived

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with arrived:
                    received.append((self.path, dict(self.headers), json.loads(body)))
                    arrived.notify_all()
                self.send_response(201)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        self.url = f"http://{HOST}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def events(self, count: int = 0, timeout: float = 30.0) -> list[dict]:
        with self._arrived:
            self._arrived.wait_for(lambda: len(self.received) >= count, timeout)
            return [event for _, _, event in self.received]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def lineage_receiver() -> Iterator[LineageReceiver]:
    receiver = LineageReceiver()
    yield receiver
    receiver.close()
