"""The OpenAI-compatible HTTP gateway: aiohttp on uvloop.

The listening socket is the manager's (passed with ``pass_fds``), so a gateway
that dies leaves the accept queue to its siblings. Requests are validated by
msgspec types, routed by ``model`` to that engine, and streamed back as SSE.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import secrets
import signal
import socket
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from api_gateway import protocol as H
from api_gateway.engines import EngineLink, EngineRequestError, EngineUnavailable
from api_gateway.metrics import Metrics
from servectl.wire import control as MP
from servectl.wire import engine as EP
from servectl.wire.spawn import GatewaySpec, gateway_component, gateway_identity
from servectl import __version__
from servectl.paths import RuntimePaths

log = logging.getLogger("api_gateway")
access_log = logging.getLogger("api_gateway.access")


class HttpError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return H.encoder.encode(H.ErrorResponse(error=H.ErrorBody(message=message, type=type_, param=param,
                                                              code=code if code is not None else status)))


def error_response(exc: HttpError) -> web.Response:
    return web.Response(status=exc.status, body=error_body(exc.status, exc.message, exc.type, exc.param, exc.code),
                        content_type="application/json", headers=exc.headers)


def unavailable(exc: EngineUnavailable) -> HttpError:
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else {}
    return HttpError(503, str(exc), "service_unavailable", code="engine_unavailable", headers=headers)


def validation_error(exc: msgspec.ValidationError) -> HttpError:
    text = str(exc)
    param = None
    if " - at `$." in text:
        text, where = text.split(" - at `$.", 1)
        param = where.rstrip("`").split("[")[0].split(".")[0]
    elif text.startswith("Object missing required field"):
        param = text.split("`")[1]
    if text.startswith("Expected `object`") and param is None:
        text = "the request body must be a JSON object"
    return HttpError(400, f"{text}" + (f" (field `{param}`)" if param else ""), param=param)


class Gateway:
    def __init__(self, spec: GatewaySpec):
        self.spec = spec
        self.cfg = spec.gateway
        self.paths = RuntimePaths(Path(spec.runtime_dir))
        self.identity = gateway_identity(spec.index, os.getpid())
        self.ctx = zmq.asyncio.Context()
        self.links = {name: EngineLink(name, str(self.paths.engine(name)), self.ctx, self.identity.encode())
                      for name in spec.models}
        self.ids = itertools.count(1)
        self.id_prefix = f"{spec.index}{os.getpid():x}{secrets.token_hex(3)}"
        self.draining = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.keys = [k.encode() for k in self.cfg.api_keys]
        self.metrics = Metrics()
        self.created = int(time.time())

    def new_request_id(self) -> str:
        # Unique across gateway processes: index, pid, random salt, counter.
        return f"{self.id_prefix}-{next(self.ids)}"

    # ---- manager link -------------------------------------------------------------
    def connect_manager(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(RuntimePaths.ipc(self.paths.events))
        self.control = self.ctx.socket(zmq.DEALER)
        self.control.setsockopt(zmq.LINGER, 1000)
        self.control.setsockopt(zmq.IDENTITY, self.identity.encode())
        self.control.connect(RuntimePaths.ipc(self.paths.control))

    async def follow_manager(self) -> None:
        sub = self.sub
        # Subscribed first, then ask for a snapshot: no state change falls between.
        await self.control.send(MP.encoder.encode(MP.StatusRequest()))
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        while True:
            for sock, _ in await poller.poll():
                body = await sock.recv()
                if sock is sub:
                    try:
                        ev = MP.event_decoder.decode(body)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue
                    if ev.kind == "model" and ev.model:
                        self.on_model_event(ev.model, ev.state, ev.incarnation, ev.detail)
                    self.metrics.child_state(ev.component, ev.state)
                    if ev.kind == "model" and ev.state == "exited" and self.spec.index == 0:
                        self.metrics.engine_restarts.labels(model=ev.model).inc()
                else:
                    try:
                        reply = MP.control_out_decoder.decode(body)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue
                    if isinstance(reply, MP.StatusReply):
                        for m in reply.models:
                            self.on_model_event(m.name, m.state, m.incarnation, m.reason)

    def on_model_event(self, model: str, state: str, incarnation: str, reason: str | None) -> None:
        """Models come and go at runtime (`servectl load/unload/reload`)."""
        link = self.links.get(model)
        if state == "removed":
            if link is not None:
                link.remove()
                del self.links[model]
            return
        if link is None:
            link = self.links[model] = EngineLink(model, str(self.paths.engine(model)), self.ctx,
                                                  self.identity.encode())
        link.on_model_state(state, incarnation, reason)

    # ---- middleware ---------------------------------------------------------------------
    @web.middleware
    async def middleware(self, request: web.Request, handler):
        started = time.monotonic()
        rid = request.headers.get("X-Request-Id") or secrets.token_hex(8)
        request["request_id"] = rid
        request["log"] = {}
        try:
            if self.keys and request.path.startswith("/v1/"):
                self.check_auth(request)
            response = await handler(request)
        except HttpError as exc:
            response = error_response(exc)
        except web.HTTPException as exc:
            status = exc.status
            message = {404: f"no route for {request.method} {request.path}",
                       405: f"method {request.method} not allowed on {request.path}"}.get(status, exc.reason)
            response = web.Response(status=status, body=error_body(status, message, "invalid_request_error"),
                                    content_type="application/json",
                                    headers={k: v for k, v in exc.headers.items() if k == "Allow"})
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            response = error_response(HttpError(500, "internal error", "internal_error"))
        if not response.prepared:
            response.headers["X-Request-Id"] = rid
        info = request["log"]
        status = response.status
        access_log.info("%s %s %d model=%s prompt_tokens=%s completion_tokens=%s %.1fms rid=%s", request.method,
                        request.path, status, info.get("model", "-"), info.get("prompt_tokens", "-"),
                        info.get("completion_tokens", "-"), (time.monotonic() - started) * 1000, rid)
        self.metrics.requests.labels(endpoint=request.path if request.path in self.metrics.endpoints else "other",
                                     status=str(status)).inc()
        return response

    def check_auth(self, request: web.Request) -> None:
        header = request.headers.get("Authorization", "")
        token = header[7:].encode() if header.startswith("Bearer ") else b""
        ok = False
        for key in self.keys:  # constant-time per key; every key is compared
            ok |= hmac.compare_digest(token, key)
        if not ok:
            raise HttpError(401, "missing or invalid API key (send `Authorization: Bearer <key>`)",
                            "authentication_error", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})

    # ---- body parsing ---------------------------------------------------------------------
    async def read_json(self, request: web.Request, typ, unsupported: tuple[str, ...]):
        ctype = request.headers.get("Content-Type", "application/json").split(";")[0].strip().lower()
        if ctype not in ("application/json", "", "text/plain"):
            raise HttpError(415, f"unsupported content type {ctype!r}: send application/json")
        if request.content_length is not None and request.content_length > self.cfg.max_body_bytes:
            raise HttpError(413, f"request body of {request.content_length} bytes exceeds the limit of "
                                 f"{self.cfg.max_body_bytes}")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise HttpError(413, f"request body exceeds the limit of {self.cfg.max_body_bytes} bytes") from None
        try:
            raw = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            raise HttpError(400, f"invalid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise HttpError(400, "the request body must be a JSON object")
        named = [k for k in unsupported if raw.get(k) not in (None, [], {}) and not (k == "best_of" and raw[k] == 1)]
        if named:
            raise HttpError(400, f"not supported by servectl: {', '.join(named)}", param=named[0],
                            code="unsupported_parameter")
        try:
            return msgspec.convert(raw, typ)
        except msgspec.ValidationError as exc:
            raise validation_error(exc) from None

    def link_for(self, model: str) -> EngineLink:
        link = self.links.get(model)
        if link is None:
            raise HttpError(404, f"model {model!r} not found; served: {', '.join(sorted(self.links))}",
                            param="model", code="model_not_found")
        return link

    # ---- handlers --------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        wanted = request.query.get("model")
        links = self.links
        if wanted is not None:
            if wanted not in links:
                raise HttpError(404, f"model {wanted!r} not found; served: {', '.join(sorted(links))}", param="model")
            links = {wanted: links[wanted]}
        states = {name: ("ready" if link.ready.is_set() else link.state) for name, link in links.items()}
        ok = all(s == "ready" for s in states.values()) and not self.draining
        body = {"status": "ok" if ok else ("draining" if self.draining else "unavailable"), "models": {
            name: {"state": s, **({"reason": links[name].reason} if links[name].reason and s != "ready" else {})}
            for name, s in states.items()}}
        return web.json_response(body, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        cards = [self.card(name) for name in sorted(self.links)]
        return web.Response(body=H.encoder.encode(H.ModelList(data=cards)), content_type="application/json")

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        self.link_for(name)
        return web.Response(body=H.encoder.encode(self.card(name)), content_type="application/json")

    def card(self, name: str) -> H.ModelCard:
        link = self.links[name]
        return H.ModelCard(id=name, created=self.created, max_model_len=link.max_model_len,
                           state="ready" if link.ready.is_set() else link.state)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__, "protocol": EP.PROTOCOL_VERSION})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        for name, link in self.links.items():
            self.metrics.waiting.labels(model=name).set(link.queued())
            stats = await link.stats()
            if stats is not None:
                self.metrics.running.labels(model=name).set(stats.unfinished)
        body, ctype = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def openapi(self, request: web.Request) -> web.Response:
        from api_gateway.openapi import spec

        return web.json_response(spec())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await self.read_json(request, H.CompletionRequest, H.UNSUPPORTED_COMPLETION)
        prompts = normalize_prompts(req.prompt)
        return await self.serve(request, req, prompts, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = await self.read_json(request, H.ChatCompletionRequest, H.UNSUPPORTED_CHAT)
        messages = [msgspec.to_builtins(m) for m in req.messages]
        for m in messages:
            if isinstance(m.get("content"), list):  # text parts only
                parts = m["content"]
                if any(p.get("type") != "text" for p in parts):
                    raise HttpError(400, "only text content parts are supported", param="messages")
                m["content"] = "".join(p.get("text", "") for p in parts)
            if m.get("content") is None:
                m["content"] = ""
        return await self.serve(request, req, [messages], chat=True)

    # ---- generation ----------------------------------------------------------------------------
    async def serve(self, request: web.Request, req, prompts: list, chat: bool) -> web.StreamResponse:
        link = self.link_for(req.model)
        request["log"]["model"] = req.model
        if self.draining:
            raise HttpError(503, "the server is shutting down", "service_unavailable", headers={"Retry-After": "5"})
        if link.queued() >= self.cfg.max_waiting_per_model:
            # Admission control (per gateway process): the engine's queue is full.
            raise HttpError(429, f"too many requests waiting for model {req.model!r} "
                                 f"(limit {self.cfg.max_waiting_per_model})", "rate_limit_error",
                            code="too_many_waiting", headers={"Retry-After": "1"})
        sampling, structured = sampling_params(req, chat)
        gens = []
        base = self.new_request_id()
        for prompt in prompts:
            g = EP.Generate(request_id=self.new_request_id(), sampling=sampling, structured=structured,
                            echo=bool(getattr(req, "echo", False)))
            if chat:
                g.messages = prompt
            elif isinstance(prompt, str):
                g.prompt = prompt
            else:
                g.prompt_token_ids = prompt
            gens.append(g)
        self.in_flight += 1
        link.admitted += 1
        self.idle.clear()
        try:
            try:
                await link.wait_ready(self.cfg.hold_timeout_s)
            except EngineUnavailable as exc:
                raise unavailable(exc) from None
            if req.stream:
                return await self.stream(request, req, link, gens, chat, base)
            return await self.complete(request, req, link, gens, chat, base)
        finally:
            self.in_flight -= 1
            link.admitted -= 1
            if self.in_flight == 0:
                self.idle.set()

    async def events(self, link: EngineLink, gens: list[EP.Generate], n: int):
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
                    if item.status == 503:
                        raise unavailable(EngineUnavailable(str(item)))
                    if item.status >= 500:
                        raise HttpError(item.status, str(item), "internal_error", item.param)
                    raise HttpError(item.status, str(item), param=item.param)
                if item.finish_reason is not None:
                    remaining[rid] -= 1
                yield index_of[rid], item
        finally:
            for p in pumps:
                p.cancel()
            for s in streams:
                link.abort(s.request_id)  # no-op for finished ones

    def report_hang(self, link: EngineLink) -> None:
        try:
            self.control.send(MP.encoder.encode(MP.GroupHung(model=link.model, incarnation=link.incarnation)),
                              zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    async def complete(self, request, req, link, gens, chat: bool, base: str) -> web.Response:
        n = req.n
        started = time.monotonic()
        texts: dict[tuple[int, int], list[str]] = {}
        finish: dict[tuple[int, int], str | None] = {}
        lps: dict[tuple[int, int], list] = {}
        prompt_tokens = [0] * len(gens)
        echo_parts: dict[int, Any] = {}
        completion_tokens = 0
        first_token = None
        async for pi, d in self.events(link, gens, n):
            key = (pi, d.index)
            if first_token is None and d.token_ids:
                first_token = time.monotonic()
            texts.setdefault(key, []).append(d.text)
            completion_tokens += len(d.token_ids)
            if d.prompt_tokens is not None:
                prompt_tokens[pi] = d.prompt_tokens
            if d.prompt_logprobs is not None:
                echo_parts[pi] = (d.prompt_text or "", d.prompt_logprobs)
            if d.logprobs:
                lps.setdefault(key, []).extend(d.logprobs)
            if d.finish_reason is not None:
                finish[key] = d.finish_reason
        usage = H.Usage(prompt_tokens=sum(prompt_tokens), completion_tokens=completion_tokens,
                        total_tokens=sum(prompt_tokens) + completion_tokens)
        self.observe(request, req.model, usage, started, first_token)
        created = int(time.time())
        keys = sorted(texts)
        if chat:
            choices = [H.ChatChoice(index=k[1], message=H.ResponseMessage(content="".join(texts[k])),
                                    finish_reason=finish.get(k),
                                    logprobs=chat_logprobs(lps.get(k, [])) if req.logprobs else None)
                       for k in keys]
            body = H.ChatCompletionResponse(id=f"chatcmpl-{base}", created=created, model=req.model,
                                            choices=choices, usage=usage)
        else:
            choices = []
            for k in keys:
                pi, ci = k
                text = "".join(texts[k])
                logprobs = None
                entries = lps.get(k, [])
                if req.echo:
                    prompt_text, prompt_entries = echo_parts.get(pi, ("", []))
                    text = prompt_text + text
                    entries = prompt_entries + entries
                if req.logprobs is not None:
                    logprobs = completion_logprobs(entries, req.logprobs)
                choices.append(H.CompletionChoice(index=pi * n + ci, text=text, logprobs=logprobs,
                                                  finish_reason=finish.get(k)))
            body = H.CompletionResponse(id=f"cmpl-{base}", created=created, model=req.model, choices=choices,
                                        usage=usage)
        return web.Response(body=H.encoder.encode(body), content_type="application/json")

    def observe(self, request, model: str, usage: H.Usage, started: float, first_token: float | None) -> None:
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

    async def stream(self, request, req, link, gens, chat: bool, base: str) -> web.StreamResponse:
        n = req.n
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": request["request_id"]})
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{base}"
        prompt_tokens = [0] * len(gens)
        completion_tokens = 0
        started = time.monotonic()
        first_token = None
        role_sent: set[tuple[int, int]] = set()
        gen = self.events(link, gens, n)
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
                pi, d = item
                key = (pi, d.index)
                if d.prompt_tokens is not None:
                    prompt_tokens[pi] = d.prompt_tokens
                completion_tokens += len(d.token_ids)
                if first_token is None and d.token_ids:
                    first_token = time.monotonic()
                if chat:
                    delta = H.DeltaMessage(content=d.text)
                    if key not in role_sent:
                        role_sent.add(key)
                        delta.role = "assistant"
                    chunk = H.ChatCompletionChunk(id=rid, created=created, model=req.model, choices=[
                        H.ChatChunkChoice(index=d.index, delta=delta, finish_reason=d.finish_reason,
                                          logprobs=chat_logprobs(d.logprobs or []) if req.logprobs else None)])
                else:
                    text = d.text
                    entries = d.logprobs or []
                    if req.echo and d.prompt_logprobs is not None:
                        text = (d.prompt_text or "") + text
                        entries = d.prompt_logprobs + entries
                    chunk = H.CompletionResponse(id=rid, created=created, model=req.model, choices=[
                        H.CompletionChoice(index=pi * n + d.index, text=text, finish_reason=d.finish_reason,
                                           logprobs=completion_logprobs(entries, req.logprobs)
                                           if req.logprobs is not None else None)])
                await send(chunk)
                try:
                    item = await gen.__anext__()
                except StopAsyncIteration:
                    item = None
            usage = H.Usage(prompt_tokens=sum(prompt_tokens), completion_tokens=completion_tokens,
                            total_tokens=sum(prompt_tokens) + completion_tokens)
            if include_usage:
                cls = H.ChatCompletionChunk if chat else H.CompletionResponse
                await send(cls(id=rid, created=created, model=req.model, choices=[], usage=usage))
            self.observe(request, req.model, usage, started, first_token)
        except HttpError as exc:
            # Mid-stream failure: an SSE error event in OpenAI's shape, then [DONE].
            await resp.write(b"data: " + error_body(exc.status, exc.message, exc.type, exc.param, exc.code) + b"\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            await gen.aclose()  # aborts the engine requests
            raise
        finally:
            await gen.aclose()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---- lifecycle ------------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self.middleware], client_max_size=self.cfg.max_body_bytes)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def run(self, listen_fd: int) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        self.connect_manager()
        follower = loop.create_task(self.follow_manager())
        sock = socket.socket(fileno=listen_fd)
        runner = web.AppRunner(self.build_app(), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.SockSite(runner, sock)
        await site.start()
        await self.control.send(MP.encoder.encode(MP.ChildReady(component=gateway_component(self.spec.index),
                                                                pid=os.getpid())))
        log.info("gateway %d serving on fd %d", self.spec.index, listen_fd)
        await stop.wait()
        # Drain: refuse new work, let in-flight requests finish (bounded), then go.
        self.draining = True
        log.info("draining %d in-flight request(s)", self.in_flight)
        try:
            await asyncio.wait_for(self.idle.wait(), self.spec.drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("drain timeout: %d request(s) still in flight", self.in_flight)
        await runner.cleanup()
        follower.cancel()
        self.ctx.destroy(linger=0)
        return 0


def normalize_prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise HttpError(400, "prompt must not be empty", param="prompt")
    def token_ids(p) -> bool:
        return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

    if token_ids(prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(token_ids(p) for p in prompt):
        if any(not p for p in prompt):
            raise HttpError(400, "token id lists must not be empty", param="prompt")
        return list(prompt)
    raise HttpError(400, "prompt must be a string, a list of strings, token ids or lists of token ids",
                    param="prompt")


def sampling_params(req, chat: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
    s: dict[str, Any] = {"n": req.n}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            s[name] = value
    if req.stop is not None:
        s["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.ignore_eos:
        s["ignore_eos"] = True
    max_tokens = (req.max_completion_tokens or req.max_tokens) if chat else req.max_tokens
    if max_tokens is not None:
        s["max_tokens"] = max_tokens
    if req.logit_bias:
        try:
            s["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError:
            raise HttpError(400, "logit_bias keys must be token ids", param="logit_bias") from None
    if chat:
        if req.logprobs:
            s["logprobs"] = req.top_logprobs or 0
        elif req.top_logprobs:
            raise HttpError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    elif req.logprobs is not None:
        s["logprobs"] = req.logprobs
    structured = None
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            structured = {"json_object": True}
        else:
            if rf.json_schema is None:
                raise HttpError(400, "response_format json_schema needs a `json_schema` object",
                                param="response_format")
            structured = {"json": rf.json_schema.schema_}
    return s, structured


def completion_logprobs(entries: list, k: int) -> H.CompletionLogprobs:
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for text, lp, alts in entries:
        tokens.append(text)
        token_lps.append(lp)
        tops.append({t: a for t, a in alts[:k]} if lp is not None and k else None)
        offsets.append(offset)
        offset += len(text)
    return H.CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets)


def chat_logprobs(entries: list) -> H.ChatLogprobs:
    return H.ChatLogprobs(content=[
        H.ChatTokenLogprob(token=text, logprob=lp if lp is not None else float("-inf"),
                           bytes=list(text.encode()),
                           top_logprobs=[H.TopLogprob(token=t, logprob=a, bytes=list(t.encode())) for t, a in alts])
        for text, lp, alts in entries])


def main(argv: list[str] | None = None) -> int:
    import argparse

    from servectl.proc import die_with_parent, setup_child_logging

    ap = argparse.ArgumentParser(prog="python -m api_gateway")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--listen-fd", type=int, required=True)
    args = ap.parse_args(argv)
    die_with_parent()
    spec = msgspec.json.decode(args.spec, type=GatewaySpec)
    setup_child_logging(f"gateway[{spec.index}]")
    import uvloop

    return uvloop.run(Gateway(spec).run(args.listen_fd))
