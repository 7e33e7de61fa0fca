"""End-to-end: baselines (`profile`), drift against them (warn / fail), inference health
metrics, the job report (`report`, and in a real headless Chromium) and live progress.

One module-scoped project: a partition scored and profiled as the baseline, then partitions of
the same job whose feature f0 is shifted a little (warn) or a lot (fail).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factories import DS, make_shards, numeric_project, one_line_error, read_partition, run_cli

pytestmark = pytest.mark.slow

WARN_DS, FAIL_DS, SAME_DS = "2026-01-20", "2026-01-21", "2026-01-22"
MONITOR = {"baseline": "baseline.json", "warn": {"psi": 0.05}, "fail": {"psi": 0.5, "ks": 0.4}}


def shifted(folder: Path, shift: float, seed: int = 0) -> None:
    """The baseline's rows (same seed) with f0 moved by ``shift`` standard deviations."""
    for path in make_shards(folder, shards=2, rows=2000, seed=seed):
        table = pq.read_table(path)
        f0 = table.column("f0").to_numpy() + np.float32(shift)
        pq.write_table(table.set_column(1, "f0", pa.array(f0.astype(np.float32))), path)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("monitoring")
    numeric_project(folder, shards=2, rows=2000, batch={"rows": 500})
    first = run_cli("run", "job.yaml", "--ds", DS, cwd=folder)
    assert first.returncode == 0, first.stderr
    profiled = run_cli("profile", "job.yaml", "--ds", DS, "--out", "baseline.json", cwd=folder)
    assert profiled.returncode == 0, profiled.stderr
    for ds, shift in ((WARN_DS, 0.3), (FAIL_DS, 1.5), (SAME_DS, 0.0)):
        shifted(folder / "data" / f"dt={ds}", shift)
    text = (folder / "job.yaml").read_text()
    (folder / "monitored.yaml").write_text(text + "monitor: " + json.dumps(MONITOR) + "\n")
    return folder


@pytest.fixture(scope="module")
def warned(project):
    return run_cli("run", "monitored.yaml", "--ds", WARN_DS, cwd=project)


@pytest.fixture(scope="module")
def failed(project):
    return run_cli("run", "monitored.yaml", "--ds", FAIL_DS, cwd=project)


def test_profile_describes_the_scored_rows(project):
    profile = json.loads((project / "baseline.json").read_text())
    predictions, _, manifest = read_partition(project / "out" / f"dt={DS}")
    assert profile["rows"] == predictions.num_rows == manifest["totals"]["rows_scored"]
    assert set(profile["columns"]) == {"f0", "f1", "f2", "f3", "y"}
    out = profile["columns"]["y"]
    values = predictions.column("y").to_numpy().astype(np.float64)
    assert out["kind"] == "prediction" and out["count"] == values.size and out["nulls"] == 0
    assert out["mean"] == pytest.approx(values.mean(), rel=1e-9)
    assert out["std"] == pytest.approx(values.std(ddof=1), rel=1e-9)
    assert out["quantiles"]["0.5"] == pytest.approx(np.quantile(values, 0.5), rel=1e-9)
    assert sum(out["counts"]) == values.size and len(out["counts"]) == len(out["cuts"]) + 1
    assert max(out["counts"]) <= 1.5 * min(out["counts"])  # equal-frequency bins (ties aside)
    assert profile["columns"]["f0"]["kind"] == "feature"


def test_profile_of_an_uncommitted_partition_exits_2(project):
    result = run_cli("profile", "job.yaml", "--ds", WARN_DS, "--out", "x.json", cwd=project)
    assert result.returncode == 2
    assert "is not committed" in one_line_error(result, "profile")
    assert not (project / "x.json").exists()


def test_same_data_shows_no_drift(project):
    result = run_cli("run", "monitored.yaml", "--ds", SAME_DS, cwd=project)
    assert result.returncode == 0, result.stderr
    assert "drift" not in result.stderr
    record = json.loads((project / "out" / f"dt={SAME_DS}" / "_profile.json").read_text())
    assert record["level"] == "ok"
    assert {d["column"]: d["psi"] for d in record["drift"]} == {c: 0.0 for c in ("f0", "f1", "f2", "f3", "y")}


def test_drift_above_warn_commits_with_a_warning(project, warned):
    assert warned.returncode == 0, warned.stderr
    lines = [line for line in warned.stderr.splitlines() if "drift" in line]
    assert len(lines) == 1 and lines[0].startswith("WARNING batchinfer: drift: 1 column(s) drifted "
                                                   "above the warn limits: f0 (psi "), warned.stderr
    out = project / "out" / f"dt={WARN_DS}"
    assert (out / "_manifest.json").exists()
    record = json.loads((out / "_metrics.json").read_text())
    assert record["tags"]["batchinfer.drift"] == "warn"
    psi = record["metrics"]["drift_psi.f0"]
    assert 0.05 < psi < 0.5 and record["metrics"]["drift_psi.f1"] == 0.0
    assert record["metrics"]["drift_columns_warn"] == 1.0 and record["metrics"]["drift_columns_fail"] == 0.0
    profile = json.loads((out / "_profile.json").read_text())
    assert [d["column"] for d in profile["drift"]][0] == "f0"  # worst first
    assert profile["drift"][0]["level"] == "warn"


def test_drift_above_fail_exits_4_and_keeps_the_drift_report(project, failed):
    assert failed.returncode == 4, failed.stderr
    line = one_line_error(failed)
    match = re.search(r"drift report kept in (\S+)$", line)
    assert match and "f0 (psi" in line and "nothing committed" in line, line
    out = project / "out" / f"dt={FAIL_DS}"
    assert not (out / "_manifest.json").exists()
    assert not list(out.rglob("*.parquet"))
    kept = Path(match[1])
    assert kept.parent == out / "_drift" and kept.exists()
    report = json.loads(kept.read_text())
    assert report["level"] == "fail" and report["drift"][0]["column"] == "f0"
    assert report["drift"][0]["psi"] > 0.5
    assert kept.with_suffix(".html").read_text().startswith("<!DOCTYPE html>")
    # A rerun of the same date is refused the same way (the drift report of each attempt kept).
    again = run_cli("run", "monitored.yaml", "--ds", FAIL_DS, cwd=project)
    assert again.returncode == 4 and len(list((out / "_drift").glob("*.json"))) == 2


def test_health_metrics(project, warned):
    metrics = json.loads((project / "out" / f"dt={WARN_DS}" / "_metrics.json").read_text())["metrics"]
    # 2 shards of 2000 rows in batches of 500: 8 model batches of 500 rows.
    assert metrics["model_batches"] == 8.0
    assert metrics["batch_rows_min"] == metrics["batch_rows_p50"] == metrics["batch_rows_max"] == 500.0
    assert 0 < metrics["model_latency_ms_p50"] <= metrics["model_latency_ms_p95"] \
        <= metrics["model_latency_ms_p99"] <= metrics["model_latency_ms_max"]
    assert metrics["model_load_seconds"] > 0 and metrics["model_warmup_ms"] > 0
    assert metrics["model_rows_per_second"] > 0 and metrics["rows_per_second"] > 0
    assert metrics["stage_seconds_profile"] > 0


def test_quarantine_counts_by_check(tmp_path):
    numeric_project(tmp_path, shards=1, rows=300, quarantine={"max_bad_fraction": 0.5})
    path = tmp_path / "data" / f"dt={DS}" / "part-00000.parquet"
    table = pq.read_table(path)
    f1 = table.column("f1").to_numpy().copy()
    f1[[3, 10, 11]] = 50.0   # out of the schema's range [-10, 10]
    pq.write_table(table.set_column(2, "f1", pa.array(f1)), path)
    result = run_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out" / f"dt={DS}"
    metrics = json.loads((out / "_metrics.json").read_text())["metrics"]
    checks = {k: v for k, v in metrics.items() if k.startswith("quarantine_rows.")}
    assert checks == {"quarantine_rows.in_range_-10_10": 3.0,
                      "quarantine_rows.f1.in_range_-10_10": 3.0}, checks
    profile = json.loads((out / "_profile.json").read_text())
    assert profile["quarantine"] == [["f1", "in_range(-10, 10)", 3]]
    assert "f1: in_range(-10, 10)" in (out / "report.html").read_text()


def test_report_command_rebuilds_the_same_report(project, warned):
    out = project / "out" / f"dt={WARN_DS}"
    written = (out / "report.html").read_bytes()
    (out / "report.html").unlink()
    result = run_cli("report", str(out), cwd=project)
    assert result.returncode == 0, result.stderr
    assert (out / "report.html").read_bytes() == written
    html = written.decode()
    for part in ("Version triple", "Accounting per shard", "Drift against the baseline", "f0",
                 "Quarantine reasons", "Time per stage", "Inference health", "<svg"):
        assert part in html, part
    # Self-contained: nothing to fetch (the only URL is SVG's namespace name), no script.
    assert not re.search(r"\b(src|href)\s*=", html) and "<script" not in html
    assert set(re.findall(r"https?://[^\"' )]+", html)) == {"http://www.w3.org/2000/svg"}


def test_report_of_an_uncommitted_output_exits_2(project):
    result = run_cli("report", str(project / "nowhere"), cwd=project)
    assert result.returncode == 2 and "not a committed output" in one_line_error(result, "report")


@pytest.mark.parametrize("monitor, message", [
    ({"baseline": "missing.json"}, "monitor.baseline"),
    ({"baseline": "baseline.json", "warn": {"psi": 0.1, "kl": 1}}, "unknown key 'monitor.warn.kl'"),
    ({"baseline": "baseline.json", "fail": {"ks": 2.0}}, "monitor.fail.ks"),
    ({"warn": {"psi": 0.1}}, "monitor has no baseline: set monitor.baseline, or stamp the model"),
])
def test_monitor_spec_errors_exit_2(project, monitor, message):
    text = (project / "job.yaml").read_text()
    (project / "bad.yaml").write_text(text + "monitor: " + json.dumps(monitor) + "\n")
    result = run_cli("run", "bad.yaml", "--ds", WARN_DS, cwd=project)
    assert result.returncode == 2
    assert message in one_line_error(result)


def test_baseline_declared_by_the_model(project):
    """``stamp --baseline``: a job whose ``monitor`` names no baseline uses the model's; the
    same drift that fails against monitor.baseline fails against the declared one."""
    shutil.copy(project / "models" / "model.onnx", project / "models" / "declared.onnx")
    bad = run_cli("stamp", "models/declared.onnx", "--job", "job.yaml", "--model-version", "model:1",
                  "--baseline", "nowhere.json", cwd=project)
    assert bad.returncode == 2 and "--baseline nowhere.json cannot be read" in one_line_error(bad, "stamp")
    stamped = run_cli("stamp", "models/declared.onnx", "--job", "job.yaml", "--model-version", "model:1",
                      "--baseline", "baseline.json", cwd=project)
    assert stamped.returncode == 0, stamped.stderr
    sidecar = json.loads((project / "models" / "declared.onnx.batchinfer.json").read_text())
    assert sidecar["baseline"] == str(project / "baseline.json")
    text = (project / "job.yaml").read_text().replace("models/model.onnx", "models/declared.onnx")
    limits = {k: v for k, v in MONITOR.items() if k != "baseline"}
    (project / "declared.yaml").write_text(text + "monitor: " + json.dumps(limits) + "\n")
    failed = run_cli("run", "declared.yaml", "--ds", FAIL_DS, "--set", "output.path=out/declared",
                     cwd=project)
    assert failed.returncode == 4, failed.stderr
    assert "f0" in one_line_error(failed) and not (project / "out" / "declared" / "_manifest.json").exists()
    same = run_cli("run", "declared.yaml", "--ds", SAME_DS, "--set", "output.path=out/declared-same",
                   cwd=project)
    assert same.returncode == 0, same.stderr


def test_progress_lines_when_stdout_is_not_a_terminal(project):
    shutil.rmtree(project / "out" / f"dt={SAME_DS}", ignore_errors=True)
    plain = run_cli("run", "job.yaml", "--ds", SAME_DS, cwd=project,
                    env={"BATCHINFER_PROGRESS_SECONDS": "0"})
    assert plain.returncode == 0, plain.stderr
    lines = [line for line in plain.stdout.splitlines() if line.startswith("progress: ")]
    assert lines, plain.stdout
    assert re.match(r"^progress: shards \d/2, rows [\d,]+/~?[\d,]+, [\d,]+ rows/s, ETA [\d:?]+, "
                    r"\d+ quarantined$", lines[-1]), lines[-1]
    shutil.rmtree(project / "out" / f"dt={SAME_DS}")
    quiet = run_cli("run", "job.yaml", "--ds", SAME_DS, "--quiet", cwd=project,
                    env={"BATCHINFER_PROGRESS_SECONDS": "0"})
    assert quiet.returncode == 0, quiet.stderr
    assert "progress" not in quiet.stdout


def test_progress_bar_on_a_terminal(project):
    """A real pseudo-terminal as stdout: rich draws its bar (and removes it at the end)."""
    import pty

    shutil.rmtree(project / "out" / f"dt={SAME_DS}", ignore_errors=True)
    leader, follower = pty.openpty()
    child = subprocess.Popen([*_python(), "-m", "batchinfer", "run", "job.yaml", "--ds", SAME_DS],
                             cwd=project, stdout=follower, stderr=subprocess.PIPE,
                             env={**os.environ, "COLUMNS": "200"})
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed with the child
            break
        if not chunk:
            break
        seen += chunk
    assert child.wait(timeout=300) == 0, child.stderr.read() if child.stderr else ""
    os.close(leader)
    text = seen.decode(errors="replace")
    assert "rows/s" in text and "ETA" in text and "quarantined" in text, text[-2000:]
    assert "\x1b[" in text  # drawn with terminal control sequences, not printed as lines
    assert "progress: " not in text
    assert f"committed {project / 'out' / f'dt={SAME_DS}'}" in text


def _python() -> list[str]:
    import sys

    return [sys.executable]


# -- the report in a real browser ---------------------------------------------------------------

def chromium() -> str | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.environ.get("BATCHINFER_REQUIRE_CHROMIUM"):
        pytest.fail("chromium is required here (BATCHINFER_REQUIRE_CHROMIUM) but not installed")
    return found


def render(page: Path, shot: Path, height: int = 2400) -> list[str]:
    """Screenshot ``page`` in headless Chromium; return the console messages it logged."""
    browser = chromium()
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium; CI installs it)")
    result = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--no-first-run", "--enable-logging=stderr", "--v=0", f"--window-size=1280,{height}",
         f"--user-data-dir={shot.parent / 'chromium-profile'}", f"--screenshot={shot}",
         page.as_uri()], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    return [line for line in result.stderr.splitlines() if ":CONSOLE" in line]


def pixel_spread(shot: Path) -> float:
    from PIL import Image

    image = np.asarray(Image.open(shot).convert("L"), dtype=np.float64)
    return float(image.std())


def test_console_check_catches_an_error_and_blank_check_a_blank_page(tmp_path):
    """The two checks below can fail: a script error is seen, a blank page has no spread."""
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><p>x</p><script>console.error('boom'); nope();</script></body></html>")
    messages = render(bad, tmp_path / "bad.png", height=300)
    assert any("boom" in m for m in messages) and any("nope" in m for m in messages), messages
    blank = tmp_path / "blank.html"
    blank.write_text("<html><body></body></html>")
    assert render(blank, tmp_path / "blank.png", height=300) == []
    assert pixel_spread(tmp_path / "blank.png") < 1.0


def test_report_renders_in_chromium(project, warned, tmp_path):
    page = project / "out" / f"dt={WARN_DS}" / "report.html"
    messages = render(page, tmp_path / "report.png")
    assert messages == []
    assert pixel_spread(tmp_path / "report.png") > 20.0
    from PIL import Image

    image = np.asarray(Image.open(tmp_path / "report.png").convert("RGB"))
    # The drift bar of f0 (warn: orange) and the run's histogram bars (blue) were drawn.
    assert ((np.abs(image.astype(int) - (0xEF, 0x6C, 0x00)).sum(axis=2)) < 30).sum() > 200
    assert ((np.abs(image.astype(int) - (0x15, 0x65, 0xC0)).sum(axis=2)) < 30).sum() > 200
