"""The manager's control sockets: one handler per message (circus's one command per handler).

Two ROUTER sockets (docs/operations.md, "Who may do what"):

- ``control`` (0600): the daemon's own user — its children (``ChildReady``,
  ``GroupFrozen``, ``GroupDrained``, ``GroupHung``, ``GroupIdle``, ``GroupReleased``,
  ``StepDeadlineChanged``, ``KeysApplied``, a gateway's ``WakeModel``) and the
  owner's CLI (status, stop, restart, reload, load, unload, freezing). Root
  reaches it too. A peer of another uid (the kernel's ``SO_PEERCRED``, via
  libzmq's ``Peer-Address``) is refused anyway.
- ``control-ro`` (0660 in a group-shared runtime directory, else 0600):
  status and wait-settled only; anything else is refused and audited. The
  group never shares a socket with the children, so it cannot take over a
  child's identity (``ROUTER_HANDOVER``) to read what the manager sends it.

Every command that changes state is written to the audit log (manager/audit.py)
with who sent it. A frame that does not decode gets ``Ack(ok=False)``; a bug in
one handler is logged and answered, never fatal to the supervisor.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from manager.audit import CHANGING, UNKNOWN, AuditLog, Peer, RefusalLimiter, audit_record
from manager.children import Child
from manager.control_access import FROM_CHILDREN, MAX_MESSAGE_BYTES, Caller, peer_of, refusal
from manager.gateways import GatewayPool
from manager.group import EngineGroup
from manager.limits import KeyLimits
from manager.served import ServedModels
from manager.usage import UsageLedger
from manager.verbs import ModelVerbs
from servectl.paths import RuntimePaths
from servectl.tasks import Tasks
from servectl.wire import control as P
from servectl.wire.spawn import ENGINE, GATEWAY, engine_identity, parse_component

log = logging.getLogger("manager")


class ControlHost(Protocol):
    """What the control socket reads and asks of the Manager."""

    state_dir: Path  # its audit log
    tasks: Tasks  # a verb's (or reload's) answer waits in one
    groups: Mapping[str, EngineGroup]  # where the children's reports go
    gateways: GatewayPool
    served: ServedModels  # LoRA and freezing changes
    verbs: ModelVerbs  # load, unload, restart
    limits: KeyLimits  # the named keys' limits, across every gateway
    usage: UsageLedger  # usage per key and model, kept in the state directory
    shutting_down: bool

    def status(self) -> P.StatusReply: ...
    def settled(self) -> bool: ...
    def check_settled(self) -> None: ...
    def child(self, component: str) -> Child | None: ...
    def on_step_deadline(self, group: EngineGroup) -> None: ...
    def request_shutdown(self, timeout_s: float | None = None) -> None: ...
    async def reload(self) -> tuple[bool, str]: ...


class ControlServer:
    def __init__(self, host: ControlHost, ctx: zmq.asyncio.Context):
        self.host = host
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A restarted engine comes back as `engine:<model>`; if the old
        # connection is not torn down yet, the new one must take the name over
        # (otherwise AbortPeer and Drain would go nowhere). See engine_core.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # The group's socket: no handover (its peers' names are theirs alone).
        self.ro = ctx.socket(zmq.ROUTER)
        self.ro.setsockopt(zmq.LINGER, 0)
        for sock in (self.sock, self.ro):
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.owners = {os.geteuid(), 0}
        self.audit = AuditLog(host.state_dir / "audit.log")
        self.refusals = RefusalLimiter()  # per peer: a flood of refusals is counted, not written
        self.settled_waiters: list[Caller] = []
        self.handlers = {
            P.ChildReady: self.on_child_ready,
            P.GroupFrozen: self.on_group_frozen,
            P.GroupDrained: self.on_group_drained,
            P.GroupHung: self.on_group_hung,
            P.EngineFailed: self.on_engine_failed,
            P.StepDeadlineChanged: self.on_step_deadline,
            P.KeysApplied: self.on_keys_applied,
            P.GroupIdle: self.on_group_idle,
            P.GroupReleased: self.on_group_released,
            P.WakeModel: self.on_wake_model,
            P.StatusRequest: self.on_status,
            P.LogTail: self.on_log_tail,
            P.WaitSettled: self.on_wait_settled,
            P.StopRequest: self.on_stop,
            P.RestartRequest: self.on_restart,
            P.ReloadRequest: self.on_reload,
            P.LoadModel: self.on_load,
            P.LoadConfigured: self.on_load_configured,
            P.UnloadModel: self.on_unload,
            P.HttpRefused: self.on_http_refused,
            P.SetFreezing: self.on_set_freezing,
            P.LoadLora: self.on_lora_change,
            P.UnloadLora: self.on_lora_change,
            P.LoraDone: self.on_lora_done,
            P.Admit: self.on_admit,
            P.Finished: self.on_finished,
            P.UsageRequest: self.on_usage,
        }

    def bind(self, paths: RuntimePaths) -> None:
        self.sock.bind(RuntimePaths.ipc(paths.control))
        self.ro.bind(RuntimePaths.ipc(paths.control_ro))

    def reply(self, caller: Caller, msg) -> None:
        try:
            caller.sock.send_multipart([caller.ident, P.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("cannot reply to %r: %s", caller.ident, exc)

    def send(self, ident: bytes, msg) -> None:
        """To a child that is connected under an identity (an engine, a gateway); dropped if it is not."""
        try:
            self.sock.send_multipart([ident, P.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def record(self, caller: Caller | None, msg, outcome: str) -> None:
        """One audit line (a SIGHUP reload has no caller); refusals not yet said go first."""
        for (via, uid, pid), count in self.refusals.owed():
            self.audit.write({**audit_record(time.time(), Peer(uid, None, pid), "refusals not written", "denied",
                                             via), "suppressed": count})
        self.audit.write(audit_record(time.time(), caller.peer if caller else UNKNOWN, msg, outcome,
                                      caller.via if caller else "signal"))

    def record_cluster(self, addr: str, what: str, outcome: str, detail: str) -> None:
        """Another host's manager joined or was refused (manager/cluster.py); refusals within
        that address's budget, as a local peer's."""
        record = {"time": audit_record(time.time(), UNKNOWN, what, outcome)["time"], "via": "cluster",
                  "address": addr, "command": what, "outcome": outcome}
        if detail:
            record["reason"] = detail
        if outcome == "denied":
            suppressed = self.refusals.take(("cluster", addr, None), time.monotonic())
            if suppressed is None:
                return
            if suppressed:
                record["suppressed"] = suppressed
        self.audit.write(record)

    def record_refusal(self, caller: Caller, msg) -> None:
        """A refusal's audit line (and log line), within its peer's budget; past it, counted and
        said with the peer's next one written (or before the next accepted line)."""
        peer = caller.peer
        suppressed = self.refusals.take((caller.via, peer.uid, None if peer.uid is not None else peer.pid),
                                        time.monotonic())
        if suppressed is None:
            return
        log.warning("refused %s from uid %s pid %s on %s", type(msg).__name__, peer.uid, peer.pid, caller.via)
        record = audit_record(time.time(), peer, msg, "denied", caller.via)
        if suppressed:
            record["suppressed"] = suppressed
        self.audit.write(record)

    def refusal(self, caller: Caller, msg) -> str | None:
        """Why this caller may not send this message, or None (manager/control_access.py)."""
        return refusal(caller, msg, self.owners, self.host)

    def loops(self) -> list[tuple[str, Callable[[], Coroutine]]]:
        """The two receive loops, (name, coroutine factory): the Manager runs each under its
        Tasks.keep, which restarts one that raised (each message's handler is already guarded,
        so only the loop's own I/O can) and shuts the manager down past its restarts."""
        return [("control loop", lambda: self._serve(self.sock, "control")),
                ("control-ro loop", lambda: self._serve(self.ro, "control-ro"))]

    async def _serve(self, sock: zmq.asyncio.Socket, via: str) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            if len(frames) < 2:
                continue
            caller = Caller(sock, frames[0].bytes, peer_of(frames[-1]), via)
            try:
                self.take(caller, frames[-1].bytes)
            except Exception as exc:  # nothing one message does may end the loop (a peer's, or a bug)
                log.error("control message on %s failed: %s", via, type(exc).__name__)
                self.reply(caller, P.Ack(ok=False, message="internal error; see the manager log"))

    def take(self, caller: Caller, body: bytes) -> None:
        """One message: decoded, checked, audited, handled."""
        try:
            msg = P.control_in_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            # repr, cut: the error quotes the sender's bytes, which must not forge log lines
            log.warning("rejected control frame from %r on %s: %r", caller.ident[:32], caller.via, str(exc)[:200])
            self.reply(caller, P.Ack(ok=False, message=f"bad request: {str(exc)[:200]}"))
            return
        why = self.refusal(caller, msg)
        if why is not None:
            if isinstance(msg, (CHANGING, FROM_CHILDREN)) or caller.via == "control-ro":
                self.record_refusal(caller, msg)
            else:
                log.warning("refused %s from uid %s pid %s on %s", type(msg).__name__, caller.peer.uid,
                            caller.peer.pid, caller.via)
            self.reply(caller, P.Ack(ok=False, message=why))
            return
        if isinstance(msg, CHANGING):
            self.record(caller, msg, "accepted")
        try:
            self.handlers[type(msg)](caller, msg)
        except Exception:  # a bug in one handler must not take the supervisor down
            log.exception("control message %s failed", type(msg).__name__)
            self.reply(caller, P.Ack(ok=False, message="internal error; see the manager log"))

    def notify_settled(self) -> None:
        waiters, self.settled_waiters = self.settled_waiters, []
        for caller in waiters:
            self.reply(caller, self.host.status())

    # ---- from children (engines; gateways: hung, wake, keys) ------------------------------
    def on_child_ready(self, caller: Caller, msg: P.ChildReady) -> None:
        name = parse_component(msg.component)
        if name is not None and name.kind == ENGINE:
            group = self.host.groups.get(name.model)
            if group is not None and group.engine.pid == msg.pid:
                group.on_ready(msg)
        elif name is not None and name.kind == GATEWAY:
            self.host.gateways.on_ready(msg, name.index)
            self.host.check_settled()

    def on_group_frozen(self, caller: Caller, msg: P.GroupFrozen) -> None:
        group = self.host.groups.get(msg.model)
        if group is not None:
            group.on_frozen(msg.frozen, msg.idle_since)

    def on_group_drained(self, caller: Caller, msg: P.GroupDrained) -> None:
        group = self.host.groups.get(msg.model)
        if group is not None:
            group.on_drained(msg.incarnation)

    def on_group_hung(self, caller: Caller, msg: P.GroupHung) -> None:
        group = self.host.groups.get(msg.model)
        if group is not None and group.kill_hung(msg.incarnation):
            log.error("model %s: a gateway saw no output in time; the group is hung, restarting it", msg.model)

    def on_engine_failed(self, caller: Caller, msg: P.EngineFailed) -> None:
        group = self.host.groups.get(msg.model)
        if group is not None and caller.ident == engine_identity(msg.model):  # from that model's engine only
            group.on_engine_failed(msg.incarnation, msg.reason)
        self.reply(caller, P.Ack(ok=True))  # the engine exits once it has this

    def on_step_deadline(self, caller: Caller, msg: P.StepDeadlineChanged) -> None:
        group = self.host.groups.get(msg.model)
        if group is not None and caller.ident == engine_identity(msg.model) and msg.incarnation == group.incarnation:
            group.step_deadline_s = msg.seconds
            self.host.on_step_deadline(group)

    def on_keys_applied(self, caller: Caller, msg: P.KeysApplied) -> None:
        name = parse_component(msg.component)
        if name is not None and name.kind == GATEWAY:
            self.host.gateways.on_keys_applied(msg, name.index)

    def on_group_idle(self, caller: Caller, msg: P.GroupIdle) -> None:
        group = self.host.groups.get(msg.model)
        if group is not None and not self.host.shutting_down:
            group.on_idle(msg.incarnation, msg.idle_s)

    def on_group_released(self, caller: Caller, msg: P.GroupReleased) -> None:
        group = self.host.groups.get(msg.model)
        if group is not None:
            group.on_released(msg)

    def on_lora_done(self, caller: Caller, msg: P.LoraDone) -> None:
        group = self.host.groups.get(msg.model)
        if group is not None:
            group.on_lora_done(msg)

    def on_wake_model(self, caller: Caller, msg: P.WakeModel) -> None:
        group = self.host.groups.get(msg.model)
        if group is not None and not self.host.shutting_down:
            group.wake()

    # ---- from the CLI --------------------------------------------------------------------
    def on_status(self, caller: Caller, msg: P.StatusRequest) -> None:
        self.reply(caller, self.host.status())

    def on_log_tail(self, caller: Caller, msg: P.LogTail) -> None:
        child = self.host.child(msg.component)
        if child is None:
            self.reply(caller, P.LogLines(component=msg.component, lines=[], written=0, known=False))
            return
        self.reply(caller, P.LogLines(component=msg.component, lines=child.sink.since(msg.after),
                                      written=child.sink.written))

    def on_wait_settled(self, caller: Caller, msg: P.WaitSettled) -> None:
        if self.host.settled() and not self.host.shutting_down:
            self.reply(caller, self.host.status())
        else:
            self.settled_waiters.append(caller)

    def on_stop(self, caller: Caller, msg: P.StopRequest) -> None:
        self.reply(caller, P.Ack(ok=True, message="stopping"))
        self.host.request_shutdown(msg.timeout_s)

    def on_restart(self, caller: Caller, msg: P.RestartRequest) -> None:
        self.answer_when_done(caller, self.host.verbs.restart(msg.model, msg.wait_s), f"restart {msg.model or 'all'}")

    def answer_when_done(self, caller: Caller, verb: Coroutine, name: str) -> None:
        """A model verb's answer, sent when its change is done (manager/verbs.py) or the caller's
        wait is over; a manager that stops meanwhile says so."""
        async def run() -> None:
            try:
                self.reply(caller, await verb)
            except asyncio.CancelledError:
                self.reply(caller, P.Ack(ok=False, message="the daemon is stopping"))
                raise

        self.host.tasks.start(run(), name)

    def on_reload(self, caller: Caller, msg: P.ReloadRequest) -> None:
        async def run() -> None:
            ok, message = await self.host.reload()
            self.reply(caller, P.Ack(ok=ok, message=message))  # once applied, not before

        self.host.tasks.start(run(), "reload")

    def on_load(self, caller: Caller, msg: P.LoadModel) -> None:
        verb = self.host.verbs.load(msg.model.name, msg.model, msg.wait_s)
        self.answer_when_done(caller, verb, f"load {msg.model.name}")

    def on_load_configured(self, caller: Caller, msg: P.LoadConfigured) -> None:
        self.answer_when_done(caller, self.host.verbs.load(msg.name, None, msg.wait_s), f"load {msg.name}")

    def on_http_refused(self, caller: Caller, msg: P.HttpRefused) -> None:
        """A gateway's refusal of a management call: recorded, nothing else (no reply)."""
        record = audit_record(time.time(), caller.peer, msg, "denied", caller.via)
        record["args"] = {"status": msg.status, "reason": msg.reason,
                          **({"suppressed": msg.suppressed} if msg.suppressed else {})}
        self.audit.write(record)

    def on_unload(self, caller: Caller, msg: P.UnloadModel) -> None:
        self.answer_when_done(caller, self.host.verbs.unload(msg.name, msg.wait_s), f"unload {msg.name}")

    def on_lora_change(self, caller: Caller, msg: P.LoadLora | P.UnloadLora) -> None:
        """Load or unload a LoRA adapter; answered once the model's engine has done it (or refused)."""
        async def run() -> None:
            self.reply(caller, await self.host.served.change_lora(msg))

        self.host.tasks.start(run(), type(msg).__name__)

    def on_set_freezing(self, caller: Caller, msg: P.SetFreezing) -> None:
        self.reply(caller, self.host.served.set_freezing(msg.model, msg.enabled))

    # ---- keys: limits and usage (docs/tenancy.md) -------------------------------------
    def on_admit(self, caller: Caller, msg: P.Admit) -> None:
        self.reply(caller, self.host.limits.admit(msg.key, (caller.ident, msg.ticket), time.monotonic()))

    def on_finished(self, caller: Caller, msg: P.Finished) -> None:
        self.host.usage.add(msg.key, msg.model, msg.prompt_tokens, msg.completion_tokens, msg.error, time.time())
        self.host.limits.finish(msg.key, (caller.ident, msg.ticket) if msg.ticket else None,
                                0 if msg.batch else msg.prompt_tokens + msg.completion_tokens, time.monotonic())

    def on_usage(self, caller: Caller, msg: P.UsageRequest) -> None:
        now = time.time()
        since = msg.since if msg.since is not None else 0.0
        self.reply(caller, P.UsageReply(since=since // 60 * 60, until=now, rows=self.host.usage.rows(msg.since)))
