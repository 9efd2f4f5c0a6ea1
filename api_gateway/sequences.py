"""The engine side of one admitted request: its engine requests submitted, read and aborted.

A ``RequestRun`` owns the engine requests one HTTP request became (one per
prompt, each with the request's ``n`` choices). ``deltas()`` submits them
and yields (prompt index, Delta) until every choice finished; leaving it in
any way (the end, an error, the client gone) aborts whatever the engine still
runs for them. Nothing of it waits without a deadline: sends are bounded
(``EngineLink.submit``), waiting for the engine to be ready is bounded by the
hold timeout, and output is awaited under ``output_timeout_s``, past which
the engine is asked whether it still holds the requests (queued behind
others is not hung; not answering is; not holding them is a lost request).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Callable

from api_gateway.engines import EngineLink
from api_gateway.errors import (EngineRequestError, EngineStalled, EngineUnavailable, HttpError, refused_by_engine,
                                unavailable)
from servectl.config import GatewayConfig
from servectl.wire import engine as EP

log = logging.getLogger("api_gateway")


def encode_generate(gen: EP.Generate) -> bytes:
    """The frame of one engine request; a value msgpack cannot carry is the client's 400."""
    try:
        return EP.encoder.encode(gen)
    except OverflowError:
        raise HttpError(400, "an integer in the request is outside the 64-bit range the engine accepts") from None


class RequestRun:
    def __init__(self, link: EngineLink, gens: list[EP.Generate], n: int, cfg: GatewayConfig,
                 new_request_id: Callable[[], str], report_hang: Callable[[EngineLink], None]):
        self.link = link
        self.gens = gens
        self.n = n
        self.cfg = cfg
        self.new_request_id = new_request_id
        self.report_hang = report_hang
        # Encoded now, before anything is registered: a request that cannot be sent is a 400.
        self.frames = [encode_generate(g) for g in gens]

    async def deltas(self) -> AsyncIterator[tuple[int, EP.Delta]]:
        """Yield (prompt index, Delta) for every prompt's request until all finish.

        A request whose engine went away before it produced anything has lost
        nothing: it waits for the next incarnation (within the hold timeout)
        and is sent again, so a request that raced the engine's death is held
        like one that arrived after it. Once output has flowed, an engine
        failure ends the request with an error.
        """
        link = self.link
        deadline = time.monotonic() + link.hold_s(self.cfg.hold_timeout_s)
        while True:
            produced = False
            try:
                async for item in self._once():
                    produced = True
                    yield item
                return
            except EngineStalled as exc:
                self.report_hang(link)  # it reads nothing: hung
                raise unavailable(exc) from None
            except EngineUnavailable as exc:
                left = deadline - time.monotonic()
                if produced or left <= 0:
                    raise unavailable(exc) from None
            log.info("engine of %s went away before any output; holding %d request(s)", link.model, len(self.gens))
            try:
                await link.wait_ready(left)
            except EngineUnavailable as exc:
                raise unavailable(exc) from None
            for g in self.gens:
                g.request_id = self.new_request_id()
            self.frames = [encode_generate(g) for g in self.gens]

    async def _once(self) -> AsyncIterator[tuple[int, EP.Delta]]:
        link = self.link
        sink: asyncio.Queue = asyncio.Queue()
        index_of = {g.request_id: i for i, g in enumerate(self.gens)}
        remaining = dict.fromkeys(index_of, self.n)
        try:
            await link.submit(list(zip(index_of, self.frames)), self.n, sink)
            while remaining:
                try:
                    # A deadline only while this request waits for output; asyncio.timeout
                    # costs a timer handle per token where wait_for would cost a task.
                    # event-proof: armed only while sequences of this request are in flight.
                    async with asyncio.timeout(self.cfg.output_timeout_s):
                        rid, item = await sink.get()
                except TimeoutError:
                    await self._probe(sink, remaining)
                    continue
                if rid not in remaining:
                    continue  # after that request's error
                if isinstance(item, EngineUnavailable):
                    raise item
                if isinstance(item, EngineRequestError):
                    raise refused_by_engine(item)
                if item.finish_reason is not None:
                    remaining[rid] -= 1
                    if remaining[rid] <= 0:
                        del remaining[rid]
                yield index_of[rid], item
        finally:
            link.abort(list(index_of))  # no-op for finished ones

    async def _probe(self, sink: asyncio.Queue, remaining: dict[str, int]) -> None:
        """No output for a while: queued behind other requests, hung, or lost?

        The engine answers Stats between steps; a step stuck on a hung worker
        keeps it from answering at all. A request it no longer holds while we
        wait for it was lost (never delivered, or dropped): it fails rather
        than waiting forever.
        """
        link = self.link
        reply = await link.stats(self.cfg.output_timeout_s, request_ids=list(remaining))
        if reply is None:
            self.report_hang(link)
            raise HttpError(503, f"model {link.model!r} produced no output for {self.cfg.output_timeout_s:g}s; "
                                 "its engine is being restarted", "service_unavailable",
                            code="engine_unavailable", headers={"Retry-After": "10"})
        # Output that came in with the reply is read first (the engine sent it before).
        lost = [rid for rid in reply.missing if rid in remaining]
        if lost and sink.empty():
            log.error("engine %s does not hold request(s) %s that wait for output", link.model, lost[:4])
            raise HttpError(503, f"model {link.model!r} lost this request; send it again", "service_unavailable",
                            code="engine_unavailable", headers={"Retry-After": "1"})
