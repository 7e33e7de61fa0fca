"""End-to-end: baselines (`profile`), drift against them (warn / fail), inference health
metrics, the job report (`report`, and in a real headless Chromium) and live progress.

One module-scoped project: a partition scored and profiled as the baseline, then partitions of
the same job whose feature f0 is shifted a little (warn) or a lot (fail).
"""
from __future__ import annotations

import json
import os
import re
import select
import shutil
import time
from pathlib import Path

import forkserver
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from browser import pixel_spread, render

from factories import (
    DS,
    kept_for_resume,
    make_shards,
    numeric_project,
    one_line_error,
    read_partition,
    run_cli,
    shifted_shards,
)

pytestmark = pytest.mark.slow

WARN_DS, FAIL_DS, SAME_DS = "2026-01-20", "2026-01-21", "2026-01-22"
MONITOR = {"baseline": "baseline.json", "warn": {"psi": 0.05}, "fail": {"psi": 0.5, "ks": 0.4}}


def shifted(folder: Path, shift: float) -> None:
    shifted_shards(folder, shift, rows=2000)


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
    assert kept_for_resume(out), "its finished shards are kept for a rerun"
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
    # A child of the fork server (the entry point is not what is tested: what cli.main draws on
    # a terminal is), its stdout the terminal's follower opened by path. This process keeps its
    # own end open until the run has ended, so the leader never reads end-of-file early.
    child = forkserver.shared().start("run", "job.yaml", "--ds", SAME_DS, cwd=project,
                                      env={**os.environ, "COLUMNS": "200"},
                                      terminal=os.ttyname(follower))
    seen = b""
    deadline = time.monotonic() + 300
    while True:
        if select.select([leader], [], [], 0.05)[0]:
            seen += os.read(leader, 65536)
        elif child.poll() is not None:
            break   # ended, and all it wrote has been read
        assert time.monotonic() < deadline, "the run did not end"
    os.close(follower)
    os.close(leader)
    assert child.returncode == 0, child.stderr
    text = seen.decode(errors="replace")
    assert "rows/s" in text and "ETA" in text and "quarantined" in text, text[-2000:]
    assert "\x1b[" in text  # drawn with terminal control sequences, not printed as lines
    assert "progress: " not in text
    assert f"committed {project / 'out' / f'dt={SAME_DS}'}" in text


# -- the report in a real browser ---------------------------------------------------------------

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


# -- issue 18: baselines that cannot gate, refused runs in MLflow, profiles of changed input ---

SHIFT3_DS, QUARANTINED_DS, CHANGED_DS = "2026-01-24", "2026-01-25", "2026-01-26"


def _baseline(project: Path) -> dict:
    return json.loads((project / "baseline.json").read_text())


def _with_baseline(project: Path, name: str, profile: dict | str) -> str:
    """A job file like monitored.yaml whose monitor.baseline is ``profile`` (a dict, or text)."""
    (project / f"{name}.json").write_text(profile if isinstance(profile, str) else json.dumps(profile))
    limits = {**MONITOR, "baseline": f"{name}.json"}
    (project / f"{name}.yaml").write_text((project / "job.yaml").read_text()
                                          + "monitor: " + json.dumps(limits) + "\n")
    return f"{name}.yaml"


def _broken(project: Path, how: str) -> dict | str:
    profile = _baseline(project)
    columns = profile["columns"]
    if how == "counts_do_not_fit_the_cuts":
        for col in columns.values():
            col["counts"] = col["counts"][:-1]
    elif how == "cuts_not_increasing":
        columns["f0"]["cuts"] = columns["f0"]["cuts"][::-1]
    elif how == "counts_do_not_sum_to_count":
        columns["f0"]["counts"][0] += 7
    elif how == "no_column_shared":
        profile["columns"] = {f"old_{name}": col for name, col in columns.items()}
    elif how == "empty":
        profile["columns"] = {}
    elif how == "columns_as_a_list":
        profile["columns"] = list(columns.values())
    elif how == "count_missing":
        del columns["f0"]["count"]
    elif how == "count_not_a_number":
        columns["f0"]["count"] = "many"
    elif how == "nan_count":
        return re.sub(r'"count": \d+', '"count": NaN', json.dumps(profile), count=1)
    elif how == "infinite_counts":
        columns["f0"]["counts"][0] = 1e999
    elif how == "string_cuts":
        columns["f0"]["cuts"] = [str(c) for c in columns["f0"]["cuts"]]
    else:
        raise AssertionError(how)
    return profile


@pytest.mark.parametrize("how, message", [
    ("counts_do_not_fit_the_cuts", "columns.f0: 19 counts for 19 cuts"),
    ("cuts_not_increasing", "columns.f0: cuts are not strictly increasing"),
    ("counts_do_not_sum_to_count", "columns.f0: counts sum to 4007, not to count 4000"),
    ("no_column_shared", "shares no column with this run"),
    ("empty", "columns: empty: a baseline needs at least one column"),
    ("columns_as_a_list", "columns: Input should be an object"),
    ("count_missing", "columns.f0.count: missing"),
    ("count_not_a_number", "columns.f0.count: Input should be a valid integer (got 'many')"),
    ("nan_count", "columns.f0.count: Input should be a valid integer"),
    ("infinite_counts", "columns.f0.counts.0: Input should be a valid integer"),
    ("string_cuts", "columns.f0.cuts.0: Input should be a valid number"),
])
def test_a_baseline_that_cannot_gate_exits_2_before_any_work(project, how, message):
    """A partition shifted by 3 standard deviations must not commit as drift "ok" because the
    baseline was broken by hand: exit 2 naming the file and the field, before any work."""
    shifted(project / "data" / f"dt={SHIFT3_DS}", 3.0)
    job = _with_baseline(project, f"broken_{how}", _broken(project, how))
    out = project / "out" / f"broken-{how}"
    result = run_cli("run", job, "--ds", SHIFT3_DS, "--set", f"output.path={out}", cwd=project)
    assert result.returncode == 2, result.stderr
    line = one_line_error(result)
    assert f"monitor.baseline {project / f'broken_{how}.json'}" in line and message in line, line
    assert not out.exists()   # nothing written: no attempt, no scratch
    # The same baseline declared with stamp --baseline is refused the same way.
    stamped = run_cli("stamp", "models/model.onnx", "--job", "job.yaml", "--model-version",
                      "model:1", "--baseline", f"broken_{how}.json", cwd=project)
    if how != "no_column_shared":   # which columns a run has is known only to a run
        assert stamped.returncode == 2 and message in one_line_error(stamped, "stamp"), stamped.stderr


def test_the_intact_baseline_stops_the_3_sigma_shift(project):
    shifted(project / "data" / f"dt={SHIFT3_DS}", 3.0)
    result = run_cli("run", "monitored.yaml", "--ds", SHIFT3_DS, "--set", "output.path=out/shift3",
                     cwd=project)
    assert result.returncode == 4 and "f0 (psi" in one_line_error(result)


def test_baseline_columns_the_run_lacks_are_named_in_a_warning(project):
    profile = _baseline(project)
    profile["columns"]["gone"] = profile["columns"]["f3"]
    job = _with_baseline(project, "extra_column", profile)
    result = run_cli("run", job, "--ds", SAME_DS, "--set", "output.path=out/extra-column", cwd=project)
    assert result.returncode == 0, result.stderr
    assert ("WARNING batchinfer: drift: monitor.baseline " in result.stderr
            and "has column(s) this run does not have, not compared: gone" in result.stderr), result.stderr
    record = json.loads((project / "out" / "extra-column" / "_profile.json").read_text())
    assert record["level"] == "ok" and "gone" not in {d["column"] for d in record["drift"]}


def test_every_row_quarantined_is_not_drift_ok(project):
    """With max_bad_fraction 1.0 a partition whose every row is quarantined may commit; with a
    baseline its drift is not "ok": no column has a value to compare (exit 4)."""
    for path in make_shards(project / "data" / f"dt={QUARANTINED_DS}", shards=2, rows=2000):
        table = pq.read_table(path)
        pq.write_table(table.set_column(2, "f1", pa.array(np.full(table.num_rows, 50.0, np.float32))), path)
    out = project / "out" / "all-quarantined"
    result = run_cli("run", "monitored.yaml", "--ds", QUARANTINED_DS, "--set", f"output.path={out}",
                     "--set", "quarantine.max_bad_fraction=1.0", cwd=project)
    assert result.returncode == 4, result.stderr
    line = one_line_error(result)
    assert "5 column(s) drifted above the fail limits" in line and "f0 (no scored values)" in line, line
    assert not (out / "_manifest.json").exists()
    [kept] = (out / "_drift").glob("*.json")
    report = json.loads(kept.read_text())
    assert {d["level"] for d in report["drift"]} == {"fail"}
    assert {d["psi"] for d in report["drift"]} == {None}


def test_drift_failure_says_how_to_accept_it(project, failed):
    line = one_line_error(failed)
    assert re.search(r"drifted above the fail limits: f0 \(psi [\d.]+ > 0\.5, ks [\d.]+ > 0\.4\)", line), line
    assert (f"to accept this drift, profile a baseline from a partition you trust (`batchinfer "
            f"profile {project / 'monitored.yaml'} --ds D --out {project / 'baseline.json'}`) or "
            f"raise the monitor.fail limits") in line, line


def _mlflow_runs(project: Path, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    found = client.get_experiment_by_name(experiment)
    return client, (client.search_runs([found.experiment_id]) if found else [])


def test_a_refused_run_is_tracked_with_its_triple_error_and_report(project):
    """A run drift stopped: its MLflow run has the triple params, the error line and exit code as
    tags, and the drift report as an artifact; a run refused for data quality the same but the
    report."""
    experiment = "refused-" + os.urandom(4).hex()
    drifted = run_cli("run", "monitored.yaml", "--ds", FAIL_DS, "--set", "output.path=out/refused",
                      "--set", f"tracking.experiment={experiment}", cwd=project, track=True)
    assert drifted.returncode == 4, drifted.stderr
    line = one_line_error(drifted)
    for path in make_shards(project / "data" / f"dt={CHANGED_DS}", shards=2, rows=2000):
        table = pq.read_table(path)
        f1 = table.column("f1").to_numpy().copy()
        f1[:100] = 50.0   # 5 % of the rows out of range: above max_bad_fraction 0.01
        pq.write_table(table.set_column(2, "f1", pa.array(f1)), path)
    bad = run_cli("run", "job.yaml", "--ds", CHANGED_DS, "--set", "output.path=out/refused-quality",
                  "--set", f"tracking.experiment={experiment}", cwd=project, track=True)
    assert bad.returncode == 4, bad.stderr
    client, runs = _mlflow_runs(project, experiment)
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FAILED"}
    sidecar = json.loads((project / "models" / "model.onnx.batchinfer.json").read_text())
    by_drift = {r.data.tags.get("batchinfer.drift"): r for r in runs}
    for run, message in ((by_drift["fail"], line), (by_drift[None], one_line_error(bad))):
        params, tags = run.data.params, run.data.tags
        for part in ("model_version", "model_digest", "schema_version", "preprocess_hash"):
            assert params[f"triple.{part}"] == sidecar[part], part
        assert params["job"] == "testjob" and params["attempt"] == tags["batchinfer.attempt"]
        assert tags["batchinfer.error"] == message.removeprefix("batchinfer run: ")
        assert tags["batchinfer.exit_code"] == "4"
    artifacts = {a.path for a in client.list_artifacts(by_drift["fail"].info.run_id)}
    assert {"report.html", "drift.json"} <= artifacts, artifacts
    html = Path(client.download_artifacts(by_drift["fail"].info.run_id, "report.html",
                                          str(project / "downloaded")))
    assert "stopped by drift" in html.read_text()


def test_profile_of_changed_input_exits_3_naming_the_shard(project):
    """``profile`` reads the input shards again: bytes other than those the partition scored
    (rewritten, or shrunk) are refused, never profiled (and never a traceback)."""
    folder = project / "data" / "dt=2026-01-27"
    shifted(folder, 0.0)
    out = project / "out" / "changed-input"
    ran = run_cli("run", "job.yaml", "--ds", "2026-01-27", "--set", f"output.path={out}", cwd=project)
    assert ran.returncode == 0, ran.stderr
    shard = folder / "part-00001.parquet"
    table = pq.read_table(shard)
    for changed in (table.set_column(1, "f0", pa.array(table.column("f0").to_numpy() + np.float32(3))),
                    table.slice(0, 10)):
        pq.write_table(changed, shard)
        result = run_cli("profile", "job.yaml", "--ds", "2026-01-27", "--set", f"output.path={out}",
                         "--out", "changed.json", cwd=project)
        assert result.returncode == 3, result.stderr
        line = one_line_error(result, "profile")
        assert f"was scored from other bytes of shard {shard} (sha256 " in line, line
        assert not (project / "changed.json").exists()


def test_report_and_track_of_hand_edited_records_exit_2(project, warned):
    out = project / "out" / f"dt={WARN_DS}"
    edited = project / "out" / "edited"
    shutil.copytree(out, edited)
    profile = json.loads((edited / "_profile.json").read_text())
    profile["columns"]["f0"]["counts"] = "lots"
    (edited / "_profile.json").write_text(json.dumps(profile))
    result = run_cli("report", str(edited), cwd=project)
    assert result.returncode == 2
    assert (f"{edited / '_profile.json'}: columns.f0.counts: Input should be a valid array (got 'lots')"
            in one_line_error(result, "report"))
    shutil.copy(out / "_profile.json", edited / "_profile.json")
    record = json.loads((edited / "_metrics.json").read_text())
    record["metrics"]["rows_in"] = "3000"
    record["uploaded"] = False
    (edited / "_metrics.json").write_text(json.dumps(record))
    for command in ("report", "track"):
        result = run_cli(command, str(edited), cwd=project)
        assert result.returncode == 2
        assert (f"{edited / '_metrics.json'}: metrics.rows_in: Input should be a valid number"
                in one_line_error(result, command))
    manifest = json.loads((edited / "_manifest.json").read_text())
    manifest["shards"][0]["rows_in"] = -1
    (edited / "_manifest.json").write_text(json.dumps(manifest))
    for command in ("report", "inspect"):
        result = run_cli(command, str(edited), cwd=project)
        assert result.returncode == 3, result.stderr
        assert (f"{edited / '_manifest.json'}: shards.0.rows_in: Input should be greater than or "
                f"equal to 0" in one_line_error(result, command))
