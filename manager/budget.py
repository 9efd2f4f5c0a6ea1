"""More models than fit: a memory budget per device and at most ``max_loaded_models`` loaded;
the least recently used model evicted to make room.

A model is loaded while its engine group holds memory: starting, serving, draining, being
released or stopped, crashed and about to restart (a model asleep on a GPU holds no
accelerator memory and is not counted). Each loaded model holds its footprint on each of its
devices (start_gate.device_labels): what its engine measured at its last load
(engine_core/footprint.py), else an estimate (servectl/memory.py). A model fits when the count
stays within the cap and, on every device with a budget (``[manager] memory_budget``), the
footprints of those loaded plus its own stay within it.

When a model must start or wake (a request for a released or sleeping model) and does not
fit, the manager releases another one first — as that model's ``idle_release`` says (unload,
or sleep where the platform has it) — the least recently used first: the engine that has been
idle longest (it froze its workers then), never one that is ``pinned``, never one with a
request in flight (its engine refuses the release, and the next is asked), and only one that
holds memory where it is short. The model that needs the room waits (its requests are held by
the gateways) until one is released; a model larger than a budget on its own is refused (its
requests are a 503 saying why). The decisions are events with their reasons. At start, models
start in config order while they fit; the rest stay released until a request comes.

``choose_victim`` and ``shortfall`` are the pure rules; ``Budget`` applies them for the Manager.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Mapping, NamedTuple, Protocol

from manager.start_gate import StartGate
from servectl import config as C
from servectl.memory import Amount, Estimate, fmt_size
from servectl.wire import status as WS
from servectl.wire.vocab import ModelState

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


class Holding(NamedTuple):
    """What one loaded (or admitted) model holds: its footprint on each of its devices."""

    name: str
    labels: tuple[str, ...]
    bytes: int | None  # per device; None: not known (counted in the cap only)
    leaving: bool = False  # being released or stopped: its memory is on its way back


class Short(NamedTuple):
    """Why a model does not fit now: the cap is reached, and/or these devices lack room."""

    count: bool
    labels: tuple[str, ...]

    def reason(self, cap: int | None, need: int | None, used: Mapping[str, int], limits: Mapping[str, int]) -> str:
        parts = [f"max_loaded_models = {cap} are loaded"] if self.count else []
        parts += [f"memory_budget {label}: {fmt_size(used.get(label, 0))} of {fmt_size(limits[label])} in use, "
                  f"{fmt_size(need)} needed" for label in self.labels]
        return "; ".join(parts)


def used_on(holdings: list[Holding], label: str) -> int:
    return sum(h.bytes or 0 for h in holdings if label in h.labels)


def shortfall(labels: tuple[str, ...], need: int | None, cap: int | None, holdings: list[Holding],
              limits: Mapping[str, int]) -> Short | None:
    """Whether a model needing ``need`` bytes on each of ``labels`` fits beside ``holdings``
    (the others loaded or admitted): None, or what is short. Pure."""
    count = cap is not None and len(holdings) >= cap
    short = tuple(label for label in labels if label in limits and need is not None
                  and used_on(holdings, label) + need > limits[label])
    return Short(count, short) if count or short else None


def too_large(labels: tuple[str, ...], need: int | None, limits: Mapping[str, int]) -> str | None:
    """Why a model cannot fit even alone (its footprint beyond a device's budget), or None. Pure."""
    for label in labels:
        if label in limits and need is not None and need > limits[label]:
            return f"needs {fmt_size(need)} on device {label}, whose memory_budget is {fmt_size(limits[label])}"
    return None


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


class Footprint(NamedTuple):
    bytes: int | None
    measured: bool
    source: str


class Eviction(NamedTuple):
    model: str
    needed_by: str
    reason: str
    at: float


class GateHost(Protocol):
    start_gate: StartGate  # a model waiting for its devices already counts as loaded


class Budgeted(Protocol):
    """What the budget reads and does with one engine group (manager/group.py's EngineGroup)."""

    name: str
    state: ModelState
    cfg: C.ModelConfig  # its pinned flag
    host: GateHost
    footprint_bytes: int | None
    footprint_source: str
    estimate: Estimate | None  # made once, here
    idle_since: float | None
    release_refused: bool
    freezing: bool

    def evict(self, reason: str) -> bool: ...
    def wake(self) -> None: ...
    def start(self) -> None: ...


class Budget:
    def __init__(self, cap: int | None, groups: dict[str, Budgeted], labels=lambda g: ("cpu",),
                 memory: Mapping[str, Amount] | None = None, totals: Mapping[str, int] | None = None,
                 estimate=lambda g: Estimate(None, "")):
        self.cap = cap
        self.groups = groups
        self.labels = labels  # a group's device labels (StartGate.labels)
        self.totals = dict(totals or {})  # each device's memory (a fraction's base)
        self.limits: dict[str, int] = {}
        self.unresolved: list[str] = []  # labels budgeted as a fraction of a device of unknown size
        self.set_memory(memory or {})
        self.estimate = estimate  # a group's footprint before its first load (servectl/memory.py)
        self.waiting: list[Budgeted] = []  # need room, in the order they asked
        self.releasing: str | None = None  # the model being released for them
        self.retry_scheduled = False
        self.last_eviction: Eviction | None = None

    def set_memory(self, memory: Mapping[str, Amount]) -> None:
        """The configured budgets, in bytes (a fraction of a device whose size is not known is
        left out, and said at start); estimates are made again (a device's size may be known now)."""
        for g in self.groups.values():
            g.estimate = None
        self.limits = {}
        self.unresolved = []
        for label, amount in memory.items():
            limit = amount.resolve(self.totals.get(label))
            if limit is None:
                self.unresolved.append(label)
            else:
                self.limits[label] = limit

    @property
    def active(self) -> bool:
        return self.cap is not None or bool(self.limits)

    def footprint(self, group: Budgeted) -> Footprint:
        """What the group holds per device: measured at its last load, else estimated."""
        if group.footprint_bytes is not None:
            return Footprint(group.footprint_bytes, True, group.footprint_source)
        est = group.estimate if group.estimate is not None else self.estimate(group)
        group.estimate = est
        return Footprint(est.bytes, False, est.source)

    def loaded(self, besides: "Budgeted | None" = None) -> list[Budgeted]:
        return [g for g in self.groups.values() if g is not besides and g.state in LOADED]

    def holdings(self, group: Budgeted) -> list[Holding]:
        """Models loaded, or admitted and waiting for their devices, other than ``group`` — and
        other than those waiting for room (a crashed one among them holds nothing meanwhile)."""
        return [Holding(g.name, self.labels(g), self.footprint(g).bytes, g.state in LEAVING)
                for g in self.groups.values() if g is not group and g not in self.waiting and
                (g.state in LOADED or g.host.start_gate.is_waiting(g))]

    def short(self, group: Budgeted, holdings: list[Holding] | None = None) -> Short | None:
        held = self.holdings(group) if holdings is None else holdings
        return shortfall(self.labels(group), self.footprint(group).bytes, self.cap, held, self.limits)

    def unfit(self, group: Budgeted) -> str | None:
        """Why the model can never be loaded under the budgets (alone, it is larger), or None."""
        fp = self.footprint(group)
        why = too_large(self.labels(group), fp.bytes, self.limits)
        if why is None:
            return None
        advice = ("measured at its last load; raise the budget" if fp.measured else
                  f"estimated: {fp.source}; raise the budget, or set the model's expected_memory")
        return f"model {group.name} does not fit the memory budget even alone: it {why} ({advice})"

    def room_at_start(self, group: Budgeted) -> str | None:
        """None: the model fits beside those already started; else why it stays released."""
        short = self.short(group)
        if short is None:
            return None
        return "no room at start: " + self.describe(group, short)

    def describe(self, group: Budgeted, short: Short) -> str:
        held = self.holdings(group)
        used = {label: used_on(held, label) for label in short.labels}
        return short.reason(self.cap, self.footprint(group).bytes, used, self.limits)

    def admit(self, group: Budgeted) -> str | None:
        """None: ``group`` may start now; else why it waits (it is started once there is room).
        First come, first served among models that compete for the same room (the cap, or a
        device they share): one is admitted only once those that asked before it are."""
        if not self.active:
            return None
        short = self.short(group)
        before = self.waiting[:self.waiting.index(group)] if group in self.waiting else self.waiting
        ahead = next((w for w in before if self.competes(w, group)), None)
        if short is None and ahead is None:
            if group in self.waiting:
                self.waiting.remove(group)
            return None
        if group not in self.waiting:
            self.waiting.append(group)
        self.make_room()
        if short is None:
            return f"waiting for room: {ahead.name} asked first" if ahead else "waiting for room"
        return (f"waiting for room: {self.describe(group, short)}"
                + (f"; releasing {self.releasing}, the least recently used" if self.releasing else
                   "; none can be released now (pinned, or a request in flight)"))

    def competes(self, a: Budgeted, b: Budgeted) -> bool:
        """Whether two models need the same room: the cap (global), or a device they share."""
        return self.cap is not None or bool(set(self.labels(a)) & set(self.labels(b)) & set(self.limits))

    def make_room(self) -> None:
        """Release the least recently used model (one at a time) for the first model that waits
        and is not behind another that competes with it, unless room is on its way for it
        (models already releasing or stopping)."""
        if not self.waiting or self.releasing is not None or not self.active:
            return
        for i, group in enumerate(self.waiting):
            if any(self.competes(w, group) for w in self.waiting[:i]):
                continue  # its turn comes after theirs
            held = self.holdings(group)
            staying = [h for h in held if not h.leaving]
            if len(staying) < len(held) and self.short(group, staying) is None:
                continue  # what is on its way out makes the room
            short = self.short(group, held)
            if short is None:
                continue
            residents = [Resident(g.name, g.state, g.cfg.pinned, g.idle_since, g.release_refused, g.freezing)
                         for g in self.loaded() if g not in self.waiting
                         and (short.count or set(self.labels(g)) & set(short.labels))]
            victim = choose_victim(residents)
            if victim is None:
                continue
            self.releasing = victim
            reason = (f"evicted: model {group.name} needs room ({self.describe(group, short)}; "
                      "the least recently used)")
            if self.groups[victim].evict(reason):
                self.last_eviction = Eviction(victim, group.name, reason, time.time())
                return
            self.releasing = None

    def status(self) -> WS.BudgetStatus:
        """Each device's budget and what the loaded models hold there; the last eviction."""
        loaded = self.loaded()
        held = [(self.labels(g), self.footprint(g).bytes or 0, g.name) for g in loaded]
        labels = sorted({label for ls, _, _ in held for label in ls} | set(self.limits))
        last = self.last_eviction
        return WS.BudgetStatus(
            max_loaded_models=self.cap, loaded=len(loaded),
            devices=[WS.DeviceBudget(label=label, budget_bytes=self.limits.get(label), total_bytes=self.totals.get(label),
                                    used_bytes=sum(n for ls, n, _ in held if label in ls),
                                    models=[name for ls, _, name in held if label in ls]) for label in labels],
            last_eviction=None if last is None else WS.LastEviction(**last._asdict()))

    def forget(self, group: Budgeted) -> None:
        if group in self.waiting:
            self.waiting.remove(group)

    def changed(self, group: Budgeted) -> None:
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
