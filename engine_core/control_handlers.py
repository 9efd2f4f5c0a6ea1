"""The engine's side of the control socket: the manager's messages, one handler each.

``ManagerMessages`` is a part of ``EngineServer`` (engine_core/core.py), kept
apart because the manager's verbs (abort a dead gateway's requests, drain,
release when idle, wake, freezing on or off) are a small world of their own;
it uses the server's state (requests, idle release, the worker group) and its
control DEALER.
"""

from __future__ import annotations

import logging
import os
import time

import msgspec
import zmq

from servectl.wire import control as MP
from servectl.wire.spawn import engine_component

log = logging.getLogger("engine_core")


class ManagerMessages:
    def _drain_control(self) -> None:
        while True:
            try:
                body = self.control.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = MP.to_engine_decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("rejected control frame: %s", exc)
                continue
            self.on_control[type(msg)](msg)

    # ---- one handler per manager message ----------------------------------------
    def _on_abort_peer(self, msg: MP.AbortPeer) -> None:
        ids = list(self.by_peer.pop(msg.peer.encode(), ()))
        if ids:
            log.info("aborting %d request(s) of dead gateway %s", len(ids), msg.peer)
            self._abort(ids)

    def _on_drain(self, msg: MP.Drain) -> None:
        self.draining = True
        log.info("draining: %d request(s) unfinished", self.engine.get_num_unfinished_requests())
        self._check_drained()

    def _on_release(self, msg: MP.Release) -> None:
        """The manager releases the idle engine, unless a request came in since GroupIdle."""
        busy = (self.engine.has_unfinished_requests() or bool(self.in_flight) or bool(self.pending)
                or bool(self.slices) or self.draining)
        released, device_memory = self.idle.release(busy)
        if released:
            log.info("released (%s): new requests are held by the gateways until a wake", self.idle.mode)
        self.control.send(MP.encoder.encode(MP.GroupReleased(
            model=self.spec.group_name, incarnation=self.spec.incarnation, released=released, mode=self.idle.mode,
            device_memory_bytes=device_memory)))

    def _on_wake(self, msg: MP.Wake) -> None:
        if self.idle.wake():
            self.clock.since = time.monotonic()
            self.say_ready()

    def say_ready(self) -> None:
        """ChildReady to the manager: at start, and after a wake from sleep (same incarnation)."""
        self.control.send(MP.encoder.encode(MP.ChildReady(
            component=engine_component(self.spec.group_name), pid=os.getpid(), incarnation=self.spec.incarnation,
            max_model_len=self.max_model_len, idle_release=self.idle.mode,
            device_memory_bytes=self.idle.device_memory(), loras=self._lora_listing(),
            footprint_bytes=self.footprint[0] if self.footprint else None,
            footprint_source=self.footprint[1] if self.footprint else "")))

    def _lora_listing(self):
        """The adapters served (None where the engine takes none: nothing to reconcile)."""
        adapters = self.__dict__.get("adapters")  # made at start when the model takes adapters
        return adapters.listing() if adapters is not None and adapters.enabled else None

    def _on_lora_change(self, msg: MP.AddLora | MP.RemoveLora) -> None:
        """Load or unload an adapter between steps (vLLM's checks; the workers read its files)."""
        from engine_core.loras import LoraRefused

        ok, status, message, files = True, 200, "", False
        try:
            if isinstance(msg, MP.AddLora):
                message = self.adapters.load(msg.lora, msg.load_inplace)
            else:
                message = self.adapters.unload(msg.name)
        except LoraRefused as exc:
            ok, status, message, files = False, exc.status, str(exc), exc.files
            log.warning("LoRA change refused: %s", message)
        self.control.send(MP.encoder.encode(MP.LoraDone(
            model=self.spec.group_name, incarnation=self.spec.incarnation, call_id=msg.call_id, ok=ok,
            status=status, message=message, loras=self.adapters.listing(), files=files)))

    def _on_freezing(self, msg: MP.FreezingControl) -> None:
        if msg.enabled:
            self.clock.freeze_grace_ms = int(msg.grace_s * 1000)
        else:
            self.clock.freeze_grace_ms = None
            self.group.thaw()
        log.info("freezing %s", "enabled" if msg.enabled else "disabled")

