"""A streamed answer's pieces (generate.py's chat and completion streams, passthrough.py's
Responses and Messages streams): its response, bounded writes, and keep-alive comments.

A stream that has nothing to send for ``sse_keep_alive_interval`` seconds — held while its
model loads, queued, in prefill, or resumed after an engine restart — gets vLLM's keep-alive
comment (``: keep-alive``), which SSE clients ignore and proxies count as traffic, so they do
not cut an idle connection. The response's headers go out with the first chunk or the first
comment: an error before either is a plain error response (a 503 for a model that cannot be
loaded, say); one after them is the API's error event.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, Callable

from aiohttp import web

# vLLM's text (vllm/entrypoints/serve/utils/sse_keep_alive.py: SSE_KEEP_ALIVE_COMMENT).
KEEP_ALIVE_COMMENT = b": keep-alive\n\n"


async def open_sse(request: web.Request) -> web.StreamResponse:
    """The event stream's response, its headers sent."""
    resp = web.StreamResponse(headers={**request.get("extra_headers", {}), "Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", "X-Request-Id": request["request_id"]})
    await resp.prepare(request)
    return resp


def bounded_writer(resp: web.StreamResponse, timeout_s: float):
    async def write(data: bytes) -> None:
        # event-proof: a write waits only while the client's socket buffer is full; a client that
        # reads nothing for this long is cut (and its sequences aborted).
        async with asyncio.timeout(timeout_s):
            await resp.write(data)

    return write


def client_gone(request: web.Request) -> None:
    """The client went away or read nothing for body_timeout_s: its sequences were aborted; the
    connection is closed, there is no one to answer."""
    request["log"]["client"] = "gone"
    if request.transport is not None:
        request.transport.close()


async def after(hold: Callable[[], Awaitable[None]] | None, items: AsyncIterator) -> AsyncIterator:
    """``items``, once ``hold`` (the wait for the model) is over; closing this closes them."""
    try:
        if hold is not None:
            await hold()
        async for item in items:
            yield item
    finally:
        await items.aclose()  # type: ignore[attr-defined]


class SseAnswer:
    """One streamed answer: its items (``RequestRun.deltas``, after the hold for its model where
    one is needed) read one at a time, with a keep-alive comment whenever none came for
    ``interval`` seconds (0: never), and the response opened at the first chunk or comment."""

    def __init__(self, request: web.Request, items: AsyncIterator, interval: float, timeout_s: float):
        self.request = request
        self.items = items
        self.interval = interval if 0 < interval < float("inf") else 0.0
        self.timeout_s = timeout_s
        self.resp: web.StreamResponse | None = None
        self._write: Callable[[bytes], Awaitable[None]] | None = None
        self._next: asyncio.Future | None = None
        self.comments = 0

    @property
    def opened(self) -> bool:
        return self.resp is not None

    async def open(self) -> web.StreamResponse:
        if self.resp is None:
            self.resp = await open_sse(self.request)
            self._write = bounded_writer(self.resp, self.timeout_s)
        return self.resp

    async def write(self, data: bytes) -> None:
        await self.open()
        assert self._write is not None
        await self._write(data)

    async def next_item(self):
        """The next item (None: there are no more), keep-alive comments written while it is awaited;
        an item's error is raised (before the response opened: a plain error response)."""
        if not self.interval:
            try:
                return await self.items.__anext__()
            except StopAsyncIteration:
                return None
        if self._next is None:
            self._next = asyncio.ensure_future(self.items.__anext__())
        while True:
            # event-proof: vLLM's sse_keep_alive_interval: a comment to a stream that has had nothing to
            # send this long; armed only while a streamed answer waits for its next item.
            done, _ = await asyncio.wait({self._next}, timeout=self.interval)
            if done:
                break
            self.comments += 1
            await self.write(KEEP_ALIVE_COMMENT)
        fut, self._next = self._next, None
        try:
            return fut.result()
        except StopAsyncIteration:
            return None

    async def close(self) -> None:
        """Stop reading (the end, an error, the client gone): what is left is aborted."""
        fut, self._next = self._next, None
        if fut is not None and not fut.done():
            fut.cancel()
            with contextlib.suppress(BaseException):
                await fut
        await self.items.aclose()  # type: ignore[attr-defined]
