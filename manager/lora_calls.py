"""A group's LoRA changes in flight: each sent to its engine, waited for, answered by its call id.

The adapters a group serves are the group's own (``EngineGroup.loras``, changed when an answer
says so); this file only pairs a change sent with its engine's answer, and gives every caller
still waiting ``None`` once the engine is gone (a member exited).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from servectl.wire import control as P


class LoraCalls:
    def __init__(self) -> None:
        self.pending: dict[int, asyncio.Future] = {}  # call id -> its answer, for this incarnation's engine

    async def call(self, send: Callable[[P.AddLora | P.RemoveLora], None], msg: P.AddLora | P.RemoveLora,
                   timeout_s: float) -> P.LoraDone | None:
        """Send a change and wait for its answer (None: the engine went away or did not answer in time)."""
        fut = self.pending[msg.call_id] = asyncio.get_running_loop().create_future()
        send(msg)
        try:
            # event-proof: a bounded wait for one answer, armed only while this change is in flight.
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            return None
        finally:
            self.pending.pop(msg.call_id, None)

    def answered(self, msg: P.LoraDone) -> None:
        """The engine's answer reaches its caller, if it still waits."""
        fut = self.pending.get(msg.call_id)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def fail_all(self) -> None:
        """The engine is gone: every caller still waiting gets None."""
        for fut in self.pending.values():
            if not fut.done():
                fut.set_result(None)
