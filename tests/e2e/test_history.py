"""End-to-end: ``batchinfer history`` over dates a user scored — committed ones, one with no
data, one whose run drift stopped, a model change between — from the job spec and from the
output folder, as a page (checked in headless Chromium) and as JSON; its argument errors.

One module-scoped project: 2026-01-15 scored and profiled as the baseline; -16 scored against it
(f0 shifted: drift warn); -17 never run; the model stamped again as model:2, -18 scored; -19
shifted far (drift fail: exit 4, nothing committed, the drift report kept).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from browser import pixel_spread, render

from factories import DS, numeric_project, one_line_error, run_cli, shifted_shards

pytestmark = pytest.mark.slow

DATES = ("2026-01-15", "2026-01-16", "2026-01-17", "2026-01-18", "2026-01-19")
MONITOR = {"baseline": "baseline.json", "warn": {"psi": 0.05}, "fail": {"psi": 0.5}}


def shifted(folder: Path, shift: float) -> None:
    shifted_shards(folder, shift, rows=500)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("history")
    numeric_project(folder, shards=2, rows=500)
    assert DS == DATES[0]
    for args in (("run", "job.yaml", "--ds", DS),
                 ("profile", "job.yaml", "--ds", DS, "--out", "baseline.json")):
        done = run_cli(*args, cwd=folder)
        assert done.returncode == 0, done.stderr
    (folder / "monitored.yaml").write_text((folder / "job.yaml").read_text() + "monitor: "
                                           + json.dumps(MONITOR) + "\n")
    for ds, shift in ((DATES[1], 0.3), (DATES[3], 0.0), (DATES[4], 1.5)):
        shifted(folder / "data" / f"dt={ds}", shift)
    steps = [(("run", "monitored.yaml", "--ds", DATES[1]), 0),
             (("stamp", "models/model.onnx", "--job", "job.yaml", "--model-version", "model:2"), 0),
             (("run", "monitored.yaml", "--ds", DATES[3]), 0),
             (("run", "monitored.yaml", "--ds", DATES[4]), 4)]
    for args, code in steps:
        done = run_cli(*args, cwd=folder)
        assert done.returncode == code, done.stderr
    return folder


def history(project: Path, *args: str):
    return run_cli("history", *args, cwd=project)


def test_history_from_the_job_and_from_the_output(project):
    by_job = history(project, "monitored.yaml", "--start", DATES[0], "--end", DATES[-1], "--json")
    assert by_job.returncode == 0, by_job.stderr
    data = json.loads(by_job.stdout)
    assert data["job"] == "testjob" and data["dates"] == list(DATES)
    assert data["states"] == ["committed", "committed", "missing", "committed", "uncommitted"]
    assert data["counts"] == {"dates": 5, "committed": 3, "gaps": 2, "missing": 1, "uncommitted": 1,
                              "unreadable": 0}
    assert data["gaps"] == [DATES[2], DATES[4]]
    assert data["changes"] == [{"ds": DATES[3], "since": DATES[1],
                                "parts": {"model_version": ["model:1", "model:2"]}}]
    assert [t and t["model_version"] for t in data["triples"]] == ["model:1", "model:1", None, "model:2", None]
    assert data["rows"] == {"in": [1000, 1000, None, 1000, None], "scored": [1000, 1000, None, 1000, None],
                            "quarantined": [0, 0, None, 0, None]}
    assert data["quarantine"] == {}
    # What each run recorded: no baseline on the first date, drift warn on the second.
    assert data["drift"]["level"] == ["none", "warn", None, "ok", None]
    assert data["drift"]["limits"] == {"warn": 0.05, "fail": 0.5}
    psi = data["drift"]["psi"]
    assert list(psi)[0] == "f0" and 0.05 < psi["f0"][1] < 0.5 and psi["f0"][3] == 0.0
    assert psi["f0"][0] is None and data["drift"]["kinds"]["y"] == "prediction"
    profile = json.loads((project / "out" / f"dt={DATES[1]}" / "_profile.json").read_text())
    assert data["scores"]["y"]["0.5"][1] == profile["columns"]["y"]["quantiles"]["0.5"]   # as recorded
    assert data["scores"]["y"]["mean"][0] is not None and data["scores"]["y"]["0.5"][0] is None
    assert all(v > 0 for v in data["compute"]["wall_seconds"][:2])
    assert data["compute"]["shards_reused"] == [0, 0, None, 0, None]
    # The stopped run kept its drift report, and its scratch for a rerun to resume.
    drift, scratch = data["notes"][DATES[4]]
    assert drift.startswith("stopped by drift: report kept in ") and "/_drift/" in drift
    assert "_tmp" in scratch and "resumes it" in scratch
    assert list(data["notes"]) == [DATES[4]]

    by_output = history(project, "out", "--start", DATES[0], "--end", DATES[-1], "--json")
    assert by_output.returncode == 0, by_output.stderr
    other = json.loads(by_output.stdout)
    assert other["source"] == "out" and data["source"] == "monitored.yaml"
    same = ("dates", "states", "rows", "drift", "scores", "changes", "compute", "triples", "attempts")
    assert {k: other[k] for k in same} == {k: data[k] for k in same}


def test_the_page_is_written_beside_the_last_report_and_renders_in_chromium(project, tmp_path):
    written = history(project, "out", "--start", DATES[0], "--end", DATES[3])
    assert written.returncode == 0, written.stderr
    page = project / "out" / f"dt={DATES[3]}" / "history.html"
    assert written.stdout.splitlines()[0] == (
        f"wrote {Path('out') / f'dt={DATES[3]}' / 'history.html'}: 4 dates from {DATES[0]} to "
        f"{DATES[3]}, 3 committed, 1 gap(s) (1 missing), 1 change(s)")
    html = page.read_text()
    for part in ("Rows per date", "Drift per feature", "Scores over time", "Compute, wall and reuse",
                 "Changes of the triple", "model:1", "model:2", *DATES[:4]):
        assert part in html, part
    assert "<script" not in html and not re.search(r"\b(src|href)\s*=", html)
    assert set(re.findall(r"https?://[^\"' )]+", html)) == {"http://www.w3.org/2000/svg"}

    assert render(page, tmp_path / "history.png", height=3200) == []
    shot = tmp_path / "history.png"
    assert pixel_spread(shot) > 20.0
    from PIL import Image

    image = np.asarray(Image.open(shot).convert("RGB")).astype(int)

    def pixels(rgb: tuple[int, int, int]) -> int:
        return int(((np.abs(image - rgb).sum(axis=2)) < 30).sum())

    assert pixels((0x15, 0x65, 0xC0)) > 2000      # the scored rows' bars
    assert pixels((0xCF, 0xD8, 0xDC)) > 2000      # the gap's grey column on each plot
    assert pixels((0x6A, 0x1B, 0x9A)) > 80        # the change's dashed line on each plot


def test_the_last_date_uncommitted_needs_out_and_bad_ranges_exit_2(project, tmp_path):
    no_place = history(project, "job.yaml", "--start", DATES[0], "--end", DATES[-1])
    assert no_place.returncode == 2
    assert "the last date 2026-01-19 has no committed partition" in one_line_error(no_place, "history")
    out = tmp_path / "page.html"
    given = history(project, "job.yaml", "--start", DATES[0], "--end", DATES[-1], "--out", str(out))
    assert given.returncode == 0, given.stderr
    assert f"  {DATES[4]}  stopped by drift" in given.stdout and "<td>2026-01-19</td>" in out.read_text()
    for args, message in (
            (("--start", "2026-01-19", "--end", "2026-01-15"), "--end 2026-01-15 is before --start 2026-01-19"),
            (("--start", "2026-02-30", "--end", "2026-03-01"), "is not a date"),
            (("--start", "2016-01-01", "--end", "2026-01-19"), "a history reads at most 3660"),
    ):
        bad = history(project, "job.yaml", *args)
        assert bad.returncode == 2 and message in one_line_error(bad, "history"), bad.stderr
    one = history(project, f"out/dt={DS}", "--start", DS, "--end", DS)
    assert one.returncode == 2 and "is one partition" in one_line_error(one, "history")
