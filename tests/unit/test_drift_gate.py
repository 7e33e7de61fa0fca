"""The drift gate and verdict (batchinfer/rows/drift.py: shard profiles + baseline in, verdict
out, no I/O) and the metric names a verdict becomes (batchinfer/app/run_record.py)."""
from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest

from batchinfer.app.run_record import drift_metrics
from batchinfer.rows.column_profiles import ColumnStats, baseline_column, bin_counts, psi
from batchinfer.rows.drift import Baseline, DriftGate, MergedProfiles, observe

RNG = np.random.default_rng(7)
F0 = RNG.normal(0.0, 1.0, 4000)
SCORE = RNG.uniform(0.0, 1.0, 4000)
WARN, FAIL = {"psi": 0.1, "ks": None}, {"psi": 0.5, "ks": None}
ACCEPT = "to accept this drift, do what the launcher says"
BASELINE = Baseline("b.json", {"f0": baseline_column("feature", F0),
                               "score": baseline_column("prediction", SCORE)},
                    shown="b.json", warn=WARN, fail=FAIL, accept=ACCEPT)
GATE = DriftGate.of(("f0",), BASELINE)


def shards(f0: np.ndarray, score: np.ndarray, parts: int = 3) -> list[dict]:
    """The profiles of ``parts`` shards, as the writer stage counts them into the cuts."""
    return [{"f0": ColumnStats.of(a, BASELINE.columns["f0"].cuts).to_dict(),
             "score": ColumnStats.of(b, BASELINE.columns["score"].cuts).to_dict()}
            for a, b in zip(np.array_split(f0, parts), np.array_split(score, parts))]


def test_the_same_distribution_passes_the_gate():
    same = shards(RNG.normal(0.0, 1.0, 3000), RNG.uniform(0.0, 1.0, 3000))
    verdict = observe(same, ("f0",), BASELINE)
    assert verdict.level == "ok" and [d.level for d in verdict.drifts] == ["ok", "ok"]
    assert GATE.refusal(same) is None


def test_a_shifted_feature_is_refused_with_its_psi_and_the_columns_above_warn():
    f0, score = F0 + 2.0, np.clip(SCORE + 0.08, 0.0, 1.0)
    profiles = shards(f0, score)
    expected = psi(BASELINE.columns["f0"].stats.counts, bin_counts(f0, BASELINE.columns["f0"].cuts))
    assert expected > 0.5
    verdict = observe(profiles, ("f0",), BASELINE)
    assert (verdict.level, [d.column for d in verdict.above("fail")]) == ("fail", ["f0"])
    assert verdict.drifts[0].psi == pytest.approx(expected)
    assert [d.column for d in verdict.above("warn")] == ["score"]
    assert GATE.refusal(profiles) == (   # how to accept it is the launcher's to say
        f"drift: 1 column(s) drifted above the fail limits: f0 (psi {expected:.3g} > 0.5); "
        f"above warn: score; nothing committed")


def test_warn_only_commits():
    profiles = shards(F0, np.clip(SCORE + 0.08, 0.0, 1.0))
    verdict = observe(profiles, ("f0",), BASELINE)
    assert verdict.level == "warn" and GATE.refusal(profiles) is None
    assert verdict.summary("warn").startswith("1 column(s) drifted above the warn limits: score (psi ")


def test_shards_merge_into_the_run_columns_and_kinds():
    verdict = observe(shards(F0, SCORE, parts=4), ("f0",), BASELINE)
    whole = ColumnStats.of(F0, BASELINE.columns["f0"].cuts)
    f0 = verdict.columns["f0"]
    assert (f0.kind, verdict.columns["score"].kind) == ("feature", "prediction")
    assert (f0.stats.count, f0.stats.counts) == (whole.count, whole.counts)
    assert f0.stats.mean == pytest.approx(F0.mean())


def test_without_a_baseline_only_the_columns_and_no_drift_metrics():
    verdict = observe([{"x": ColumnStats.of(np.arange(5.0)).to_dict()}], (), None)
    assert verdict.level == "none" and not verdict.drifts and verdict.columns["x"].stats.count == 5
    assert drift_metrics(verdict) == {}


def test_drift_metric_names_and_a_column_without_values():
    baseline = Baseline("b.json", {"a.b c": baseline_column("feature", F0)}, warn=WARN, fail=FAIL)
    shifted = observe([{"a.b c": ColumnStats.of(F0 + 2.0, baseline.columns["a.b c"].cuts).to_dict()}],
                      ("a.b c",), baseline)
    metrics = drift_metrics(shifted)
    assert set(metrics) == {"drift_psi.a_b_c", "drift_ks.a_b_c", "drift_columns_warn", "drift_columns_fail"}
    assert (metrics["drift_columns_fail"], metrics["drift_columns_warn"]) == (1.0, 0.0)
    assert metrics["drift_psi.a_b_c"] == pytest.approx(shifted.drifts[0].psi)
    empty = observe([], ("a.b c",), baseline)  # nothing scored: above fail, no PSI to log
    assert empty.level == "fail" and math.isnan(empty.drifts[0].psi)
    assert drift_metrics(empty) == {"drift_columns_warn": 0.0, "drift_columns_fail": 1.0}


def test_the_gate_pickles_to_the_worker_that_commits_with_only_the_columns_and_limits():
    profiles = shards(F0 + 2.0, SCORE)
    assert pickle.loads(pickle.dumps(GATE)).refusal(profiles) == GATE.refusal(profiles) is not None
    # the baseline's URL, how it is shown and how to accept a drift stay with the launcher
    assert (GATE.baseline.path, GATE.baseline.shown, GATE.baseline.accept, GATE.baseline.about) == (
        "", "", "", {})
    assert (GATE.baseline.warn, GATE.baseline.fail) == (WARN, FAIL)


def test_the_shards_merged_into_one_profile_give_their_verdict_and_refusal():
    """The commit step folds the shards' profiles into one (rows/drift.py MergedProfiles, in
    shard order, as run_columns merges them); through the commit record's JSON, the gate and the
    launcher's verdict on it are the shards' own, to the bit."""
    from batchinfer.io.records import ResultsSummary

    f0 = np.concatenate([F0 + 2.0, [np.nan, np.inf]])
    score = np.concatenate([np.clip(SCORE + 0.08, 0.0, 1.0), [0.5, np.nan]])
    profiles = [{}] + shards(f0, score, parts=7) + [{}]
    merging = MergedProfiles()
    for profile in profiles:
        merging.add(profile)
    merged = ResultsSummary.read(json.dumps(ResultsSummary(profiles=merging.profiles()).to_dict())).profiles
    assert len(merged) == 1
    for baseline in (BASELINE, None):
        one, each = observe(merged, ("f0",), baseline), observe(profiles, ("f0",), baseline)
        assert one == each and list(one.columns) == list(each.columns)
    assert GATE.refusal(merged) == GATE.refusal(profiles) is not None
    nothing = MergedProfiles()
    nothing.add({})
    assert nothing.profiles() == () and observe((), ("f0",), BASELINE).columns == {}
