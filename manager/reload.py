"""A reload: what it changes (``plan_reload``, pure) and applying it (``Reloader``).

``servectl reload`` (or SIGHUP) re-reads the file and re-applies the start
options; only the models that differ are touched (added ones started,
removed ones drained and stopped, changed ones rolled out: manager/rollout.py),
the manager's settings and budgets applied, and the gateways are replaced one
by one only when the [gateway] section changed. One reload at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from manager.budget import Budget
from manager.gateways import GatewayPool
from manager.limits import KeyLimits
from manager.rollout import Rollout
from manager.sdnotify import notify
from manager.served import ServedModels
from manager.spans import GroupSpans, roll_span
from manager.standbys import StandbyPool
from manager.start_gate import StartGate
from servectl import config as C
from servectl.memory import device_totals
from servectl.model_check import check_model_paths

log = logging.getLogger("manager")


@dataclass(frozen=True)
class ReloadPlan:
    added: list[C.ModelConfig]
    removed: list[str]
    changed: list[C.ModelConfig]  # the new configuration of each
    gateway: C.GatewayConfig | None  # the new [gateway] section, if it changed
    manager: C.ManagerConfig

    def summary(self) -> str:
        def names(items) -> str:
            return ", ".join(getattr(m, "name", m) for m in items) or "-"

        return (f"added {names(self.added)}; removed {names(self.removed)}; changed {names(self.changed)}; "
                f"gateway {'changed' if self.gateway is not None else 'unchanged'}")


def plan_reload(served: list[C.ModelConfig], gateway: C.GatewayConfig, new: C.Config) -> ReloadPlan:
    old = {m.name: m for m in served}
    fresh = {m.name: m for m in new.models}
    return ReloadPlan(
        added=[m for name, m in fresh.items() if name not in old],
        removed=[name for name in old if name not in fresh],
        changed=[m for name, m in fresh.items() if name in old and m != old[name]],
        gateway=new.gateway if new.gateway != gateway else None,
        manager=new.manager,
    )


class ReloadHost(Protocol):
    """What a reload reads and changes (the Manager)."""

    config_path: str | None  # exactly the file it started with (None: the defaults)
    overrides: C.Overrides
    settings: C.ManagerConfig  # replaced by the new [manager] section
    gateway_cfg: C.GatewayConfig
    limits: KeyLimits
    served: ServedModels
    budget: Budget
    start_gate: StartGate
    standbys: StandbyPool
    gateways: GatewayPool
    spans: GroupSpans | None  # tracing on: the manager's spans (a roll is one)

    def reconfigure_cluster(self, new: C.Config) -> str | None: ...
    def bind_failure(self, gateway: C.GatewayConfig, exc: OSError) -> str: ...


class Reloader:
    def __init__(self, host: ReloadHost):
        self.host = host
        self.rollout = Rollout(host.served, host.budget, host.start_gate)
        self.lock = asyncio.Lock()

    async def reload(self) -> tuple[bool, str]:
        """Re-read the file, re-apply the start options, and apply only the difference; one
        reload at a time (a second waits for the first: each compares with what is served)."""
        async with self.lock:
            return await self._reload()

    async def _reload(self) -> tuple[bool, str]:
        h, served = self.host, self.host.served
        notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}\nSTATUS=reloading")
        try:
            # Exactly the file it started with (none: the defaults), wherever reload is asked from.
            new, _ = C.effective_config(h.config_path, h.overrides, search=False)
        except C.ConfigError as exc:
            log.error("reload refused: %s", exc)
            notify("READY=1\nSTATUS=reload refused: config error")
            return False, str(exc)
        bad = check_model_paths(new, h.config_path, h.overrides)
        if not bad:
            # The other hosts and the cluster secret (rotated: the next links use it); then only
            # the models this host runs engines for are compared with what it serves.
            refused = h.reconfigure_cluster(new)
            bad = [refused] if refused else []
        if bad:
            log.error("reload refused: %s", "; ".join(bad))
            notify("READY=1\nSTATUS=reload refused: config error")
            return False, "\n".join(bad)
        # A model is changed while any of its groups differs from the file (a roll that stopped short).
        wanted = {m.name: m for m in new.models}
        now: dict[str, C.ModelConfig] = {}
        for g in served.groups.values():
            if g.model not in now or g.model_cfg != wanted.get(g.model):
                now[g.model] = g.model_cfg
        plan = plan_reload(list(now.values()), h.gateway_cfg, new)
        clash = served.name_taken_by_adapter([*plan.added, *plan.changed])
        if clash is not None:
            log.error("reload refused: %s", clash)
            notify("READY=1\nSTATUS=reload refused: a name is a LoRA adapter's")
            return False, clash
        log.info("reload: %s", plan.summary())
        if plan.manager.log_format != h.settings.log_format:  # the tree's environment, set at start
            log.warning("manager.log_format = %r takes effect at the next start", plan.manager.log_format)
        if plan.manager.otlp_traces_endpoint != h.settings.otlp_traces_endpoint:
            log.warning("manager.otlp_traces_endpoint = %r takes effect at the next start",
                        plan.manager.otlp_traces_endpoint)
        h.settings = plan.manager
        h.budget.cap = plan.manager.max_loaded_models
        if plan.manager.memory_budget and not h.budget.totals:
            h.budget.totals = device_totals(h.start_gate.accelerator)
        h.budget.set_memory(C.memory_budget(plan.manager))
        for group in served.groups.values():  # a model too large for the old budget may fit the new
            if group.unfit is not None:
                group.refuse_if_unfit()
        h.budget.retry()  # a raised (or removed) cap or budget lets waiting models start
        served.configured = {m.name: m for m in new.models}
        for name in plan.removed:
            await served.remove_model(name)
        for model in plan.added:
            served.add_model(model)
        ways = {}
        for model in plan.changed:  # one after another: one start at a time per device anyway
            with roll_span(h.spans, model.name):
                ways[model.name] = await self.rollout.apply(model)
        for group in served.groups.values():  # [manager] warm_standby may have changed
            if h.settings.warm_standby:
                h.standbys.refill(group)
            else:
                h.standbys.release_model(group.name)
        if plan.gateway is not None:
            try:
                await h.gateways.replace(plan.gateway)
            except OSError as exc:  # the new address cannot be bound: the gateways keep the old one
                message = h.bind_failure(plan.gateway, exc)
                log.error("reload: %s", message)
                notify("READY=1\nSTATUS=serving; reload: gateway address refused")
                return False, f"gateway not reloaded: {message}"
            h.limits.set_keys(plan.gateway.keys)  # as the gateways check them now; a name keeps its counts
        notify("READY=1\nSTATUS=serving")
        return True, f"reloaded: {plan.summary()}" + "".join(f"; {name} {way}" for name, way in ways.items())
