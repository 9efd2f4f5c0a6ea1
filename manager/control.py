"""The manager's control socket: one handler per message (circus's one command per handler).

Children (``ChildReady``, ``GroupFrozen``, ``GroupDrained``, ``GroupHung``)
and the CLI (status, stop, restart, reload, load, unload, freezing) talk to
the manager here. A frame that does not decode gets ``Ack(ok=False)``; a bug
in one handler is logged and answered, never fatal to the supervisor.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from servectl import config as C
from servectl.paths import RuntimePaths
from servectl.wire import control as P
from servectl.wire.spawn import ENGINE, GATEWAY, parse_component

if TYPE_CHECKING:
    from manager.daemon import Manager

log = logging.getLogger("manager")


class ControlServer:
    def __init__(self, manager: "Manager", ctx: zmq.asyncio.Context):
        self.manager = manager
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A restarted engine comes back as `engine:<model>`; if the old
        # connection is not torn down yet, the new one must take the name over
        # (otherwise AbortPeer and Drain would go nowhere). See engine_core.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.settled_waiters: list[bytes] = []
        self.handlers = {
            P.ChildReady: self.on_child_ready,
            P.GroupFrozen: self.on_group_frozen,
            P.GroupDrained: self.on_group_drained,
            P.GroupHung: self.on_group_hung,
            P.KeysApplied: self.on_keys_applied,
            P.StatusRequest: self.on_status,
            P.WaitSettled: self.on_wait_settled,
            P.StopRequest: self.on_stop,
            P.RestartRequest: self.on_restart,
            P.ReloadRequest: self.on_reload,
            P.LoadModel: self.on_load,
            P.UnloadModel: self.on_unload,
            P.SetFreezing: self.on_set_freezing,
        }

    def bind(self, path) -> None:
        self.sock.bind(RuntimePaths.ipc(path))

    def reply(self, ident: bytes, msg) -> None:
        try:
            self.sock.send_multipart([ident, P.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("cannot reply to %r: %s", ident, exc)

    def send(self, ident: bytes, msg) -> None:
        """To a child that is connected under an identity (an engine); dropped if it is not."""
        try:
            self.sock.send_multipart([ident, P.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    async def serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) < 2:
                continue
            ident, body = frames[0], frames[-1]
            try:
                msg = P.control_in_decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("rejected control frame from %r: %s", ident[:32], exc)
                self.reply(ident, P.Ack(ok=False, message=f"bad request: {exc}"))
                continue
            try:
                self.handlers[type(msg)](ident, msg)
            except Exception:  # a bug in one handler must not take the supervisor down
                log.exception("control message %r failed", msg)
                self.reply(ident, P.Ack(ok=False, message="internal error; see the manager log"))

    def notify_settled(self) -> None:
        waiters, self.settled_waiters = self.settled_waiters, []
        for ident in waiters:
            self.reply(ident, self.manager.status())

    # ---- from children ---------------------------------------------------------------
    def on_child_ready(self, ident: bytes, msg: P.ChildReady) -> None:
        name = parse_component(msg.component)
        if name is None:
            return
        if name.kind == ENGINE:
            group = self.manager.groups.get(name.model)
            if group is not None and group.engine.pid == msg.pid:
                group.on_ready(msg.incarnation)
        elif name.kind == GATEWAY:
            self.manager.gateways.on_ready(msg, name.index)
            self.manager.check_settled()

    def on_group_frozen(self, ident: bytes, msg: P.GroupFrozen) -> None:
        group = self.manager.groups.get(msg.model)
        if group is not None:
            group.on_frozen(msg.frozen)

    def on_group_drained(self, ident: bytes, msg: P.GroupDrained) -> None:
        group = self.manager.groups.get(msg.model)
        if group is not None:
            group.on_drained(msg.incarnation)

    def on_group_hung(self, ident: bytes, msg: P.GroupHung) -> None:
        group = self.manager.groups.get(msg.model)
        if group is not None and group.kill_hung(msg.incarnation):
            log.error("model %s: a gateway saw no output in time; the group is hung, restarting it", msg.model)

    def on_keys_applied(self, ident: bytes, msg: P.KeysApplied) -> None:
        name = parse_component(msg.component)
        if name is not None and name.kind == GATEWAY:
            self.manager.gateways.on_keys_applied(msg, name.index)

    # ---- from the CLI --------------------------------------------------------------------
    def on_status(self, ident: bytes, msg: P.StatusRequest) -> None:
        self.reply(ident, self.manager.status())

    def on_wait_settled(self, ident: bytes, msg: P.WaitSettled) -> None:
        if self.manager.settled() and not self.manager.shutting_down:
            self.reply(ident, self.manager.status())
        else:
            self.settled_waiters.append(ident)

    def on_stop(self, ident: bytes, msg: P.StopRequest) -> None:
        self.reply(ident, P.Ack(ok=True, message="stopping"))
        self.manager.request_shutdown(msg.timeout_s)

    def on_restart(self, ident: bytes, msg: P.RestartRequest) -> None:
        if msg.model is not None and msg.model not in self.manager.groups:
            self.reply(ident, self.no_model(msg.model))
            return
        names = self.manager.restart(msg.model)
        self.reply(ident, P.Ack(ok=True, message=f"restarting {', '.join(names)}"))

    def on_reload(self, ident: bytes, msg: P.ReloadRequest) -> None:
        async def run() -> None:
            ok, message = await self.manager.reload()
            self.reply(ident, P.Ack(ok=ok, message=message))  # once applied, not before

        asyncio.get_running_loop().create_task(run())

    def on_load(self, ident: bytes, msg: P.LoadModel) -> None:
        if msg.model.name in self.manager.groups:
            self.reply(ident, P.Ack(ok=False, message=f"model {msg.model.name!r} is already served"))
            return
        m = self.manager
        cfg = C.finalize(C.Config(gateway=m.gateway_cfg, manager=m.settings, models=[msg.model]))
        m.add_model(cfg.models[0])
        self.reply(ident, P.Ack(ok=True, message=f"loading {msg.model.name}"))

    def on_unload(self, ident: bytes, msg: P.UnloadModel) -> None:
        if msg.name not in self.manager.groups:
            self.reply(ident, self.no_model(msg.name))
            return
        asyncio.get_running_loop().create_task(self.manager.remove_model(msg.name))
        self.reply(ident, P.Ack(ok=True, message=f"unloading {msg.name}"))

    def on_set_freezing(self, ident: bytes, msg: P.SetFreezing) -> None:
        group = self.manager.groups.get(msg.model)
        if group is None:
            self.reply(ident, self.no_model(msg.model))
            return
        group.freezing = msg.enabled
        self.manager.send_to_engine(group, P.FreezingControl(
            enabled=msg.enabled, grace_s=self.manager.settings.freeze_grace_s or C.DEFAULT_FREEZE_GRACE_S))
        self.reply(ident, P.Ack(ok=True, message=f"freezing {'on' if msg.enabled else 'off'} for {msg.model}"))

    def no_model(self, name: str) -> P.Ack:
        return P.Ack(ok=False, message=f"no model {name!r}; served: {', '.join(self.manager.groups)}")
