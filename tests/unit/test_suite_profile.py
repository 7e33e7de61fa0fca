"""bench/suite_profile.py's reading of accounting records and its attribution of processes to
tests, on records written here in the kernel's acct_v3 layout (turning accounting on needs root
and changes the whole machine: the script itself does that, not the suite)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from factories import REPO

spec = importlib.util.spec_from_file_location("suite_profile", REPO / "bench" / "suite_profile.py")
suite_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite_profile)


def comp_t(ticks: int) -> int:
    """``ticks`` as the kernel encodes it: 13-bit mantissa, base-8 exponent (rounded down)."""
    exponent = 0
    while ticks > 0x1FFF:
        ticks >>= 3
        exponent += 1
    return (exponent << 13) | ticks


def record(pid: int, ppid: int, comm: str, cpu_ticks: tuple[int, int], fork: bool = False) -> bytes:
    user, system = (comp_t(t) for t in cpu_ticks)
    return suite_profile.RECORD.pack(bytes([suite_profile.AFORK if fork else 0]), 3, 0, 0, 0, 0, pid, ppid,
                                     0, 0.0, user, system, 0, 0, 0, 0, 0, 0, comm.encode())


def write_logs(folder: Path) -> None:
    worker = ["/venv/bin/python", "-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"]
    starts = [{"pid": 10, "argv": worker, "test": None},
              {"pid": 20, "argv": ["/venv/bin/python", "-m", "batchinfer.io.tracking"],
               "test": "tests/e2e/test_a.py::test_one (call)"}]
    forks = [{"pid": 11, "what": "run", "test": "tests/e2e/test_a.py::test_one (call)"},
             {"pid": 13, "what": "tracking helper", "test": "tests/e2e/test_a.py::test_one (call)"}]
    (folder / "starts.log").write_text("".join(json.dumps(s) + "\n" for s in starts))
    (folder / "forks.log").write_text("".join(json.dumps(f) + "\n" for f in forks))
    (folder / "tests.10.log").write_text(json.dumps({"id": "tests/e2e/test_a.py::test_one",
                                                     "wall": 2.0, "cpu": 0.25}) + "\n")


def test_records_decode_cpu_times_even_past_the_mantissa(tmp_path):
    (tmp_path / "pacct").write_bytes(record(10, 1, "python", (150, 50))
                                     + record(11, 10, "python", (20_000, 0), fork=True))
    found = suite_profile.records(tmp_path / "pacct")
    assert found[10] == {"ppid": 1, "comm": "python", "fork": False, "cpu": 2.0}
    assert found[11]["fork"] and found[11]["cpu"] == 200.0   # 20,000 ticks: exponent 1, exact


def test_each_process_gets_its_kind_and_the_test_of_its_nearest_ancestor(tmp_path):
    write_logs(tmp_path)
    (tmp_path / "pacct").write_bytes(
        record(10, 1, "python", (100, 0))                      # the pytest worker
        + record(11, 10, "python", (60, 0), fork=True)         # a fork server child's run
        + record(12, 11, "uname", (1, 0))                      # what that run executed
        + record(13, 11, "python", (30, 0), fork=True)         # its forked MLflow helper
        + record(20, 10, "python", (250, 0))                   # a helper started as an interpreter
        + record(30, 1, "moto", (40, 0)))                      # nothing known of it
    procs = suite_profile.records(tmp_path / "pacct")
    who = suite_profile.attribute(procs, suite_profile._logged(tmp_path / "starts.log"),
                                  suite_profile._logged(tmp_path / "forks.log"))
    test = "tests/e2e/test_a.py::test_one"
    assert who[10] == ("pytest worker", None)
    assert who[11] == ("fork server child: run", test)
    assert who[12] == ("uname", test)
    assert who[13] == ("fork server child: tracking helper", test)
    assert who[20] == ("python -m batchinfer.io.tracking", test)
    assert who[30] == ("moto", None)
    text = suite_profile.report(tmp_path, wall=3.0)
    assert "CPU of the processes that ended while accounting was on: 5 s (6 processes" in text
    assert "   2.5      1  python -m batchinfer.io.tracking" in text
    # the module: its test's wall, the worker's CPU, its processes' CPU (0.6+0.01+0.3+2.5), 1 run
    assert "    2.0     0.2     3.4     1  tests/e2e/test_a.py" in text


def test_interpreters_are_named_by_what_they_run():
    kind = suite_profile._kind
    assert kind(["/v/bin/python", "-m", "pytest", "-n", "2"]) == "pytest (controller)"
    assert kind(["/v/bin/python", "/tmp/pytest-of-root/x.py"]) == "python x.py"
    assert kind(["/v/bin/python", "-c", "print(1)"]) == "python -c print(1)"
    assert kind(["/v/bin/python", "-m", "mlflow", "server", "--port", "1"]) == "python -m mlflow server"
