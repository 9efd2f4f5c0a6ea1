"""Admission: which model a request names, and whether and when it goes to that model's engine.

``Admission`` is a part of ``Gateway`` (app.py): the model a request names (a served
model, or a LoRA adapter's model), the drain's refusal, the per-request and per-model caps
counted in sequences (prompts × ``n``), the hold until a replica is ready, the admitted
work counted for the drain, and the tokenizer questions admitted like generation. Its fields
(``cfg``, ``served``, ``generator``, ``draining``, ``in_flight``, ``idle``) are the gateway's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable

import msgspec
from aiohttp import web

from api_gateway import tracing as T
from api_gateway.errors import EngineRequestError, EngineUnavailable, HttpError, refused_by_engine, unavailable
from api_gateway.generate import Generator
from api_gateway.input_bounds import check_input
from api_gateway.passthrough import check_kind
from api_gateway.served import ServedModel, prefix_key
from api_gateway.tenancy import KeyGate
from api_gateway.translate import check_logit_bias, generate_messages
from servectl.config import GatewayConfig
from servectl.wire import engine as EP


class Admission:
    """The admission part of ``Gateway``: the fields below are the gateway's."""

    cfg: GatewayConfig
    served: dict[str, ServedModel]  # by the name requests use
    generator: Generator
    draining: bool  # refusing new work (a 503)
    in_flight: int  # admitted requests not answered yet
    idle: asyncio.Event  # set while in_flight is 0: the drain's wait
    new_request_id: Callable[[], str]
    keygate: KeyGate  # the request's key: its models, limits, fair share

    def model_for(self, model: str | None) -> str:
        """The model a request names; without a name, the one served model (as `vllm serve`)."""
        if model is not None:
            return model
        if len(self.served) == 1:
            return next(iter(self.served))
        raise HttpError(400, f"name the model: several are served ({', '.join(sorted(self.served))})",
                        param="model")

    def link_for(self, model: str) -> ServedModel:
        """The model a request names: that model, or, for a LoRA adapter, its model (the request
        keeps the adapter's name: the engine applies the adapter)."""
        served = self.served.get(model) or self.adapter_link(model)
        if served is None:
            raise HttpError(404, f"model {model!r} not found; served: {', '.join(sorted(self.served))}",
                            param="model", code="model_not_found")
        return served

    async def keyed_link(self, request: web.Request, model: str) -> ServedModel:
        """The model a request names, checked against its key: a model the key may not use is a
        403, past its limits a 429 (asked of the manager, for every gateway's requests)."""
        request["log"]["model"] = model
        link = self.link_for(model)
        self.keygate.check_model(request, model, link.model)
        await self.keygate.admit(request, model)
        return link

    def adapter_link(self, name: str) -> ServedModel | None:
        return next((m for m in self.served.values() if any(lora.name == name for lora in m.loras)), None)


    def check_chat_input(self, model: str | None, forward: dict) -> None:
        """Messages the model's context cannot hold, or too many of them: a 400 before the engine
        renders them with the chat template on its only thread (api_gateway/input_bounds.py)."""
        link = self.link_for(self.model_for(model))
        check_input("chat", forward, link.max_model_len, link.max_prompt_chars, self.cfg.max_input_items)

    # ---- admission --------------------------------------------------------------------------
    async def serve(self, request: web.Request, req, forward: dict, prompts: list | None,
                    chat: bool) -> web.StreamResponse:
        with T.span("servectl.admission"):
            await self.keyed_link(request, self.model_for(req.model))
            link, run, seqs, base = self.admit(request, req, forward, prompts, "chat" if chat else "completion")
        with self.admitted(link, seqs):
            hold = functools.partial(self.hold, link, seqs, req.model, request.path)
            if req.stream:  # held under keep-alive comments while the model is not ready (sse.py)
                return await self.generator.respond(request, req, run, chat, base, hold)
            await hold()
            return await self.generator.respond(request, req, run, chat, base)

    def admit(self, request: web.Request, req, forward: dict, prompts: list | None, kind: str):
        """The checks before a request is queued: its model, the caps; its engine requests built."""
        req.model = self.model_for(req.model)
        check_logit_bias(req.logit_bias)
        request["log"]["model"] = req.model
        link = self.link_for(req.model)
        if self.draining:
            raise HttpError(503, "the server is shutting down", "service_unavailable", headers={"Retry-After": "5"})
        # Admission counts sequences (prompts × n), the engine's unit of work (a chat is one prompt).
        n, count = req.n or 1, 1 if prompts is None else len(prompts)
        seqs = count * n
        cap = self.cfg.max_sequences_per_request
        if seqs > cap:
            raise HttpError(400, f"{count} prompt(s) × n={n} is {seqs} sequences; at most {cap} per "
                                 "request", param="prompt" if count > 1 else "n", code="too_many_sequences")
        self.check_room(link, seqs)
        self.keygate.prioritise(request, kind, forward, seqs)  # a saturated model shared by key weight
        # The response id, as vLLM's: the X-Request-Id header (when plain), else the body's
        # request_id, else ours.
        header = request.headers.get("X-Request-Id")
        base = header if header and header == request["request_id"] else req.request_id or self.new_request_id()
        gens = generate_messages(forward, prompts, self.new_request_id, self.keygate.tenant(request))
        # (a request the engine cannot take is a 400 here)
        run = self.generator.run(link, gens, n, prefix_key(forward))
        return link, run, seqs, base

    async def hold(self, link: ServedModel, seqs: int, model: str, path: str) -> None:
        """Until the model's engine is ready to take the request (held while it loads), then
        whether the model does what the route asks; a 503 or a 400 (HttpError) otherwise."""
        try:
            if T.tracer is not None and not link.ready_links():  # a span only for a real wait
                with T.hold(model, str(link.status)):
                    await link.wait_ready(link.hold_s(self.cfg.hold_timeout_s), seqs)
            else:
                await link.wait_ready(link.hold_s(self.cfg.hold_timeout_s), seqs)
        except EngineUnavailable as exc:
            raise unavailable(exc) from None
        check_kind(model, link.supported_tasks, path)

    def check_room(self, link: ServedModel, seqs: int) -> None:
        """Per gateway process: sequences beyond what the engine runs at once are capped. A
        request alone in the queue is always admitted (it fits the per-request cap)."""
        if link.queued() > 0 and link.queued(seqs) > self.cfg.max_waiting_per_model:
            raise HttpError(429, f"too many requests waiting for model {link.model!r} "
                                 f"(limit {self.cfg.max_waiting_per_model} sequences)", "rate_limit_error",
                            code="too_many_waiting", headers={"Retry-After": "1"})

    @contextlib.contextmanager
    def admitted(self, link: ServedModel, seqs: int):
        """Admitted work: counted for the model (its queue cap) and for the drain."""
        self.in_flight += 1
        link.admitted += seqs
        self.idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            link.admitted -= seqs
            if self.in_flight == 0:
                self.idle.set()


    async def ask_tokenizer(self, request: web.Request, model: str | None, kind: str, body: dict) -> web.Response:
        model = self.model_for(model)
        link = await self.keyed_link(request, model)
        if self.draining:
            raise HttpError(503, "the server is shutting down", "service_unavailable", headers={"Retry-After": "5"})
        # Admitted as one sequence: tokenising is the engine's work too (a flood of them waits
        # in, and is capped by, the model's queue like generation).
        self.check_room(link, 1)
        try:
            with self.admitted(link, 1):
                await link.wait_ready(link.hold_s(self.cfg.hold_timeout_s), 1)
                engine = link.pick()
                if engine is None:
                    raise EngineUnavailable(f"model {model!r} is restarting")
                answer = await engine.tokenizer(EP.Tokenizer(request_id=self.new_request_id(), kind=kind,
                                                           body=body), self.cfg.output_timeout_s)
        except EngineUnavailable as exc:
            raise unavailable(exc) from None
        except EngineRequestError as exc:
            raise refused_by_engine(exc) from None
        return web.Response(body=msgspec.json.encode(answer), content_type="application/json")

