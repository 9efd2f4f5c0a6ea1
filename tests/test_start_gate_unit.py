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
    assert choose_victim([r("a"), r("b", refused=True)]) == "a"  # not known idle: asked (it may refuse)
    assert choose_victim([r("a", state=S.STARTING), r("b", refused=True), r("c", pinned=True)]) is None
