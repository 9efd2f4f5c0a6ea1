"""The manager's pure parts, without processes: the group state machine, reload planning."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from manager.budget import Budget
from manager.children import Child, ChildState
from manager.group import TRANSITIONS, BadTransition, EngineGroup, GroupState
from manager.reload import plan_reload
from manager.start_gate import StartGate
from servectl import config as C
from servectl.wire import control as P
from servectl.tasks import Tasks

pytestmark = pytest.mark.unit
S = GroupState


class StandbysDouble:
    def __init__(self):
        self.refilled: list[str] = []
        self.released: list[str] = []

    def refill(self, group) -> None:
        self.refilled.append(group.name)

    def release_model(self, model: str) -> list:
        self.released.append(model)
        return []

    def take(self, member, env):
        return None

    def of_model(self, model: str) -> list:
        return []


class HostDouble:
    """What EngineGroup sees of its supervisor, recording what it is asked."""

    def __init__(self, tmp: Path, **settings):
        self.settings = C.ManagerConfig(**settings)
        self.gateway_cfg = C.GatewayConfig()
        self.runtime_dir = tmp
        self.log_dir = tmp
        self.standbys = StandbysDouble()
        self.start_gate = StartGate(accelerator=False)
        self.budget = Budget(None, {})
        self.shutting_down = False
        self.tasks = Tasks(logging.getLogger("test"))
        self.published: list[str] = []
        self.child_events: list[tuple[str, str]] = []
        self.sent: list = []

    def events_slot(self, group) -> int:
        return 0

    def child_env(self, extra):
        return dict(extra)

    def watch(self, child):
        pass

    def on_child_change(self, child, detail):
        self.child_events.append((child.component, str(child.state)))

    def on_group_change(self, group):
        self.published.append(str(group.state))

    def send_to_engine(self, group, msg):
        self.sent.append(msg)

    async def wait_exit(self, children, grace_s):
        pass


class Alive:
    """Marks a Child alive without a process: signals go nowhere."""

    @staticmethod
    def make(child: Child) -> None:
        child.pidfd = -1
        child.signal = lambda sig: None  # type: ignore[method-assign]

    @staticmethod
    def die(child: Child, how: str = "signal SIGKILL") -> None:
        child.pidfd = None
        child.last_exit = how


def group_in(tmp_path, state: GroupState, tp: int = 1, **settings) -> tuple[EngineGroup, HostDouble]:
    host = HostDouble(tmp_path, **settings)
    group = EngineGroup(C.ModelConfig(name="m", model="/x", tensor_parallel_size=tp), host)
    for c in group.children:
        Alive.make(c)
    group.state = state
    return group, host


def test_transition_table_is_closed_and_every_state_can_be_left():
    assert set(TRANSITIONS) == set(GroupState)
    for state, targets in TRANSITIONS.items():
        assert targets or state is S.REMOVED, state
        assert targets <= set(GroupState)
    # The ways out of failed and backoff: a (re)start, a stop, or released as too large for the budget.
    assert TRANSITIONS[S.FAILED] == TRANSITIONS[S.BACKOFF] == {S.STARTING, S.STOPPING, S.RELEASED}
    assert TRANSITIONS[S.REMOVED] == frozenset()  # terminal
    # A stop ends stopped, or released when it is an idle model's unload.
    assert TRANSITIONS[S.STOPPING] == {S.STOPPED, S.RELEASED}


def test_illegal_transition_raises_and_changes_nothing(tmp_path):
    group, host = group_in(tmp_path, S.STOPPED)
    with pytest.raises(BadTransition):
        group._enter(S.READY)
    assert group.state is S.STOPPED
    assert host.published == []


def test_swap_only_from_expected_states(tmp_path):
    group, host = group_in(tmp_path, S.READY)
    assert group._swap({S.STARTING}, S.READY) is False
    assert host.published == []
    assert group._swap({S.READY}, S.DRAINING) is True
    assert group.state is S.DRAINING
    assert host.published == ["draining"]


def test_ready_only_for_the_current_incarnation(tmp_path):
    group, host = group_in(tmp_path, S.STARTING)
    group.incarnation = "new"
    group.on_ready(P.ChildReady(component="engine_core:m", pid=1, incarnation="old"))
    assert group.state is S.STARTING
    group.on_ready(P.ChildReady(component="engine_core:m", pid=1, incarnation="new"))
    assert group.state is S.READY
    assert host.standbys.refilled == ["m"]
    assert [s for c, s in host.child_events] == ["ready", "ready"]


def test_member_exit_kills_the_rest_then_backs_off_once_all_are_gone(tmp_path):
    async def scenario():
        group, host = group_in(tmp_path, S.READY, tp=2, backoff_initial_s=5.0)
        killed = []
        for c in group.children:
            c.signal = lambda sig, c=c: killed.append((c.component, sig))
        worker0, worker1 = group.workers
        Alive.die(worker0)
        group.on_member_exit(worker0)
        assert group.state is S.EXITED
        assert group.reason == "worker:m:0 signal SIGKILL"
        assert {c for c, _ in killed} == {"engine_core:m", "worker:m:1"}
        Alive.die(worker1)
        group.on_member_exit(worker1)
        assert group.state is S.EXITED  # the engine is still alive
        Alive.die(group.engine)
        group.on_member_exit(group.engine)
        assert group.state is S.BACKOFF
        assert group.restart_timer is not None
        group.restart_timer.cancel()
        assert host.published == ["exited", "backoff"]

    asyncio.run(scenario())


def test_crash_loop_fails_the_group_and_releases_its_standbys(tmp_path):
    async def scenario():
        group, host = group_in(tmp_path, S.READY, crash_loop_count=1)
        Alive.die(group.workers[0])
        group.on_member_exit(group.workers[0])
        Alive.die(group.engine)
        group.on_member_exit(group.engine)
        assert group.state is S.FAILED
        assert "1 exits within" in group.reason
        assert host.standbys.released == ["m"]
        assert group.restart_timer is None

    asyncio.run(scenario())


def test_exits_while_stopping_are_not_crashes(tmp_path):
    group, host = group_in(tmp_path, S.STOPPING)
    Alive.die(group.engine)
    group.on_member_exit(group.engine)
    assert group.state is S.STOPPING
    assert host.published == []


def test_a_crash_while_draining_ends_the_drain(tmp_path):
    async def scenario():
        group, host = group_in(tmp_path, S.READY)
        drain = asyncio.ensure_future(group.drain(timeout_s=60))
        await asyncio.sleep(0)  # let drain() send Drain and wait
        assert group.state is S.DRAINING
        assert [type(m).__name__ for m in host.sent] == ["Drain"]
        Alive.die(group.engine)
        group.on_member_exit(group.engine)
        await asyncio.wait_for(drain, 1)
        assert group.drained.result() is False
        assert group.state is S.EXITED

    asyncio.run(scenario())


def test_frozen_workers_are_a_state_of_their_own(tmp_path):
    group, host = group_in(tmp_path, S.READY)
    group.on_frozen(True)
    assert group.frozen is True
    assert group.workers[0].state is ChildState.FROZEN
    assert group.engine.state is not ChildState.FROZEN
    group.on_frozen(False)
    assert group.workers[0].state is ChildState.READY
    group.frozen = True
    group._enter(S.STOPPING)
    assert group.frozen is False


def test_hang_report_of_an_old_incarnation_is_ignored(tmp_path):
    group, host = group_in(tmp_path, S.READY)
    group.incarnation = "now"
    assert group.kill_hung("before") is False
    assert group.killed_hung is False
    assert group.kill_hung("now") is True


def test_an_engine_killed_as_hung_says_so_in_its_exit(tmp_path):
    """Gateways send its unstarted requests nowhere (security issue 53: the event's ``hung``)."""
    async def scenario():
        group, host = group_in(tmp_path, S.READY)
        group.incarnation = "now"
        for c in group.children:
            c.signal = lambda sig: None
        assert group.kill_hung("now") is True and group.killed_hung
        for c in group.children:
            Alive.die(c)
            group.on_member_exit(c)
        assert group.state is S.BACKOFF and "killed as hung" in group.reason
        group.restart_timer.cancel()

    asyncio.run(scenario())


# ---- reload planning ---------------------------------------------------------------

def model(name: str, **kw) -> C.ModelConfig:
    return C.ModelConfig(name=name, model=f"/models/{name}", **kw)


def test_plan_reload_touches_only_what_differs():
    served = [model("a"), model("b"), model("c")]
    new = C.Config(models=[model("a"), model("b", tensor_parallel_size=2), model("d")])
    plan = plan_reload(served, C.GatewayConfig(), new)
    assert [m.name for m in plan.added] == ["d"]
    assert plan.removed == ["c"]
    assert [(m.name, m.tensor_parallel_size) for m in plan.changed] == [("b", 2)]
    assert plan.gateway is None
    assert plan.summary() == "added d; removed c; changed b; gateway unchanged"


def test_plan_reload_of_the_same_config_is_empty():
    served = [model("a", env={"X": "1"})]
    plan = plan_reload(served, C.GatewayConfig(port=9000), C.Config(gateway=C.GatewayConfig(port=9000),
                                                                     models=[model("a", env={"X": "1"})]))
    assert (plan.added, plan.removed, plan.changed, plan.gateway) == ([], [], [], None)


def test_plan_reload_replaces_gateways_only_when_their_section_changed():
    new_gateway = C.GatewayConfig(port=9001, processes=2)
    plan = plan_reload([model("a")], C.GatewayConfig(port=9000), C.Config(gateway=new_gateway, models=[model("a")]))
    assert plan.gateway == new_gateway
    assert plan.summary().endswith("gateway changed")


# ---- worker threads ------------------------------------------------------------------

def cpus(n: int, nodes: int = 1, smt: int = 1):
    from manager.worker_cpus import Cpu

    per_node = n // nodes
    return [Cpu(i, i // per_node, (0, (i % per_node) // smt + 1000 * (i // per_node))) for i in range(n)]


def test_cpu_workers_leave_one_core_per_rank_to_the_engine_and_float_by_default():
    from manager.worker_cpus import worker_envs

    assert worker_envs(1, False, {}, cpus(2), "x86_64") == [{"OMP_NUM_THREADS": "1"}]
    assert worker_envs(1, False, {}, cpus(16), "x86_64") == [{"OMP_NUM_THREADS": "15"}]
    assert worker_envs(2, False, {}, cpus(16), "x86_64") == [{"OMP_NUM_THREADS": "7"}] * 2
    assert worker_envs(2, False, {}, cpus(2), "x86_64") == [{"OMP_NUM_THREADS": "1"}] * 2


def worker_envs_auto(ranks, env=None, cpu_list=None, machine="x86_64"):
    from manager.worker_cpus import worker_envs

    return worker_envs(ranks, False, {"VLLM_CPU_OMP_THREADS_BIND": "auto", **(env or {})}, cpu_list, machine)


def test_auto_binding_binds_as_vllms_executor_binds():
    bind = {"OMP_PROC_BIND": "true"}
    # This machine: 2 cores, one node, TP 1: the worker gets core 0, the engine keeps core 1 (as vllm serve).
    assert worker_envs_auto(1, None, cpus(2), "x86_64") == [{"OMP_NUM_THREADS": "1", "OMP_PLACES": "{0}", **bind}]
    assert worker_envs_auto(1, None, cpus(16), "x86_64") == [
        {"OMP_NUM_THREADS": "15", "OMP_PLACES": "{" + ",".join(map(str, range(15))) + "}", **bind}]
    # Two nodes, TP 2: a node each, one CPU of each taken back for the engine (the last ones).
    two = worker_envs_auto(2, None, cpus(16, nodes=2), "x86_64")
    assert [e["OMP_PLACES"] for e in two] == ["{0,1,2,3,4,5,6}", "{8,9,10,11,12,13,14}"]
    # One node, TP 2 (vLLM refuses): equal runs; on 2 cores nothing is left to take back.
    assert [e["OMP_PLACES"] for e in worker_envs_auto(2, None, cpus(2), "x86_64")] == ["{0}", "{1}"]
    # x86 SMT: one logical CPU per physical core, the highest-numbered.
    assert worker_envs_auto(1, None, cpus(8, smt=2), "x86_64")[0]["OMP_PLACES"] == "{1,3,5}"
    assert worker_envs_auto(1, None, cpus(8, smt=2), "aarch64")[0]["OMP_PLACES"] == "{0,1,2,3,4,5,6}"
    # The OpenMP runtime that will load decides the variables.
    assert worker_envs_auto(1, {"LD_PRELOAD": "/x/libgomp.so.1"}, cpus(4)) == [
        {"OMP_NUM_THREADS": "3", "GOMP_CPU_AFFINITY": "0 1 2"}]
    iomp = worker_envs_auto(1, {"LD_PRELOAD": "/x/libiomp5.so"}, cpus(4))[0]
    assert iomp["KMP_AFFINITY"] == "granularity=fine,explicit,proclist=[0,1,2]" and iomp["OMP_NUM_THREADS"] == "3"


def test_the_operators_binding_is_honoured_as_vllm_honours_it(caplog):
    from manager.worker_cpus import worker_envs

    explicit = worker_envs(2, False, {"VLLM_CPU_OMP_THREADS_BIND": "0-3|8,9"}, cpus(16), "x86_64")
    assert [(e["OMP_NUM_THREADS"], e["OMP_PLACES"]) for e in explicit] == [("4", "{0,1,2,3}"), ("2", "{8,9}")]
    # A list that does not fit the ranks: a warning naming it, and auto.
    bad = worker_envs(2, False, {"VLLM_CPU_OMP_THREADS_BIND": "0-3"}, cpus(2), "x86_64")  # binds as auto
    assert [e["OMP_PLACES"] for e in bad] == ["{0}", "{1}"]
    assert "VLLM_CPU_OMP_THREADS_BIND='0-3' is not 2 CPU list(s)" in caplog.text
    assert worker_envs(1, False, {"VLLM_CPU_OMP_THREADS_BIND": "x-y"}, cpus(2), "x86_64")[0]["OMP_PLACES"] == "{0}"


def test_gpu_workers_size_the_pool_for_loading_and_let_vllm_drop_it():
    from manager.worker_cpus import worker_envs

    assert worker_envs(2, True, {}, cpus(16), "x86_64") == [{"OMP_NUM_THREADS": "8",
                                                              "VLLM_OMP_NUM_THREADS_SET_BY_VLLM": "1"}] * 2


def test_the_host_topology_is_read_from_sys():
    from manager.worker_cpus import host_cpus

    found = host_cpus()
    assert [c.id for c in found] == sorted(os.sched_getaffinity(0))
    assert len({c.core for c in found}) >= 1


def test_the_operators_thread_count_wins(tmp_path):
    host = HostDouble(tmp_path)
    group = EngineGroup(C.ModelConfig(name="m", model="/x", env={"OMP_NUM_THREADS": "3"}), host)
    engine_env, worker_envs = group.member_envs()
    assert worker_envs[0]["OMP_NUM_THREADS"] == "3"
    assert "VLLM_OMP_NUM_THREADS_SET_BY_VLLM" not in worker_envs[0] and "OMP_PLACES" not in worker_envs[0]


def test_each_rank_gets_its_own_binding(tmp_path):
    host = HostDouble(tmp_path)
    group = EngineGroup(C.ModelConfig(name="m", model="/x", tensor_parallel_size=2,
                                      env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}), host)
    engine_env, worker_envs = group.member_envs()
    assert [e["OMP_PLACES"] for e in worker_envs] == ["{0}", "{1}"]
    assert "OMP_PLACES" not in engine_env and engine_env["OMP_NUM_THREADS"] == "1"


def test_a_removed_group_publishes_removed_and_can_never_start_again(tmp_path):
    group, host = group_in(tmp_path, S.STOPPED)
    group.remove()
    assert host.published == ["removed"]
    with pytest.raises(BadTransition):
        group._enter(S.STARTING)
    group.start()  # refused quietly: only stopped, backoff or failed groups start
    assert group.state is S.REMOVED


def test_a_model_too_large_for_its_budget_goes_released_from_any_down_state(tmp_path):
    """A crashed (backoff) or failed model that no longer fits its budget alone is released with
    the reason, its restart cancelled and nothing left queued; raised again, it is held again."""
    from servectl.memory import check_budget, estimate

    for state in (GroupState.STOPPED, GroupState.BACKOFF, GroupState.FAILED):
        group, host = group_in(tmp_path, state)
        group.cfg.expected_memory = "4GiB"
        host.budget = Budget(None, {"m": group}, labels=host.start_gate.labels, memory=check_budget({"cpu": "2GiB"}),
                             estimate=lambda g: estimate(g.cfg, False, None, None))
        fired: list[bool] = []
        group.restart_timer = SimpleNamespace(cancel=lambda: fired.append(True))
        group.start()
        assert group.state is GroupState.RELEASED and "does not fit the memory budget even alone" in group.reason
        assert group.unfit and group.restart_timer is None and fired == [True]
        assert group not in host.budget.waiting
        host.budget.set_memory(check_budget({"cpu": "8GiB"}))
        assert group.refuse_if_unfit() is False and group.unfit is None and group.reason is None
