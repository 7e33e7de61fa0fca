"""bench/gpu_check.sh runs here too (``--device cpu --quick``): the script that a GPU machine
runs must not first be tried there.

The script's first step, the conformance cases it selects, is not run again in a nested pytest
(``--no-conformance``): this session runs those cases itself, in test_backends.py, whose last
test checks that the script's selection picks them and that they passed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from outcomes import gpu_check_cpu_selection

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def test_gpu_check_runs_on_cpu(tmp_path):
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--quick", "--no-conformance"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    marks, keywords = gpu_check_cpu_selection()
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

