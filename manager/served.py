"""The served models and the changes to them: adding, starting, removing, restarting their groups.

The engine groups by group name (a model's name, or ``<model>@<i>`` for each of its replicas)
are the one source of truth of what is served (``groups``, the Manager's dict, shared); the
configuration's models (``configured``, as last loaded or reloaded) are what ``LoadConfigured``
may start again once unloaded. The operator's verbs (manager/verbs.py), a reload
(manager/reload.py) and the control socket's model messages change what is served through
here; a group's own state is its own (manager/group.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from manager import loras
from manager.group import EngineGroup, GroupHost, GroupState
from servectl import config as C
from servectl.wire import control as P

log = logging.getLogger("manager")


class ServedHost(GroupHost, Protocol):
    """What the served models need from the Manager: the host of their groups, and the groups."""

    groups: dict[str, EngineGroup]


class ServedModels:
    def __init__(self, host: ServedHost, configured: list[C.ModelConfig]):
        self.host = host
        self.groups = host.groups
        self.configured = {m.name: m for m in configured}
        self.state_waiters: dict[EngineGroup, list[asyncio.Future]] = {}  # state_in
        self.lora_changes: set[str] = set()  # adapters a load or unload is under way for (manager/loras.py)

    @property
    def settings(self) -> C.ManagerConfig:
        return self.host.settings  # (a reload replaces them)

    @property
    def gateway_cfg(self) -> C.GatewayConfig:
        return self.host.gateway_cfg

    # ---- what is served ---------------------------------------------------------------
    def groups_of(self, name: str) -> list[EngineGroup]:
        """What an operator's verb names: a model (all its replicas) or one replica's group."""
        if name in self.groups and self.groups[name].name != self.groups[name].model:
            return [self.groups[name]]
        return [g for g in self.groups.values() if g.model == name]

    def serves(self, model: str) -> bool:
        return any(g.model == model for g in self.groups.values())

    def new_group(self, model: C.ModelConfig, replica: int, name: str | None = None) -> EngineGroup:
        """One of a model's engine groups (not started); ``name``: a rolled out one's own."""
        return EngineGroup(model, self.host, replica, name)

    def new_groups(self, model: C.ModelConfig) -> list[EngineGroup]:
        """A model's engine groups, one per replica (not started)."""
        return [self.new_group(model, replica) for replica in range(model.replicas)]

    def name_taken_by_adapter(self, models: list[C.ModelConfig]) -> str | None:
        """Why one of these models (or its configured adapters) cannot be served beside the LoRA
        adapters served now, or None: requests name adapters as they name models."""
        for model in models:
            names = [model.name, *(lora.name for lora in model.lora_modules if isinstance(lora, C.LoraModule))]
            for name in names:
                owner = loras.adapter_owner({k: g for k, g in self.groups.items() if g.model != model.name}, name)
                if owner is not None:
                    return (f"{name!r} is the name of a LoRA adapter of model {owner!r}; unload it first "
                            f"(servectl lora unload {name})")
        return None

    # ---- changing it -----------------------------------------------------------------------
    def add_model(self, model: C.ModelConfig) -> None:
        for group in self.new_groups(model):
            self.groups[group.name] = group
            self.start_group(group)

    def start_group(self, group: EngineGroup) -> None:
        """Start a configured model, or leave it released until its first request: autostart =
        false, or no room beside those started before it (models start in config order), or
        larger than its memory budget alone (its requests are refused)."""
        if group.refuse_if_unfit():
            return
        if not group.cfg.autostart:
            group.park()
        elif (no_room := self.host.budget.room_at_start(group)) is not None:
            log.info("model %s: %s; released until its first request", group.name, no_room)
            group.park(no_room)
        else:
            group.start()

    async def remove_model(self, name: str) -> None:
        """Unload a model: each of its groups drained and stopped, together."""
        await asyncio.gather(*(self.remove_group(g) for g in self.groups_of(name)))

    async def remove_group(self, group: EngineGroup) -> None:
        if self.groups.get(group.name) is not group:
            return  # removed meanwhile (an unload during a reload's roll)
        await group.drain(self.settings.drain_timeout_s)
        await group.stop(self.settings.stop_grace_s)
        if self.groups.get(group.name) is not group:
            return  # another unload (or a reload) removed it meanwhile: a new group under that name stays
        del self.groups[group.name]
        self.host.standbys.forget_model(group.name)
        group.remove()  # publishes `removed`: gateways drop the group

    async def restart_group(self, old: EngineGroup, model: C.ModelConfig) -> None:
        """A replica's changed configuration where no new group fits beside it: drain and stop it,
        start it again under its name, its requests held meanwhile: on its warm standbys where their
        environments still match (a standby is a warm interpreter; ``take`` checks)."""
        await old.drain(self.settings.drain_timeout_s)
        await old.stop(self.settings.stop_grace_s, keep_standbys=True)
        self.host.standbys.forget_model(old.name)
        group = self.groups[old.name] = self.new_group(model, old.replica, old.name)
        self.start_group(group)

    # ---- waiting for a change ----------------------------------------------------------------
    def changed(self, group: EngineGroup) -> None:
        """A group's state changed: whoever waits for it (``state_in``) looks again."""
        for fut in self.state_waiters.pop(group, []):
            if not fut.done():
                fut.set_result(None)

    async def state_in(self, group: EngineGroup, states: frozenset[GroupState], timeout_s: float) -> bool:
        """Until the group's state is one of ``states`` (told by its state changes); False past
        ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while group.state not in states:
            fut = loop.create_future()
            self.state_waiters.setdefault(group, []).append(fut)
            try:
                # event-proof: a bound on one reload's (or restart's) wait for a group it started.
                await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return False
        return True

    def hold_s(self, model: C.ModelConfig) -> float:
        """How long a start of ``model`` may take before a reload or restart stops waiting for it:
        what a request would wait for it (its hold timeout, else the gateways')."""
        return model.hold_timeout_s or self.gateway_cfg.hold_timeout_s

    # ---- the control socket's model messages (beside the verbs) ----------------------------------
    def set_freezing(self, name: str, enabled: bool) -> P.Ack:
        """Freezing on or off for a model's groups (a replica's alone), told to their engines."""
        groups = self.groups_of(name)
        if not groups:
            return self.no_model(name)
        for group in groups:
            group.freezing = enabled
            self.host.send_to_engine(group, P.FreezingControl(
                enabled=enabled, grace_s=self.settings.freeze_grace_s or C.DEFAULT_FREEZE_GRACE_S))
        return P.Ack(ok=True, message=f"freezing {'on' if enabled else 'off'} for {name}")

    async def change_lora(self, msg: P.LoadLora | P.UnloadLora) -> P.LoraReply:
        """Load or unload a LoRA adapter; answered once the model's engine has done it (or refused)."""
        return await loras.change(self.groups, msg, P.LORA_CHANGE_TIMEOUT_S, frozenset(self.configured),
                                  self.lora_changes, self.settings.lora_roots)

    def no_model(self, name: str) -> P.Ack:
        served = dict.fromkeys(g.model for g in self.groups.values())
        return P.Ack(ok=False, message=f"no model {name!r}; served: {', '.join(served)}")
