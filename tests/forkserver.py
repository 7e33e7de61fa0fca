"""A fork server for the CLI: ``batchinfer`` runs as forked children of an interpreter that has
already imported Beam, ONNX Runtime, pandera, polars and MLflow (about 3-5 s of imports per plain
``python -m batchinfer``), so each run in the test suite costs only its own work. Once a run has
imported torch, the server imports it too, before the next fork, with what loading a program and
explaining it import (about 2.5 s of CPU a torch run): sessions that run no torch job never pay
for it. torch is imported there as batchinfer imports it (``OMP_WAIT_POLICY=PASSIVE`` for the
import unless set), so a run whose own environment set ``OMP_WAIT_POLICY`` would not see it
applied: no test's does.

A child is a real process: its own cwd, environment, stdin/stdout/stderr, exit code, and
``BATCHINFER_FAULT`` kills it with SIGKILL like any ``python -m`` process. It runs
``batchinfer.cli.main(argv)``, which is what ``python -m batchinfer`` runs. Started once per test
session (:func:`shared`), on first use. Tests of the entry point itself, of start-up imports or
of signals use a plain ``python -m batchinfer`` (``factories.run_cli(..., fresh=True)``).
"""
from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_SERVER = r'''
import gc, importlib, json, os, sys, time
import batchinfer.cli, batchinfer.commands.run, batchinfer.pipeline.transforms, batchinfer.faults
import batchinfer.io.tracking, batchinfer.handlers.onnx, batchinfer.io.manifest
import apache_beam
from apache_beam.runners.direct.direct_runner import DirectRunner
from apache_beam.runners.portability.fn_api_runner import fn_runner
import onnx, onnxruntime, pandera.polars, polars
try:  # absent where bench/gpu_check.sh runs the conformance suite (MLflow is not carried there)
    import mlflow.tracking
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
except ImportError:
    pass
import threading
assert threading.active_count() == 1, "the fork server must not run threads"
out = os.fdopen(os.dup(1), "w")
TORCH_USED = os.path.join(sys.argv[1], "torch-used")   # a child touches it: it imported torch
PROFILE = os.environ.get("BATCHINFER_SUITE_PROFILE")   # bench/suite_profile.py: log each fork
asked_by = None   # in a child: the test that asked for it


def _profiled(what):
    """Tell bench/suite_profile.py which test this forked process is for (a fork runs no
    sitecustomize)."""
    if PROFILE:
        with open(os.path.join(PROFILE, "forks.log"), "a") as log:
            log.write(json.dumps({"pid": os.getpid(), "what": what, "test": asked_by}) + "\n")


def _import_torch():
    """What a torch run imports: torch (as batchinfer does, see _passive_openmp), what
    torch.export.load and captum import. Imported only: no operator runs here (an OpenMP pool
    would not survive the fork)."""
    try:
        import batchinfer.handlers.pytorch
        with batchinfer.handlers.pytorch._passive_openmp():
            import torch
        import torch.export, torch.export._trace, torch._dynamo, torch._export.serde.serialize
        import captum.attr
    except ImportError:
        pass
    assert threading.active_count() == 1, "the fork server must not run threads"
    # A CUDA context does not survive a fork either: none of these imports makes one (checked
    # on CPU: none calls torch.cuda.is_available or device_count); this says so if one does.
    assert "torch" not in sys.modules or not sys.modules["torch"].cuda.is_initialized()


class _ForkedHelper:
    """batchinfer.io.tracking's helper, forked from a run (see _forked_helper)."""
    def __init__(self, pid, stdin, stdout):
        self.pid, self.stdin, self.stdout = pid, stdin, stdout

    def kill(self):
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass


def _forked_helper(env):
    """tracking.start_helper for a run forked from this server: MLflow is imported here
    already, so the helper is a fork of the run (the same _serve and pipe protocol), not a new
    interpreter that imports MLflow again (about 2.5 s of CPU per tracked run)."""
    child_in, parent_out = os.pipe()
    parent_in, child_out = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(child_in, 0)
            os.dup2(child_out, 1)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            os.closerange(3, 65536)  # the run's other files: its stdin must end when it closes it
            sys.stdin = open(0, "r", closefd=False)
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # replies only (see _serve)
            sys.stderr = open(2, "w", closefd=False)
            os.environ.clear()
            os.environ.update(env)
            _profiled("tracking helper")
            batchinfer.io.tracking._serve()
        finally:
            os._exit(0)
    os.close(child_in)
    os.close(child_out)
    return _ForkedHelper(pid, os.fdopen(parent_out, "w", buffering=1), os.fdopen(parent_in, "r"))

print("ready", file=out, flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "start":
        if "torch" not in sys.modules and os.path.exists(TORCH_USED):
            _import_torch()
        # What the server has imported is never garbage: frozen, the child's collections skip
        # it (a full collection of ~400,000 objects, 700,000 with torch, costs 0.25-0.45 s of
        # CPU and copies the pages it touches; a run makes several).
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            try:
                os.chdir(req["cwd"])
                os.environ.clear()
                os.environ.update(req["env"])
                asked_by = req["test"]
                _profiled(req["argv"][0] if req["argv"] else "")
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
                os.dup2(os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
                importlib.reload(batchinfer.faults)   # reads BATCHINFER_FAULT, as at import
                batchinfer.io.tracking.start_helper = _forked_helper
                if req["stub_tracking"]:
                    class _NoTracking:
                        error, run_id = "tracking stubbed by the test", None
                        def __init__(self, *a, **k): pass
                        def wait(self, *a, **k): return None
                        def finish(self, *a, **k): return False
                        def __getattr__(self, name): return lambda *a, **k: None
                    batchinfer.io.tracking.TrackingRun = _NoTracking
                rc = batchinfer.cli.main(req["argv"])
            except SystemExit as exc:  # argparse: --help, --version, usage errors
                rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException as exc:
                rc = 99
                print(f"fork server child: {exc!r}", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            if "torch" in sys.modules:
                open(TORCH_USED, "a").close()
            os._exit(rc)
        print(json.dumps({"pid": pid}), file=out, flush=True)
    elif req["op"] == "wait":
        deadline = time.monotonic() + req["timeout"]
        while True:
            done, status = os.waitpid(req["pid"], os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(req["pid"], 9)
                os.waitpid(req["pid"], 0)
                rc = "timeout"
                break
            time.sleep(0.02)
        print(json.dumps({"rc": rc}), file=out, flush=True)
    elif req["op"] == "poll":
        done, status = os.waitpid(req["pid"], os.WNOHANG)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status) if done else None}), file=out,
              flush=True)
'''


class Run:
    def __init__(self, server: "ForkServer", pid: int, stdout: Path, stderr: Path):
        self.server, self.pid, self._out, self._err = server, pid, stdout, stderr
        self.returncode = None

    def wait(self, timeout: float = 240) -> "Run":
        if self.returncode is None:
            self.returncode = self.server._call({"op": "wait", "pid": self.pid, "timeout": timeout})["rc"]
            assert self.returncode != "timeout", f"run {self.pid} timed out: {self.stderr}"
        return self

    # What tests use of subprocess.Popen, for a child of the fork server (its parent: the
    # server reaps it, so only the server can tell whether it ended).
    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server._call({"op": "poll", "pid": self.pid})["rc"]
        return self.returncode

    def communicate(self, timeout: float = 240) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout, self.stderr

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(9)

    @property
    def stdout(self) -> str:
        return self._out.read_text()

    @property
    def stderr(self) -> str:
        return self._err.read_text()


class ForkServer:
    """Starts ``batchinfer`` runs as forked processes of a pre-imported interpreter."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.count = 0
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(logs)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env={k: v for k, v in os.environ.items() if k != "BATCHINFER_FAULT"})
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", f"fork server failed to start: {line!r}"

    def _call(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def start(self, *argv: str, cwd: Path, fault: str | None = None, track: bool = True,
              env: dict[str, str] | None = None, terminal: str | None = None) -> Run:
        """Start ``batchinfer ARGV`` in ``cwd`` with ``env`` (default: this process's, without
        ``BATCHINFER_FAULT``); ``fault`` sets ``BATCHINFER_FAULT``; ``track=False`` replaces
        MLflow tracking by a stub (its helper process imports MLflow, about 2 s of CPU a run);
        ``terminal``, the path of a pseudo-terminal's follower, is the run's stdout instead of
        a file (the run's ``stdout`` is then what the caller reads from the leader)."""
        self.count += 1
        out, err = self.logs / f"{self.count}.out", self.logs / f"{self.count}.err"
        if terminal is not None:
            out.write_text("")   # what Run.stdout reads: the run writes to the terminal
        if env is None:
            env = {k: v for k, v in os.environ.items() if k != "BATCHINFER_FAULT"}
        env = dict(env)
        if fault:
            env["BATCHINFER_FAULT"] = fault
        pid = self._call({"op": "start", "argv": list(argv), "cwd": str(cwd), "env": env,
                          "stdout": terminal or str(out), "stderr": str(err),
                          "stub_tracking": not track,
                          "test": os.environ.get("PYTEST_CURRENT_TEST")})["pid"]
        return Run(self, pid, out, err)

    def run(self, *argv: str, cwd: Path, fault: str | None = None, track: bool = True,
            env: dict[str, str] | None = None, timeout: float = 240) -> Run:
        return self.start(*argv, cwd=cwd, fault=fault, track=track, env=env).wait(timeout)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


_shared: list[ForkServer] = []


def shared() -> ForkServer:
    """The session's fork server, started on first use and stopped when the session ends."""
    if not _shared or _shared[0].proc.poll() is not None:
        _shared[:] = [ForkServer(Path(tempfile.mkdtemp(prefix="batchinfer-forkserver-")))]
        atexit.register(_shared[0].close)
    return _shared[0]
