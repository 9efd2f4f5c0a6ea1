"""More models than fit: at most ``max_loaded_models`` loaded, the least recently used evicted.

A model is loaded while its engine group holds memory: starting, serving, draining, being
released or stopped, crashed and about to restart (a model asleep on a GPU holds no
accelerator memory and is not counted). When a model must start or wake (a request for a
released or sleeping model) and the count is at the cap, the manager
releases another one first — as that model's ``idle_release`` says (unload, or sleep where the
platform has it) — the least recently used first: the engine that has been idle longest
(it froze its workers then), never one that is ``pinned``, never one with a request in flight
(its engine refuses the release, and the next is asked). The model that needs the room waits
(its requests are held by the gateways) until one is released; the decisions are events with
their reasons. At start, models start in config order up to the cap; the rest stay released
until a request comes.

``choose_victim`` is the pure rule; ``Budget`` applies it for the Manager.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, NamedTuple

from servectl.wire.vocab import ModelState

if TYPE_CHECKING:
    from manager.group import EngineGroup

log = logging.getLogger("manager")

S = ModelState
# States in which a group holds its memory (asleep: only host memory, not counted).
LOADED = frozenset({S.STARTING, S.READY, S.DRAINING, S.RELEASING, S.STOPPING, S.EXITED, S.BACKOFF})


# On their way out: their memory is being given back (an eviction, an idle release, an unload).
LEAVING = frozenset({S.RELEASING, S.STOPPING})


class Resident(NamedTuple):
    """What the rule needs to know of one loaded model."""

    name: str
    state: ModelState
    pinned: bool
    idle_since: float | None  # wall clock; known while its workers are frozen (idle)
    refused: bool  # its engine refused a release since it was last idle (a request in flight)
    freezes: bool = True  # its workers freeze when idle (freezing on): idle_since will be known


def choose_victim(residents: list[Resident]) -> str | None:
    """The model to release to make room, or None (none can be now). Pure.

    Only a serving model that is not pinned and did not just refuse: idle ones (frozen), the
    longest idle first. A model whose workers never freeze (freezing off) never says it is idle:
    such a one is asked (its engine refuses with a request in flight, and the next is asked)
    when no idle one can go. One that freezes and has not is busy or has just started: never."""
    ready = [r for r in residents if r.state is S.READY and not r.pinned and not r.refused]
    idle = sorted((r for r in ready if r.idle_since is not None), key=lambda r: r.idle_since)
    unknown = [r for r in ready if r.idle_since is None and not r.freezes]
    order = idle or unknown
    return order[0].name if order else None


class Budget:
    def __init__(self, cap: int | None, groups: dict[str, "EngineGroup"]):
        self.cap = cap
        self.groups = groups
        self.waiting: list["EngineGroup"] = []  # need room, in the order they asked
        self.releasing: str | None = None  # the model being released for them
        self.retry_scheduled = False

    def loaded(self, besides: "EngineGroup | None" = None) -> list["EngineGroup"]:
        return [g for g in self.groups.values() if g is not besides and g.state in LOADED]

    def counted(self, group: "EngineGroup") -> int:
        """Models loaded, or admitted and waiting for their devices, other than ``group``."""
        return len({g for g in self.groups.values() if g is not group and
                    (g.state in LOADED or g.host.start_gate.is_waiting(g))})

    def fits_at_start(self, group: "EngineGroup") -> bool:
        return self.cap is None or self.counted(group) < self.cap

    def admit(self, group: "EngineGroup") -> str | None:
        """None: ``group`` may start now; else why it waits (it is started once there is room).
        First come, first served: a model is admitted only once those that asked before it are."""
        if self.cap is None:
            return None
        position = self.waiting.index(group) if group in self.waiting else len(self.waiting)
        if position < self.cap - self.counted(group):
            if group in self.waiting:
                self.waiting.remove(group)
            return None
        if group not in self.waiting:
            self.waiting.append(group)
        self.make_room()
        return (f"waiting for room: max_loaded_models = {self.cap} are loaded"
                + (f"; releasing {self.releasing}, the least recently used" if self.releasing else
                   "; none can be released now (pinned, or a request in flight)"))

    def make_room(self) -> None:
        """Release the least recently used model (one at a time) for the models that wait, unless
        room is on its way (a model already releasing or stopping)."""
        if not self.waiting or self.releasing is not None or self.cap is None:
            return
        loaded = self.loaded()
        leaving = sum(1 for g in loaded if g.state in LEAVING)
        if leaving and self.counted(self.waiting[0]) - leaving < self.cap:
            return
        residents = [Resident(g.name, g.state, g.cfg.pinned, g.idle_since, g.release_refused, g.freezing)
                     for g in loaded if g not in self.waiting]
        victim = choose_victim(residents)
        if victim is None:
            return
        self.releasing = victim
        needed = self.waiting[0].name
        if not self.groups[victim].evict(f"evicted: model {needed} needs room (max_loaded_models = {self.cap}; "
                                         "the least recently used)"):
            self.releasing = None

    def forget(self, group: "EngineGroup") -> None:
        if group in self.waiting:
            self.waiting.remove(group)

    def changed(self, group: "EngineGroup") -> None:
        """A model's state changed: an eviction under way may be over, room may have come; the
        models that wait are tried again (soon, not inside this change)."""
        if self.releasing == group.name and (group.state not in LOADED or group.state is S.READY):
            self.releasing = None  # released (or asleep, or gone), or it refused
        if self.waiting and not self.retry_scheduled:
            self.retry_scheduled = True
            asyncio.get_running_loop().call_soon(self.retry)

    def retry(self) -> None:
        self.retry_scheduled = False
        for group in list(self.waiting):
            if group.name not in self.groups or self.groups[group.name] is not group:
                self.waiting.remove(group)
                continue
            # admitted now, or still waiting (and room is being made)
            group.wake() if group.state is S.ASLEEP else group.start()
        self.make_room()
