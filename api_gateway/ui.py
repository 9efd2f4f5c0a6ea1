"""The status page, ``/ui``: models, processes, memory, live events and logs in a browser.

One static page (``api_gateway/ui/``: HTML, one script, one style sheet; no CDN, no
build step) that opens one server-sent-events stream, ``/ui/stream``, and renders what
comes: a ``hello`` (what this browser may do, its CSRF token), ``snapshot``s (models,
processes: the manager's status, RSS and CPU from /proc, requests and tokens per second),
``event``s as the manager publishes them, and ``log`` lines of the component chosen
(``?log=<component>``). Nothing polls: states and events are pushed as they happen; the
figures that have no event (RSS, CPU, tokens per second, requests running) are sampled at
most once a second, and only while a page is connected (``UiHub.sample``); uptimes and
countdowns are the browser's arithmetic on timestamps; a keep-alive comment goes after
15 s without anything else. An idle daemon with no page open does nothing for it.

Who may do what: with API keys configured, the page needs one; log tails (they can hold
request text) and the load / unload / restart / freeze buttons need an admin key. A key is
given once, in a form (``POST /ui/login``), never in a URL: the answer is an HttpOnly,
SameSite=Strict session cookie, signed (``Sessions``) with a secret the manager gives every
gateway of the daemon, naming the key by its fingerprint (it stops working when the key is
removed). Buttons exist in the DOM only for an admin session, and their POSTs carry a CSRF
token derived from the session. Every value reaches the DOM as text (``textContent``), the
Content-Security-Policy allows no inline script and nothing from elsewhere, and the Host and
CORS rules are the API's (the gateway's middleware).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import html
import json
import logging
import os
import secrets
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

import msgspec
from aiohttp import web

from api_gateway.errors import HttpError
from api_gateway.keys import Access, KeyRing, fingerprint
from servectl.wire import control as MP
from servectl.wire.spawn import model_of

if TYPE_CHECKING:
    from api_gateway.app import Gateway

log = logging.getLogger("api_gateway.ui")

ASSETS = Path(__file__).resolve().parent / "ui"
STATIC = {"ui.js": "text/javascript", "ui.css": "text/css", "favicon.svg": "image/svg+xml"}
COOKIE = "servectl_session"
SESSION_TTL_S = 12 * 3600
SAMPLE_S = 1.0  # the figures without events (RSS, CPU, tokens per second): at most this often
KEEPALIVE_S = 15.0  # a comment after this long without anything else
EVENTS_KEPT = 200  # the recent events a page gets when it opens
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "same-origin", "X-Frame-Options": "DENY", "Cache-Control": "no-store"}
VERBS = ("load", "unload", "restart", "freeze", "thaw")


class Sessions:
    """Pure: signed session tokens ``<access>.<key id>.<issued>.<nonce>.<mac>`` and their CSRF tokens."""

    def __init__(self, secret: bytes, ttl_s: float = SESSION_TTL_S):
        self.secret = secret
        self.ttl_s = ttl_s

    def _mac(self, text: str) -> str:
        return hmac.new(self.secret, text.encode(), hashlib.sha256).hexdigest()

    def issue(self, access: Access, key_id: str, now: float) -> str:
        body = f"{access.value}.{key_id}.{int(now)}.{secrets.token_hex(8)}"
        return f"{body}.{self._mac(body)}"

    def check(self, token: str | None, keys: KeyRing, now: float) -> Access:
        """What a session opens now: its key's access if the token is ours, fresh, and the key it
        was made with is still configured (at most what it was made with); else NONE."""
        if not token or token.count(".") != 4:
            return Access.NONE
        body, _, mac = token.rpartition(".")
        if not hmac.compare_digest(mac, self._mac(body)):
            return Access.NONE
        level, key_id, issued, _ = body.split(".")
        try:
            age = now - int(issued)
            made = Access(level)
        except ValueError:
            return Access.NONE
        if not 0 <= age <= self.ttl_s:
            return Access.NONE
        now_access = keys.access_of(key_id)
        if now_access is Access.NONE:
            return Access.NONE
        return Access.ADMIN if made is Access.ADMIN and now_access is Access.ADMIN else Access.API

    def csrf(self, token: str) -> str:
        return self._mac("csrf:" + token)[:32]


class Page:
    """One open page: its stream, what it may see, the log it follows."""

    def __init__(self, resp: web.StreamResponse, admin: bool, log_component: str | None):
        self.resp = resp
        self.admin = admin
        self.log_component = log_component
        self.log_after = 0
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=256)

    def push(self, data: bytes) -> None:
        try:
            self.queue.put_nowait(data)
        except asyncio.QueueFull:
            pass  # a page that reads nothing: it gets the next snapshot when it catches up


def sse(kind: str, data) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def proc_figures(pid: int | None) -> tuple[int | None, int | None]:
    """(RSS bytes, CPU ticks so far) of a process, or (None, None)."""
    if not pid:
        return None, None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/statm") as f:
            rss_pages = int(f.read().split()[1])
        return rss_pages * os.sysconf("SC_PAGE_SIZE"), int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None, None


class UiHub:
    """The pages open on this gateway and what they are sent."""

    def __init__(self, gateway: Gateway):
        self.g = gateway
        self.pages: set[Page] = set()
        self.events: deque[dict] = deque(maxlen=EVENTS_KEPT)
        self.poke = asyncio.Event()  # an event came: sample now
        self.sampler: asyncio.Task | None = None
        self.last_snapshot: dict | None = None
        self.ticks: dict[int, tuple[int, float]] = {}  # pid -> (CPU ticks, when) at the last sample
        self.tokens: dict[str, tuple[float, float]] = {}  # model -> (tokens generated, when)
        self.hz = os.sysconf("SC_CLK_TCK")

    def on_event(self, ev: MP.Event) -> None:
        entry = {"time": ev.time, "component": ev.component, "kind": str(ev.kind.value), "model": ev.model,
                 "state": str(getattr(ev.state, "value", ev.state)), "pid": ev.pid, "detail": ev.detail,
                 "restarts": ev.restarts}
        self.events.append(entry)
        for page in self.pages:
            page.push(sse("event", entry))
        self.poke.set()

    def join(self, page: Page) -> None:
        self.pages.add(page)
        if self.sampler is None or self.sampler.done():
            self.sampler = asyncio.get_running_loop().create_task(self.sample(), name="ui sampler")
        else:
            self.poke.set()

    def leave(self, page: Page) -> None:
        self.pages.discard(page)
        if not self.pages and self.sampler is not None:
            self.sampler.cancel()  # no page: nothing is sampled
            self.sampler = None
            self.last_snapshot = None

    async def sample(self) -> None:
        while self.pages:
            self.poke.clear()
            try:
                snap = await self.snapshot()
                if snap != self.last_snapshot:
                    self.last_snapshot = snap
                    data = sse("snapshot", snap)
                    for page in self.pages:
                        page.push(data)
                for page in list(self.pages):
                    if page.log_component:
                        await self.follow_log(page)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the page shows the next sample; the gateway serves on
                log.exception("status page sample failed")
            try:
                # event-proof: runs only while a page is connected (leave() cancels it); an event pokes it.
                await asyncio.wait_for(self.poke.wait(), SAMPLE_S)
            except asyncio.TimeoutError:
                pass

    async def follow_log(self, page: Page) -> None:
        reply = await self.g.manager.ask(MP.LogTail(component=page.log_component, after=page.log_after), 5.0)
        if not isinstance(reply, MP.LogLines):
            return
        if not reply.known:
            page.push(sse("log", {"component": page.log_component, "lines": [], "unknown": True}))
            page.log_component = None
            return
        if reply.lines or page.log_after == 0:
            page.push(sse("log", {"component": page.log_component, "lines": reply.lines}))
        page.log_after = reply.written

    async def snapshot(self) -> dict:
        st = await self.g.manager.ask(MP.StatusRequest(), 5.0)
        if not isinstance(st, MP.StatusReply):
            raise RuntimeError("the manager gave no status")
        now_wall, now = time.time(), time.monotonic()
        links = self.g.links
        stats = await asyncio.gather(*(link.stats(0.5) for link in links.values()))
        running: dict[str, int] = {}
        for group, s in zip(links, stats):
            if s is not None:
                running[model_of(group)] = running.get(model_of(group), 0) + s.unfinished
        generated = self.g.metrics.generated_tokens()
        models: dict[str, dict] = {}
        for m in st.models:
            name = model_of(m.name)
            served = self.g.served.get(name)
            entry = models.setdefault(name, {
                "name": name, "state": str(served.status if served is not None else m.state.value),
                "reason": served.reason if served is not None else m.reason, "groups": [],
                "running": running.get(name, 0), "waiting": served.queued() if served is not None else 0,
                "tokens_per_s": self.rate(name, generated.get(name, 0.0), now)})
            entry["groups"].append({
                "name": m.name, "state": m.state.value, "devices": m.devices, "memory_bytes": m.memory_bytes,
                "device_memory_bytes": m.device_memory_bytes, "idle_since": m.idle_since,
                "release_after_s": m.release_after_s, "released_since": m.released_since, "restarts": m.restarts,
                "frozen": m.frozen, "reason": m.reason})
        processes = []
        seen = set()
        for c in st.children:
            rss, ticks = proc_figures(c.pid)
            cpu = None
            if c.pid and ticks is not None:
                seen.add(c.pid)
                before = self.ticks.get(c.pid)
                if before is not None and now > before[1]:
                    cpu = round(100 * (ticks - before[0]) / self.hz / (now - before[1]), 1)
                self.ticks[c.pid] = (ticks, now)
            processes.append({"component": c.component, "kind": c.kind.value, "model": c.model, "pid": c.pid,
                              "state": c.state.value, "started_at": c.started_at, "restarts": c.restarts,
                              "last_exit": c.last_exit, "rss_bytes": rss, "cpu_percent": cpu})
        self.ticks = {pid: v for pid, v in self.ticks.items() if pid in seen}
        return {"now": now_wall, "manager": {"pid": st.manager_pid, "started_at": st.started_at,
                                             "state": st.state.value, "instance": st.instance},
                "models": sorted(models.values(), key=lambda m: m["name"]), "unloaded": st.unloaded,
                "processes": processes}

    def rate(self, model: str, total: float, now: float) -> float | None:
        before = self.tokens.get(model)
        self.tokens[model] = (total, now)
        if before is None or now <= before[1]:
            return None
        return round(max(0.0, total - before[0]) / (now - before[1]), 1)


class UiRoutes:
    def __init__(self, gateway: Gateway, secret: str = ""):
        self.g = gateway
        self.sessions = Sessions(bytes.fromhex(secret) if secret else secrets.token_bytes(32))
        self.hub = UiHub(gateway)
        gateway.manager.on_event = self.hub.on_event

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/ui", self.page)
        app.router.add_get("/ui/", self.page)
        app.router.add_get("/ui/static/{name}", self.static)
        app.router.add_post("/ui/login", self.login)
        app.router.add_post("/ui/logout", self.logout)
        app.router.add_get("/ui/stream", self.stream)
        app.router.add_post("/ui/action", self.action)

    # ---- who is asking --------------------------------------------------------------------
    def access(self, request: web.Request) -> tuple[Access, str]:
        """(what this browser's session opens, its token)."""
        token = request.cookies.get(COOKIE, "")
        return self.sessions.check(token, self.g.keys, time.time()), token

    def may_view(self, access: Access) -> bool:
        return self.g.keys.api_open or access is not Access.NONE

    @staticmethod
    def same_origin(request: web.Request) -> bool:
        """A browser's POST comes with its page's Origin: it must be this server's."""
        origin = request.headers.get("Origin")
        return origin is None or origin.split("://", 1)[-1] == request.headers.get("Host", "")

    # ---- routes -----------------------------------------------------------------------------
    async def page(self, request: web.Request) -> web.Response:
        access, _ = self.access(request)
        if not self.may_view(access):
            return self.login_page(request.query.get("failed") is not None)
        return web.Response(body=(ASSETS / "index.html").read_bytes(), content_type="text/html",
                            charset="utf-8", headers=SECURITY_HEADERS)

    def login_page(self, failed: bool, status: int = 200) -> web.Response:
        text = (ASSETS / "login.html").read_text()
        note = "That key is not one this server accepts." if failed else ""
        return web.Response(text=text.replace("{{note}}", html.escape(note)), content_type="text/html",
                            status=status, headers=SECURITY_HEADERS)

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        return web.Response(body=(ASSETS / name).read_bytes(), content_type=STATIC[name],
                            headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})

    async def login(self, request: web.Request) -> web.Response:
        if not self.same_origin(request):
            raise HttpError(403, "a login form from another origin", "permission_error")
        form = parse_qs((await request.read()).decode("utf-8", "replace"), max_num_fields=4)
        key = (form.get("key") or [""])[0].strip().encode()
        access = self.g.keys.access(key)
        if access is Access.NONE:
            self.g.admin.refused(request, fingerprint(key) if key else None, 401, "status page login: not a "
                                 "configured key")
            return self.login_page(True, status=401)
        resp = web.Response(status=303, headers={**SECURITY_HEADERS, "Location": "/ui"})
        resp.set_cookie(COOKIE, self.sessions.issue(access, fingerprint(key), time.time()), max_age=SESSION_TTL_S,
                        path="/ui", httponly=True, samesite="Strict", secure=request.secure)
        return resp

    async def logout(self, request: web.Request) -> web.Response:
        if not self.same_origin(request):
            raise HttpError(403, "a logout from another origin", "permission_error")
        resp = web.Response(status=303, headers={**SECURITY_HEADERS, "Location": "/ui"})
        resp.del_cookie(COOKIE, path="/ui")
        return resp

    async def stream(self, request: web.Request) -> web.StreamResponse:
        access, token = self.access(request)
        if not self.may_view(access):
            raise HttpError(401, "sign in on /ui first (an API key)", "authentication_error")
        admin = access is Access.ADMIN
        wanted = request.query.get("log") or None
        if wanted is not None and not admin:
            raise HttpError(403, "log tails need an admin key (they can hold request text)", "permission_error")
        resp = web.StreamResponse(headers={**SECURITY_HEADERS, "Content-Type": "text/event-stream",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        page = Page(resp, admin, wanted)
        hello = {"admin": admin, "signed_in": access is not Access.NONE, "csrf": self.sessions.csrf(token) if admin
                 else None, "admin_keys": self.g.keys.admin_enabled, "log": wanted, "verbs": list(VERBS) if admin
                 else []}
        await resp.write(sse("hello", hello) + b"".join(sse("event", e) for e in self.hub.events))
        self.hub.join(page)
        try:
            while True:
                try:
                    # event-proof: a page is connected; the keep-alive's bound, as the API's streams have.
                    data = await asyncio.wait_for(page.queue.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    data = b": keep-alive\n\n"
                await resp.write(data)
        except (ConnectionResetError, ConnectionError):
            pass
        finally:
            self.hub.leave(page)
        return resp

    async def action(self, request: web.Request) -> web.Response:
        access, token = self.access(request)
        if access is not Access.ADMIN:
            raise HttpError(403, "the buttons need an admin key", "permission_error")
        if not self.same_origin(request) or not hmac.compare_digest(
                request.headers.get("X-CSRF-Token", ""), self.sessions.csrf(token)):
            raise HttpError(403, "missing or wrong CSRF token (reload the page)", "permission_error")
        try:
            body = msgspec.json.decode(await request.read(), type=dict[str, str])
            verb, name = body["verb"], body["model"]
        except (msgspec.DecodeError, msgspec.ValidationError, KeyError):
            raise HttpError(400, 'send {"verb": "...", "model": "..."}') from None
        if verb not in VERBS:
            raise HttpError(400, f"verb must be one of {', '.join(VERBS)}", param="verb")
        key_id = token.split(".")[1]
        who = self.g.admin.caller(request, key_id)
        await self.g.admin.known(name)
        message = {"load": lambda: MP.LoadConfigured(name=name, http=who),
                   "unload": lambda: MP.UnloadModel(name=name, http=who),
                   "restart": lambda: MP.RestartRequest(model=name, http=who),
                   "freeze": lambda: MP.SetFreezing(model=name, enabled=True, http=who),
                   "thaw": lambda: MP.SetFreezing(model=name, enabled=False, http=who)}[verb]()
        return self.g.admin.answer(name, verb, await self.g.admin.ask(message))
