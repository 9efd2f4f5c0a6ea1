"""The operator's model verbs — load, unload, restart — each answered when its change is done.

An answer says what is true, not what was asked: ``Ack(done=True)`` once the model serves
(or is released until its first request, as configured), is gone, or was restarted; a failure
says why. One change at a time per model name (``ModelVerbs.changes``): a verb that arrives
while another change of that model is under way runs once it is over — a ``load`` sent while the
model drains for an ``unload`` loads it then, instead of a 409 — and the same verb sent again
joins the one under way, so asking again is how a caller waits longer. The caller's ``wait_s``
bounds its own wait only: past it the answer is ``done=False`` and the change goes on. Each
change has its own bound (the drain and stop timeouts; a start's hold timeout).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import NamedTuple, Protocol

from servectl import config as C
from servectl import kv_events
from servectl.wire import control as P
from servectl.wire.vocab import ModelState as S

log = logging.getLogger("manager")

# Where a started group has come to rest, for a verb: serving, released as configured (autostart
# = false, no room under the memory budget: its first request starts it), failed, or removed by
# another change meanwhile. Backoff and exit are not: the restart policy is still at work.
AT_REST = frozenset({S.READY, S.RELEASED, S.FAILED, S.REMOVED})
EVERY_MODEL = "*"  # the change key of a restart of every model


class Verb(enum.Enum):
    LOAD = "load"
    UNLOAD = "unload"
    RESTART = "restart"


class Outcome(NamedTuple):
    ok: bool
    message: str
    done: bool = True


class Group(Protocol):
    """What a verb reads and does with one engine group (manager/group.py's EngineGroup)."""

    name: str
    model: str
    state: S
    reason: str | None
    model_cfg: C.ModelConfig

    async def restart(self, drain_timeout_s: float, grace_s: float) -> None: ...


class Served(Protocol):
    """The served models, as the verbs change them (manager/served.py's ServedModels)."""

    settings: C.ManagerConfig
    gateway_cfg: C.GatewayConfig
    configured: dict[str, C.ModelConfig]

    @property
    def groups(self) -> dict[str, Group]: ...
    def groups_of(self, name: str) -> list[Group]: ...
    def serves(self, model: str) -> bool: ...
    def name_taken_by_adapter(self, models: list[C.ModelConfig]) -> str | None: ...
    def add_model(self, model: C.ModelConfig) -> None: ...
    async def remove_model(self, name: str) -> None: ...
    async def state_in(self, group: Group, states: frozenset, timeout_s: float) -> bool: ...
    def hold_s(self, model: C.ModelConfig) -> float: ...


class Change(NamedTuple):
    verb: Verb
    key: str  # the model's name, or EVERY_MODEL
    task: asyncio.Task


class ModelVerbs:
    def __init__(self, served: Served, start: Callable[[Coroutine, str], asyncio.Task] | None = None):
        self.served = served
        # How a change's task is started: the manager's Tasks (cancelled, and so answered, at shutdown).
        self.start = start or (lambda coro, name: asyncio.get_running_loop().create_task(coro, name=name))
        self.changes: dict[str, Change] = {}  # model name (or EVERY_MODEL) -> the latest change asked

    # ---- the verbs -------------------------------------------------------------------------
    async def load(self, name: str, model: C.ModelConfig | None, wait_s: float | None) -> P.Ack:
        """Serve ``model`` (a new one), or the configured model ``name`` again (``model`` None)."""
        change = self.changes.get(name)
        if change is None and self.served.serves(name):
            return P.Ack(ok=False, message=f"model {name!r} is already served")
        if change is not None and change.verb is Verb.LOAD:
            return await self.answer(change, wait_s)
        return await self.answer(self.begin(name, Verb.LOAD, lambda: self._load(name, model)), wait_s)

    async def unload(self, name: str, wait_s: float | None) -> P.Ack:
        change = self.changes.get(name)
        if change is None and not self.served.serves(name):
            return P.Ack(ok=False, message=self.no_model(name))
        if change is not None and change.verb is Verb.UNLOAD:
            return await self.answer(change, wait_s)
        return await self.answer(self.begin(name, Verb.UNLOAD, lambda: self._unload(name)), wait_s)

    async def restart(self, name: str | None, wait_s: float | None) -> P.Ack:
        """A model's groups (a replica's alone), or every group, one at a time: the others serve."""
        key = name or EVERY_MODEL
        change = self.changes.get(key)
        if change is None and name is not None and not self.served.groups_of(name):
            return P.Ack(ok=False, message=self.no_model(name))
        if change is not None and change.verb is Verb.RESTART:
            return await self.answer(change, wait_s)
        return await self.answer(self.begin(key, Verb.RESTART, lambda: self._restart(name)), wait_s)

    # ---- one change at a time per model --------------------------------------------------------
    def begin(self, key: str, verb: Verb, run: Callable[[], Awaitable[Outcome]]) -> Change:
        """Start ``run`` once the change under way for ``key`` (if any) is over."""
        before = self.changes.get(key)

        async def after() -> Outcome:
            if before is not None:
                await asyncio.wait({before.task})  # whatever came of it
            try:
                return await run()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one change must not leave its callers waiting
                log.exception("%s of %s failed", verb.value, key)
                return Outcome(False, f"{verb.value} of {key} failed; see the manager log")

        change = Change(verb, key, self.start(after(), f"{verb.value} {key}"))
        self.changes[key] = change

        def forget(_task) -> None:
            if self.changes.get(key) is change:
                del self.changes[key]

        change.task.add_done_callback(forget)
        return change

    @staticmethod
    async def answer(change: Change, wait_s: float | None) -> P.Ack:
        try:
            # event-proof: the caller's own bound on its wait; the change goes on past it.
            outcome = await asyncio.wait_for(asyncio.shield(change.task), wait_s)
        except asyncio.TimeoutError:
            what = "every model" if change.key == EVERY_MODEL else change.key
            return P.Ack(ok=True, done=False, message=f"{change.verb.value} of {what} under way; the same call again "
                                                      "waits for it")
        return P.Ack(ok=outcome.ok, message=outcome.message, done=outcome.done)

    # ---- what each change does ------------------------------------------------------------------
    async def _load(self, name: str, model: C.ModelConfig | None) -> Outcome:
        s = self.served
        if s.serves(name):
            return Outcome(False, f"model {name!r} is already served")
        if model is None:
            model = s.configured.get(name)
            if model is None:
                return Outcome(False, f"no configured model {name!r}; configured: {', '.join(s.configured) or 'none'}")
        else:
            try:
                model = self.finalized(model)
            except C.ConfigError as exc:
                return Outcome(False, str(exc))
        if (why := s.name_taken_by_adapter([model])) is not None:
            return Outcome(False, why)
        s.add_model(model)
        return await self.at_rest(name, "loaded")

    def finalized(self, model: C.ModelConfig) -> C.ModelConfig:
        """A model given at run time, checked as a configuration file's would be (and its KV-event
        endpoint against those served)."""
        s = self.served
        cfg = C.finalize(C.Config(gateway=s.gateway_cfg, manager=s.settings, models=[model]))
        served = {g.model: g.model_cfg for g in s.groups.values()}
        clash = kv_events.port_clash([*served.values(), cfg.models[0]], s.gateway_cfg.port)
        if clash:
            raise C.ConfigError(clash)
        return cfg.models[0]

    async def _unload(self, name: str) -> Outcome:
        if not self.served.serves(name):
            return Outcome(False, self.no_model(name))
        await self.served.remove_model(name)
        return Outcome(True, f"unloaded {name}")

    async def _restart(self, name: str | None) -> Outcome:
        s = self.served
        targets = s.groups_of(name) if name else list(s.groups.values())
        if not targets:
            return Outcome(False, self.no_model(name or ""))
        for group in targets:
            if s.groups.get(group.name) is not group:
                continue  # unloaded (or replaced by a reload) while the ones before it restarted
            await group.restart(s.settings.drain_timeout_s, s.settings.stop_grace_s)
            # Serving again before the next goes (bounded by its start's hold timeout).
            await s.state_in(group, AT_REST, s.hold_s(group.model_cfg))
        return self.rest_outcome(targets, f"restarted {name or 'every model'}")

    async def at_rest(self, name: str, did: str) -> Outcome:
        """Once every group of ``name`` has come to rest (bounded by its hold timeout), what it is."""
        groups = self.served.groups_of(name)
        await asyncio.gather(*(self.served.state_in(g, AT_REST, self.served.hold_s(g.model_cfg)) for g in groups))
        return self.rest_outcome(groups, f"{did} {name}")

    @staticmethod
    def rest_outcome(groups: list[Group], did: str) -> Outcome:
        states = {g.name: g.state for g in groups}
        if any(st is S.FAILED for st in states.values()):
            why = "; ".join(f"{g.name}: {g.reason or 'failed'}" for g in groups if g.state is S.FAILED)
            return Outcome(False, f"{did}, but it failed: {why}")
        if not all(st in AT_REST for st in states.values()):
            words = ", ".join(f"{n} {st.value}" for n, st in states.items())
            return Outcome(True, f"{did}; not serving yet ({words})", done=False)
        released = [g for g in groups if g.state is S.RELEASED]
        if released:
            return Outcome(True, f"{did}: released until its first request ({released[0].reason or 'as configured'})")
        return Outcome(True, f"{did}: ready")

    def no_model(self, name: str) -> str:
        served = dict.fromkeys(g.model for g in self.served.groups.values())
        return f"no model {name!r}; served: {', '.join(served)}"
