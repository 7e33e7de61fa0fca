"""Where the test suite's CPU goes (issue 19): every process it starts, by kind and by test.

    sudo .venv/bin/python bench/suite_profile.py OUT [pytest arguments]   # e.g. OUT -n 2 -q

The suite is CPU-bound on two cores, and most of its CPU is spent in processes that pytest's
``--durations`` cannot see: the fork server's runs, MLflow helpers, Beam SDK workers, Dask and
Airflow processes, servers. This script runs pytest with

- the kernel's process accounting on (``acct(2)``, root only): one record per process that ends,
  with its pid, parent, command name and CPU time, threads included;
- a ``sitecustomize`` on ``PYTHONPATH`` that logs each interpreter's argv and the test that was
  running when it started (``PYTEST_CURRENT_TEST``, which child processes inherit);
- ``BATCHINFER_SUITE_PROFILE``, which makes tests/forkserver.py log each child it forks (a
  fork runs no ``sitecustomize``) with the test that asked for it;
- a pytest plugin that logs each test's wall time and the CPU of its own worker process.

It writes ``OUT/report.txt``: CPU by kind of process, then by test module and by test (wall,
the worker's own CPU, the CPU of the processes started during it). A process inherits the test
of its nearest ancestor that has one; processes started by session fixtures (servers, the fork
server) count for the test that first needed them. Interpreters that a test starts with its own
``PYTHONPATH`` (README's Airflow commands) are known by their command name only.
"""
from __future__ import annotations

import collections
import ctypes
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime,
# etime (float), utime, stime, mem, io, rw, minflt, majflt, swaps (comp_t each), comm[16].
RECORD = struct.Struct("=cBHIIIIIIf8H16s")
TICKS = 100   # AHZ: acct_v3 times are in hundredths of a second
AFORK = 0x01  # forked, did not exec

SITECUSTOMIZE = '''import json, os, sys
try:
    with open(os.path.join({out!r}, "starts.log"), "a") as _log:
        _log.write(json.dumps({{"pid": os.getpid(), "argv": list(sys.orig_argv)[:12],
                               "test": os.environ.get("PYTEST_CURRENT_TEST")}}) + "\\n")
except OSError:
    pass
'''
PLUGIN = '''import json, os, resource, time
import pytest
_log = open(os.path.join({out!r}, f"tests.{{os.getpid()}}.log"), "a")

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    yield
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    _log.write(json.dumps({{"id": item.nodeid, "wall": time.perf_counter() - t0, "cpu": cpu}}) + "\\n")
    _log.flush()
'''


def _comp(value: int) -> int:
    """comp_t: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


def records(path: Path) -> dict[int, dict]:
    """pid → {ppid, comm, fork, cpu (s)} of every accounted process."""
    data, found = path.read_bytes(), {}
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        f = RECORD.unpack_from(data, offset)
        found[f[6]] = {"ppid": f[7], "comm": f[18].split(b"\0")[0].decode(errors="replace"),
                       "fork": bool(f[0][0] & AFORK), "cpu": (_comp(f[10]) + _comp(f[11])) / TICKS}
    return found


def _logged(path: Path) -> dict[int, dict]:
    if not path.exists():
        return {}
    return {d["pid"]: d for d in map(json.loads, path.read_text().splitlines())}


def _kind(argv: list[str]) -> str:
    """A short name for an interpreter's command line."""
    line = " ".join(argv)
    if "exec(eval(sys.stdin" in line:
        return "pytest worker"
    if argv[1:3] == ["-m", "pytest"]:
        return "pytest (controller)"
    if "-c" in argv:
        code = argv[argv.index("-c") + 1]
        return "fork server" if "fork server" in code else "python -c " + " ".join(code.split())[:50]
    args = [a for a in argv[1:] if not a.startswith("-") or a == "-m"]
    return "python " + " ".join(Path(a).name if "/" in a else a for a in args[:3])


def attribute(procs: dict[int, dict], starts: dict[int, dict], forks: dict[int, dict]):
    """(kind, test) of each accounted process."""
    def kind(pid: int, depth: int = 0) -> str:
        if pid in forks:
            return f"fork server child: {forks[pid]['what']}"
        if pid in starts:
            return _kind(starts[pid]["argv"])
        proc = procs.get(pid)
        if proc is None:
            return "?"
        name = proc["comm"] + (" (fork)" if proc["fork"] else "")
        parent = procs.get(proc["ppid"]) or starts.get(proc["ppid"])
        if proc["fork"] and parent and depth < 3:
            return f"{name} of {kind(proc['ppid'], depth + 1)}"
        return name

    def test(pid: int) -> str | None:
        for _ in range(30):
            for log in (forks, starts):
                if log.get(pid, {}).get("test"):
                    return log[pid]["test"].rsplit(" (", 1)[0]
            if pid not in procs:
                return None
            pid = procs[pid]["ppid"]
        return None

    return {pid: (kind(pid), test(pid)) for pid in procs}


def report(out: Path, wall: float) -> str:
    procs = records(out / "pacct")
    starts, forks = _logged(out / "starts.log"), _logged(out / "forks.log")
    who = attribute(procs, starts, forks)
    tests = {}
    for log in out.glob("tests.*.log"):
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            tests[entry["id"]] = entry
    by_kind: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    by_test: collections.Counter = collections.Counter()
    for pid, proc in procs.items():
        kind, test = who[pid]
        by_kind[kind] += proc["cpu"]
        count[kind] += 1
        if test:
            by_test[test] += proc["cpu"]
    runs = collections.Counter(f["test"].rsplit(" (", 1)[0] for f in forks.values()
                               if f["what"] != "tracking helper" and f.get("test"))
    total = sum(p["cpu"] for p in procs.values())
    lines = [f"wall {wall:.0f} s; CPU of the processes that ended while accounting was on: "
             f"{total:.0f} s ({len(procs)} processes; the pytest workers' own CPU included)", "",
             "CPU s  processes  kind"]
    lines += [f"{cpu:6.1f} {count[k]:6d}  {k}" for k, cpu in by_kind.most_common() if cpu >= 0.5]
    modules: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for nodeid, entry in tests.items():
        m = modules[nodeid.split("::")[0]]
        m[0] += entry["wall"]
        m[1] += entry["cpu"]
        m[2] += by_test.get(nodeid, 0.0)
        m[3] += runs.get(nodeid, 0)
    lines += ["", "by module: wall s, its worker's CPU s, its processes' CPU s, fork server runs"]
    lines += [f"{w:7.1f} {c:7.1f} {s:7.1f} {int(r):5d}  {m}"
              for m, (w, c, s, r) in sorted(modules.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))]
    lines += ["", "by test (the 60 most costly): wall s, worker CPU s, processes' CPU s, fork server runs"]
    ranked = sorted(tests.values(), key=lambda e: -(e["cpu"] + by_test.get(e["id"], 0.0)))
    lines += [f"{e['wall']:6.1f} {e['cpu']:6.1f} {by_test.get(e['id'], 0.0):6.1f} "
              f"{runs.get(e['id'], 0):4d}  {e['id']}" for e in ranked[:60]]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out, pytest_args = Path(argv[0]).resolve(), argv[1:]
    out.mkdir(parents=True, exist_ok=True)
    for stale in (*out.glob("*.log"), out / "pacct"):
        stale.unlink(missing_ok=True)
    (out / "sitecustomize.py").write_text(SITECUSTOMIZE.format(out=str(out)))
    (out / "suite_profile_plugin.py").write_text(PLUGIN.format(out=str(out)))
    (out / "pacct").touch()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(str(out / "pacct").encode()) != 0:
        print(f"suite_profile: acct(2) failed: {os.strerror(ctypes.get_errno())} "
              "(root and a kernel with BSD process accounting are needed)", file=sys.stderr)
        return 1
    env = {**os.environ, "BATCHINFER_SUITE_PROFILE": str(out),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(out), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    try:
        rc = subprocess.call([sys.executable, "-m", "pytest", "-p", "suite_profile_plugin", *pytest_args],
                             cwd=REPO, env=env)
        wall = time.perf_counter() - t0
        time.sleep(3)   # helpers and servers that outlive their test exit on their own
    finally:
        libc.acct(None)
    text = report(out, wall)
    (out / "report.txt").write_text(text)
    print(text[:4000])
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
