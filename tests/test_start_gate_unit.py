"""One start at a time per device (issue 35, item 3): the labels, the queue (no daemon, no vLLM)."""

from __future__ import annotations

import pytest

from manager.start_gate import CPU, StartGate, blocker, device_labels
from servectl import config as C

pytestmark = pytest.mark.unit


def model(name: str, devices: str | None = None, tp: int = 1) -> C.ModelConfig:
    return C.ModelConfig(name=name, model="/m", devices=devices, tensor_parallel_size=tp)


def test_device_labels():
    assert device_labels(model("a"), accelerator=False) == (CPU,)
    assert device_labels(model("a", tp=2), accelerator=True) == ("0", "1")
    assert device_labels(model("a", devices="2, 3"), accelerator=True) == ("2", "3")
    assert device_labels(model("a", devices="1"), accelerator=False) == ("1",)  # said: the devices it uses


def test_blocker():
    assert blocker(("0",), {}) is None
    assert blocker(("0", "1"), {"x": ("1", "2")}) == ("x", "1")
    assert blocker(("0",), {"x": ("1",)}) is None


class GroupDouble:
    def __init__(self, gate: StartGate, name: str, devices: str | None = None):
        self.gate, self.name, self.cfg = gate, name, model(name, devices)
        self.started = 0
        self.reason: str | None = None

    def start(self) -> None:  # as EngineGroup.start: ask the gate, start if it says so
        self.reason = self.gate.admit(self)
        if self.reason is None:
            self.started += 1


def test_models_sharing_a_device_start_one_after_another_in_order():
    gate = StartGate(accelerator=False)
    a, b, c = (GroupDouble(gate, n) for n in "abc")
    for g in (a, b, c):
        g.start()
    assert (a.started, b.started, c.started) == (1, 0, 0)
    assert "model a is starting on device cpu" in b.reason
    gate.done(a)  # a is ready: b next, c still waits (b starts on cpu now)
    assert (b.started, c.started) == (1, 0)
    gate.done(b)
    assert c.started == 1
    gate.done(c)
    assert not gate.starting and not gate.waiting


def test_models_on_disjoint_devices_start_together():
    gate = StartGate(accelerator=True)
    a, b, c = GroupDouble(gate, "a", "0"), GroupDouble(gate, "b", "1"), GroupDouble(gate, "c", "0,1")
    for g in (a, b, c):
        g.start()
    assert (a.started, b.started, c.started) == (1, 1, 0)
    gate.done(a)
    assert c.started == 0  # b still holds device 1
    gate.done(b)
    assert c.started == 1


def test_a_stopped_model_is_not_started_later_and_done_twice_is_harmless():
    gate = StartGate(accelerator=False)
    a, b = GroupDouble(gate, "a"), GroupDouble(gate, "b")
    a.start()
    b.start()
    gate.forget(b)
    gate.done(a)
    gate.done(a)
    assert b.started == 0 and not gate.starting


# ---- max_loaded_models: which model makes room (issue 35) -------------------------------------

def test_the_longest_idle_unpinned_model_makes_room():
    from manager.budget import Resident, choose_victim
    from servectl.wire.vocab import ModelState as S

    def r(name, state=S.READY, pinned=False, idle=None, refused=False):
        return Resident(name, state, pinned, idle, refused)

    assert choose_victim([r("a", idle=5.0), r("b", idle=3.0), r("c")]) == "b"  # idle longest
    assert choose_victim([r("a", pinned=True, idle=1.0), r("b", idle=9.0)]) == "b"  # never a pinned one
    assert choose_victim([r("a"), r("b", refused=True)]) is None  # busy or just started: never
    unknown = Resident("a", S.READY, False, None, False, freezes=False)  # freezing off: never says idle
    assert choose_victim([unknown, r("b", refused=True)]) == "a"  # asked (its engine refuses if busy)
    assert choose_victim([r("a", state=S.STARTING), r("b", refused=True), r("c", pinned=True)]) is None


class Budgeted:
    """What Budget sees of an EngineGroup."""

    def __init__(self, name: str, state, gate: StartGate, idle_since: float | None = None, pinned: bool = False,
                 footprint: int | None = None, devices: str | None = None):
        from types import SimpleNamespace

        self.name, self.state, self.idle_since = name, state, idle_since
        self.cfg = SimpleNamespace(pinned=pinned, devices=devices, tensor_parallel_size=1)
        self.footprint_bytes, self.footprint_source, self.estimate, self.unfit = footprint, "measured", None, None
        self.host = SimpleNamespace(start_gate=gate)
        self.release_refused, self.freezing = False, True
        self.evicted: list[str] = []

    def evict(self, reason: str) -> bool:
        from servectl.wire.vocab import ModelState as S

        self.evicted.append(reason)
        self.state = S.RELEASING
        return True


def test_one_eviction_at_a_time_until_the_room_is_there():
    import asyncio

    from manager.budget import Budget
    from servectl.wire.vocab import ModelState as S

    async def scenario() -> None:
        gate = StartGate(accelerator=False)
        a, b = Budgeted("a", S.READY, gate, idle_since=1.0), Budgeted("b", S.READY, gate, idle_since=2.0)
        c, e = Budgeted("c", S.RELEASED, gate), Budgeted("e", S.RELEASED, gate)
        budget = Budget(2, {g.name: g for g in (a, b, c, e)})
        for g in (c, e):  # as EngineGroup.start: starting once admitted
            g.start = lambda g=g: budget.admit(g) is None and setattr(g, "state", S.STARTING)
        assert "waiting for room" in budget.admit(c)
        assert a.evicted and not b.evicted and budget.releasing == "a"  # the longest idle
        assert "waiting" in budget.admit(e)  # after c, whatever comes
        a.state = S.STOPPING  # on its way out: still loaded, still the one released for c
        budget.changed(a)
        await asyncio.sleep(0)  # the retry
        assert not b.evicted, "a second model released for one that needs one"
        a.state = S.RELEASED
        budget.changed(a)
        await asyncio.sleep(0)
        assert c.state is S.STARTING and e in budget.waiting  # c asked first: its turn
        assert budget.releasing == "b" and b.evicted  # and now room is made for e

    asyncio.run(scenario())


def test_a_model_waiting_for_its_devices_is_counted_once():
    from manager.budget import Budget
    from servectl.wire.vocab import ModelState as S

    gate = StartGate(accelerator=False)
    a = Budgeted("a", S.BACKOFF, gate)
    gate.waiting.append(a)
    c = Budgeted("c", S.RELEASED, gate)
    assert Budget(2, {"a": a, "c": c}).admit(c) is None
