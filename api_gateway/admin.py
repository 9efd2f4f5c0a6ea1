"""The model-management routes, ``/servectl/v1/``: list the configured models; load, unload,
restart and freeze one — behind the admin keys (docs/api.md, "Managing models over HTTP").

The verbs are the CLI's: each route sends the manager the control message
`servectl load/unload/restart/freeze` sends, with who asked (the admin key's
fingerprint, the client's address) for the audit log, and answers with what
the manager said it did. Refusals (no key: 401, a key that is not an admin
key: 403) are audited too, a flood of them summarised (``RefusalBudget``).
With no admin key configured the routes do not exist: 404, as any unknown path.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import time
from typing import Protocol

import msgspec
import zmq
from aiohttp import web

from api_gateway.errors import HttpError
from api_gateway.http_policy import is_json_content_type
from api_gateway.engines import EngineLink
from api_gateway.keys import Access, KeyRing, RefusalBudget, bearer_token, fingerprint
from api_gateway.link_state import LinkState
from api_gateway.manager_link import ManagerLink
from api_gateway.served import ServedModel
from servectl.wire import control as MP
from servectl.wire import status as WS
from servectl.wire.spawn import model_of

log = logging.getLogger("api_gateway.admin")

PREFIX = "/servectl/v1/"
# How long a verb's answer waits for this gateway's view to show the change (its events trail the
# manager's answer by a moment; a gateway whose events stall still answers, after this).
AGREE_TIMEOUT_S = 5.0
# A replica's link states that a done `load` or `restart` may leave: serving, released until a
# request, or failed (the manager's answer already said so).
SETTLED_LINKS = frozenset({LinkState.READY, LinkState.RELEASED, LinkState.FAILED})
# vLLM's runtime LoRA routes (`vllm serve` with VLLM_ALLOW_RUNTIME_LORA_UPDATING), behind the admin keys
# here like the other management routes: not behind the API keys alone.
LORA_TIMEOUT_S = MP.LORA_CHANGE_TIMEOUT_S + 30  # past the manager's own bound on the engine's answer
LORA_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def since_of(raw: str | None) -> float | None:
    """``?since=``: unix seconds, or an ISO 8601 time (UTC unless it says its offset)."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        try:
            at = datetime.datetime.fromisoformat(raw)
        except ValueError:
            raise HttpError(400, f"since: unix seconds or an ISO 8601 time (got {raw[:40]!r})", param="since") from None
        value = (at if at.tzinfo else at.replace(tzinfo=datetime.timezone.utc)).timestamp()
    if not math.isfinite(value) or value < 0:
        raise HttpError(400, f"since: a time after 1970 (got {raw[:40]!r})", param="since")
    return value


class FreezeBody(msgspec.Struct, forbid_unknown_fields=True):
    enabled: bool


class LoadLoraBody(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``LoadLoRAAdapterRequest``, and servectl's ``model``: which model takes it (needed
    only when several models take adapters)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False
    model: str | None = None


class UnloadLoraBody(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``UnloadLoRAAdapterRequest`` (its ``lora_int_id`` is not used there either), and ``model``."""

    lora_name: str
    lora_int_id: int | None = None
    model: str | None = None


class AdminHost(Protocol):
    """What the management routes need of their gateway."""

    manager: ManagerLink  # the manager's control socket (ask, report) and its events (changed)
    keys: KeyRing  # the keys in force (a reload replaces them)
    links: dict[str, EngineLink]  # by engine group
    served: dict[str, ServedModel]  # by the name requests use


class AdminRoutes:
    def __init__(self, gateway: AdminHost):
        self.gw = gateway
        self.refusals = RefusalBudget()
        self.timeout_s = 10.0  # for the manager's answer to what it answers at once (beyond a verb's wait)

    def add_to(self, app: web.Application) -> None:
        app.router.add_get(PREFIX + "models", self.models)
        app.router.add_get(PREFIX + "usage", self.usage)
        for verb in ("load", "unload", "restart", "freeze"):
            app.router.add_post(PREFIX + "models/{model}/" + verb, getattr(self, verb))
        app.router.add_post("/v1/load_lora_adapter", self.load_lora)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora)

    # ---- who asks -----------------------------------------------------------------------
    def caller(self, request: web.Request, key_id: str | None) -> MP.HttpCaller:
        return MP.HttpCaller(key_id=key_id, address=request.remote or "", gateway=self.gw.manager.component,
                             route=f"{request.method} {request.path}"[:300])

    def check(self, request: web.Request) -> MP.HttpCaller:
        """The caller of a management route with an admin key, or the HTTP error that refuses it."""
        keys = self.gw.keys
        if not keys.admin_enabled:
            raise web.HTTPNotFound()  # no admin key configured: no such routes
        header = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        token = bearer_token(header)
        access = keys.access(token)
        if access is Access.ADMIN:
            return self.caller(request, fingerprint(token))
        if access is Access.API:  # named in the audit log by its name if it has one, else its fingerprint
            self.refused(request, keys.identify(token).label, 403, "an API key, not an admin key")
            raise HttpError(403, "this route needs an admin key (gateway.admin_keys); an API key is not one",
                            "permission_error", code="admin_key_required")
        self.refused(request, None, 401, "no key" if not token else "not a configured key")
        raise HttpError(401, "missing or invalid admin key (send `Authorization: Bearer <admin key>`)",
                        "authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def refused(self, request: web.Request, key_id: str | None, status: int, reason: str) -> None:
        suppressed = self.refusals.take(time.monotonic())
        if suppressed is None:
            return
        self.gw.manager.report(MP.HttpRefused(http=self.caller(request, key_id), status=status, reason=reason,
                                              suppressed=suppressed))

    # ---- the manager's answers -----------------------------------------------------------
    async def ask(self, msg, timeout_s: float | None = None) -> MP.StatusReply | MP.Ack | MP.LoraReply:
        try:
            return await self.gw.manager.ask(msg, timeout_s or self.timeout_s)
        except (TimeoutError, zmq.ZMQError, msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            log.error("management call %s: no answer from the manager: %s", type(msg).__name__, exc)
            raise HttpError(503, "the manager did not answer; try again", "service_unavailable",
                            headers={"Retry-After": "1"}) from None

    async def status(self) -> MP.StatusReply:
        reply = await self.ask(MP.StatusRequest())
        if not isinstance(reply, MP.StatusReply):
            raise HttpError(503, f"the manager did not give its status: {reply.message}", "service_unavailable")
        return reply

    async def known(self, name: str) -> MP.StatusReply:
        """The manager's status, once ``name`` is known to be one of its configured or served models."""
        st = await self.status()
        served = {m.name for m in st.models} | {model_of(m.name) for m in st.models}  # groups and models
        if name not in served and name not in st.unloaded:
            names = sorted({model_of(m.name) for m in st.models} | set(st.unloaded))
            raise HttpError(404, f"model {name!r} not found; configured or served: {', '.join(names)}",
                            param="model", code="model_not_found")
        return st

    @staticmethod
    def answer(name: str, action: str, ack: MP.Ack | MP.StatusReply) -> web.Response:
        """200 with ``done: true`` once the change is done; 202 with ``done: false`` while it is
        under way (the caller's ``wait`` ran out: the same call again waits for it); 409 when the
        manager refused it (with why)."""
        if not isinstance(ack, MP.Ack):
            raise HttpError(503, "the manager gave no answer to the command", "service_unavailable")
        if not ack.ok:
            raise HttpError(409, ack.message, code="not_done")
        return web.json_response({"model": name, "action": action, "done": ack.done, "message": ack.message},
                                 status=200 if ack.done else 202)

    @staticmethod
    def wait_s(request: web.Request) -> float | None:
        """``?wait=SECONDS``: how long this call waits for its change (default: until it is done)."""
        raw = request.query.get("wait")
        if raw is None:
            return None
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 <= value <= MP.MAX_VERB_WAIT_S:  # also NaN
            raise HttpError(400, f"wait: seconds from 0 to {MP.MAX_VERB_WAIT_S:g} (got {raw[:40]!r})", param="wait")
        return value

    # ---- routes ----------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        self.check(request)
        st = await self.status()
        stats = await asyncio.gather(*(self.engine_stats(m.name) for m in st.models))
        data = [self.model_entry(m, s) for m, s in zip(st.models, stats)]
        data += [{"name": name, "model": name, "state": "unloaded", "served": False} for name in st.unloaded]
        # The memory budget: each device's budget and use, the cap, the last eviction (docs/operations.md).
        return web.json_response({"object": "list", "data": data, "budget": msgspec.to_builtins(st.budget)})

    async def usage(self, request: web.Request) -> web.Response:
        """Usage per key and model (``?since=``: unix seconds or an ISO 8601 time; default: all kept),
        as the manager keeps it across restarts (docs/tenancy.md)."""
        self.check(request)
        reply = await self.ask(MP.UsageRequest(since=since_of(request.query.get("since"))))
        if not isinstance(reply, MP.UsageReply):
            raise HttpError(503, "the manager gave no usage", "service_unavailable")
        return web.json_response({"object": "list", "since": reply.since, "until": reply.until,
                                  "data": msgspec.to_builtins(reply.rows)})

    async def engine_stats(self, name: str):
        link = self.gw.links.get(name)
        return None if link is None else await link.stats()

    def model_entry(self, m: WS.ModelStatus, stats) -> dict:
        served = self.gw.served.get(model_of(m.name))  # its model's queue (a replica's is its model's)
        last_used = stats.last_worked_at if stats is not None and stats.last_worked_at is not None else m.idle_since
        state = msgspec.to_builtins(m)["state"]  # the wire's word for it
        return {
            # An engine group: the model's own, or one replica of it (`model`, `<model>@<i>`).
            "name": m.name, "model": model_of(m.name), "state": state, "served": True, "reason": m.reason, "devices": m.devices,
            "memory_bytes": m.memory_bytes, "device_memory_bytes": m.device_memory_bytes,
            "last_used": last_used, "idle_since": m.idle_since, "released_since": m.released_since,
            # The engine's own count (every gateway's requests); None while no engine answers.
            "requests_running": stats.unfinished if stats is not None else None,
            # Held in this gateway for the model's readiness or beyond what its engine runs.
            "requests_waiting": served.queued() if served is not None else 0,
            "restarts": m.restarts, "frozen": m.frozen, "incarnation": m.incarnation,
            "release_after_s": m.release_after_s, "release_mode": m.release_mode or None,
            "step_deadline_s": m.step_deadline_s,
            "start_s": m.start_s,  # its longest start so far (a held request waits this out)
            "config_id": m.config_id,  # what its outputs depend on, as a digest (a reload may change it)
            "loras": [msgspec.to_builtins(lora) for lora in m.loras],  # its LoRA adapters (docs/lora.md)
            # What the memory budget counts for it on each of its devices: measured at its last load,
            # else estimated (source says how); why it cannot be loaded under the budget, if so.
            "footprint": {"bytes": m.footprint_bytes, "measured": m.footprint_measured, "source": m.footprint_source,
                          "devices": m.device_labels},
            "unfit": m.unfit, "standby_memory_bytes": m.standby_memory_bytes,
        }

    async def load(self, request: web.Request) -> web.Response:
        return await self.command(request, "load", lambda name, who, wait_s: MP.LoadConfigured(
            name=name, http=who, wait_s=wait_s))

    async def unload(self, request: web.Request) -> web.Response:
        return await self.command(request, "unload", lambda name, who, wait_s: MP.UnloadModel(
            name=name, http=who, wait_s=wait_s), gone=True)

    async def restart(self, request: web.Request) -> web.Response:
        return await self.command(request, "restart", lambda name, who, wait_s: MP.RestartRequest(
            model=name, http=who, wait_s=wait_s))

    async def command(self, request: web.Request, action: str, message, gone: bool = False) -> web.Response:
        """Check the caller, the model; send the manager ``message(name, caller, wait_s)``; say what
        it did once done (or, past ``?wait=``, that it is under way). ``gone``: done means the
        model is no longer served."""
        who = self.check(request)
        name = request.match_info["model"]
        wait_s = self.wait_s(request)
        await self.known(name)
        # The manager answers within wait_s (or, without it, when the change's own bound is over).
        timeout_s = (wait_s if wait_s is not None else MP.MAX_VERB_WAIT_S) + self.timeout_s
        ack = await self.ask(message(name, who, wait_s), timeout_s)
        if isinstance(ack, MP.Ack) and ack.ok and ack.done:
            await self.agreed(name, gone)
        return self.answer(name, action, ack)

    async def agreed(self, name: str, gone: bool) -> None:
        """Until this gateway's view shows what the manager said is done — ``name`` gone, or with a
        replica it can send requests to (or released until one comes) — so a request sent on the
        answer finds it so. The manager's events can trail its answer by a moment; bounded."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + AGREE_TIMEOUT_S
        while True:
            served = self.gw.served.get(model_of(name))
            links = [] if served is None else [link for group, link in served.links.items()
                                               if group == name or model_of(group) == name]
            if (not links) if gone else (links and all(link.state in SETTLED_LINKS for link in links)):
                return
            left = deadline - loop.time()
            if left <= 0:
                return
            waits = [self.gw.manager.changed.wait(), *([served.changed.wait()] if served is not None else [])]
            # event-proof: this gateway's next model event or link change, bounded by AGREE_TIMEOUT_S.
            done, pending = await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=left,
                                               return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()

    async def freeze(self, request: web.Request) -> web.Response:
        who = self.check(request)
        name = request.match_info["model"]
        body = await request.read()
        try:
            enabled = msgspec.json.decode(body, type=FreezeBody).enabled
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HttpError(400, f'send {{"enabled": true}} or {{"enabled": false}}: {exc}', param="enabled") \
                from None
        await self.known(name)
        return self.answer(name, "freeze" if enabled else "thaw",
                           await self.ask(MP.SetFreezing(model=name, enabled=enabled, http=who)))

    # ---- LoRA adapters (vLLM's routes) ---------------------------------------------------------
    async def load_lora(self, request: web.Request) -> web.Response:
        who = self.check(request)
        body = await self.lora_body(request, LoadLoraBody)
        if body.is_3d_lora_weight:
            raise HttpError(400, "is_3d_lora_weight (3D MoE adapter weights) is not supported by servectl",
                            param="is_3d_lora_weight")
        lora = self.lora_module(body.lora_name, body.lora_path)
        return await self.lora_answer(MP.LoadLora(model=body.model, lora=lora, load_inplace=body.load_inplace,
                                                  http=who))

    async def unload_lora(self, request: web.Request) -> web.Response:
        who = self.check(request)
        body = await self.lora_body(request, UnloadLoraBody)
        if not body.lora_name:
            raise HttpError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
        return await self.lora_answer(MP.UnloadLora(model=body.model, name=body.lora_name, http=who))

    @staticmethod
    async def lora_body(request: web.Request, kind):
        if not is_json_content_type(request.headers.get("Content-Type")):
            raise HttpError(415, "send the body as application/json", code="unsupported_media_type")
        try:
            return msgspec.json.decode(await request.read(), type=kind)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HttpError(400, f"invalid body: {exc}") from None

    @staticmethod
    def lora_module(name: str, path: str) -> MP.LoraModule:
        if not name or not path:
            raise HttpError(400, "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        try:
            return msgspec.convert({"name": name, "path": path}, MP.LoraModule)
        except msgspec.ValidationError:
            raise HttpError(400, f"lora_name {name[:130]!r}: a name of letters, digits and . _ : / @ + - "
                                 "(at most 128, starting with a letter or digit)", param="lora_name") from None

    async def lora_answer(self, msg) -> web.Response:
        """The manager's answer, as `vllm serve` gives it: its success text, or an error body."""
        # The engine reads the adapter's files between two steps: as long as a slow step, at most.
        reply = await self.ask(msg, LORA_TIMEOUT_S)
        if not isinstance(reply, MP.LoraReply):
            raise HttpError(503, f"the manager gave no answer to the command: {getattr(reply, 'message', '')}",
                            "service_unavailable")
        served = self.gw.served.get(reply.model) if reply.model else None
        for link in served.links.values() if served is not None else ():
            link.loras = list(reply.loras)  # this gateway knows at once; the others from the model's events
        if not reply.ok:
            kind = {404: "NotFoundError", 409: "conflict_error", 503: "service_unavailable"}.get(reply.status,
                                                                                              "BadRequestError")
            raise HttpError(reply.status, reply.message, kind,
                            headers={"Retry-After": "1"} if reply.status == 503 else None)
        return web.Response(status=200, text=reply.message)
