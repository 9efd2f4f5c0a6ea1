"""What the manager says about what it supervises: the status reply and the events it publishes.

Pure builders: the manager sends what they make (``StatusReply`` on the control sockets,
``Event`` on the events socket). A model's status and events read its engine group and what
the budget, the start gate and the standby pool know of it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Mapping, Protocol

from manager.budget import Budget
from manager.children import Child
from manager.gateways import GatewayPool
from manager.group import EngineGroup, GroupState
from manager.served import ServedModels
from manager.standbys import StandbyPool
from manager.start_gate import StartGate
from servectl import config as C
from servectl.proc import ppid_of, rss_bytes
from servectl.wire import control as P
from servectl.wire import status as WS
from servectl.wire.spawn import MODEL, engine_component, model_component, worker_component
from servectl.wire.vocab import ARMED, CHILD_DOWN, ChildState, EventKind, ManagerState


def child_event(child: Child, group: EngineGroup | None, detail: str) -> WS.Event:
    return WS.Event(component=child.component, kind=child.kind, model=child.model, state=child.state,
                   pid=child.popen.pid if child.popen else None, time=time.time(),
                   incarnation=group.incarnation if group else "", detail=detail, restarts=child.restarts)


def group_event(group: EngineGroup) -> WS.Event:
    return WS.Event(component=model_component(group.name), kind=MODEL, model=group.name, state=group.state,
                   pid=group.engine.pid, time=time.time(), incarnation=group.incarnation,
                   detail=group.reason or "", hold_timeout_s=group.cfg.hold_timeout_s,
                   start_s=group.start_s, config_id=group.config_id, loras=list(group.loras),
                   unfit=group.unfit is not None,
                   hung=group.killed_hung and group.state in (GroupState.EXITED, GroupState.BACKOFF))


def host_event(host: str, joined: bool, detail: str) -> WS.Event:
    """Another host joined or left (a model spread over hosts): the event names it."""
    return WS.Event(component=f"host:{host}", kind=EventKind.HOST, model=None,
                    state=ChildState.READY if joined else ChildState.EXITED, pid=None, time=time.time(),
                    detail=detail, host=host)


def deadline_event(group: EngineGroup) -> WS.Event:
    """The engine's step deadline changed (gateways find hangs by it; an operator sees it)."""
    return WS.Event(component=engine_component(group.name), kind=EventKind.DEADLINE, model=group.name,
                   state=ARMED, pid=group.engine.pid, time=time.time(), incarnation=group.incarnation,
                   detail=f"{group.step_deadline_s:.3f}", step_deadline_s=group.step_deadline_s)


class Supervised(Protocol):
    """What a status reply reads (the Manager)."""

    instance: str
    started_at: float
    state: ManagerState
    state_dir: Path
    gateway_cfg: C.GatewayConfig
    gateways: GatewayPool
    groups: Mapping[str, EngineGroup]
    served: ServedModels  # the configured models, and which are served
    budget: Budget
    start_gate: StartGate
    standbys: StandbyPool

    def children(self) -> list[Child]: ...


def status_reply(m: Supervised) -> P.StatusReply:
    return P.StatusReply(
        version=P.PROTOCOL_VERSION, instance=m.instance, manager_pid=os.getpid(), started_at=m.started_at,
        state=m.state, port=m.gateways.port, host=m.gateway_cfg.host, state_dir=str(m.state_dir),
        children=[WS.ChildStatus(
            component=c.component, kind=c.kind, model=c.model, pid=c.pid, ppid=ppid_of(c.pid), state=c.state,
            since=c.since, started_at=c.started_at if c.alive else None, restarts=c.restarts,
            last_exit=c.last_exit, last_log=c.tail(15) if c.state in CHILD_DOWN else [],
            exit_code=c.exit_code, exit_signal=c.exit_signal, head=head_of(m, c))
            for c in m.children()] + remote_children(m),
        models=[model_status(g, m.budget, m.start_gate, m.standbys) for g in m.groups.values()],
        budget=m.budget.status(), unloaded=[name for name in m.served.configured if not m.served.serves(name)])


def head_of(m: "Supervised", child: Child) -> str | None:
    """The host whose engine a rank run here serves (a member host's), or None."""
    member = getattr(m, "member", None)
    return member.head_of.get(child.model) if member is not None and child in member.children() else None


def remote_children(m: "Supervised") -> list[WS.ChildStatus]:
    """The ranks other hosts run for the groups headed here, as those hosts last said."""
    cluster = getattr(m, "cluster", None)
    if cluster is None:
        return []
    return [WS.ChildStatus(component=worker_component(g, r.rank), kind=EventKind.WORKER, model=g, pid=r.pid,
                           ppid=None, state=r.state, since=r.since, started_at=None, restarts=0,
                           last_exit=r.last_exit, host=r.host)
            for g, r in cluster.remote_ranks()]


def model_status(g: EngineGroup, budget: Budget, start_gate: StartGate, standbys: StandbyPool) -> WS.ModelStatus:
    idle = g.idle_policy
    fp = budget.footprint(g)
    return WS.ModelStatus(
        name=g.name, state=g.state, frozen=g.frozen, incarnation=g.incarnation, reason=g.reason,
        release_after_s=idle.after_s, release_mode=g.release_mode if idle.after_s > 0 else "",
        idle_since=g.idle_since, released_since=g.released_since,
        memory_bytes=sum(rss_bytes(c.pid) for c in g.children if c.alive),
        device_memory_bytes=g.device_memory_bytes, hold_timeout_s=g.cfg.hold_timeout_s,
        step_deadline_s=g.step_deadline_s, restarts=g.engine.restarts, devices=g.cfg.devices,
        start_s=g.start_s, config_id=g.config_id, lora_enabled=C.lora_enabled(g.cfg), loras=list(g.loras),
        footprint_bytes=fp.bytes, footprint_measured=fp.measured, footprint_source=fp.source,
        device_labels=list(start_gate.labels(g)), unfit=g.unfit,
        standby_memory_bytes=sum(rss_bytes(c.pid) for c in standbys.of_model(g.name) if c.alive))
