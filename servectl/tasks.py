"""Background tasks with one owner: each kept until it ends, any failure logged.

``asyncio`` keeps only a weak reference to a task: one started with nothing
holding it may be collected before it ends, and an exception it raises is
reported, if ever, at collection as "Task exception was never retrieved". A
process's fire-and-forget work (an unload's stop, a reload, a shutdown) is
started through its ``Tasks`` instead, which holds it while it runs and logs
what it raised, naming it.

A long-lived task (a loop that should never end while the process serves) is
started with ``Tasks.keep``: when it raises, it is started again, at most
``restarts`` times within ``window_s`` seconds; past that its ``give_up`` is
called, which ends the process with ``ExitCode.TASK_DIED`` (its supervisor, the
manager or systemd, then replaces it). A live process whose loop died is never
left serving nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

# A restarted loop waits this long first (doubling), so a failure that repeats at once
# (no descriptors left) is not a busy loop; at most RESTART_BACKOFF_MAX_S.
RESTART_BACKOFF_S = 0.1
RESTART_BACKOFF_MAX_S = 2.0


class Tasks:
    """The tasks one process started in the background and has not seen end."""

    def __init__(self, log: logging.Logger):
        self.log = log
        self.running: set[asyncio.Task] = set()

    def start(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """Run ``coro`` on the running loop as a task named ``name``, kept until it is done."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.running.add(task)
        task.add_done_callback(self._done)
        return task

    def keep(self, factory: Callable[[], Coroutine[Any, Any, Any]], name: str, *,
             give_up: Callable[[str, BaseException], None], restarts: int = 3,
             window_s: float = 60.0) -> asyncio.Task:
        """Run ``factory()`` as the long-lived task ``name``: started again when it raises
        (at most ``restarts`` times in ``window_s``), then ``give_up(name, exc)``. A return or
        a cancellation ends it for good."""
        return self.start(self._keep(factory, name, give_up, restarts, window_s), name)

    async def _keep(self, factory, name: str, give_up, restarts: int, window_s: float) -> None:
        failures: list[float] = []
        while True:
            try:
                await factory()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                now = time.monotonic()
                failures = [t for t in failures if now - t < window_s] + [now]
                if len(failures) > restarts:
                    self.log.critical("task %r failed %d times in %.0fs; giving up: %r", name, len(failures),
                                      window_s, exc, exc_info=exc)
                    give_up(name, exc)
                    return
                self.log.error("task %r failed (restart %d of at most %d in %.0fs)", name, len(failures),
                               restarts, window_s, exc_info=exc)
            delay = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (len(failures) - 1))
            await asyncio.sleep(delay)  # event-proof: a backoff after a crash, once per failure

    def _done(self, task: asyncio.Task) -> None:
        self.running.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.log.error("background task %r failed", task.get_name(), exc_info=exc)

    def cancel_all(self) -> None:
        for task in list(self.running):
            task.cancel()
