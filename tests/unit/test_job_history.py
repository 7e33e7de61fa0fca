"""``batchinfer history``'s pure parts: the History built from each date's records (the record
fixtures of tests/fixtures/records, varied per date), its JSON, and the page — escaped, and small
and complete at 365 dates × 50 features."""
from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from datetime import date, timedelta
from pathlib import Path

import pytest

from batchinfer.app.history_page import render_history
from batchinfer.app.job_history import DateRecords, build_history
from batchinfer.codec import json_validated
from batchinfer.io.records import Manifest

RECORDS = Path(__file__).resolve().parents[1] / "fixtures" / "records"
EVIL = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def manifest() -> Manifest:
    return json_validated(Manifest, json.loads((RECORDS / "manifest.json").read_text()))


def committed(manifest: Manifest, ds: str, *, version: str = "m:1", quarantine=(), psi=None,
              level: str = "ok", median: float | None = None, wall: float = 2.0, job: str = "j") -> DateRecords:
    """A committed date: the fixture manifest with this date, model version and job."""
    profile = {"level": level, "quarantine": [list(q) for q in quarantine],
               "limits": {"warn": {"psi": 0.1}, "fail": {"psi": 0.25}},
               "drift": [{"column": c, "kind": "feature", "psi": v, "ks": 0.0, "level": "ok"}
                         for c, v in (psi or {}).items()],
               "columns": {"y": {"kind": "prediction", "count": 8, "nulls": 0, "mean": 0.4, "min": 0.0,
                                 "max": 1.0, "quantiles": {"0.5": median, "0.05": 0.1, "0.95": 0.9}}}}
    return DateRecords(ds, "committed", replace(manifest, ds=ds, job=job,
                                                triple={**manifest.triple, "model_version": version}),
                       {"wall_seconds": wall, "stage_seconds_infer": 1.0, "stage_seconds_read": 0.5},
                       profile)


def test_gaps_changes_and_quarantine_by_reason(manifest):
    days = [committed(manifest, "2026-01-01", quarantine=[("f0", "in_range(0, 1)", 2)], psi={"f0": 0.02, "f1": 0.3}),
            DateRecords("2026-01-02"),
            DateRecords("2026-01-03", "uncommitted", notes=("stopped by drift",)),
            committed(manifest, "2026-01-04", version="m:2", quarantine=[(None, "validation_error", 5)],
                      psi={"f0": 0.5}, level="fail"),
            DateRecords("2026-01-05", "unreadable", notes=("manifest unreadable: x",)),
            committed(manifest, "2026-01-06", version="m:2", median=0.45)]
    history = build_history(days, source="job.yaml")
    assert history.job == "j" and history.dates[0] == "2026-01-01" and len(history.dates) == 6
    assert history.gaps == ("2026-01-02", "2026-01-03", "2026-01-05")
    assert history.counts() == {"dates": 6, "committed": 3, "gaps": 3, "missing": 1, "uncommitted": 1,
                                "unreadable": 1}
    # The change is at the first date under the new version, against the committed date before it.
    assert [(c.ds, c.since, c.parts) for c in history.changes] == [
        ("2026-01-04", "2026-01-01", {"model_version": ("m:1", "m:2")})]
    assert history.rows["in"] == [10, None, None, 10, None, 10]
    # By reason, most rows first; 0 on a committed date without it, None on a gap.
    assert history.quarantine == {"(row): validation_error": [0, None, None, 5, None, 0],
                                  "f0: in_range(0, 1)": [2, None, None, 0, None, 0]}
    assert list(history.psi) == ["f0", "f1"]   # worst over the range first
    assert history.psi["f1"] == [0.3, None, None, None, None, None]
    assert history.drift_level == ["ok", None, None, "fail", None, "ok"]
    assert history.scores["y"]["0.5"] == [None, None, None, None, None, 0.45]
    assert list(history.scores["y"]) == ["mean", "min", "max", "0.05", "0.5", "0.95"]
    # The fixture's shard 0 was scored by an earlier attempt: reused, named.
    assert history.compute["shards_reused"] == [1, None, None, 1, None, 1]
    assert history.reused_from[0] == ["20260114T010203Z-00000009"]
    assert history.compute["compute_seconds"][0] == 1.5 and history.compute["wall_seconds"][0] == 2.0
    assert history.notes == {"2026-01-03": ("stopped by drift",), "2026-01-05": ("manifest unreadable: x",)}

    data = json.loads(json.dumps(history.to_dict()))
    assert data["history_version"] == 1 and data["gaps"] == list(history.gaps)
    assert data["changes"] == [{"ds": "2026-01-04", "since": "2026-01-01",
                                "parts": {"model_version": ["m:1", "m:2"]}}]
    assert all(len(s) == 6 for s in (data["states"], data["rows"]["in"], data["drift"]["psi"]["f0"],
                                      data["compute"]["wall_seconds"], data["triples"]))

    page = render_history(history)
    assert page.count("<svg") == 6   # rows, quarantine, drift, scores, wall, reuse
    assert page.count('stroke="#6a1b9a"') == 6   # the change's line on every plot
    for ds in history.dates:
        assert f"<td>{ds}</td>" in page
    assert "stopped by drift" in page and "manifest unreadable: x" in page


def test_no_change_across_gaps_and_model_options_are_watched(manifest):
    days = [committed(manifest, "2026-02-01"), DateRecords("2026-02-02"), committed(manifest, "2026-02-03")]
    assert build_history(days).changes == ()
    fp16 = replace(days[2], manifest=replace(days[2].manifest, model_options={"precision": "fp16"}))
    (change,) = build_history([days[0], fp16]).changes
    assert change.parts == {"model_options.precision": ("fp32", "fp16")}


def test_the_page_escapes_names_and_needs_no_network(manifest):
    day = committed(manifest, "2026-03-01", job=EVIL, quarantine=[(EVIL, EVIL, 1)], psi={EVIL: 0.2})
    page = render_history(build_history([day, committed(manifest, "2026-03-02", job=EVIL, version=EVIL)],
                                        source=EVIL))
    assert EVIL not in page and "<script" not in page and "&lt;script&gt;" in page
    assert not re.search(r"\b(src|href)\s*=", page)
    assert set(re.findall(r"https?://[^\"' )]+", page)) == {"http://www.w3.org/2000/svg"}


def test_365_dates_by_50_features_stay_small_and_every_date_is_there(manifest):
    start = date(2025, 1, 1)
    days = []
    for n in range(365):
        ds = (start + timedelta(days=n)).isoformat()
        if n % 30 == 7:
            days.append(DateRecords(ds))
            continue
        psi = {f"feature_{k:02d}": ((n * 7 + k * 13) % 40) / 100 for k in range(50)}
        days.append(committed(manifest, ds, version=f"m:{1 + n // 120}", psi=psi, median=0.3 + n / 2000,
                              quarantine=[(f"f{k}", "in_range(0, 1)", (n + k) % 50) for k in range(8)]))
    t0 = time.perf_counter()
    history = build_history(days)
    page = render_history(history)
    seconds = time.perf_counter() - t0
    size = len(page.encode())
    # Measured: 605,813 bytes (runs of one colour drawn as one subpath); the bound leaves ~50% room.
    assert 200_000 < size < 900_000, size
    assert seconds < 5, seconds
    assert all(f"<td>{d.ds}</td>" in page for d in days)
    assert len(history.changes) == 3 and page.count('stroke="#6a1b9a"') == 3 * page.count("<svg") == 18
    assert all(f"feature_{k:02d}" in page for k in range(50))
