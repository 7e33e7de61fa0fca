"""What each test of this session came to, by node id: a plugin (conftest.py), so that a test can
check cases the session already ran instead of running them again in a nested pytest
(tests/conformance/test_gpu_check.py)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

# node id → "passed", "failed" or "skipped": the worst of its setup, call and teardown
OUTCOMES: dict[str, str] = {}
_RANK = {"passed": 0, "skipped": 1, "failed": 2}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        known = OUTCOMES.get(report.nodeid, "passed")
        OUTCOMES[report.nodeid] = max(known, report.outcome, key=_RANK.__getitem__)


def gpu_check_cpu_selection() -> tuple[str, str]:
    """(-m, -k) of the conformance cases that bench/gpu_check.sh runs with ``--device cpu``."""
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"
    found = re.search(r'selection=\(-m "([^"]+)" -k "([^"]+)"\)', script.read_text())
    assert found, "bench/gpu_check.sh: no CPU selection of the conformance cases"
    return found[1], found[2]
