"""Issue 57, without vLLM: a standby's priority (servectl/priority.py) lowered and given back on
every thread, what an unprivileged daemon may do, a roll passing standbys on and warming standbys
paced by serving (manager/standbys.py; a sleeping interpreter stands in for a standby's import).

Priorities are changed in forked children only (the test process keeps its own); ``nobody`` stands
in for a service user (tests run as root, which has CAP_SYS_NICE).
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from as_user import NOBODY, run_as
from manager.children import Child, ChildState, Standby
from manager.standbys import StandbyPool
from servectl import config as C
from servectl import priority

pytestmark = pytest.mark.unit


def lower_then_restore() -> dict:
    """In a child: lower, start a thread (it inherits), read both, restore, read again."""
    serving, cpu = priority.lower()
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        lowered = {tid: priority.of(tid) for tid in priority.threads()}
        failed = priority.restore(serving)
        back = {tid: priority.of(tid) for tid in priority.threads()}
    finally:
        stop.set()
        t.join()
    return dict(serving=serving, cpu=cpu, lowered=lowered, failed=failed, back=back)


def in_child(fn, *args):
    return run_as(os.getuid(), fn, *args)  # a fork that stays root


def test_lowered_threads_are_idle_and_every_thread_gets_its_priority_back():
    got = in_child(lower_then_restore)
    assert got["cpu"] and got["failed"] == 0
    assert len(got["lowered"]) == 2  # the main thread and the one born after lowering
    for p in got["lowered"].values():
        assert p.policy == os.SCHED_IDLE and p.ioprio == priority.IOPRIO_IDLE
    for p in got["back"].values():
        assert p == got["serving"] and not p.idle


def test_a_nice_serving_priority_comes_back_as_it_was():
    def nice_then(fn):
        os.setpriority(os.PRIO_PROCESS, 0, 5)
        return fn()

    got = in_child(nice_then, lower_then_restore)
    assert got["serving"].nice == 5
    assert all(p == got["serving"] for p in got["back"].values())


def test_without_cap_sys_nice_or_rlimit_nice_only_io_is_lowered():
    got = run_as(NOBODY, lower_then_restore)
    assert not got["cpu"] and got["failed"] == 0
    for p in got["lowered"].values():
        assert p.policy == got["serving"].policy and p.ioprio == priority.IOPRIO_IDLE  # I/O needs no permission
    assert all(p == got["serving"] for p in got["back"].values())


@pytest.mark.parametrize("nice,rlimit,caps,allowed", [
    (0, 0, 0, False),  # a service user by default
    (0, 20, 0, True),  # LimitNICE=+0: back to nice 0
    (0, 19, 0, False),
    (5, 15, 0, True),  # a unit with Nice=5 needs only LimitNICE=+5
    (-5, 20, 0, False),  # a negative serving nice value needs more
    (0, 0, 1 << priority.CAP_SYS_NICE, True),
    (0, resource.RLIM_INFINITY, 0, True),
])
def test_who_may_leave_sched_idle(nice, rlimit, caps, allowed):
    assert priority.allows_nice(nice, rlimit, caps) is allowed


def test_the_shipped_unit_allows_the_serving_nice_value():
    unit = (Path(__file__).parent.parent / "systemd" / "servectl.service").read_text()
    assert "\nLimitNICE=+0\n" in unit


# ---- a roll passes standbys on -----------------------------------------------------------------

def group(name: str, ranks: int) -> SimpleNamespace:
    def child(component: str) -> Child:
        return Child(component, "engine_core", name, Path("/dev/null"), lambda c, d: None, lambda c: None)

    return SimpleNamespace(name=name, engine=child(f"engine_core:{name}"),
                           workers=[child(f"worker:{name}:{r}") for r in range(ranks)])


def pool_with(g: SimpleNamespace) -> StandbyPool:
    host = SimpleNamespace(settings=C.ManagerConfig(warm_standby=True), log_dir=Path("/dev/null"),
                           shutting_down=False)
    pool = StandbyPool(host)
    for member in [g.engine, *g.workers]:
        pool.waiting[member.component] = Standby(member, Path("/dev/null"), lambda c, d: None, lambda c: None)
    return pool


def test_a_roll_passes_each_members_standby_to_the_same_member_of_the_new_group():
    old, new = group("a", 2), group("a@1", 2)
    pool = pool_with(old)
    engine_standby = pool.waiting["engine_core:a"]
    assert pool.pass_on(old, new) == 3
    assert sorted(pool.waiting) == ["engine_core:a@1", "worker:a@1:0", "worker:a@1:1"]
    assert pool.waiting["engine_core:a@1"] is engine_standby
    assert (engine_standby.member, engine_standby.model, engine_standby.component) == \
        ("engine_core:a@1", "a@1", "standby:engine_core:a@1")
    assert pool.of_model("a") == [] and len(pool.of_model("a@1")) == 3


def test_a_roll_to_fewer_ranks_passes_what_has_a_successor():
    old, new = group("a", 2), group("a@1", 1)
    pool = pool_with(old)
    assert pool.pass_on(old, new) == 2
    assert sorted(pool.waiting) == ["engine_core:a@1", "worker:a:1", "worker:a@1:0"]  # rank 1's goes with a


# ---- warming waits while a model serves ------------------------------------------------------

def proc_state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]


def until_state(pid: int, want: str) -> str:
    end = time.monotonic() + 10
    while (got := proc_state(pid)) != want and time.monotonic() < end:
        time.sleep(0.01)
    return got


def test_warming_standbys_stop_while_a_model_serves_and_go_on_when_all_are_idle():
    g = group("a", 1)
    pool = pool_with(g)
    importing, warm = pool.waiting["engine_core:a"], pool.waiting["worker:a:0"]
    for standby in (importing, warm):
        standby.spawn([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    warm.set(ChildState.READY)  # said W: it sleeps in recvmsg, nothing to stop
    try:
        pool.pace(True)
        assert not pool.paused and proc_state(importing.pid) != "T"  # not before it said L (no PDEATHSIG yet)
        pool.pace(False)
        importing.importing = warm.importing = True  # (both said L)
        pool.pace(True)
        assert until_state(importing.pid, "T") == "T" and proc_state(warm.pid) != "T"
        pool.pace(True)  # (again: nothing changes)
        assert pool.paused == {importing}
        pool.pace(False)
        assert until_state(importing.pid, "S") == "S" and not pool.paused and proc_state(warm.pid) != "T"
        pool.pace(True)
        assert until_state(importing.pid, "T") == "T"
        pool._release(importing)  # a stopped standby acts on its SIGTERM: it is continued
        assert importing.popen.wait(10) == -signal.SIGTERM and not pool.paused
    finally:
        for standby in (importing, warm):
            if standby.popen.poll() is None:
                standby.popen.kill()
                standby.popen.wait()
