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
    r = d.openai().completions.create(model="default", prompt="def ", max_tokens=4, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    d.stop()
    assert not d.tree()
    assert d.cli("stop").returncode == 0  # stopping a stopped daemon says so, exit 0
