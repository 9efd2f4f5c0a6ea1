"""The operator's model verbs answer when their change is done (issue 51, item 5): manager/verbs.py
over a double of the served models (no daemon, no vLLM)."""

from __future__ import annotations

import asyncio

import pytest

from manager.verbs import ModelVerbs
from servectl import config as C
from servectl.wire.vocab import ModelState as S

pytestmark = pytest.mark.unit


class Group:
    def __init__(self, model: C.ModelConfig, served: "Served"):
        self.name = self.model = model.name
        self.model_cfg = model
        self.state = S.STARTING
        self.reason = None
        self.served = served
        self.restarts = 0

    def enter(self, state: S, reason: str | None = None) -> None:
        self.state, self.reason = state, reason
        for fut in self.served.waiters.pop(self, []):
            if not fut.done():
                fut.set_result(None)

    async def restart(self, drain_timeout_s: float, grace_s: float) -> None:
        self.restarts += 1
        self.enter(S.STARTING)
        self.served.started.append(self.name)


class Served:
    """The manager as the verbs see it: starts and stops are steps the test takes (``gate``)."""

    def __init__(self, *names: str):
        self.settings = C.ManagerConfig()
        self.gateway_cfg = C.GatewayConfig()
        self.configured = {n: C.ModelConfig(name=n, model=f"/models/{n}") for n in names}
        self.groups: dict[str, Group] = {}
        self.waiters: dict[Group, list[asyncio.Future]] = {}
        self.started: list[str] = []
        self.unloads_begun: list[str] = []
        self.stop_gate = asyncio.Event()  # an unload's drain and stop end when it is set

    def groups_of(self, name: str) -> list[Group]:
        return [g for g in self.groups.values() if g.model == name]

    def serves(self, model: str) -> bool:
        return bool(self.groups_of(model))

    def name_taken_by_adapter(self, models) -> str | None:
        return None

    def add_model(self, model: C.ModelConfig) -> None:
        self.groups[model.name] = Group(model, self)
        self.started.append(model.name)

    async def remove_model(self, name: str) -> None:
        self.unloads_begun.append(name)
        await self.stop_gate.wait()
        group = self.groups.pop(name)
        group.enter(S.REMOVED)

    async def state_in(self, group: Group, states: frozenset, timeout_s: float) -> bool:
        while group.state not in states:
            fut = asyncio.get_running_loop().create_future()
            self.waiters.setdefault(group, []).append(fut)
            try:
                await asyncio.wait_for(fut, timeout_s)
            except asyncio.TimeoutError:
                return False
        return True

    def hold_s(self, model: C.ModelConfig) -> float:
        return 30.0

    def serving(self, name: str) -> Group:
        self.add_model(self.configured[name])
        group = self.groups[name]
        group.enter(S.READY)
        return group


def serving_a(*also: str) -> tuple[Served, ModelVerbs]:
    """Model ``a`` served (ready), the models ``also`` configured only, and the verbs on them."""
    served = Served("a", *also)
    served.serving("a")
    return served, ModelVerbs(served)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_unload_answers_once_the_model_is_gone():
    async def scenario():
        served, verbs = serving_a()
        answer = asyncio.ensure_future(verbs.unload("a", None))
        await settle()
        assert served.unloads_begun == ["a"] and not answer.done()  # still draining: no answer yet
        served.stop_gate.set()
        ack = await answer
        assert (ack.ok, ack.done, ack.message) == (True, True, "unloaded a")
        assert not served.serves("a") and verbs.changes == {}

    run(scenario())


def test_a_load_sent_while_the_model_unloads_loads_it_once_it_is_gone():
    async def scenario():
        served, verbs = serving_a()
        unload = asyncio.ensure_future(verbs.unload("a", 0))  # answered at once: under way
        ack = await unload
        assert (ack.ok, ack.done) == (True, False) and "under way" in ack.message
        load = asyncio.ensure_future(verbs.load("a", None, None))
        await settle()
        assert not load.done() and served.started == ["a"]  # not 'already served', not started twice
        served.stop_gate.set()
        await settle()
        assert served.started == ["a", "a"]  # started again, after the unload
        assert not load.done()  # not before it serves
        served.groups["a"].enter(S.READY)
        ack = await load
        assert (ack.ok, ack.done, ack.message) == (True, True, "loaded a: ready")

    run(scenario())


def test_asking_again_waits_for_the_change_under_way():
    async def scenario():
        served, verbs = serving_a()
        first = await verbs.unload("a", 0)
        assert first.done is False
        again = await verbs.unload("a", 0.01)  # joins it: the caller's wait ran out again
        assert (again.ok, again.done) == (True, False) and served.unloads_begun == ["a"]
        waiting = asyncio.ensure_future(verbs.unload("a", None))
        await settle()
        served.stop_gate.set()
        ack = await waiting
        assert (ack.ok, ack.done, ack.message) == (True, True, "unloaded a")
        assert served.unloads_begun == ["a"]  # one unload for the three calls

    run(scenario())


def test_refusals_only_for_what_can_never_apply():
    async def scenario():
        served, verbs = serving_a("b")
        ack = await verbs.load("a", None, None)
        assert not ack.ok and "already served" in ack.message
        ack = await verbs.unload("nope", None)
        assert not ack.ok and ack.message == "no model 'nope'; served: a"
        ack = await verbs.restart("nope", None)
        assert not ack.ok and "no model 'nope'" in ack.message
        load = asyncio.ensure_future(verbs.load("zzz", None, None))
        ack = await load
        assert not ack.ok and "no configured model 'zzz'" in ack.message and verbs.changes == {}

    run(scenario())


def test_a_load_that_fails_says_so_and_one_released_as_configured_is_done():
    async def scenario():
        served = Served("a", "b")
        verbs = ModelVerbs(served)
        load = asyncio.ensure_future(verbs.load("a", None, None))
        await settle()
        served.groups["a"].enter(S.BACKOFF)  # the restart policy is still at work: not an answer
        await settle()
        assert not load.done()
        served.groups["a"].enter(S.FAILED, "engine exited 5 times in 120 s")
        ack = await load
        assert not ack.ok and "failed" in ack.message and "5 times" in ack.message
        load = asyncio.ensure_future(verbs.load("b", None, None))
        await settle()
        served.groups["b"].enter(S.RELEASED, "autostart = false")
        ack = await load
        assert ack.ok and ack.done and "released until its first request" in ack.message

    run(scenario())


def test_a_restart_is_done_once_every_group_serves_again_and_a_second_joins_it():
    async def scenario():
        served, verbs = serving_a()
        group = served.groups["a"]
        first = asyncio.ensure_future(verbs.restart("a", None))
        await settle()
        second = asyncio.ensure_future(verbs.restart("a", None))
        await settle()
        assert group.restarts == 1 and not first.done() and not second.done()
        group.enter(S.READY)
        for ack in (await first, await second):
            assert (ack.ok, ack.done, ack.message) == (True, True, "restarted a: ready")
        assert group.restarts == 1

    run(scenario())


def test_an_unload_after_a_load_under_way_waits_for_it():
    async def scenario():
        served = Served("a")
        verbs = ModelVerbs(served)
        load = asyncio.ensure_future(verbs.load("a", None, 0))
        assert (await load).done is False
        unload = asyncio.ensure_future(verbs.unload("a", None))
        await settle()
        assert served.unloads_begun == []  # the load comes to rest first
        served.groups["a"].enter(S.READY)
        await settle()
        assert served.unloads_begun == ["a"]
        served.stop_gate.set()
        assert (await unload).message == "unloaded a"

    run(scenario())


def test_a_restart_of_every_model_skips_one_unloaded_meanwhile():
    async def scenario():
        served = Served("a", "b")
        a, b = served.serving("a"), served.serving("b")
        verbs = ModelVerbs(served)
        everything = asyncio.ensure_future(verbs.restart(None, None))
        await settle()
        assert a.restarts == 1 and not everything.done()  # a starts again; b waits its turn
        served.stop_gate.set()
        assert (await verbs.unload("b", None)).message == "unloaded b"
        a.enter(S.READY)
        ack = await everything
        assert ack.ok and ack.done and b.restarts == 0 and b.state is S.REMOVED  # never started again
        assert not served.serves("b")

    run(scenario())
