"""An engine group between serving and released: what its engine says once it serves, and the wake.

Its engine's reports (ready, frozen, idle), its memory given back (an idle release, an eviction
for another model, a memory budget it never fits: parked released) and its wake. A part of
``EngineGroup`` (manager/group.py), mixed into it: the state it changes is the group's, through
the group's one setter (``_enter``, ``_swap``) and its transition table.
"""

from __future__ import annotations

import logging
import time

from manager.children import ChildState
from servectl.wire import control as P
from servectl.wire.vocab import IDLE_RELEASED, IdleMode
from servectl.wire.vocab import ModelState as S

log = logging.getLogger("manager")


class ReleaseAndWake:
    """EngineGroup's serving and releasing half (its attributes and setter are EngineGroup's)."""

    def park(self, why: str = "autostart = false") -> None:
        """Configured and listed, started by its first request (WakeModel): autostart = false, or
        no room at start (max_loaded_models, memory_budget)."""
        self._swap({S.STOPPED}, S.RELEASED, f"{why}: starts on its first request")

    def refuse_if_unfit(self) -> bool:
        """True (and the model stays released, saying why) if it cannot fit its memory budget
        even alone: no start is tried, its requests are refused."""
        unfit = self.host.budget.unfit(self)
        changed = unfit != self.unfit
        self.unfit = unfit
        if unfit is None:
            if changed:
                if self.state in IDLE_RELEASED:
                    self.reason = None  # (it said why it did not fit)
                self.host.on_group_change(self)  # the gateways hold its requests again
            return False
        if changed:
            log.warning("%s", unfit)
        self.host.budget.forget(self)  # it waits for no room: none will do
        self.host.start_gate.forget(self)
        if self.restart_timer is not None:
            self.restart_timer.cancel()
            self.restart_timer = None
        if not self._swap({S.STOPPED, S.BACKOFF, S.FAILED}, S.RELEASED, unfit) and (changed or self.reason != unfit):
            self.reason = unfit
            self.host.on_group_change(self)
        return True

    def on_ready(self, msg: P.ChildReady) -> None:
        """The engine serves: built (a start) or awake again (a wake from sleep)."""
        if msg.incarnation != self.incarnation or self.state is not S.STARTING:
            return
        mode = msg.idle_release
        if mode is not None:
            if mode != self.release_mode:
                log.warning("model %s: idle_release = %r is not available here (vLLM has no sleep mode on this "
                            "platform); an idle model is unloaded instead", self.name, str(self.release_mode))
            self.release_mode = mode
        self.device_memory_bytes = msg.device_memory_bytes
        if msg.footprint_bytes is not None:
            self.footprint_bytes, self.footprint_source = msg.footprint_bytes, msg.footprint_source
            beyond = self.host.budget.unfit(self)
            if beyond is not None:
                log.warning("%s; it serves now, but once released it is not loaded again", beyond)
        if msg.loras is not None:
            dropped = {lora.name for lora in self.loras} - {lora.name for lora in msg.loras}
            if dropped:
                log.warning("model %s: LoRA adapter(s) %s could not be loaded again; no longer served "
                            "(details: servectl logs %s)", self.name, ", ".join(sorted(dropped)), self.engine.component)
            self.loras = list(msg.loras)
        if self.start_began is not None:
            took, self.start_began = time.monotonic() - self.start_began, None
            self.start_s = max(self.start_s or 0.0, took)
        self._enter(S.READY)
        self.host.standbys.refill(self)

    def on_frozen(self, frozen: bool, idle_since: float | None = None) -> None:
        """The engine froze (or thawed) its workers between steps."""
        if self.state is not S.READY or not self.engine.alive:
            return
        self.frozen = frozen
        self.idle_since = idle_since if frozen else None
        if frozen:
            self.release_refused = False  # idle now: it may be asked to make room again
        for worker in self.workers:
            if worker.alive:
                worker.set(ChildState.FROZEN if frozen else ChildState.READY)
        self.host.on_group_change(self)

    # ---- idle release --------------------------------------------------------------------
    def on_idle(self, incarnation: str, idle_s: float) -> None:
        """The engine has been idle for idle_release_s: ask it to give its memory back."""
        idle = self.idle_policy
        if incarnation != self.incarnation or idle.after_s <= 0 or not self._swap(
                {S.READY}, S.RELEASING, f"idle for {idle_s:.1f}s"):
            return
        log.info("model %s: idle for %.1fs; releasing it (%s)", self.name, idle_s, self.release_mode)
        self.host.send_to_engine(self, P.Release(mode=self.release_mode, level=idle.sleep_level))

    def on_released(self, msg: P.GroupReleased) -> None:
        """The engine's answer to Release."""
        if msg.incarnation != self.incarnation or self.state is not S.RELEASING:
            return
        if not msg.released:
            log.info("model %s: a request came in; not released", self.name)
            self.release_refused = True
            self._enter(S.READY)
            return
        self.device_memory_bytes = msg.device_memory_bytes
        if msg.mode == IdleMode.SLEEP:
            self._enter(S.ASLEEP, f"asleep (vLLM sleep mode level {self.idle_policy.sleep_level})")
            log.info("model %s: asleep", self.name)
            if self.wake_wanted:
                self.wake()
            return

        async def unload() -> None:
            # Same configuration on the next start: the standbys fit, so they stay.
            await self.stop(self.host.settings.stop_grace_s, keep_standbys=True, then=S.RELEASED)
            log.info("model %s: released (unloaded; %d standby(s) kept)", self.name,
                     len(self.host.standbys.of_model(self.name)))
            if self.wake_wanted and self.state is S.RELEASED:
                self.wake()

        self.host.tasks.start(unload(), f"release {self.name}")

    def evict(self, reason: str) -> bool:
        """Release the model to make room for another (manager/budget.py), as its idle release
        would: its engine refuses if a request is in flight. False: it is not serving now."""
        if not self._swap({S.READY}, S.RELEASING, reason):
            return False
        log.info("model %s: %s; releasing it (%s)", self.name, reason, self.release_mode)
        self.host.send_to_engine(self, P.Release(mode=self.release_mode, level=self.idle_policy.sleep_level))
        return True

    def wake(self) -> None:
        """A gateway holds a request for this model: bring it back (idempotent)."""
        if self.state is S.RELEASED:
            log.info("model %s: woken by a request", self.name)
            self.start()
        elif self.state is S.ASLEEP:
            if self.refuse_if_unfit():
                return
            waits = self.host.budget.admit(self)  # asleep it was not counted; awake it is
            if waits is not None:
                if self.reason != waits:
                    self.reason = waits
                    self.host.on_group_change(self)
                return
            log.info("model %s: waking from sleep", self.name)
            self._enter(S.STARTING, "waking")
            self.host.send_to_engine(self, P.Wake())
        elif self.state in (S.RELEASING, S.STOPPING, S.EXITED):
            self.wake_wanted = True  # acted on once the release (or the exit) is settled
