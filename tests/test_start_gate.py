"""Issue 35, item 3: models that share a device start one after the other; on disjoint devices together.

A daemon serves three copies of the bundled model: `a` and `b` on device label "0", `c` on
"1" (a model's `devices`; on this CPU machine they label it and change nothing else). At start
`b` waits for `a` to be ready while `c` starts beside `a`; killed together, the three restart
the same way, as the manager's events show.
"""

from __future__ import annotations

import os
import signal

from conftest import DEFAULT_MODEL_DIR, EventStream, wait_for

CONFIG = "[manager]\nwarm_standby = false\nbackoff_initial_s = 0.3\nfreeze_grace_s = 1.0\n" + "".join(
    f'[[models]]\nname = "{name}"\nmodel = "{DEFAULT_MODEL_DIR}"\ndevices = "{dev}"\n'
    for name, dev in (("a", "0"), ("b", "0"), ("c", "1")))


def engines(d) -> dict:
    return {c.model: c for c in d.status().children if c.kind == "engine_core"}


def test_starts_are_one_at_a_time_per_device(daemon_factory):
    d = daemon_factory(CONFIG)
    e = engines(d)
    a_ready = e["a"].since  # its state's time: ready since
    assert e["b"].started_at >= a_ready, "b started while a was starting on device 0"
    assert e["c"].started_at < a_ready, "c (device 1) waited for a (device 0)"
    assert "waiting to start: model a is starting on device 0" in d.log("manager")

    with EventStream(d, "a") as events:
        pids = {m: e[m].pid for m in "abc"}
        for m in "abc":
            os.kill(pids[m], signal.SIGKILL)

        def ready_again(seen, m: str) -> bool:  # ready after its kill
            mine = [ev.state for ev in seen if ev.component == f"model:{m}"]
            return "exited" in mine and "ready" in mine[mine.index("exited"):]

        def all_ready(seen) -> bool:
            return all(ready_again(seen, m) for m in "abc")

        seen = events.until(all_ready, 300, what="a, b and c ready again")
    order = [(ev.model, ev.state, ev.detail) for ev in seen if ev.kind == "model"]
    order = order[next(i for i, (_, state, _) in enumerate(order) if state == "exited"):]  # from the kills on
    first = {}
    for i, (m, s, _) in enumerate(order):
        first.setdefault((m, s), i)
    a_start, b_start = first[("a", "starting")], first[("b", "starting")]
    # whichever of a and b started first, the other started only once it was ready
    lead, follow = ("a", "b") if a_start < b_start else ("b", "a")
    assert first[(follow, "starting")] > first[(lead, "ready")], order
    assert any(m == follow and "waiting to start" in detail for m, _, detail in order), order
    assert first[("c", "starting")] < first[(lead, "ready")], order  # device 1: beside the lead
    wait_for(lambda: all(str(m.state) == "ready" for m in d.status().models), 60, what="every model ready")
