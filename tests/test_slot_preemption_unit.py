"""engine_core/slot_preemption.py's choice (``victim_for``), pure: which running request a better
waiting one preempts. On vLLM's real scheduler: test_slot_preemption.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_core.slot_preemption import victim_for

pytestmark = pytest.mark.unit


def req(priority: int, arrival: float, lora: int = 0, preemptions: int = 0):
    return SimpleNamespace(priority=priority, arrival_time=arrival, num_preemptions=preemptions,
                           lora_request=SimpleNamespace(lora_int_id=lora) if lora else None)


def test_the_worst_priority_then_the_latest_arrival_is_the_victim():
    running = [req(0, 1), req(2000, 2), req(2000, 3), req(1000, 4)]
    assert victim_for(running, req(0, 9)) is running[2]


def test_among_the_worst_the_one_preempted_least_pays_then_the_latest():
    running = [req(2000, 1), req(2000, 2, preemptions=1), req(2000, 3, preemptions=1), req(0, 4)]
    assert victim_for(running, req(0, 9)) is running[0]
    running[0].num_preemptions = 1
    assert victim_for(running, req(0, 9)) is running[2]


def test_only_a_strictly_better_priority_preempts():
    running = [req(1000, 1), req(1000, 2)]
    assert victim_for(running, req(1000, 0.5)) is None  # earlier arrival alone is not enough
    assert victim_for(running, req(2000, 9)) is None
    assert victim_for(running, req(999, 9)) is running[1]
    assert victim_for([], req(0, 9)) is None


def test_a_lora_that_could_not_run_preempts_nobody():
    running = [req(0, 1, lora=1), req(1000, 2, lora=2)]
    # max_loras = 2, both in use: an adapter 3 request fits only if the victim's adapter frees
    assert victim_for(running, req(0, 9, lora=3), loras_full={1, 2}) is running[1]
    running = [req(0, 1, lora=1), req(1000, 2, lora=2), req(500, 3, lora=2)]
    assert victim_for(running, req(0, 9, lora=3), loras_full={1, 2}) is None
    assert victim_for(running, req(0, 9, lora=2), loras_full={1, 2}) is running[1]
    assert victim_for(running, req(0, 9), loras_full={1, 2}) is running[1]  # no adapter: always fits


@given(st.lists(st.tuples(st.integers(-5, 5), st.floats(0, 100)), min_size=1, max_size=20),
       st.integers(-6, 6))
def test_the_victim_is_never_better_than_the_request_it_makes_room_for(pairs, best):
    running = [req(p, a) for p, a in pairs]
    victim = victim_for(running, req(best, 1000))
    if victim is None:
        assert best >= max(p for p, _ in pairs)
    else:
        assert victim.priority > best and victim.priority == max(p for p, _ in pairs)
