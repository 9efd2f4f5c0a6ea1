"""The Responses, Messages and pooling endpoints: answers the engine makes whole, passed through.

``/v1/responses`` and ``/v1/messages`` are answered by vLLM's own serving
classes, which run in the model's engine (engine_core/serving_apis.py): the
engine sends each step's output already in the API's form
(``Delta.api_output``: a stream's SSE events, a whole answer's JSON body). The
gateway does here what it does for every endpoint (the body read and its
fields sorted and media refused, the model routed, admission, holding through a restart) and
writes what the engine made. ``/v1/messages/count_tokens`` is a tokenizer
question to the engine. vLLM keeps no responses (its store is off), so
``GET /v1/responses/{id}`` and its cancel are its 404. The pooling routes
(``/v1/embeddings``, ``/v2/embed``, ``/pooling``, ``/score``, ``/rerank``,
``/classify``, ...) are answered by vLLM's pooling serving classes in the
engine (engine_core/pooling_apis.py), whole. A request to a model of the
other kind (generating, pooling: the engine's ``HelloReply.tasks``) is a 400
naming the endpoints that fit.

Errors keep each API's shape: OpenAI's on ``/v1/responses``, Anthropic's
(``{"type": "error", "error": {...}}``) on ``/v1/messages``; a failure after a
stream began is the API's ``error`` event. A stream is written by the loop every
streamed route shares (sse.py's ``stream_answer``), framed by ``EventFraming``.
"""

from __future__ import annotations

import json
import secrets
import time

from aiohttp import web

from api_gateway import tracing as T
from api_gateway.bodies import read_body
from api_gateway.errors import HttpError, http_error_body
from api_gateway.input_bounds import check_input, check_sequences, pooling_sequences
from api_gateway.served import prefix_key
from api_gateway.sse import stream_answer
from servectl.wire import engine as EP

MESSAGES_PREFIX = "/v1/messages"
# The pooling routes `vllm serve` registers, and the request kind each takes (engine_core/pooling_apis.py).
POOLING_PATHS = {"/v1/embeddings": "embeddings", "/v2/embed": "embed", "/pooling": "pooling", "/score": "score",
                 "/v1/score": "score", "/rerank": "rerank", "/v1/rerank": "rerank", "/v2/rerank": "rerank",
                 "/classify": "classify"}
# vLLM's speech-to-text routes and the request kind each takes (engine_core/speech_apis.py).
SPEECH_PATHS = {"/v1/audio/transcriptions": "transcription", "/v1/audio/translations": "translation"}
GENERATE_PATHS = "/v1/completions, /v1/chat/completions, /v1/responses or /v1/messages"


def check_kind(model: str, tasks: list[str], path: str) -> None:
    """A request to a model of the other kind: a 400 naming the endpoints that fit it."""
    if not tasks:
        return  # not told (an engine of an older protocol): the engine's own answer stands
    if path in SPEECH_PATHS:
        if "transcription" not in tasks:  # `vllm serve` registers no such route then: its 404
            raise HttpError(404, f"model {model!r} does not transcribe speech (its tasks: {', '.join(tasks)})",
                            param="model", code="wrong_model_kind")
        return
    pooling = path in POOLING_PATHS
    if pooling and "generate" in tasks and len(tasks) == 1:
        raise HttpError(400, f"model {model!r} generates text: use {GENERATE_PATHS}", param="model",
                        code="wrong_model_kind")
    if not pooling and "generate" not in tasks:
        raise HttpError(400, f"model {model!r} is a pooling model ({', '.join(tasks)}): use /v1/embeddings, "
                             "/pooling, /score, /rerank or /classify, as its tasks allow", param="model",
                        code="wrong_model_kind")


def anthropic_error_body(exc: HttpError) -> bytes:
    """Anthropic's error shape, as vLLM's Messages router gives it."""
    return json.dumps({"type": "error", "error": {"type": exc.type, "message": exc.message}}).encode()


class ApiEndpoints:
    def __init__(self, gateway):
        self.gateway = gateway

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{response_id}", self.stored_response)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.stored_response)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        for path in POOLING_PATHS:
            app.router.add_post(path, self.pooling)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, "responses")

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, "messages")

    async def pooling(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, POOLING_PATHS[request.path])

    async def stored_response(self, request: web.Request) -> web.Response:
        """vLLM without its store (VLLM_ENABLE_RESPONSES_API_STORE off): no response is kept."""
        rid = request.match_info["response_id"]
        raise HttpError(404, f"Response with id '{rid}' not found.", param="response_id")

    async def count_tokens(self, request: web.Request) -> web.Response:
        req, forward = await read_body(request, self.gateway.cfg, "count_tokens")  # media refused there
        link = self.gateway.link_for(self.gateway.model_for(req.model))  # its limits, if its engine said them
        check_input("messages", forward, link.max_model_len, link.max_prompt_chars, self.gateway.cfg.max_input_items)
        return await self.gateway.ask_tokenizer(request, req.model, "count_tokens", forward)

    async def serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        req, forward = await read_body(request, self.gateway.cfg, kind)  # inline media bounded there (media.py)
        if forward.get("encoding_format") in ("bytes", "bytes_only"):
            raise HttpError(400, "`encoding_format` bytes and bytes_only are not supported by servectl (vLLM streams "
                                 "them as raw binary); use float or base64", param="encoding_format",
                            code="unsupported_parameter")
        return await self.answer(request, kind, req.model, forward, bool(req.stream))

    async def answer(self, request: web.Request, kind: str, model: str | None, forward: dict,
                     stream: bool) -> web.StreamResponse:
        """Admit a request whose body is read and send it to its model's engine, whose serving
        code answers it (a stream, or a whole JSON body)."""
        g = self.gateway
        with T.span("servectl.admission"):
            model = g.model_for(model)
            link = await g.keyed_link(request, model)
            if g.draining:
                raise HttpError(503, "the server is shutting down", "service_unavailable",
                                headers={"Retry-After": "5"})
            # A pooling request's inputs are sequences, as a completion's prompts are (input_bounds.py).
            seqs = pooling_sequences(forward) if request.path in POOLING_PATHS else 1
            check_sequences(seqs, g.cfg.max_sequences_per_request, forward)
            g.check_room(link, seqs)
            tag = g.keygate.prioritise(request, kind, forward, seqs)
            gen = EP.Generate(request_id=g.new_request_id(), kind=kind, body=forward,
                              answer_id=secrets.token_hex(8), priority=tag, tenant=g.keygate.tenant(request))
            run = g.generator.run(link, [gen], 1, prefix_key(forward))
        run.keep_deltas = True  # a stream goes on after a restart from the same deltas (Resume.deltas)

        async def hold() -> None:  # then the input against the model's limits, once they are known
            await g.hold(link, seqs, model, request.path)
            check_input(kind, forward, link.max_model_len, link.max_prompt_chars, g.cfg.max_input_items)

        with g.admitted(link, seqs):
            if stream and kind not in POOLING_PATHS.values():
                # Held under keep-alive comments while the model is not ready (sse.py).
                return await self.stream(request, kind, run, model, hold)
            await hold()
            return await self.complete(request, run, model)

    async def complete(self, request: web.Request, run, model: str) -> web.Response:
        started = time.monotonic()
        body, tokens = "", Counts()
        request["tally"] = tokens.so_far  # what it used if it ends early (tenancy.py)
        gen = run.deltas()
        try:
            async for _, d in gen:
                tokens.add(d)
                if d.api_output:
                    body = d.api_output
        finally:
            await gen.aclose()
        if not body:  # before observe: its usage report would count the 500 a success
            raise HttpError(500, "the engine sent no answer", "internal_error")
        tokens.observe(self.gateway, request, model, started)
        return web.Response(body=body.encode(), content_type="application/json")

    async def stream(self, request: web.Request, kind: str, run, model: str, hold=None) -> web.StreamResponse:
        framing = EventFraming(self.gateway, request, kind, model)
        return await stream_answer(request, run, hold, self.gateway.cfg, framing)


def error_event(kind: str, exc: HttpError, sequence_number: int) -> str:
    """A failure after a stream began, as the API's ``error`` event (vLLM's shapes)."""
    if kind in SPEECH_PATHS.values():  # a chunk stream, as chat's: its error object, then [DONE]
        return f"data: {http_error_body(exc).decode()}\n\ndata: [DONE]\n\n"
    if kind == "messages":
        data = {"type": "error", "error": {"type": exc.type, "message": exc.message}}
    else:
        data = {"type": "error", "code": str(exc.code or exc.status), "message": exc.message, "param": exc.param,
                "sequence_number": sequence_number}
    return f"event: error\ndata: {json.dumps(data)}\n\n"


class EventFraming:
    """A Responses or Messages stream (sse.py's ``Framing``): vLLM's events as the engine made
    them (``Delta.api_output``), a failure as the API's ``error`` event, no ``[DONE]``."""

    done = b""

    def __init__(self, gateway, request: web.Request, kind: str, model: str):
        self.gateway = gateway
        self.request = request
        self.kind = kind
        self.model = model
        self.started = time.monotonic()
        self.counts = Counts()
        request["tally"] = self.counts.so_far  # what it used if it ends early (tenancy.py)
        self.events = 0  # written so far: an error event's sequence_number

    def frames(self, item) -> tuple[bytes, ...]:
        d = item[1]
        self.counts.add(d)
        if d.api_output:
            self.events += d.api_output.count("\n\n")  # one JSON line per event: no blank line inside
            return (d.api_output.encode(),)
        return ()

    def end(self) -> bytes:
        return b""

    def finished(self) -> None:
        self.counts.observe(self.gateway, self.request, self.model, self.started)

    def error(self, exc: HttpError) -> bytes:
        return error_event(self.kind, exc, self.events).encode()


class Counts:
    """A passed-through answer's token counts and first-token time (access log, metrics)."""

    def __init__(self):
        self.prompt = 0
        self.completion = 0
        self.first_token_at: float | None = None

    def add(self, d: EP.Delta) -> None:
        if d.prompt is not None:
            self.prompt = d.prompt.tokens
        if d.token_ids:
            self.completion += len(d.token_ids)
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()

    def so_far(self) -> tuple[int, int]:
        return self.prompt, self.completion

    def observe(self, gateway, request: web.Request, model: str, started: float) -> None:
        request["log"].update(prompt_tokens=self.prompt, completion_tokens=self.completion)
        gateway.generator.observe_counts(model, self.prompt, self.completion, started, self.first_token_at)
        gateway.generator.on_usage(request, 200)
