"""bench/gpu_check.sh runs here too (``--device cpu --quick``): the script that a GPU machine
runs must not first be tried there.

The script's first step, the conformance cases it selects, is not run again in a nested pytest
(``--no-conformance``): this session runs those cases itself, in test_backends.py, and the test
below checks that the script's selection picks them and that they passed."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.mark import KeywordMatcher, MarkMatcher
from _pytest.mark.expression import Expression
from outcomes import OUTCOMES

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def cpu_selection() -> tuple[str, str]:
    """(-m, -k) of the conformance cases the script runs with ``--device cpu``."""
    found = re.search(r'selection=\(-m "([^"]+)" -k "([^"]+)"\)', SCRIPT.read_text())
    assert found, "bench/gpu_check.sh: no CPU selection of the conformance cases"
    return found[1], found[2]


def test_gpu_check_runs_on_cpu(tmp_path):
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--quick", "--no-conformance"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    marks, keywords = cpu_selection()
    assert f"== conformance suite (-m {marks} -k {keywords}): not run (--no-conformance)" in done.stdout
    table = [line for line in done.stdout.splitlines() if line.startswith(("bench 32-", "large 32-"))]
    assert len(table) == 4, done.stdout
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert {(r["model"].split()[0], r["precision"]) for r in results} == {
        ("bench", "fp32"), ("bench", "bf16"), ("large", "fp32"), ("large", "bf16")}
    for r in results:
        assert r["end_to_end"]["device"] == "cpu"
        assert 0 < r["ratio"] and r["end_to_end"]["rows_per_s"] > 0
        assert r["max_abs_diff_fp32_vs_cpu"] == 0.0          # the CPU against itself: bit-identical
        assert r["kl_bf16_vs_fp32"] > 0                       # bf16 does move the outputs


def test_the_conformance_cases_gpu_check_selects_passed_in_this_session(request):
    """What the script's own pytest run asserted (its cases passed, none failed), from this
    session's run of test_backends.py, selected as pytest selects them (-m, -k)."""
    pytest.importorskip("torch")
    backends = Path(__file__).with_name("test_backends.py")
    items = [item for item in request.session.items if item.path == backends]
    if not items:
        pytest.skip("tests/conformance/test_backends.py is not part of this session")
    marks, keywords = map(Expression.compile, cpu_selection())
    chosen = [item.nodeid for item in items
              if marks.evaluate(MarkMatcher.from_markers(item.iter_markers()))
              and keywords.evaluate(KeywordMatcher.from_item(item))]
    assert len(chosen) >= 20, chosen  # each torch-cpu precision, model and size
    assert {node: OUTCOMES.get(node) for node in chosen} == dict.fromkeys(chosen, "passed")
