"""Background tasks with one owner: each kept until it ends, any failure logged.

``asyncio`` keeps only a weak reference to a task: one started with nothing
holding it may be collected before it ends, and an exception it raises is
reported, if ever, at collection as "Task exception was never retrieved". A
process's fire-and-forget work (an unload's stop, a reload, a shutdown) is
started through its ``Tasks`` instead, which holds it while it runs and logs
what it raised, naming it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any


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
