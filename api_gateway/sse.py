"""Every streamed answer's loop (``stream_answer``: generate.py's chat and completion streams,
passthrough.py's Responses and Messages streams, each with its ``Framing``) and its pieces:
its response, bounded writes, and keep-alive comments.

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
from typing import AsyncIterator, Awaitable, Callable, Iterable, Protocol

from aiohttp import web

from api_gateway.errors import HttpError
from servectl.config import GatewayConfig

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


def gone_response(sse: "SseAnswer") -> web.StreamResponse:
    """What a stream's handler returns: its response, or (the client went away before anything
    was sent) a 499 for the access log, which no one reads."""
    return sse.resp if sse.resp is not None else web.Response(status=499, reason="Client Closed Request")


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
    ``interval`` seconds (0: never), and the response opened at the first chunk or comment.

    The items are awaited directly (no task per item); a one-shot timer armed for each wait
    writes the comment from a task of its own, which the next write waits for, so bytes never
    interleave."""

    def __init__(self, request: web.Request, items: AsyncIterator, interval: float, timeout_s: float):
        self.request = request
        self.items = items
        self.interval = interval if 0 < interval < float("inf") else 0.0
        self.timeout_s = timeout_s
        self.resp: web.StreamResponse | None = None
        self._write: Callable[[bytes], Awaitable[None]] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._commenting: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None  # set while next_item waits (comments are due then)
        self._failed: BaseException | None = None  # a comment's write failed: the client is gone
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
        await self._comment_written()
        await self._send(data)

    async def _send(self, data: bytes) -> None:
        await self.open()
        assert self._write is not None
        await self._write(data)

    async def next_item(self):
        """The next item (None: there are no more), keep-alive comments written while it is awaited;
        an item's error is raised (before the response opened: a plain error response)."""
        if self._failed is not None:
            raise self._failed  # a comment found the client gone
        if self.interval:
            self._reader = asyncio.current_task()
            self._arm()
        try:
            return await self.items.__anext__()
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            failed = self._failed
            if failed is not None and self._reader is not None and self._reader.uncancel() == 0:
                raise failed from None  # cancelled by _comment: the client went away meanwhile
            raise
        finally:
            self._reader = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _arm(self) -> None:
        # event-proof: vLLM's sse_keep_alive_interval: a one-shot timer, armed only while a streamed
        # answer waits for its next item, cancelled when it comes.
        self._timer = asyncio.get_running_loop().call_later(self.interval, self._comment_due)

    def _comment_due(self) -> None:
        self._timer = None
        if self._commenting is None or self._commenting.done():
            self._commenting = asyncio.ensure_future(self._comment())

    async def _comment(self) -> None:
        self.comments += 1
        try:
            await self._send(KEEP_ALIVE_COMMENT)
        except (ConnectionError, TimeoutError) as exc:
            # Nobody reads any more: the wait for the item ends (its sequences are aborted).
            self._failed = exc
            if self._reader is not None:
                self._reader.cancel()
            return
        if self._timer is None and self._reader is not None:
            self._arm()  # still waiting: the next comment

    async def _comment_written(self) -> None:
        """A comment being written is finished (or its failure raised) before anything else is."""
        task, self._commenting = self._commenting, None
        if task is not None:
            await task
        if self._failed is not None:
            raise self._failed

    async def close(self) -> None:
        """Stop reading (the end, an error, the client gone): what is left is aborted."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task, self._commenting = self._commenting, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await self.items.aclose()  # type: ignore[attr-defined]


class Framing(Protocol):
    """One API's stream format: what ``stream_answer`` writes for each item, at the end, and for
    a failure after the headers."""

    done: bytes  # written last, after the answer or its error event (b"": nothing)

    def frames(self, item) -> Iterable[bytes]:
        """An item's events (none, one or more), each written as it is."""

    def end(self) -> bytes:
        """Written after the last item (b"": nothing)."""

    def finished(self) -> None:
        """The answer went out whole (its access log fields, its metrics)."""

    def error(self, exc: HttpError) -> bytes:
        """A failure after the headers, as the API's error event."""


async def stream_answer(request: web.Request, run, hold: Callable[[], Awaitable[None]] | None,
                        cfg: GatewayConfig, framing: Framing) -> web.StreamResponse:
    """A streamed answer, the same for every route: ``run``'s deltas (``RequestRun``), after
    ``hold`` (the wait for the model) under keep-alive comments, each written as ``framing``
    frames it. An error before the headers is raised (a plain error response); one after them
    is the API's error event. A client that goes away or reads nothing for ``body_timeout_s``
    ends the answer, and leaving ``run.deltas`` aborts its sequences in the engine."""
    sse = SseAnswer(request, after(hold, run.deltas()), cfg.sse_keep_alive_interval, cfg.body_timeout_s)
    frames = framing.frames
    try:
        try:
            item = await sse.next_item()  # an error before the headers: a plain error response
            run.whole_answer = False  # from now on the client sees the answer as it comes
            await sse.open()
            while item is not None:
                for data in frames(item):
                    await sse.write(data)
                item = await sse.next_item()
            last = framing.end()
            if last:
                await sse.write(last)
            framing.finished()
        except HttpError as exc:
            if not sse.opened:
                raise
            request["log"]["stream_error"] = exc.status  # the access line says 200; its key's usage an error
            await sse.close()
            await sse.write(framing.error(exc))
        finally:
            await sse.close()  # the end, the client gone, a write timeout: aborts what is left
        if framing.done:
            await sse.write(framing.done)
        assert sse.resp is not None
        await sse.resp.write_eof()
    except (ConnectionError, TimeoutError):
        client_gone(request)
    return gone_response(sse)
