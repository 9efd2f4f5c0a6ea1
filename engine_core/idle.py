"""The engine's side of idle release: when to say it is idle, how to release and wake.

No vLLM and no torch here, so the logic is unit-tested against an engine
double (tests/test_idle_unit.py), the GPU sleep path included.

The engine decides idleness: it knows its unfinished requests and already
keeps the time since its last step (the freeze grace). Once nothing has been
unfinished for ``idle_release_s`` it says ``GroupIdle`` to the manager, once
per idle period: a one-shot deadline armed on the busy→idle transition, never
a periodic timer. The manager answers with ``Release``; the engine, which is
the one place every request passes, then decides for good:

- a request arrived meanwhile (something is unfinished): it refuses and
  serves on (``GroupReleased(released=False)``);
- else it is released from now on: every new ``Generate`` is answered with
  ``RequestError(released=True)``, which the gateway holds and sends again
  after the wake. For "unload" the manager then stops the group; for "sleep"
  the engine has called vLLM's ``LLMEngine.sleep(level)`` first (weights
  offloaded to host memory at level 1, discarded at level 2; the KV cache
  dropped) and waits for ``Wake`` (``LLMEngine.wake_up()``; at level 2 the
  weights are reloaded from the checkpoint between waking the weights' and the
  KV cache's memory).

A configured "sleep" where vLLM has no sleep mode (``is_sleep_mode_available()``
is false: CPU) falls back to "unload", with a warning at load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from servectl.wire.vocab import IdleMode

log = logging.getLogger("engine_core")

UNLOAD, SLEEP = IdleMode.UNLOAD, IdleMode.SLEEP


class SleepingEngine(Protocol):
    """What idle release needs of vLLM's LLMEngine (a double in the unit tests)."""

    def sleep(self, level: int = 1) -> Any: ...
    def wake_up(self, tags: list[str] | None = None) -> Any: ...
    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> Any: ...


@dataclass(frozen=True)
class BuildChoice:
    mode: IdleMode  # the mode in force: the configured one, or UNLOAD where sleep is not available
    engine_args: dict[str, Any]  # what to add to the engine arguments
    warning: str | None = None


def build_choice(configured: IdleMode, sleep_available: bool, after_s: float, model: str) -> BuildChoice:
    """How to build the engine for the configured idle release (sleep mode must be enabled at build).
    A model released to make room for another (max_loaded_models) is released the same way, so
    sleep mode is enabled wherever "sleep" is configured, with or without an idle time."""
    if configured != SLEEP:
        return BuildChoice(UNLOAD, {})
    if not sleep_available:
        warning = None if after_s <= 0 else (
            f"model {model}: idle_release = \"sleep\" but vLLM has no sleep mode on this platform "
            "(is_sleep_mode_available() is false); an idle model is unloaded instead (its engine and workers "
            "stop; the warm standbys stay)")
        return BuildChoice(UNLOAD, {}, warning)
    return BuildChoice(SLEEP, {"enable_sleep_mode": True})


def device_memory_in_use(_worker: Any) -> int | None:
    """Run in a worker (collective_rpc): bytes in use on its accelerator, None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free


class IdleRelease:
    """One engine's idle-release state; the engine loop asks it and tells it."""

    def __init__(self, engine: SleepingEngine, after_s: float, mode: IdleMode, level: int,
                 device_memory: Callable[[], int | None] = lambda: None):
        self.engine = engine
        self.after_ms = int(after_s * 1000) if after_s > 0 else None
        self.mode = IdleMode(mode)
        self.level = level
        self.device_memory = device_memory
        self.reported = False  # GroupIdle sent for the current idle period
        self.released = False  # new requests are refused (held by the gateway) until a wake
        self.asleep = False  # vLLM's sleep mode is on

    # ---- the loop's questions -------------------------------------------------------
    def due_in_ms(self, idle_ms: int) -> int | None:
        """Milliseconds until GroupIdle is due in this idle period; None if nothing is armed."""
        if self.after_ms is None or self.reported or self.released:
            return None
        return max(0, self.after_ms - idle_ms)

    def take_due(self, idle_ms: int) -> bool:
        """True once per idle period, when the engine has been idle for idle_release_s."""
        due = self.due_in_ms(idle_ms)
        if due is None or due > 0:
            return False
        self.reported = True
        return True

    def worked(self) -> None:
        """The engine stepped: a new idle period starts once it is idle again."""
        self.reported = False

    # ---- the manager's messages ------------------------------------------------------
    def release(self, busy: bool) -> tuple[bool, int | None]:
        """``Release``: (released, accelerator memory in use after it)."""
        if busy or self.released:
            # A request came in after GroupIdle: serve it; a new idle period will follow.
            self.reported = False
            return self.released, None
        if self.mode == SLEEP:
            before = self.device_memory()
            self.engine.sleep(level=self.level)
            self.asleep = True
            after = self.device_memory()
            log.info("asleep (level %d): accelerator memory in use %s → %s", self.level, _fmt(before), _fmt(after))
        else:
            after = None
        self.released = True
        return True, after

    def wake(self) -> bool:
        """``Wake``: leave sleep mode. False if there was nothing to wake (an unload is a new engine)."""
        if not self.asleep:
            return False
        if self.level == 2:
            # Level 2 discarded the weights: back their memory, reload them from the checkpoint,
            # then the KV cache (vLLM's own order, vllm/snapshot/server.py).
            self.engine.wake_up(["weights"])
            self.engine.collective_rpc("reload_weights")
            self.engine.wake_up(["kv_cache"])
        else:
            self.engine.wake_up()
        self.asleep = False
        self.released = False
        self.reported = False
        log.info("awake: accelerator memory in use %s", _fmt(self.device_memory()))
        return True


def _fmt(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f} MiB"


class IdleClock:
    """When the engine last worked, and the one-shot deadlines armed on its busy→idle
    transition: the workers' freeze (``freeze_grace_ms`` after the last step, if freezing is on)
    and telling the manager it is idle (``IdleRelease.due_in_ms``). Nothing ticks: the engine's
    poll sleeps until the nearest one, or until a message comes when none is armed."""

    def __init__(self, group, idle: "IdleRelease", freeze_grace_ms: int | None):
        self.group = group
        self.idle = idle
        self.freeze_grace_ms = freeze_grace_ms
        self.since = time.monotonic()  # the last step's end (monotonic)

    @property
    def since_wall(self) -> float:
        """``since`` on the wall clock (the manager's status): derived, so a step reads one clock."""
        return time.time() - (time.monotonic() - self.since)

    def worked(self) -> None:
        """A step ran: the idle period starts again (and with it both deadlines)."""
        self.since = time.monotonic()
        self.idle.worked()

    def idle_ms(self) -> int:
        return int((time.monotonic() - self.since) * 1000)

    def _freeze_due_in_ms(self, idle_ms: int) -> int | None:
        if self.group.frozen or self.freeze_grace_ms is None:
            return None
        return max(0, self.freeze_grace_ms - idle_ms)

    def timeout_ms(self) -> int | None:
        """The nearest of the freeze and the idle-release deadlines; None: sleep until a message comes."""
        idle_ms = self.idle_ms()
        due = [d for d in (self._freeze_due_in_ms(idle_ms), self.idle.due_in_ms(idle_ms)) if d is not None]
        return min(due) if due else None

    def fire(self, say_idle: Callable[[int], None]) -> None:
        """What is due now: the freeze, and ``say_idle(idle_ms)`` once per idle period."""
        idle_ms = self.idle_ms()
        if self._freeze_due_in_ms(idle_ms) == 0:
            self.group.freeze()
        if self.idle.take_due(idle_ms):
            say_idle(idle_ms)
