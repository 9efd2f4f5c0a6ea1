"""Issue 3: a SIGKILLed manager leaves no process; the next start cleans up after it."""

from __future__ import annotations

import os
import signal
import time

from conftest import wait_for


def test_manager_sigkill_leaves_nothing_and_start_recovers(daemon_factory):
    d = daemon_factory()
    st = d.status()
    # The tree: the manager and its children (gateway, engine, worker, their standbys), nothing else.
    assert sorted(d.tree()) == sorted([st.manager_pid, *(c.pid for c in st.children)])
    assert {c.kind for c in st.children} == {"gateway", "engine_core", "worker", "standby"}
    t0 = time.monotonic()
    os.kill(d.manager_pid, signal.SIGKILL)
    wait_for(lambda: not d.tree(), 120, what="every process of the tree to die with the manager")
    print(f"tree gone {time.monotonic() - t0:.2f}s after the manager's SIGKILL")  # a figure, not an assertion
    # What the dead manager left behind is stale, and must not be trusted.
    assert (d.runtime_dir / "control").exists() and (d.runtime_dir / "manager.pid").exists()
    assert d.cli("status").returncode == 3
    first = d.instance
    d.start()
    assert d.instance != first
    assert "removed what a dead manager left" in d.log("manager")
    r = d.openai().completions.create(model="default", prompt="def ", max_tokens=4, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    d.stop()
    assert not d.tree()
    assert d.cli("stop").returncode == 0  # stopping a stopped daemon says so, exit 0


def test_a_clean_stop_leaves_nothing_the_next_start_calls_a_dead_managers(daemon_factory):
    """Issue 51: after `servectl stop` the next start in the same directory finds nothing stale."""
    d = daemon_factory("[manager]\nwarm_standby = false\n")
    r = d.openai().completions.create(model="default", prompt="def ", max_tokens=2)  # metrics files written
    assert r.usage.completion_tokens == 2
    d.stop()
    left = sorted(str(p.relative_to(d.runtime_dir)) for p in d.runtime_dir.rglob("*")
                  if not p.is_dir() and "state" not in p.parts)
    d.start()
    log = (d.runtime_dir / "state" / "logs" / "manager.log").read_text()
    assert "removed what a dead manager left" not in log, (left, log[-2000:])
