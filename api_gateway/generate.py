"""Generation: one admitted OpenAI request, run on its engine and answered whole or as SSE.

``RequestRun.deltas`` (sequences.py) yields the engine's deltas for every
prompt of a request. ``complete`` and ``stream`` feed them to a
``ResponseAccumulator`` and write its body or its chunks (``ChunkFraming``, for
the stream loop every streamed route shares: sse.py's ``stream_answer``). A client that goes
away (aiohttp cancels the handler) or stops reading a stream for
``body_timeout_s`` ends its request, and leaving ``deltas`` aborts its
sequences in the engine.
"""

from __future__ import annotations

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
from api_gateway.served import ServedModel
from api_gateway.sse import stream_answer
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
        # A finished answer's usage, told before its last bytes go out (tenancy.py's KeyGate.finished).
        self.on_usage: Callable[[web.Request, int], None] = lambda request, status: None

    def run(self, model: ServedModel, gens: list[EP.Generate], n: int, key: bytes | None = None) -> RequestRun:
        """The engine side of a request; raises the client's 400 if it cannot be sent at all."""
        return RequestRun(model, gens, n, self.cfg, self.new_request_id, self.report_hang, key=key)

    async def respond(self, request: web.Request, req, run: RequestRun, chat: bool,
                      base: str, hold=None) -> web.StreamResponse:
        """The answer, whole or streamed; ``hold`` (a stream only): the wait for the model, under
        keep-alive comments (sse.py)."""
        acc = ResponseAccumulator(req, chat, len(run.gens), f"{'chatcmpl' if chat else 'cmpl'}-{base}",
                                  keep=not req.stream)
        run.restart = acc.restart  # a choice that runs again from its start (nothing of it was sent)
        request["tally"] = acc.so_far  # what it used if it ends early (tenancy.py)
        if req.stream:
            return await self.stream(request, req, run, acc, hold)
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

    async def stream(self, request: web.Request, req, run: RequestRun, acc: ResponseAccumulator,
                     hold=None) -> web.StreamResponse:
        return await stream_answer(request, run, hold, self.cfg, ChunkFraming(self, request, req, acc))

    def observe(self, request: web.Request, model: str, acc: ResponseAccumulator, started: float) -> None:
        """The access log's token counts and the latency metrics of one finished request."""
        usage = acc.usage()
        request["log"].update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)
        self.observe_counts(model, usage.prompt_tokens, usage.completion_tokens, started, acc.first_token_at)
        self.on_usage(request, 200)

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


class ChunkFraming:
    """A completion or chat stream as vLLM writes it (sse.py's ``Framing``): ``data: <chunk>``
    for each chunk, the usage chunk when the client asked for it, a failure in OpenAI's error
    shape, then ``data: [DONE]``."""

    done = b"data: [DONE]\n\n"

    def __init__(self, generator: Generator, request: web.Request, req, acc: ResponseAccumulator):
        self.generator = generator
        self.request = request
        self.req = req
        self.acc = acc
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.created = int(time.time())
        self.started = time.monotonic()

    def frames(self, item) -> list[bytes]:
        acc, created = self.acc, self.created
        return [b"data: " + H.encoder.encode(chunk) + b"\n\n" for chunk in acc.chunks(acc.add(*item), created)]

    def end(self) -> bytes:
        return b"data: " + H.encoder.encode(self.acc.usage_chunk(self.created)) + b"\n\n" if self.include_usage else b""

    def finished(self) -> None:
        self.generator.observe(self.request, self.req.model, self.acc, self.started)

    def error(self, exc: HttpError) -> bytes:
        return b"data: " + http_error_body(exc) + b"\n\n"  # then [DONE]
