"""Who may send the manager what on its control sockets (manager/control.py takes the messages).

The owner's uid (and root) on ``control``; status and wait-settled only on ``control-ro``; and
a report only the manager's own children make (a hang, a readiness, an engine's release) only
from the very process that may make it, by the kernel's pid of the connection (SO_PEERCRED,
libzmq's ``Peer-Address``): any other process of the owner's uid could otherwise fake a hang
(the engine killed) or a readiness.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple, Protocol

import zmq
import zmq.asyncio

from manager.audit import READ_ONLY, UNKNOWN, Peer, parse_peer_address
from servectl.wire import control as P
from servectl.wire.spawn import ENGINE, GATEWAY, parse_component

# Messages only the manager's own children send: accepted only from the very process
# (by the kernel's pid of the connection) that may send each.
# A gateway's LogTail is the status page's (api_gateway/ui.py): logs can hold request text.
# Admit and Finished: only a gateway may take a key's slot or count its usage.
FROM_GATEWAYS = (P.GroupHung, P.WakeModel, P.KeysApplied, P.HttpRefused, P.LogTail, P.Admit, P.Finished)
FROM_ENGINES = (P.GroupFrozen, P.GroupDrained, P.GroupIdle, P.GroupReleased, P.EngineFailed, P.StepDeadlineChanged,
                P.LoraDone)
FROM_CHILDREN = (*FROM_GATEWAYS, *FROM_ENGINES, P.ChildReady)
# Nothing a peer sends the manager is near this big (a LoadModel is a few KiB): a larger
# message closes that peer's connection before the manager holds it.
MAX_MESSAGE_BYTES = 1 << 20


class Caller(NamedTuple):
    """Where a request came from: the socket to answer on, the peer's identity there, who it is."""

    sock: zmq.asyncio.Socket
    ident: bytes
    peer: Peer
    via: str  # "control" or "control-ro"


def peer_of(frame: zmq.Frame) -> Peer:
    try:
        return parse_peer_address(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return UNKNOWN


class Children(Protocol):
    """Where the manager's children are (the Manager): its gateways and its engine groups."""

    gateways: object  # a GatewayPool: .pids()
    groups: Mapping[str, object]  # EngineGroup by name: .engine.pid


def refusal(caller: Caller, msg, owners: set[int], children: Children) -> str | None:
    """Why this caller may not send this message, or None."""
    if caller.via == "control-ro":
        if isinstance(msg, READ_ONLY):
            return None
        return (f"permission denied: {type(msg).__name__} changes the daemon; only its owner "
                f"(uid {os.geteuid()}) or root may send it (on the control socket)")
    if caller.peer.uid is not None and caller.peer.uid not in owners:
        return f"permission denied: uid {caller.peer.uid} is not the daemon's owner (uid {os.geteuid()}) or root"
    if isinstance(msg, FROM_CHILDREN) and not sent_by_its_child(children, msg, caller.peer.pid):
        return (f"permission denied: {type(msg).__name__} is accepted only from the child process "
                f"that may send it, and pid {caller.peer.pid} is not that child")
    return None


def sent_by_its_child(children: Children, msg, pid: int | None) -> bool:
    """Whether ``pid`` is the child this message may come from: a gateway for a gateway's
    report, that model's engine for an engine's, the component named for a readiness."""
    if pid is None:
        return False
    if isinstance(msg, FROM_GATEWAYS):
        return pid in children.gateways.pids()
    if isinstance(msg, P.ChildReady):
        if msg.pid != pid:
            return False
        name = parse_component(msg.component)
        if name is not None and name.kind == GATEWAY:
            return pid in children.gateways.pids()
        group = children.groups.get(name.model) if name is not None and name.kind == ENGINE else None
        return group is not None and group.engine.pid == pid
    group = children.groups.get(msg.model)
    return group is not None and group.engine.pid == pid
