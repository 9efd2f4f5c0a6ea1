"""Generation: one admitted OpenAI request, run on its engine and answered whole or as SSE.

``events`` yields the engine's deltas for every prompt of a request; a
request whose engine went away before any output is held and sent again to
the next incarnation. ``complete`` and ``stream`` feed the same deltas to a
``ResponseAccumulator`` and write its body or its chunks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Callable

from aiohttp import web

from api_gateway import openai_types as H
from api_gateway.accumulator import ResponseAccumulator
from api_gateway.engines import EngineLink
from api_gateway.errors import (EngineRequestError, EngineUnavailable, HttpError, http_error_body, refused_by_engine,
                                unavailable)
from api_gateway.metrics import Metrics
from servectl.config import GatewayConfig
from servectl.wire import engine as EP

log = logging.getLogger("api_gateway")


class Generator:
    def __init__(self, cfg: GatewayConfig, metrics: Metrics, new_request_id: Callable[[], str],
                 report_hang: Callable[[EngineLink], None]):
        self.cfg = cfg
        self.metrics = metrics
        self.new_request_id = new_request_id
        self.report_hang = report_hang

    async def respond(self, request: web.Request, req, link: EngineLink, gens: list[EP.Generate], chat: bool,
                      base: str) -> web.StreamResponse:
        acc = ResponseAccumulator(req, chat, len(gens), f"{'chatcmpl' if chat else 'cmpl'}-{base}",
                                  keep=not req.stream)
        if req.stream:
            return await self.stream(request, req, link, gens, acc)
        return await self.complete(request, req, link, gens, acc)

    # ---- the engine's deltas ---------------------------------------------------------
    async def events(self, link: EngineLink, gens: list[EP.Generate], n: int) -> AsyncIterator[tuple[int, EP.Delta]]:
        """Yield (prompt index, Delta) for every prompt's request until all finish.

        A request whose engine went away before it produced anything has lost
        nothing: it waits for the next incarnation (within the hold timeout)
        and is sent again, so a request that raced the engine's death is held
        like one that arrived after it. Once output has flowed, an engine
        failure ends the request with an error.
        """
        deadline = time.monotonic() + self.cfg.hold_timeout_s
        while True:
            produced = False
            try:
                async for item in self._events_once(link, gens, n):
                    produced = True
                    yield item
                return
            except EngineUnavailable as exc:
                left = deadline - time.monotonic()
                if produced or left <= 0:
                    raise unavailable(exc) from None
            log.info("engine of %s went away before any output; holding %d request(s)", link.model, len(gens))
            try:
                await link.wait_ready(left)
            except EngineUnavailable as exc:
                raise unavailable(exc) from None
            for g in gens:
                g.request_id = self.new_request_id()

    async def _events_once(self, link: EngineLink, gens: list[EP.Generate], n: int):
        streams = []
        try:
            for g in gens:
                streams.append(link.submit(g, n))
        except EngineUnavailable:
            for s in streams:
                link.abort(s.request_id)
            raise
        remaining = {s.request_id: n for s in streams}
        index_of = {s.request_id: i for i, s in enumerate(streams)}
        pumps = []
        if len(streams) == 1:  # the common case: read the one stream directly
            only = streams[0]

            async def next_item():
                return only.request_id, await only.queue.get()
        else:
            merged: asyncio.Queue = asyncio.Queue()

            async def pump(stream):
                while True:
                    merged.put_nowait((stream.request_id, await stream.queue.get()))

            pumps = [asyncio.ensure_future(pump(s)) for s in streams]
            next_item = merged.get
        try:
            while any(v > 0 for v in remaining.values()):
                try:
                    # A deadline only while this request waits for output; asyncio.timeout
                    # costs a timer handle per token where wait_for would cost a task.
                    async with asyncio.timeout(self.cfg.output_timeout_s):
                        rid, item = await next_item()
                except TimeoutError:
                    # Queued behind other requests is not hung. The engine answers
                    # Stats between steps; a step stuck on a hung worker keeps it
                    # from answering at all.
                    if await link.stats(self.cfg.output_timeout_s) is not None:
                        continue
                    self.report_hang(link)
                    raise HttpError(503, f"model {link.model!r} produced no output for "
                                         f"{self.cfg.output_timeout_s:g}s; its engine is being restarted",
                                    "service_unavailable", headers={"Retry-After": "10"}) from None
                if isinstance(item, EngineUnavailable):
                    raise item
                if isinstance(item, EngineRequestError):
                    raise refused_by_engine(item)
                if item.finish_reason is not None:
                    remaining[rid] -= 1
                yield index_of[rid], item
        finally:
            for p in pumps:
                p.cancel()
            for s in streams:
                link.abort(s.request_id)  # no-op for finished ones

    # ---- answers -----------------------------------------------------------------------
    async def complete(self, request: web.Request, req, link: EngineLink, gens: list[EP.Generate],
                       acc: ResponseAccumulator) -> web.Response:
        started = time.monotonic()
        async for pi, d in self.events(link, gens, req.n):
            acc.add(pi, d)
        self.observe(request, req.model, acc, started)
        return web.Response(body=H.encoder.encode(acc.response(created=int(time.time()))),
                            content_type="application/json")

    async def stream(self, request: web.Request, req, link: EngineLink, gens: list[EP.Generate],
                     acc: ResponseAccumulator) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": request["request_id"]})
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())
        started = time.monotonic()
        gen = self.events(link, gens, req.n)
        try:
            # The first event decides between a normal stream and a plain error response.
            first = await gen.__anext__()
        except HttpError:
            await gen.aclose()
            raise
        except StopAsyncIteration:
            first = None
        await resp.prepare(request)

        async def send(obj) -> None:
            await resp.write(b"data: " + H.encoder.encode(obj) + b"\n\n")

        try:
            item = first
            while item is not None:
                await send(acc.chunk(acc.add(*item), created))
                try:
                    item = await gen.__anext__()
                except StopAsyncIteration:
                    item = None
            if include_usage:
                await send(acc.usage_chunk(created))
            self.observe(request, req.model, acc, started)
        except HttpError as exc:
            # Mid-stream failure: an SSE error event in OpenAI's shape, then [DONE].
            await resp.write(b"data: " + http_error_body(exc) + b"\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            await gen.aclose()  # aborts the engine requests
            raise
        finally:
            await gen.aclose()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def observe(self, request: web.Request, model: str, acc: ResponseAccumulator, started: float) -> None:
        """The access log's token counts and the latency metrics of one finished request."""
        usage = acc.usage()
        first_token = acc.first_token_at
        request["log"].update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)
        m = self.metrics
        m.prompt_tokens.labels(model=model).inc(usage.prompt_tokens)
        m.generation_tokens.labels(model=model).inc(usage.completion_tokens)
        now = time.monotonic()
        m.e2e.labels(model=model).observe(now - started)
        if first_token is not None:
            m.ttft.labels(model=model).observe(first_token - started)
            if usage.completion_tokens > 1:
                m.itl.labels(model=model).observe((now - first_token) / (usage.completion_tokens - 1))
