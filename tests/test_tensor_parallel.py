"""Issue 2: tensor_parallel_size 2 gives two manager-owned workers that serve."""

from __future__ import annotations

import os
import signal

import pytest

from conftest import DaemonFactory, read_stat, wait_for


@pytest.fixture(scope="module")
def tp_daemon(tmp_path_factory):
    with DaemonFactory(tmp_path_factory, "tp2") as make:
        yield make(args=["--tp", "2"])


def test_tp2_serves_with_two_manager_owned_workers(tp_daemon, daemon):
    st = tp_daemon.status()
    workers = [c for c in st.children if c.kind == "worker"]
    assert len(workers) == 2
    for w in workers:
        assert int(read_stat(w.pid)[1]) == st.manager_pid
    prompt = "def main():\n"
    r = tp_daemon.openai().completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0)
    assert r.usage.completion_tokens == 12
    # Same greedy output as the single-worker engine of the shared daemon.
    single = daemon.openai().completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == single.choices[0].text


def test_tp2_restart_hands_every_rank_to_its_warm_standby(tp_daemon):
    """The engine gets both workers' pidfds through the standby's channel (SCM_RIGHTS)."""
    warm = tp_daemon.wait_standbys_warm(3)
    os.kill(tp_daemon.child("worker:default:1").pid, signal.SIGKILL)

    def restarted():
        st = tp_daemon.status()
        return (all(m.state == "ready" for m in st.models)
                and {c.component: c.pid for c in st.children}.get("engine_core:default") == warm["engine_core:default"].pid)

    wait_for(restarted, 180, interval=0.5, what="the group to come back on its standbys",
             diagnose=lambda: tp_daemon.log_tails("manager", "engine_core:default"))
    now = {c.component: c.pid for c in tp_daemon.status().children}
    for member in ("worker:default:0", "worker:default:1"):
        assert now[member] == warm[member].pid, member
    r = tp_daemon.openai().completions.create(model="default", prompt="def main():\n", max_tokens=12, temperature=0)
    assert r.usage.completion_tokens == 12
    # The engine drives both ranks: freezing goes through the passed pidfds.
    wait_for(lambda: all(c.state == "idle (frozen)" for c in tp_daemon.status().children if c.kind == "worker"),
             60, what="both workers frozen through the engine's pidfds")
