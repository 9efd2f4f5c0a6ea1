"""Issue 18, without processes or vLLM: idle release's state logic in each process.

- the manager's group: releasing → released (unload) or asleep (sleep), a wake,
  a request that raced the release, a crash while asleep (it comes back
  released, not awake), autostart = false;
- the engine's ``IdleRelease`` against an engine double: the one-shot idle
  deadline, the GPU sleep path (``sleep(level)`` / ``wake_up()`` and the
  accelerator memory measured around them), the fallback to unload;
- the gateway's link: a bounced request, "asleep" and "released", the wake
  request, the per-model hold timeout; the merged vLLM metrics.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from gateway_harness import served
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from api_gateway.engine_requests import RequestStream
from api_gateway.engines import EngineLink, LinkState
from api_gateway.errors import EngineUnavailable
from api_gateway.metrics import merge_exposition
from engine_core import metrics as engine_metrics
from engine_core.idle import SLEEP, UNLOAD, IdleRelease, build_choice
from manager.children import ChildState
from manager.group import IDLE_RELEASED, TRANSITIONS, GroupState
from servectl import config as C
from servectl.wire import control as P
from servectl.wire import status as WS
from servectl.wire import engine as EP
from test_manager_unit import Alive, group_in

pytestmark = pytest.mark.unit
S = GroupState
L = LinkState


# ---- config ------------------------------------------------------------------------------

def test_idle_policy_is_the_models_own_else_the_managers():
    m = C.ManagerConfig(idle_release_s=300, idle_release="sleep", sleep_level=2)
    assert C.IdlePolicy.of(C.ModelConfig(name="a", model="/a"), m) == C.IdlePolicy(after_s=300, mode="sleep",
                                                                                   sleep_level=2)
    own = C.ModelConfig(name="a", model="/a", idle_release_s=0, idle_release="unload", sleep_level=1)
    assert C.IdlePolicy.of(own, m) == C.IdlePolicy(after_s=0, mode="unload", sleep_level=1)
    assert C.IdlePolicy.of(C.ModelConfig(name="a", model="/a"), C.ManagerConfig()).after_s == 0  # never


@pytest.mark.parametrize("toml, key", [
    ('[manager]\nidle_release = "hibernate"\n', "manager.idle_release"),
    ('[manager]\nidle_release_s = -1\n', "manager.idle_release_s"),
    ('[[models]]\nname = "a"\nmodel = "/a"\nsleep_level = 3\n', "models[0].sleep_level"),
    ('[[models]]\nname = "a"\nmodel = "/a"\nhold_timeout_s = 0\n', "models[0].hold_timeout_s"),
    ('[[models]]\nname = "a"\nmodel = "/a"\nautostart = "no"\n', "models[0].autostart"),
])
def test_bad_idle_settings_name_the_key(tmp_path, toml, key):
    path = tmp_path / "s.toml"
    path.write_text(toml)
    with pytest.raises(C.ConfigError) as info:
        C.load_config(path)
    assert key in str(info.value) and str(path) in str(info.value)


# ---- the manager's group -----------------------------------------------------------------

def released_group(tmp_path, mode: str = "unload", **settings):
    group, host = group_in(tmp_path, S.READY, idle_release_s=3.0, idle_release=mode, **settings)
    group.incarnation = "inc"
    group.release_mode = mode
    return group, host


def test_transitions_of_idle_release():
    assert TRANSITIONS[S.READY] >= {S.RELEASING}
    assert TRANSITIONS[S.RELEASING] == {S.READY, S.STOPPING, S.ASLEEP, S.EXITED}
    assert TRANSITIONS[S.RELEASED] == {S.STARTING, S.STOPPING}
    assert TRANSITIONS[S.ASLEEP] == {S.STARTING, S.STOPPING, S.EXITED}
    assert S.RELEASED in TRANSITIONS[S.EXITED] and S.RELEASED in TRANSITIONS[S.STOPPED]
    assert IDLE_RELEASED == {S.RELEASED, S.ASLEEP}
    # Every state the manager publishes is one the gateways and the CLI count correctly.
    assert {str(s) for s in IDLE_RELEASED} | {"ready"} == P.AVAILABLE


def test_idle_of_another_incarnation_or_without_a_policy_is_ignored(tmp_path):
    group, host = released_group(tmp_path)
    group.on_idle("old", 3.0)
    assert (group.state, host.sent) == (S.READY, [])
    never, host2 = group_in(tmp_path, S.READY)  # idle_release_s = 0
    never.incarnation = "inc"
    never.on_idle("inc", 1000.0)
    assert (never.state, host2.sent) == (S.READY, [])


def test_unload_stops_the_members_and_keeps_the_standbys(tmp_path):
    async def scenario():
        group, host = released_group(tmp_path)
        group.on_idle("inc", 3.0)
        assert group.state is S.RELEASING and host.sent == [P.Release(mode="unload", level=1)]
        assert group.reason == "idle for 3.0s"
        group.on_released(P.GroupReleased(model="m", incarnation="inc", released=True, mode="unload"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert group.state is S.RELEASED
        assert host.published == ["releasing", "stopping", "released"]
        assert host.standbys.released == []  # kept: waking costs the model load, not `import vllm`
        assert all(c.state is ChildState.STOPPED for c in group.children)
        assert group.released_since is not None
        # A gateway holds a request: the group starts again (on its standbys).
        group.wake()
        assert group.state is S.STARTING and group.released_since is None

    asyncio.run(scenario())


def test_a_request_that_raced_the_release_keeps_the_model_ready(tmp_path):
    group, host = released_group(tmp_path)
    group.on_idle("inc", 3.0)
    group.on_released(P.GroupReleased(model="m", incarnation="inc", released=False))
    assert group.state is S.READY
    assert host.published == ["releasing", "ready"]


def test_a_wake_during_the_release_starts_the_model_once_it_is_released(tmp_path):
    async def scenario():
        group, host = released_group(tmp_path)
        group.on_idle("inc", 3.0)
        group.wake()  # a gateway got a bounced request
        assert group.state is S.RELEASING and group.wake_wanted
        group.on_released(P.GroupReleased(model="m", incarnation="inc", released=True))
        for _ in range(3):
            await asyncio.sleep(0)
        assert host.published == ["releasing", "stopping", "released", "starting"]
        assert group.state is S.STARTING and not group.wake_wanted

    asyncio.run(scenario())


def test_sleep_wakes_the_same_engine(tmp_path):
    group, host = released_group(tmp_path, mode="sleep", sleep_level=2)
    group.on_idle("inc", 3.0)
    assert host.sent == [P.Release(mode="sleep", level=2)]
    group.on_released(P.GroupReleased(model="m", incarnation="inc", released=True, mode="sleep",
                                      device_memory_bytes=1 << 20))
    assert group.state is S.ASLEEP and group.device_memory_bytes == 1 << 20
    assert all(c.state is ChildState.ASLEEP and c.alive for c in group.children)
    group.wake()
    assert group.state is S.STARTING and host.sent[-1] == P.Wake()
    group.wake()  # idempotent: one Wake
    assert host.sent.count(P.Wake()) == 1
    group.on_ready(P.ChildReady(component="engine_core:m", pid=1, incarnation="inc", max_model_len=512,
                                idle_release=P.IdleMode.SLEEP, device_memory_bytes=4096))
    assert group.state is S.READY and group.device_memory_bytes == 4096
    assert host.published == ["releasing", "asleep", "starting", "ready"]


def test_a_sleeping_model_that_crashes_comes_back_released_not_awake(tmp_path):
    group, host = released_group(tmp_path, mode="sleep")
    group.on_idle("inc", 3.0)
    group.on_released(P.GroupReleased(model="m", incarnation="inc", released=True, mode="sleep"))
    Alive.die(group.workers[0])
    group.on_member_exit(group.workers[0])
    assert group.state is S.EXITED
    Alive.die(group.engine)
    group.on_member_exit(group.engine)
    assert group.state is S.RELEASED and group.restart_timer is None
    assert host.standbys.released == []
    assert host.published == ["releasing", "asleep", "exited", "released"]


def test_a_crash_loop_while_asleep_still_fails(tmp_path):
    group, host = released_group(tmp_path, mode="sleep", crash_loop_count=1)
    group.on_idle("inc", 3.0)
    group.on_released(P.GroupReleased(model="m", incarnation="inc", released=True, mode="sleep"))
    for c in group.children:
        Alive.die(c)
        group.on_member_exit(c)
    assert group.state is S.FAILED


def test_the_engines_fallback_to_unload_is_the_mode_in_force(tmp_path):
    group, host = released_group(tmp_path, mode="sleep")
    group.state = S.STARTING
    group.on_ready(P.ChildReady(component="engine_core:m", pid=1, incarnation="inc", max_model_len=512,
                                idle_release=P.IdleMode.UNLOAD))
    assert group.release_mode == "unload"
    group.on_idle("inc", 3.0)
    assert host.sent == [P.Release(mode="unload", level=1)]


def test_autostart_false_parks_the_model_released(tmp_path):
    group, host = group_in(tmp_path, S.STOPPED)
    for c in group.children:
        Alive.die(c, "")
    group.park()
    assert group.state is S.RELEASED and "autostart" in group.reason
    group.park()  # only from stopped
    assert host.published == ["released"]


def test_a_stop_during_an_unload_waits_for_it(tmp_path):
    async def scenario():
        group, host = released_group(tmp_path)
        gate = asyncio.Event()

        async def slow_wait_exit(children, grace_s):
            await gate.wait()

        host.wait_exit = slow_wait_exit
        group.on_idle("inc", 3.0)
        group.on_released(P.GroupReleased(model="m", incarnation="inc", released=True))
        await asyncio.sleep(0)
        assert group.state is S.STOPPING
        stop = asyncio.ensure_future(group.stop(1.0))  # the operator's stop (or shutdown)
        await asyncio.sleep(0)
        gate.set()
        await asyncio.wait_for(stop, 1)
        assert group.state is S.STOPPED
        assert host.published == ["releasing", "stopping", "released", "stopping", "stopped"]

    asyncio.run(scenario())


# ---- the engine's IdleRelease against an engine double ----------------------------------------

class EngineDouble:
    """vLLM's LLMEngine as idle release sees it, with an accelerator's memory in use."""

    def __init__(self, weights: int = 8 << 30, kv: int = 4 << 30):
        self.calls: list[tuple] = []
        self.weights, self.kv = weights, kv
        self.on_device = weights + kv

    def sleep(self, level: int = 1):
        self.calls.append(("sleep", level))
        self.on_device = 0  # level 1: weights to host memory, KV dropped; level 2: both dropped

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        self.on_device += {None: self.weights + self.kv, "weights": self.weights, "kv_cache": self.kv}[
            tags[0] if tags else None]
        return True

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc", method))
        return [None]


def test_the_idle_deadline_is_one_shot_per_idle_period():
    idle = IdleRelease(EngineDouble(), after_s=3.0, mode=UNLOAD, level=1)
    assert idle.due_in_ms(0) == 3000 and idle.due_in_ms(2500) == 500
    assert idle.take_due(2999) is False
    assert idle.take_due(3000) is True
    assert idle.due_in_ms(5000) is None and idle.take_due(9000) is False  # said once: nothing is armed
    idle.worked()
    assert idle.due_in_ms(0) == 3000
    never = IdleRelease(EngineDouble(), after_s=0, mode=UNLOAD, level=1)
    assert never.due_in_ms(10**9) is None


def test_release_refused_while_busy_then_unload():
    engine = EngineDouble()
    idle = IdleRelease(engine, after_s=3.0, mode=UNLOAD, level=1)
    assert idle.take_due(3000)
    assert idle.release(busy=True) == (False, None)
    assert idle.released is False and idle.due_in_ms(0) == 3000  # re-armed for the next idle period
    assert idle.release(busy=False) == (True, None)
    assert idle.released and not idle.asleep and engine.calls == []  # unload: the manager stops the group
    assert idle.due_in_ms(10**6) is None
    assert idle.wake() is False  # an unloaded engine is never woken: a new one starts


@pytest.mark.parametrize("level", [1, 2])
def test_the_gpu_sleep_path(level):
    engine = EngineDouble()
    idle = IdleRelease(engine, after_s=3.0, mode=SLEEP, level=level, device_memory=lambda: engine.on_device)
    assert idle.release(busy=False) == (True, 0)
    assert engine.calls == [("sleep", level)]
    assert idle.released and idle.asleep
    assert idle.release(busy=False) == (True, None)  # a second Release changes nothing
    assert engine.calls == [("sleep", level)]
    assert idle.wake() is True
    woke = engine.calls[1:]
    if level == 1:  # weights back from host memory, a fresh KV cache
        assert woke == [("wake_up", None)]
    else:  # the weights were discarded: their memory back, reloaded from the checkpoint, then the KV cache
        assert woke == [("wake_up", ["weights"]), ("collective_rpc", "reload_weights"), ("wake_up", ["kv_cache"])]
    assert engine.on_device == 12 << 30
    assert not idle.released and not idle.asleep and idle.due_in_ms(0) == 3000


def test_sleep_falls_back_to_unload_where_vllm_has_no_sleep_mode():
    cpu = build_choice(SLEEP, sleep_available=False, after_s=3.0, model="m")
    assert cpu.mode == UNLOAD and cpu.engine_args == {} and "is_sleep_mode_available" in cpu.warning
    gpu = build_choice(SLEEP, sleep_available=True, after_s=3.0, model="m")
    assert gpu == build_choice(SLEEP, True, 3.0, "m") and gpu.mode == SLEEP
    assert gpu.engine_args == {"enable_sleep_mode": True} and gpu.warning is None
    assert build_choice(UNLOAD, True, 3.0, "m").engine_args == {}
    # Never released: no sleep mode (it changes how vLLM allocates), no warning.
    assert build_choice(SLEEP, False, 0, "m").warning is None


# ---- vLLM's metrics: the engine renders, the gateway merges -----------------------------------

def vllm_registry(model: str) -> CollectorRegistry:
    reg = CollectorRegistry()
    Counter("vllm:generation_tokens", "Generated tokens", ["model_name", "engine"], registry=reg).labels(
        model, "0").inc(7)
    Gauge("vllm:num_requests_running", "Running", ["model_name", "engine"], registry=reg).labels(model, "0").set(1)
    sleep = Gauge("vllm:engine_sleep_state", "Sleep", ["model_name", "engine", "sleep_state"], registry=reg)
    sleep.labels(model, "0", "awake").set(1)
    Gauge("servectl_not_vllm", "Other", registry=reg).set(3)
    return reg


def test_the_engine_renders_only_vllm_families_and_only_the_sleep_state_while_asleep():
    reg = vllm_registry("a")
    names = {f.name for f in text_string_to_metric_families(engine_metrics.render(source=reg))}
    assert names == {"vllm:generation_tokens", "vllm:generation_tokens_created", "vllm:num_requests_running",
                     "vllm:engine_sleep_state"}
    asleep = {f.name for f in text_string_to_metric_families(engine_metrics.render(asleep=True, source=reg))}
    assert asleep == {"vllm:engine_sleep_state"}


def test_the_gateway_merges_several_engines_into_one_valid_exposition():
    texts = [engine_metrics.render(source=vllm_registry(m)) for m in ("a", "b")]
    merged = merge_exposition(["", *texts, ""]).decode()
    assert merged.count("# TYPE vllm:num_requests_running gauge") == 1
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    running = families["vllm:num_requests_running"]
    assert sorted(s.labels["model_name"] for s in running.samples) == ["a", "b"]
    tokens = families["vllm:generation_tokens"]
    assert {s.labels["model_name"]: s.value for s in tokens.samples} == {"a": 7.0, "b": 7.0}
    assert merge_exposition([]) == b"" and merge_exposition(["", ""]) == b""


# ---- the gateway's link ---------------------------------------------------------------------------

def link_with_wakes() -> tuple[EngineLink, list[str]]:
    wakes: list[str] = []
    return EngineLink("m", "/nonexistent/engine-m", None, b"gw-test", wake=wakes.append), wakes


def test_a_request_for_a_released_model_asks_the_manager_to_wake_it():
    async def scenario():
        link, wakes = link_with_wakes()
        link.on_model_state("released", "", "autostart = false: starts on its first request", 600.0)
        assert (link.state, link.status, link.hold_s(60.0)) == (L.RELEASED, "released", 600.0)
        assert wakes == []
        waiter = asyncio.ensure_future(served(link).wait_ready(5))
        await asyncio.sleep(0)
        assert wakes == ["m"]
        link.on_model_state("starting", "", None)
        assert link.hold_s(60.0) == 60.0  # the event carries no model timeout: the gateway's
        link._swap(frozenset(L), L.READY)  # (the engine answered the Hello)
        await asyncio.wait_for(waiter, 1)

    asyncio.run(scenario())


def test_requests_held_through_the_release_ask_for_a_wake_once_it_is_released():
    async def scenario():
        link, wakes = link_with_wakes()
        link.on_model_state("stopping", "", None)  # the release's stop: requests wait
        waiter = asyncio.ensure_future(served(link).wait_ready(5))
        await asyncio.sleep(0)
        assert wakes == []
        link.on_model_state("released", "", None)
        assert wakes == ["m"]
        waiter.cancel()

    asyncio.run(scenario())


def test_releasing_changes_nothing_the_engine_decides():
    link, _ = link_with_wakes()
    link._swap(frozenset(L), L.READY)
    link.on_model_state("releasing", "inc", "idle for 3.0s")
    assert link.state is L.READY and link.is_ready


def test_a_bounced_request_is_held_not_failed():
    link, wakes = link_with_wakes()
    link._swap(frozenset(L), L.READY)
    link.incarnation = "inc"
    sink: asyncio.Queue = asyncio.Queue()
    link.streams["r1"] = RequestStream("r1", sink)
    link.on_engine_message(EP.RequestError(incarnation="inc", request_id="r1", message="released", status=503,
                                           released=True), "inc")
    rid, item = sink.get_nowait()
    assert rid == "r1" and isinstance(item, EngineUnavailable)  # sequences.py holds it and sends it again
    assert (link.state, link.status) == (L.RELEASED, "released")


def test_a_sleeping_engine_keeps_its_socket_and_its_wake_needs_no_new_hello():
    link, _ = link_with_wakes()
    link._swap(frozenset(L), L.READY)
    link.incarnation = link.connecting_to = "inc"
    link.sock = object()  # the engine's socket (kept while it sleeps)
    link.on_model_state("asleep", "inc", "asleep (vLLM sleep mode level 1)")
    assert (link.state, link.status, link.sock is not None) == (L.RELEASED, "asleep", True)
    link.on_model_state("starting", "inc", "waking")
    assert link.state is L.STARTING
    link.on_model_state("ready", "inc", None)
    assert link.state is L.READY and link.ready.is_set()
    link.sock = None


def test_status_reply_and_event_carry_the_idle_fields():
    st = WS.ModelStatus(name="m", state="asleep", frozen=False, incarnation="i", release_after_s=3.0,
                       release_mode="sleep", released_since=1.0, memory_bytes=5, device_memory_bytes=6,
                       hold_timeout_s=600.0)
    assert msgspec.msgpack.decode(P.encoder.encode(st), type=WS.ModelStatus) == st
