"""The OpenAI-compatible HTTP gateway: aiohttp on uvloop.

The listening socket is the manager's (passed with ``pass_fds``), so a gateway
that dies leaves the accept queue to its siblings. Requests are validated by
msgspec types, admitted (drain, per-model queue limit), routed by ``model``
to that engine and answered whole or streamed back as SSE (generate.py).
This module holds the process: ``main``, its links, the route table, the
plain handlers (health, models, version, metrics, completions and chat, the
tokenizer routes), its run and drain. Middleware: middleware.py; admission
and the tokenizer questions: admission.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import signal
import socket
import time
from pathlib import Path

import msgspec
import zmq.asyncio
from aiohttp import web

from api_gateway import openai_types as H
from api_gateway import tracing as T
from api_gateway.admin import AdminRoutes
from api_gateway.admission import Admission
from api_gateway.batch_runner import BatchAuth, BatchRunner
from api_gateway.batch_store import Store
from api_gateway.batches_api import BatchesApi
from api_gateway.bodies import read_body
from api_gateway.errors import HttpError
from api_gateway.files_api import FilesApi
from api_gateway.generate import Generator
from api_gateway.http_policy import CorsPolicy, HostPolicy
from api_gateway.http_server import make_runner, raise_fd_limit
from api_gateway.keys import KeyRing
from api_gateway.manager_link import ManagerLink
from api_gateway.metrics import Metrics, key_usage_exposition
from api_gateway.middleware import Middleware
from api_gateway.passthrough import ApiEndpoints
from api_gateway.speech import SpeechEndpoints
from api_gateway.tenancy import KeyGate
from api_gateway.probes import Probes
from api_gateway.served import ServedModel
from api_gateway.translate import check_messages, normalize_prompts
from api_gateway.ui import UiRoutes
from servectl import __version__
from servectl.paths import RuntimePaths
from servectl.wire import control as MP
from servectl.wire import engine as EP
from servectl.wire.spawn import GatewaySpec, gateway_component, gateway_identity, read_spec_fd
from servectl.wire.vocab import DEGRADED, ExitCode, ModelState

log = logging.getLogger("api_gateway")


class Gateway(Admission):
    """One gateway process: its links to the manager and the engines, its routes, its run."""

    def __init__(self, spec: GatewaySpec):
        self.spec = spec
        self.cfg = spec.gateway
        self.paths = RuntimePaths(Path(spec.runtime_dir))
        self.identity = gateway_identity(spec.index, os.getpid())
        self.ctx = zmq.asyncio.Context()
        self.metrics = Metrics()
        self.manager = ManagerLink(self.paths, self.identity, self.ctx, list(spec.models), self.metrics,
                                   count_restarts=spec.index == 0, send_timeout_s=self.cfg.output_timeout_s)
        # The same dict as the manager link's: it adds and drops models as the manager says.
        self.links = self.manager.links  # by engine group
        self.served = self.manager.models  # by the name requests use
        self.generator = Generator(self.cfg, self.metrics, self.new_request_id,
                                   lambda link: self.manager.report_hang(link))
        self.ids = itertools.count(1)
        self.id_prefix = f"{spec.index}{os.getpid():x}{secrets.token_hex(3)}"
        self.draining = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.keys = KeyRing(self.cfg.api_keys, self.cfg.admin_keys, self.cfg.keys)
        self.keygate = KeyGate(self.manager, self.cfg.fair_share)  # models, limits, fair share, usage per key
        self.generator.on_usage = self.keygate.finished  # told before an answer's last bytes
        self.manager.on_api_keys = self.set_api_keys
        self.admin = AdminRoutes(self)
        self.probes = Probes(self)  # /live, /ready, /kv_event_sources
        self.ui = UiRoutes(self, spec.ui_secret, spec.instance)  # the status page, /ui
        self.apis = ApiEndpoints(self)  # /v1/responses, /v1/messages (passthrough.py)
        self.speech = SpeechEndpoints(self.apis, lambda: self.cfg)  # /v1/audio/* (speech.py)
        self.hosts = HostPolicy(self.cfg.host, self.cfg.allowed_hosts)
        self.cors = CorsPolicy(self.cfg.cors_origins)
        self.front = Middleware(self.hosts, self.cors, self.metrics, lambda: self.keys, self.keygate.finished)
        # The Files and Batch APIs (docs/batch.md): their store on the disk, this gateway's runner
        # sending its batches' lines to its own routes through a private socket.
        self.store = Store(Path(spec.state_dir) if spec.state_dir else self.paths.root / "state")
        self.front.batch = BatchAuth(lambda label: self.keys.by_label(label))
        self.batch_socket = str(self.paths.root / f"batch-{spec.index}.sock")  # (uvloop connects to no abstract name)
        self.runner = BatchRunner(self.store, spec.index, self.cfg.processes, lambda: self.cfg.batch,
                                  self.front.batch, self.batch_socket)
        self.files = FilesApi(self.store, lambda: self.cfg)
        self.batches = BatchesApi(self.store, self.runner, lambda: self.cfg)
        self.created = int(time.time())
        # Set by SIGTERM/SIGINT, or when a long-lived task died past its restarts (task_died).
        self.stop = asyncio.Event()
        self.exit_code = 0
        self.manager.on_task_died = self.task_died

    def task_died(self, name: str, exc: BaseException) -> None:
        """A long-lived task (following the manager, reading an engine) kept failing: this
        gateway cannot serve, so it drains what it has and exits TASK_DIED; the manager's
        supervision starts another in its place."""
        log.critical("task %r died (%s: %s): this gateway exits %d and the manager replaces it", name,
                     type(exc).__name__, str(exc)[:200], ExitCode.TASK_DIED)
        self.exit_code = int(ExitCode.TASK_DIED)
        self.stop.set()

    def set_api_keys(self, keys: MP.ApiKeys) -> None:
        """A reload rotated the keys: from the next request on, only these are accepted."""
        self.keys = KeyRing(keys.keys, keys.admin_keys, keys.named)
        self.ui.keys_changed()
        log.info("API keys replaced (%d API key(s), %d named, %d admin key(s))", len(keys.keys), len(keys.named),
                 len(keys.admin_keys))

    def stop_being_ready(self) -> None:
        """The host is stopping (SIGUSR1 from the manager): /ready fails from now on, so routers and
        kubelets stop sending here before the drain refuses new requests."""
        if not self.probes.unready:
            log.info("the host is stopping: /ready answers 503 from now on")
        self.probes.unready = True

    def new_request_id(self) -> str:
        # Unique across gateway processes: index, pid, random salt, counter.
        return f"{self.id_prefix}-{next(self.ids)}"

    # ---- handlers --------------------------------------------------------------------------
    async def read_json(self, request: web.Request, endpoint: str):
        """(the validated request, the supported fields as sent): bodies.read_body."""
        return await read_body(request, self.cfg, endpoint)

    async def health(self, request: web.Request) -> web.Response:
        wanted = request.query.get("model")
        links = self.served
        if wanted is not None:
            if wanted not in links:
                raise HttpError(404, f"model {wanted!r} not found; served: {', '.join(sorted(links))}", param="model")
            links = {wanted: links[wanted]}
        states = {name: link.status for name, link in links.items()}
        ok = all(s in MP.AVAILABLE or s == DEGRADED for s in states.values()) and not self.draining
        body = {"status": "ok" if ok else ("draining" if self.draining else "unavailable"), "models": {
            name: {"state": s, **({"reason": links[name].reason} if links[name].reason and s is not ModelState.READY else {})}
            for name, s in states.items()}}
        return web.json_response(body, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        cards = [self.card(name) for name in sorted(self.served)]
        cards += [self.adapter_card(link, lora) for name in sorted(self.served) for link in [self.served[name]]
                  for lora in link.loras]
        allowed = self.keygate.models_of(request)  # a key with a models list sees those
        if allowed is not None:
            cards = [c for c in cards if c.id in allowed or (c.parent is not None and c.parent in allowed)]
        return web.Response(body=H.encoder.encode(H.ModelList(data=cards)), content_type="application/json")

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        link = self.link_for(name)
        allowed = self.keygate.models_of(request)  # a key with a models list sees only those
        if allowed is not None and name not in allowed and link.model not in allowed:
            raise HttpError(404, f"model {name!r} not found", param="model", code="model_not_found")
        card = self.card(name) if name in self.served else \
            self.adapter_card(link, next(lora for lora in link.loras if lora.name == name))
        return web.Response(body=H.encoder.encode(card), content_type="application/json")

    def card(self, name: str) -> H.ModelCard:
        link = self.served[name]
        return H.ModelCard(id=name, created=self.created, max_model_len=link.max_model_len, state=link.status,
                           tasks=link.supported_tasks or None)

    def adapter_card(self, link: ServedModel, lora) -> H.ModelCard:
        """A LoRA adapter as vLLM lists it (parent: its base model), in its model's state; no ``root``:
        vLLM's is the adapter's path, which an API key has no business knowing (issue 53)."""
        return H.ModelCard(id=lora.name, created=self.created,
                           parent=lora.base_model_name or link.model, max_model_len=link.max_model_len,
                           state=link.status, tasks=link.supported_tasks or None)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__, "protocol": EP.PROTOCOL_VERSION})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        engines = []
        for name, served in self.served.items():
            self.metrics.waiting.labels(model=name).set(served.queued())
        # Each engine group: a model's, or each of its replicas (a copy: groups come and go meanwhile).
        for name, link in list(self.links.items()):
            stats = await link.stats()
            if stats is not None:
                self.metrics.running.labels(model=name).set(stats.unfinished)
                self.metrics.overlapped_steps.labels(model=name).set(stats.overlapped_steps)
                self.metrics.worker_replies.labels(model=name, encoding="tokens").set(stats.token_replies)
                self.metrics.worker_replies.labels(model=name, encoding="signed_pickle").set(stats.signed_replies)
                self.metrics.yield_steps.labels(model=name, kind="one_deep").set(stats.steps_one_deep)
                self.metrics.yield_steps.labels(model=name, kind="sat_out").set(stats.steps_sat_out)
            # vLLM's own (vllm:*): only from an engine that lives; a released model's are gone.
            engines.append(await link.engine_metrics())
        body, ctype = self.metrics.render(engines)
        return web.Response(body=body + await self.key_usage(), headers={"Content-Type": ctype})

    async def key_usage(self) -> bytes:
        """The usage counters per key and model, as the manager keeps them (none if it does not answer)."""
        if self.manager.control is None:  # not connected to a manager (the unit tests' gateway)
            return b""
        try:
            reply = await self.manager.ask(MP.UsageRequest(), timeout_s=2.0)
        except (TimeoutError, zmq.ZMQError, ValueError, msgspec.DecodeError) as exc:
            log.warning("/metrics without the usage per key: the manager did not answer (%s)", exc)
            return b""
        return key_usage_exposition(reply.rows) if isinstance(reply, MP.UsageReply) else b""

    async def openapi(self, request: web.Request) -> web.Response:
        from api_gateway.openapi import spec

        return web.json_response(spec())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req, forward = await self.read_json(request, "completion")
        prompts = normalize_prompts(req.prompt)
        return await self.serve(request, req, forward, prompts, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req, forward = await self.read_json(request, "chat")
        check_messages(req.messages)
        self.check_chat_input(req.model, forward)
        return await self.serve(request, req, forward, None, chat=True)

    # ---- tokenizer endpoints (vLLM's; answered by the model's engine) -------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        req, forward = await self.read_json(request, "tokenize")
        if (req.prompt is None) == (req.messages is None):
            raise HttpError(400, "send either `prompt` or `messages`", param="prompt")
        if req.messages is not None:
            check_messages(req.messages)
            self.check_chat_input(req.model, forward)
        return await self.ask_tokenizer(request, req.model, "tokenize", forward)

    async def detokenize(self, request: web.Request) -> web.Response:
        req, forward = await self.read_json(request, "detokenize")
        return await self.ask_tokenizer(request, req.model, "detokenize", forward)

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        return await self.ask_tokenizer(request, request.query.get("model"), "tokenizer_info", {})

    # ---- lifecycle ------------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self.front.middleware], client_max_size=self.cfg.max_body_bytes)
        if self.cors.enabled:
            app.on_response_prepare.append(self.front.add_cors_headers)
        elif T.tracer is not None:
            app.on_response_prepare.append(self.front.on_prepare)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
        self.apis.add_to(app)
        self.files.add_to(app)
        self.batches.add_to(app)
        self.speech.add_to(app)
        self.admin.add_to(app)
        self.probes.add_to(app)
        self.ui.add_to(app)
        return app

    async def run(self, listen_fd: int) -> int:
        loop = asyncio.get_running_loop()
        stop = self.stop
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGUSR1, self.stop_being_ready)
        raise_fd_limit()
        self.manager.connect()
        # Restarted, not fatal at once: each start asks the manager for a snapshot again, so
        # whatever the failed run missed is caught up; a failure that keeps coming back (no
        # descriptors left) ends the gateway, which the manager replaces.
        follower = self.manager.tasks.keep(self.manager.follow, "follow the manager", give_up=self.task_died)
        sock = socket.socket(fileno=listen_fd)
        runner = make_runner(self.build_app(), self.cfg)
        await runner.setup()
        site = web.SockSite(runner, sock)
        await site.start()
        # The batch runner's way in: this process's alone (its predecessor's file is replaced), 0600.
        Path(self.batch_socket).unlink(missing_ok=True)
        await web.UnixSite(runner, self.batch_socket).start()
        os.chmod(self.batch_socket, 0o600)
        self.runner.resume()
        await self.manager.send_ready(gateway_component(self.spec.index), os.getpid())
        log.info("gateway %d serving on fd %d", self.spec.index, listen_fd)
        await stop.wait()
        # Drain: refuse new work, let in-flight requests finish (bounded), then go.
        self.draining = True
        await self.runner.stop()  # its lines in flight are sent again by the runner that starts next
        self.ui.hub.close_all()  # open status pages' streams end (their browsers reconnect elsewhere)
        log.info("draining %d in-flight request(s)", self.in_flight)
        try:
            # event-proof: the drain's bound on the way out; the last request's end sets idle at once.
            await asyncio.wait_for(self.idle.wait(), self.spec.drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("drain timeout: %d request(s) still in flight", self.in_flight)
        await runner.cleanup()
        follower.cancel()
        for link in self.links.values():  # their readers end here, not on the sockets' close
            link.tasks.cancel_all()
        self.ctx.destroy(linger=0)
        return self.exit_code


def main(argv: list[str] | None = None) -> int:
    import argparse

    from servectl.proc import die_with_parent, setup_child_logging

    ap = argparse.ArgumentParser(prog="python -m api_gateway")
    ap.add_argument("--spec-fd", type=int, required=True, help="a memfd holding the GatewaySpec as JSON")
    ap.add_argument("--listen-fd", type=int, required=True)
    args = ap.parse_args(argv)
    die_with_parent()
    spec = read_spec_fd(args.spec_fd, GatewaySpec)
    setup_child_logging(f"gateway[{spec.index}]", gateway_component(spec.index))
    T.start(spec.index)  # before the app is built: it adds the traceresponse header when on
    import uvloop

    return uvloop.run(Gateway(spec).run(args.listen_fd))
