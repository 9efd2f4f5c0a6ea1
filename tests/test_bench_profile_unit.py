"""bench/profile_step.py's window without servers: a step is a token at c=1, the engines' count above."""

from __future__ import annotations

import pytest

from bench.profile_step import Load

pytestmark = pytest.mark.unit


def loaded(stamps: list[float]) -> Load:
    load = Load("http://127.0.0.1:9", "x", concurrency=16)
    load.requests = [{"chunks": len(stamps), "completion_tokens": len(stamps), "prompt_tokens": 4}]
    load.stamps = [(t, 0) for t in stamps]
    return load


def test_at_c1_a_step_is_a_token():
    got = loaded([0.1 * i for i in range(10)]).window(0.0, 1.0)
    assert (got["tokens"], got["steps"], got["us_per_step"]) == (10, 10, 100000.0)


def test_above_c1_a_step_is_the_engines_count():
    got = loaded([0.1 * i for i in range(10)]).window(0.0, 1.0, steps=4)
    assert (got["tokens"], got["steps"], got["us_per_step"]) == (10, 4, 250000.0)
    assert loaded([0.5]).window(0.0, 1.0, steps=0)["us_per_step"] is None  # no step seen: no figure
