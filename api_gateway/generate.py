"""Generation: one admitted OpenAI request, run on its engine and answered whole or as SSE.

``RequestRun.deltas`` (sequences.py) yields the engine's deltas for every
prompt of a request. ``complete`` and ``stream`` feed them to a
``ResponseAccumulator`` and write its body or its chunks. A client that goes
away (aiohttp cancels the handler) or stops reading a stream for
``body_timeout_s`` ends its request, and leaving ``deltas`` aborts its
sequences in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from aiohttp import web

from api_gateway import openai_types as H
from api_gateway.accumulator import ResponseAccumulator
from api_gateway.engines import EngineLink
from api_gateway.errors import HttpError, http_error_body
from api_gateway.metrics import Metrics
from api_gateway.sequences import RequestRun
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

    def run(self, link: EngineLink, gens: list[EP.Generate], n: int) -> RequestRun:
        """The engine side of a request; raises the client's 400 if it cannot be sent at all."""
        return RequestRun(link, gens, n, self.cfg, self.new_request_id, self.report_hang)

    async def respond(self, request: web.Request, req, run: RequestRun, chat: bool,
                      base: str) -> web.StreamResponse:
        acc = ResponseAccumulator(req, chat, len(run.gens), f"{'chatcmpl' if chat else 'cmpl'}-{base}",
                                  keep=not req.stream)
        run.restart = acc.restart  # a choice that runs again from its start (nothing of it was sent)
        if req.stream:
            return await self.stream(request, req, run, acc)
        return await self.complete(request, req, run, acc)

    # ---- answers -----------------------------------------------------------------------
    async def complete(self, request: web.Request, req, run: RequestRun, acc: ResponseAccumulator) -> web.Response:
        started = time.monotonic()
        gen = run.deltas()
        try:
            async for pi, d in gen:
                acc.add(pi, d)
        finally:
            await gen.aclose()  # the client gone (cancelled) or an error: abort in the engine
        self.observe(request, req.model, acc, started)
        return web.Response(body=H.encoder.encode(acc.response(created=int(time.time()))),
                            content_type="application/json")

    async def stream(self, request: web.Request, req, run: RequestRun, acc: ResponseAccumulator) -> web.StreamResponse:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())
        started = time.monotonic()
        gen = run.deltas()
        first = await first_delta(gen)  # an error before it is a plain error response
        resp = await open_sse(request, run)
        write = bounded_writer(resp, self.cfg.body_timeout_s)

        async def send(obj) -> None:
            await write(b"data: " + H.encoder.encode(obj) + b"\n\n")

        try:
            try:
                item = first
                while item is not None:
                    for chunk in acc.chunks(acc.add(*item), created):
                        await send(chunk)
                    try:
                        item = await gen.__anext__()
                    except StopAsyncIteration:
                        item = None
                if include_usage:
                    await send(acc.usage_chunk(created))
                self.observe(request, req.model, acc, started)
            except HttpError as exc:
                # Mid-stream failure: an SSE error event in OpenAI's shape, then [DONE].
                await gen.aclose()
                await write(b"data: " + http_error_body(exc) + b"\n\n")
            finally:
                await gen.aclose()  # the end, the client gone, a write timeout: aborts what is left
            await write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, TimeoutError):
            client_gone(request)
        return resp

    def observe(self, request: web.Request, model: str, acc: ResponseAccumulator, started: float) -> None:
        """The access log's token counts and the latency metrics of one finished request."""
        usage = acc.usage()
        request["log"].update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)
        self.observe_counts(model, usage.prompt_tokens, usage.completion_tokens, started, acc.first_token_at)

    def observe_counts(self, model: str, prompt: int, completion: int, started: float,
                       first_token: float | None) -> None:
        m = self.metrics
        m.prompt_tokens.labels(model=model).inc(prompt)
        m.generation_tokens.labels(model=model).inc(completion)
        now = time.monotonic()
        m.e2e.labels(model=model).observe(now - started)
        if first_token is not None:
            m.ttft.labels(model=model).observe(first_token - started)
            if completion > 1:
                m.itl.labels(model=model).observe((now - first_token) / (completion - 1))


# ---- a stream's pieces (this module's chat and completion streams, passthrough.py's) ---------------

async def first_delta(gen):
    """The first item of ``RequestRun.deltas`` (None if there is none): it decides between a
    stream and a plain error response, so an error before it is raised as is."""
    try:
        return await gen.__anext__()
    except HttpError:
        await gen.aclose()
        raise
    except StopAsyncIteration:
        return None


async def open_sse(request: web.Request, run: RequestRun) -> web.StreamResponse:
    """The event stream's response, its headers sent; from now on the client sees the answer as
    it comes (a choice can no longer run again from its start)."""
    resp = web.StreamResponse(headers={**request.get("extra_headers", {}), "Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", "X-Request-Id": request["request_id"]})
    await resp.prepare(request)
    run.whole_answer = False
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
