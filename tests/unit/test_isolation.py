"""Tests for batchinfer.rows.isolation.run_isolating: bisecting a batch to isolate failing rows."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.rows.isolation import MAX_LONE_FAILURES, run_isolating


class Model:
    """Fails any call whose rows include a bad row; records every call."""

    def __init__(self, bad=(), message="bad input"):
        self.bad = set(bad)
        self.message = message
        self.calls: list[tuple[int, int]] = []

    def __call__(self, start: int, stop: int):
        self.calls.append((start, stop))
        assert 0 <= start < stop
        hit = [r for r in range(start, stop) if r in self.bad]
        if hit:
            raise ValueError(f"{self.message} at row {hit[0]}")
        return list(range(start, stop))


def _check_partition(n_rows: int, done, failed, bad) -> None:
    """Every row in exactly one of done/failed; both in row order; results match ranges."""
    done_rows = [r for start, stop, _ in done for r in range(start, stop)]
    failed_rows = [row for row, _ in failed]
    assert sorted(done_rows + failed_rows) == list(range(n_rows))
    assert not set(done_rows) & set(failed_rows)
    assert done_rows == sorted(done_rows)
    assert failed_rows == sorted(failed_rows)
    assert set(failed_rows) == set(bad)
    for start, stop, result in done:
        assert start < stop
        assert result == list(range(start, stop))


def test_no_rows_no_calls():
    model = Model()
    assert run_isolating(0, model) == ([], [])
    assert model.calls == []


def test_all_good_is_one_call():
    model = Model()
    done, failed = run_isolating(100, model)
    assert done == [(0, 100, list(range(100)))]
    assert failed == []
    assert model.calls == [(0, 100)]


def test_single_bad_row_single_row_batch():
    model = Model(bad={0})
    done, failed = run_isolating(1, model)
    assert done == []
    assert failed == [(0, "ValueError: bad input at row 0")]


@pytest.mark.parametrize("bad", [{0}, {99}, {50}, {0, 99}, {1, 2, 3}, {10, 11, 60, 98},
                                 set(range(0, 100, 7))])
def test_bad_rows_isolated_at_positions(bad):
    model = Model(bad=bad)
    done, failed = run_isolating(100, model)
    _check_partition(100, done, failed, bad)
    for row, message in failed:
        assert message == f"ValueError: bad input at row {row}"


def test_one_bad_row_costs_logarithmic_calls():
    n = 1 << 12
    model = Model(bad={1234})
    done, failed = run_isolating(n, model)
    _check_partition(n, done, failed, {1234})
    assert len(model.calls) <= 2 * math.ceil(math.log2(n)) + 1
    assert len(done) <= math.ceil(math.log2(n))


def test_done_ranges_are_maximal_halves_in_order():
    model = Model(bad={5})
    done, failed = run_isolating(8, model)
    assert [(s, e) for s, e, _ in done] == [(0, 4), (4, 5), (6, 8)]
    assert failed == [(5, "ValueError: bad input at row 5")]
    # left halves run before right halves
    assert model.calls == [(0, 8), (0, 4), (4, 8), (4, 6), (4, 5), (5, 6), (6, 8)]


def test_error_message_is_one_line_and_bounded():
    def run(start, stop):
        raise RuntimeError("line one\n   line two\t" + "x" * 1000)

    done, failed = run_isolating(3, run)
    assert done == []
    assert [row for row, _ in failed] == [0, 1, 2]
    for _, message in failed:
        assert "\n" not in message
        assert message.startswith("RuntimeError: line one line two x")
        assert len(message) <= len("RuntimeError: ") + 300


def test_empty_error_message_uses_type_name():
    def run(start, stop):
        raise ValueError()

    _, failed = run_isolating(1, run)
    assert failed == [(0, "ValueError: ValueError")]


def test_lone_failure_cap_for_model_that_always_fails():
    n = 100_000
    calls = []

    def run(start, stop):
        calls.append((start, stop))
        raise RuntimeError("model is broken")

    done, failed = run_isolating(n, run)
    assert done == []
    assert [row for row, _ in failed] == list(range(n))
    assert all(message == "RuntimeError: model is broken" for _, message in failed)
    singles = [c for c in calls if c[1] - c[0] == 1]
    assert len(singles) == MAX_LONE_FAILURES
    # far fewer calls than rows: the cap stops the row-by-row search
    assert len(calls) <= 2 * MAX_LONE_FAILURES + 2 * math.ceil(math.log2(n))


def test_cap_does_not_apply_once_something_succeeded():
    n = 2 * MAX_LONE_FAILURES + 64
    bad = set(range(1, n, 2))  # every odd row fails; even rows succeed alone
    model = Model(bad=bad)
    done, failed = run_isolating(n, model)
    _check_partition(n, done, failed, bad)
    assert len(failed) > MAX_LONE_FAILURES


def test_results_are_returned_as_given():
    sentinel = object()
    done, failed = run_isolating(4, lambda start, stop: sentinel)
    assert done == [(0, 4, sentinel)]
    assert done[0][2] is sentinel


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n_rows=st.integers(min_value=0, max_value=300))
def test_random_bad_rows_are_isolated_exactly(data, n_rows):
    bad = data.draw(st.sets(st.integers(min_value=0, max_value=max(n_rows - 1, 0)),
                            max_size=min(n_rows, 40))) if n_rows else set()
    model = Model(bad=bad)
    done, failed = run_isolating(n_rows, model)
    _check_partition(n_rows, done, failed, bad)
    for row, message in failed:
        assert message == f"ValueError: bad input at row {row}"
    # bisection: never more than about 2 calls per bad row per level, plus the first call
    if n_rows:
        levels = math.ceil(math.log2(n_rows)) + 1
        assert len(model.calls) <= 1 + 2 * len(bad) * levels
