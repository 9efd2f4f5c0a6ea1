"""bench/spread.py without servers: the order of alternating rounds, and the median/spread table."""

from __future__ import annotations

import pytest

from bench.spread import alternate, cell, ratio_row, spread, spreads

pytestmark = pytest.mark.unit


def test_rounds_alternate_in_order_or_swapped_every_other_round():
    order = []
    raw = alternate(3, ("a", "b"), lambda i, side: order.append((i, side)) or f"{side}{i}")
    assert order == [(0, "a"), (0, "b"), (1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert raw == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"]}
    order.clear()
    raw = alternate(3, ("a", "b"), lambda i, side: order.append((i, side)) or i, swap=True)
    assert order == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert list(raw) == ["a", "b"] and raw["b"] == [0, 1, 2]


def test_a_figure_is_its_median_and_spread_over_the_rounds_that_have_it():
    assert spread([3, 1, 2]) == {"median": 2, "min": 1, "max": 3}
    assert spread([1.23456, 2.0], 3) == {"median": 1.617, "min": 1.235, "max": 2.0}
    rounds = [{"x": 1.0, "y": None}, {"x": 3.0, "y": None}, {"x": 2.0, "y": None}]
    assert spreads(rounds, ("x", "y"), lambda r, f: r[f]) == {"x": {"median": 2.0, "min": 1.0, "max": 3.0}}


def test_a_row_shows_both_spreads_and_the_ratio_of_the_medians():
    a, b = spread([10, 12, 11]), spread([20, 21, 25])
    assert cell(a) == "11.0 [10.0–12.0]" and cell(a, " – ") == "11.0 [10.0 – 12.0]"
    assert ratio_row("c=1", "tok/s", a=a, b=b) == "| c=1 | tok/s | 11.0 [10.0–12.0] | 21.0 [20.0–25.0] | 1.91× |"
