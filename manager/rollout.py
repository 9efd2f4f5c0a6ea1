"""A changed model rolled out by ``servectl reload``: started anew beside the old where memory allows.

For each replica of a model whose configuration changed (weights, engine arguments, ...), a new
engine group is started beside the old one under a name of its own (``<model>@<n>``): the old
one serves meanwhile, so no request is held. Once the new one is ready the old one drains (its
requests finish there; new ones go to the new group, the only one ready) and stops. Replica by
replica, so a replicated model keeps serving on the others throughout. Where memory does not
allow two copies (``room_to_roll``), the replica is drained, stopped and started again with the
new configuration under its own name, as before, its requests held meanwhile. A new group that
cannot start (it fails, or is left released) is stopped and the old one kept: the model serves
with its old configuration and the reload says so. A request never goes on on a group of another
configuration (``config_id``: api_gateway/sequences.py).
"""

from __future__ import annotations

import logging

from manager.budget import Budget
from manager.group import EngineGroup, GroupState
from manager.served import ServedModels
from manager.start_gate import StartGate
from servectl import config as C
from servectl.memory import device_free, fmt_size
from servectl.wire.spawn import REPLICA_MARK, group_name

log = logging.getLogger("manager")
S = GroupState

ROLLED, RESTARTED, KEPT = "rolled", "restarted", "kept"
# A new group's start ends in one of these: serving, or not (an exit counts: the old one serves on).
DECIDED = frozenset({S.READY, S.FAILED, S.RELEASED, S.REMOVED, S.EXITED, S.BACKOFF})


def free_name(model: str, replica: int, replicas: int, taken: set[str]) -> str:
    """A group name not in use: the replica's own if free, else ``<model>@<n>``, the least n free."""
    name = group_name(model, replica, replicas)
    n = 1  # (@0 would share the plain name's engine label, 0)
    while name in taken:
        name, n = f"{model}{REPLICA_MARK}{n}", n + 1
    return name


def room_to_roll(needed: int | None, labels: tuple[str, ...], short: str | None, budgeted: bool,
                 free: dict[str, int]) -> str | None:
    """None when a new group fits beside the old one; else why not. Pure.

    With a memory budget (or max_loaded_models), the budget decides (``short``: its reason, or
    None); without one, each of its devices must have the new group's footprint free now.
    """
    if budgeted:
        return short
    if needed is None:
        return "its footprint is not known"
    for label in labels:
        if label not in free:
            return f"the free memory of device {label} is not known"
        if free[label] < needed:
            return f"device {label} has {fmt_size(free[label])} free, the new group needs {fmt_size(needed)}"
    return None


class Rollout:
    def __init__(self, served: ServedModels, budget: Budget, start_gate: StartGate):
        self.m = served
        self.budget = budget  # whether memory allows two copies
        self.start_gate = start_gate

    async def apply(self, cfg: C.ModelConfig) -> str:
        """Bring a served model to ``cfg``; how it went: rolled, restarted, or kept (and why)."""
        m = self.m
        old = sorted(m.groups_of(cfg.name), key=lambda g: g.replica)
        ways: list[str] = []
        for replica in range(max(cfg.replicas, len(old))):
            was = old[replica] if replica < len(old) else None
            if replica >= cfg.replicas:
                await m.remove_group(was)  # one replica fewer
                continue
            if was is None:  # one replica more
                self._start(m.new_group(cfg, replica, free_name(cfg.name, replica, cfg.replicas, set(m.groups))))
                continue
            if was.model_cfg == cfg or m.groups.get(was.name) is not was:
                continue  # rolled by an earlier reload that stopped short; or gone meanwhile (an unload)
            way = await self._replace(was, cfg, replica)
            if way.startswith(KEPT):
                return way  # the new configuration does not start: the other replicas stay as they are
            ways.append(way)
        return RESTARTED if RESTARTED in ways else ROLLED

    async def _replace(self, was: EngineGroup, cfg: C.ModelConfig, replica: int) -> str:
        m = self.m
        new = m.new_group(cfg, replica, free_name(cfg.name, replica, cfg.replicas, set(m.groups)))
        why = None if was.state is S.READY else f"{was.name} is {was.state}"
        if why is None:
            budget = self.budget
            short = budget.short(new)
            why = room_to_roll(budget.footprint(new).bytes, self.start_gate.labels(new),
                               budget.describe(new, short) if short is not None else None, budget.active,
                               device_free(self.start_gate.accelerator))
        if why is not None:
            log.info("reload: %s restarted with its new configuration (not rolled: %s)", was.name, why)
            await m.restart_group(was, cfg)
            return RESTARTED
        passed = m.host.standbys.pass_on(was, new)  # warm interpreters: the new group skips the imports
        log.info("reload: starting %s beside %s (the new configuration of model %s; %d warm standbys passed on)",
                 new.name, was.name, cfg.name, passed)
        m.groups[new.name] = new
        new.start()  # (the old one serves: started whatever its autostart says)
        limit = m.hold_s(cfg)
        await m.state_in(new, DECIDED, limit)
        if new.state is not S.READY:
            reason = new.reason or (f"not ready within {limit:g}s" if new.state is S.STARTING else str(new.state))
            log.error("reload: %s did not start (%s); %s keeps serving the old configuration", new.name, reason,
                      was.name)
            await m.remove_group(new)
            m.host.standbys.refill(was)  # (its standbys went to the new group)
            return f"{KEPT}: the new configuration did not start ({reason})"
        await m.remove_group(was)  # drained: its requests finish there, new ones go to the new group
        return ROLLED

    def _start(self, group: EngineGroup) -> None:
        self.m.groups[group.name] = group
        self.m.start_group(group)

