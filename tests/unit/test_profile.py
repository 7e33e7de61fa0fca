"""The pure drift statistics (batchinfer/rows/column_profiles.py) and what the driver makes of them
(health metrics, the report's HTML): many examples, hypothesis for the merge."""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.app.job_report import render_report
from batchinfer.app.run_record import health_metrics, metric_part
from batchinfer.io.records import ShardRecord, ShardResult, fold
from batchinfer.rows.column_profiles import (
    ColumnProfile,
    ColumnStats,
    approx_quantiles,
    baseline_column,
    bin_counts,
    choose_cuts,
    drift,
    ks,
    merge_columns,
    numeric_values,
    psi,
    run_column,
)

floats = st.floats(-1e6, 1e6, allow_nan=False, width=64)


@given(st.lists(st.one_of(floats, st.just(math.nan), st.just(math.inf)), min_size=0, max_size=200),
       st.lists(floats, min_size=1, max_size=8, unique=True), st.integers(0, 200))
@settings(max_examples=200, deadline=None)
def test_merged_batches_equal_the_whole(values, cuts, split):
    """Per-batch statistics merge exactly (counts) or to rounding (moments), in any order."""
    x = np.array(values, dtype=np.float64)
    cuts = sorted(cuts)
    whole = ColumnStats.of(x, cuts)
    split = min(split, x.size)
    parts = ColumnStats.of(x[:split], cuts) + ColumnStats.of(x[split:], cuts)
    reverse = ColumnStats.of(x[split:], cuts) + ColumnStats.of(x[:split], cuts)
    for merged in (parts, reverse):
        assert (merged.count, merged.nulls, merged.counts) == (whole.count, whole.nulls, whole.counts)
        assert merged.minimum == whole.minimum and merged.maximum == whole.maximum
        assert merged.mean == pytest.approx(whole.mean, rel=1e-9, abs=1e-6)
        assert merged.m2 == pytest.approx(whole.m2, rel=1e-6, abs=1e-3)
    finite = x[np.isfinite(x)]
    assert whole.count == finite.size and whole.nulls == x.size - finite.size
    assert sum(whole.counts) == finite.size
    if finite.size > 1:
        assert whole.std == pytest.approx(finite.std(ddof=1), rel=1e-9, abs=1e-6)


@given(st.lists(floats, min_size=0, max_size=300), st.lists(floats, min_size=1, max_size=25, unique=True))
@settings(max_examples=200, deadline=None)
def test_bin_counts_match_searchsorted(values, cuts):
    x = np.array(values, dtype=np.float64)
    cuts = np.array(sorted(cuts))
    expected = np.bincount(np.searchsorted(cuts, x, side="right"), minlength=cuts.size + 1)
    assert bin_counts(x, cuts) == tuple(int(c) for c in expected)


def test_bins_are_closed_on_the_left():
    # cuts 1, 2: (-inf, 1) [1, 2) [2, inf)
    assert bin_counts(np.array([0.0, 1.0, 1.5, 2.0, 9.0]), [1.0, 2.0]) == (1, 2, 2)


def test_numeric_values_of_arrow_and_numpy_columns():
    assert np.array_equal(numeric_values(pa.array([1, None, 3])), [1.0, np.nan, 3.0], equal_nan=True)
    assert np.array_equal(numeric_values(pa.array([True, None, False])), [1.0, np.nan, 0.0], equal_nan=True)
    assert numeric_values(pa.array(["a", "b"])) is None
    assert numeric_values(pa.array([[1.0], [2.0]])) is None
    assert numeric_values(np.ones((3, 1), np.float32)).shape == (3,)
    assert numeric_values(np.ones((3, 2), np.float32)) is None  # [N, K] outputs: not profiled


def test_choose_cuts_equal_frequency_and_degenerate_columns():
    x = np.arange(1000, dtype=np.float64)
    cuts = choose_cuts(x, bins=10)
    assert len(cuts) == 9
    assert bin_counts(x, cuts) == (100,) * 10
    assert choose_cuts(np.array([0.0, 0.0, 1.0, 1.0])) == [1.0]         # binary: two bins
    constant = choose_cuts(np.full(50, 7.0))
    assert len(constant) == 1 and 7.0 < constant[0] < 7.0001            # values ≠ 7 are drift
    assert choose_cuts(np.array([np.nan, np.inf])) == []


def test_psi_and_ks_by_hand():
    assert psi([10, 10], [10, 10]) == 0.0 and ks([10, 10], [10, 10]) == 0.0
    # p = (.5, .5), q = (.25, .75): (−.25)·ln(.5) + (.25)·ln(1.5)
    assert psi([50, 50], [25, 75]) == pytest.approx(0.25 * math.log(2) + 0.25 * math.log(1.5))
    assert ks([50, 50], [25, 75]) == pytest.approx(0.25)
    # An empty bin on one side is floored, not infinite.
    assert math.isfinite(psi([100, 0], [50, 50])) and psi([100, 0], [50, 50]) > 1.0
    assert ks([100, 0], [0, 100]) == 1.0
    assert ks([0, 0], [1, 1]) == 0.0  # nothing to compare


def test_psi_grows_with_the_shift():
    rng = np.random.default_rng(0)
    base = baseline_column("feature", rng.standard_normal(20_000))
    values = [psi(base.stats.counts, ColumnStats.of(rng.standard_normal(20_000) + s, base.cuts).counts)
              for s in (0.0, 0.2, 0.5, 1.0)]
    assert values[0] < 0.01 < values[1] < values[2] < values[3]
    assert 0.03 < values[1] < 0.08  # the rule of thumb: a 0.2 sd shift is a small PSI


def test_approx_quantiles_within_one_bin():
    rng = np.random.default_rng(1)
    x = rng.gamma(2.0, size=50_000)
    base = baseline_column("feature", x)
    approx = approx_quantiles(ColumnStats.of(x, base.cuts), base.cuts)
    edges = [x.min(), *base.cuts, x.max()]
    for q, exact in base.quantiles.items():
        i = int(np.searchsorted(base.cuts, exact, side="right"))  # the bin holding the exact one
        assert edges[i] <= approx[q] <= edges[i + 1], q
    flat = baseline_column("feature", np.zeros(10))
    assert approx_quantiles(flat.stats, flat.cuts)["0.5"] == 0.0


def test_drift_levels_and_order():
    rng = np.random.default_rng(2)
    base = {name: baseline_column(kind, rng.standard_normal(10_000))
            for name, kind in (("a", "feature"), ("b", "feature"), ("c", "prediction"), ("d", "feature"))}
    shifts = {"a": 0.0, "b": 2.0, "c": 0.4, "d": 0.0}
    run = {name: ColumnStats.of(rng.standard_normal(10_000) + shifts[name], col.cuts)
           for name, col in base.items() if name != "d"}
    found = drift(base, run, warn={"psi": 0.1, "ks": None}, fail={"psi": 1.0, "ks": 0.5})
    # fail (d: no scored values, first; b), warn, ok
    assert [d.column for d in found] == ["d", "b", "c", "a"]
    assert [d.level for d in found] == ["fail", "fail", "warn", "ok"]
    assert found[0].breached == ("no scored values",) and math.isnan(found[0].psi)
    assert found[0].to_dict()["psi"] is None and found[0].to_dict()["ks"] is None
    assert found[1].breached[0].startswith("psi ") and "> 1" in found[1].breached[0]
    assert any(b.startswith("ks ") for b in found[1].breached)
    assert found[3].breached == ()


def test_a_column_without_scored_values_is_not_ok():
    """Every row quarantined, or all null: the run has no histogram to compare, which must not
    pass as "ok" (it is above fail; above warn when fail sets no limit)."""
    base = {"a": baseline_column("feature", np.random.default_rng(3).standard_normal(1000))}
    empty = {"a": ColumnStats.of(np.full(50, np.nan), base["a"].cuts)}
    for current in ({}, empty):
        [found] = drift(base, current, warn={"psi": 0.1}, fail={"psi": 0.25})
        assert (found.level, found.breached) == ("fail", ("no scored values",))
    [found] = drift(base, {}, warn={"psi": 0.1}, fail={"psi": None, "ks": None})
    assert found.level == "warn"


def test_profiles_round_trip_through_json():
    col = baseline_column("prediction", np.array([0.1, 0.2, np.nan, 0.9]))
    again = ColumnProfile.from_dict(col.to_dict())
    assert again.stats == col.stats and again.cuts == col.cuts and again.kind == "prediction"
    stats = ColumnStats.of(np.array([1.0, 2.0, 3.0]), [2.0])
    assert ColumnStats.from_dict(stats.to_dict()) == stats
    assert merge_columns({"x": stats}, {"x": stats, "y": stats})["x"].count == 6


def test_cuts_must_agree_to_merge():
    with pytest.raises(ValueError):
        ColumnStats.of(np.ones(3), [0.5]) + ColumnStats.of(np.ones(3), [0.5, 2.0])


def _result(batches, quarantine=()):
    return ShardResult(record=ShardRecord(path="s", sha256="0" * 64, rows_in=10, rows_scored=10,
                                          rows_quarantined=0, status="scored", reason=None),
                       seconds={}, quarantine=quarantine, batches=tuple(batches))


def test_health_metrics_percentiles_and_quarantine_names():
    results = [_result([(100, float(ms)) for ms in range(1, 51)], ((None, "validation_error", 2),)),
               _result([(50, float(ms)) for ms in range(51, 101)], (("f 1", "in_range(0, 1)", 3),))]
    metrics = health_metrics(fold(results), 0.25)
    assert metrics["model_latency_ms_p50"] == pytest.approx(50.5)
    assert metrics["model_latency_ms_p99"] == pytest.approx(99.01)
    assert metrics["model_latency_ms_max"] == 100.0 and metrics["model_batches"] == 100.0
    assert (metrics["batch_rows_min"], metrics["batch_rows_max"]) == (50.0, 100.0)
    assert metrics["model_rows_per_second"] == pytest.approx(7500 / 5.05)
    assert metrics["model_load_seconds"] == 0.25
    assert metrics["quarantine_rows._row.validation_error"] == 2.0
    assert metrics["quarantine_rows.f_1.in_range_0_1"] == 3.0
    assert metric_part("a.b c/d") == "a_b_c_d"


def test_report_escapes_names_and_needs_no_network():
    evil = "<script>alert(1)</script>"
    profile = {"level": "warn", "baseline": {"path": "b.json", "ds": "d", "columns": {
        evil: {"kind": "prediction", "counts": [5, 5], "cuts": [0.5]}}},
        "limits": {"warn": {"psi": 0.1}, "fail": {"psi": 0.25}},
        "drift": [{"column": evil, "kind": "prediction", "psi": 0.2, "ks": 0.1, "level": "warn",
                   "breached": ["psi 0.2 > 0.1"]}],
        "columns": {evil: {"kind": "prediction", "count": 10, "nulls": 0, "counts": [2, 8], "cuts": [0.5]}},
        "quarantine": [[None, evil, 3]]}
    page = render_report(None, {"metrics": {"rows_in": 10.0, "stage_seconds_infer": 0.5}}, profile)
    assert evil not in page and "&lt;script&gt;" in page and "<script" not in page
    assert page.count("<svg") >= 3   # drift bars, histogram, quarantine bars


@given(st.lists(st.floats(-1e6, 1e6, width=32, allow_nan=False), min_size=1, max_size=200),
       st.lists(st.floats(-1e30, 1e30, allow_nan=False), min_size=1, max_size=20, unique=True))
@settings(max_examples=200, deadline=None)
def test_float32_columns_bin_and_summarise_as_float64(values, cuts):
    """float32 columns stay float32 (half the memory traffic) with the same counts and moments,
    whether the cuts are float32 values (compared as float32) or not (compared as float64)."""
    x32 = np.array(values, dtype=np.float32)
    x64 = x32.astype(np.float64)
    assert numeric_values(x32).dtype == np.float32
    for edges in (sorted(cuts), sorted({float(np.float32(c)) for c in cuts})):
        a, b = ColumnStats.of(x32, edges), ColumnStats.of(x64, edges)
        assert a.counts == b.counts and a.count == b.count
        assert a.mean == pytest.approx(b.mean, rel=1e-12, abs=1e-12)
        assert a.minimum == b.minimum and a.maximum == b.maximum


def test_quantiles_of_a_discrete_column_are_its_values():
    """``term_months`` is 36 or 60: its baseline's cuts are its values ([60]), and a run's
    quantiles read off those bins are 36 or 60 — never one between them that no row can have
    (the report showed a median of 51.66)."""
    rng = np.random.default_rng(4)
    base = baseline_column("feature", rng.choice([36.0, 60.0], 5000, p=[0.6, 0.4]))
    assert base.cuts == (60.0,)
    for share in (0.3, 0.55, 0.9):   # the run's share of 36
        run = rng.choice([36.0, 60.0], 4000, p=[share, 1 - share]).astype(np.float32)
        halves = ColumnStats.of(run[:1500], base.cuts) + ColumnStats.of(run[1500:], base.cuts)
        quantiles = run_column("feature", halves, base.cuts).quantiles
        assert set(quantiles.values()) <= {36.0, 60.0}, quantiles
        assert quantiles["0.5"] == (36.0 if share > 0.5 else 60.0)
        assert quantiles == {q: float(np.quantile(run, float(q), method="lower")) for q in quantiles}
    # Five values: each quantile is one of them, and the exact one.
    levels = rng.choice([1.0, 2.0, 3.0, 5.0, 8.0], 3000)
    base = baseline_column("feature", levels)
    run = rng.choice([1.0, 2.0, 3.0, 5.0, 8.0], 3000, p=[0.1, 0.1, 0.2, 0.3, 0.3])
    quantiles = run_column("feature", ColumnStats.of(run, base.cuts), base.cuts).quantiles
    assert quantiles == {q: float(np.quantile(run, float(q), method="lower")) for q in quantiles}


def test_a_run_quantile_inside_a_bin_with_values_at_its_cut():
    """Half the rows at the cut, half spread above it: the lower half's quantiles are the cut,
    the rest are interpolated over the rest of the bin only."""
    cuts = (0.0, 10.0)
    values = np.concatenate([np.zeros(500), np.linspace(0.01, 9.99, 500)])
    stats = ColumnStats.of(values, cuts)
    assert stats.at_cuts == (500, 0) and stats.counts == (0, 1000, 0)
    quantiles = approx_quantiles(stats, cuts)
    assert quantiles["0.25"] == 0.0 and quantiles["0.05"] == 0.0
    assert quantiles["0.75"] == pytest.approx(5.0, abs=0.05)


def test_the_report_shows_a_discrete_median():
    base = baseline_column("feature", np.repeat([36.0, 60.0], [600, 400]))
    stats = ColumnStats.of(np.repeat([36.0, 60.0], [550, 450]), base.cuts)   # median in bin 0
    column = run_column("feature", stats, base.cuts)
    html = render_report(None, {}, {"columns": {"term_months": column.to_dict()}})
    row = html[html.index("<td>term_months</td>"):].split("</tr>")[0]
    cells = [cell.split(">", 1)[1] for cell in row.split("</td>")[:-1]]
    # column, kind, count, nulls, mean, baseline mean, std, min, median, max
    assert cells[4] == "46.8" and cells[7:] == ["36", "36", "60"], cells


def test_the_metrics_of_the_results_folded_are_those_of_every_result():
    """The launcher's figures come from the shards' results folded (io/records.py fold): the
    same sums, added in shard order, as when every result was held (the formulas below are
    what run_record did with them)."""
    from batchinfer.app.run_record import challenger_metrics, quarantine_counts, run_metrics
    from batchinfer.io.records import ChallengerShard, ModelStats, PreprocessStats, Totals
    from batchinfer.rows.drift import DriftVerdict

    def shard(i: int, by: str | None) -> ShardResult:
        rows = 10 + i
        record = ShardRecord(path=f"s{i}", sha256="0" * 64, rows_in=rows, rows_scored=rows - i % 3,
                             rows_quarantined=i % 3, status="scored", reason=None, scored_by=by)
        return ShardResult(
            record=record, seconds={"read": 0.1 * i, "infer": 1 / (i + 3), **({"write": 0.3} if i % 2 else {})},
            model=ModelStats(rows=rows, raised=i % 2, error=f"e{i}" if i % 2 else None,
                             chunk_rows=100 - i, warmup_ms=0.7 * i, tokens=i, padded_tokens=2 * i),
            quarantine=((None, "validation_error", i % 3),) if i % 3 else (("f 1", "in_range", 1),),
            batches=((rows, 0.1 + i / 7),),
            challengers={"c": ChallengerShard(path=f"s{i}", rows_scored=rows - 1, rows_rejected=1,
                                              compute_ms=1 / (i + 1))},
            preprocess=PreprocessStats(rows, {"KeyError": i}, {"KeyError": f"k{i}"}, f"t{i}" if i > 2 else None))

    results = [shard(i, "old" if i < 3 else "now" if i % 2 else None) for i in range(9)]
    summary = fold(results)
    verdict = DriftVerdict(columns={})
    metrics = run_metrics(Totals.of([r.record for r in results]), 2.0, 3.0, summary, 0.5, verdict,
                          attempt="now")
    assert metrics["shards_reused"] == 3.0 and metrics["rows_reused"] == 10.0 + 11.0 + 12.0
    stages: dict[str, float] = {}
    challengers: dict[str, float] = {}
    for r in results:
        for stage, value in r.seconds.items():
            stages[stage] = stages.get(stage, 0.0) + value
        for name, c in r.challengers.items():
            for key, value in (("rows_scored", c.rows_scored), ("rows_rejected", c.rows_rejected),
                               ("compute_ms", c.compute_ms)):
                challengers[f"challenger.{name}.{key}"] = challengers.get(f"challenger.{name}.{key}", 0.0) + value
    assert {k: v for k, v in metrics.items() if k.startswith("stage_seconds_")} == {
        f"stage_seconds_{k}": v for k, v in stages.items()}
    assert challenger_metrics(summary) == challengers
    model = sum((r.model for r in results), ModelStats())
    assert summary.model == model and metrics["model_warmup_ms"] == model.warmup_ms
    assert summary.preprocess == sum((r.preprocess for r in results), PreprocessStats())
    assert summary.preprocess.trace == "t3"
    assert summary.batches == tuple(b for r in results for b in r.batches)
    assert health_metrics(summary, 0.5) == {k: v for k, v in metrics.items() if k in health_metrics(summary, 0.5)}
    assert quarantine_counts(summary) == [(None, "validation_error", 9), ("f 1", "in_range", 3)]
    assert summary.totals == Totals.of([r.record for r in results])
