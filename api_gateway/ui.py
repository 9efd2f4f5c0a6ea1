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
15 s without anything else. An idle daemon with no page open does nothing for it. Open
pages are capped (``ui_hub.stream_cap``: a quarter of the connection cap at most, so the
API keeps the rest; ``STREAMS_PER_ADDRESS`` per client address) and a page that takes no
write within ``WRITE_TIMEOUT_S`` is closed.

Who may do what: with API keys configured, the page needs one; log tails (they can hold
request text) and the load / unload / restart / freeze buttons need an admin key. A key is
given once, in a form (``POST /ui/login``), never in a URL: the answer is an HttpOnly,
SameSite=Strict session cookie, signed (``Sessions``) with a secret the manager gives every
gateway of the daemon, naming the key by its fingerprint (it stops working when the key is
removed); the gateway's port is in the cookie's name and its MAC (cookies ignore ports), and
it is ``Secure`` on TLS or behind a TLS proxy named in ``gateway.tls_proxies``. Buttons exist
in the DOM only for an admin session, and their POSTs carry a CSRF token derived from the
session; they and the stream need ``Sec-Fetch-Site: same-origin`` (or this server's
``Origin`` from a browser that sends no Sec-Fetch-Site: ``from_this_page``). Every value
reaches the DOM as text (``textContent``), the Content-Security-Policy allows no inline
script and nothing from elsewhere, and the Host and CORS rules are the API's (the gateway's
middleware).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import html
import logging
import secrets
import time
from pathlib import Path
from typing import Protocol
from urllib.parse import parse_qs

import msgspec
from aiohttp import web

from api_gateway.admin import AdminRoutes
from api_gateway.errors import HttpError
from api_gateway.http_policy import host_name, is_loopback_name
from api_gateway.http_server import connection_cap
from api_gateway.keys import Access, KeyRing, fingerprint
from api_gateway.manager_link import ManagerLink
from api_gateway.ui_hub import WRITE_TIMEOUT_S, Page, UiHub, sse, stream_cap
from servectl.config import GatewayConfig
from servectl.wire import control as MP

log = logging.getLogger("api_gateway.ui")

ASSETS = Path(__file__).resolve().parent / "ui"
STATIC = {"ui.js": "text/javascript", "ui.css": "text/css", "favicon.svg": "image/svg+xml"}
COOKIE = "servectl_session"  # and the daemon's instance: two daemons on one host keep theirs apart
SESSION_TTL_S = 12 * 3600
KEEPALIVE_S = 15.0  # a comment after this long without anything else
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "same-origin", "X-Frame-Options": "DENY", "Cache-Control": "no-store"}
VERBS = ("load", "unload", "restart", "freeze", "thaw")


class Sessions:
    """Pure: signed session tokens ``<access>.<key id>.<issued>.<nonce>.<mac>`` and their CSRF tokens.

    The MAC covers the ``scope`` too, the gateway's port: browsers send a host's cookies to
    every port on it, and a token another service there is sent opens nothing on another port."""

    def __init__(self, secret: bytes, ttl_s: float = SESSION_TTL_S):
        self.secret = secret
        self.ttl_s = ttl_s

    def _mac(self, text: str, scope: str = "") -> str:
        return hmac.new(self.secret, f"{scope}|{text}".encode(), hashlib.sha256).hexdigest()

    def issue(self, access: Access, key_id: str, now: float, scope: str = "") -> str:
        body = f"{access.value}.{key_id}.{int(now)}.{secrets.token_hex(8)}"
        return f"{body}.{self._mac(body, scope)}"

    def check(self, token: str | None, keys: KeyRing, now: float, scope: str = "") -> Access:
        """What a session opens now: its key's access if the token is ours (for this scope), fresh,
        and the key it was made with is still configured (at most what it was made with); else NONE."""
        if not token or token.count(".") != 4:
            return Access.NONE
        body, _, mac = token.rpartition(".")
        if not token.isascii() or not hmac.compare_digest(mac.encode(), self._mac(body, scope).encode()):
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

    def csrf(self, token: str, scope: str = "") -> str:
        return self._mac("csrf:" + token, scope)[:32]


class UiHost(Protocol):
    """What the status page needs of its gateway."""

    cfg: GatewayConfig
    keys: KeyRing  # the keys in force (a reload replaces them)
    admin: AdminRoutes  # the buttons are its control messages, their refusals its audit
    manager: ManagerLink  # its events and status (UiHub)


class UiRoutes:
    write_timeout_s = WRITE_TIMEOUT_S

    def __init__(self, gateway: UiHost, secret: str = "", instance: str = ""):
        self.g = gateway
        self.sessions = Sessions(bytes.fromhex(secret) if secret else secrets.token_bytes(32))
        self.cookie = f"{COOKIE}_{instance[:8]}" if instance else COOKIE
        self.hub = UiHub(gateway.manager)
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
    @staticmethod
    def port(request: web.Request) -> str:
        """The gateway's port this request came in on: the scope of its session (its cookie's name
        and MAC), whatever Host the client sent."""
        sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
        return str(sockname[1]) if isinstance(sockname, tuple) and len(sockname) >= 2 else ""

    def cookie_name(self, request: web.Request) -> str:
        return f"{self.cookie}_{self.port(request)}"

    def access(self, request: web.Request) -> tuple[Access, str]:
        """(what this browser's session opens, its token)."""
        token = request.cookies.get(self.cookie_name(request), "")
        return self.sessions.check(token, self.g.keys, time.time(), self.port(request)), token

    def may_view(self, access: Access) -> bool:
        return self.g.keys.api_open or access is not Access.NONE

    @staticmethod
    def same_origin(request: web.Request) -> bool:
        """A browser's POST comes with its page's Origin: it must be this server's."""
        origin = request.headers.get("Origin")
        return origin is None or origin.split("://", 1)[-1] == request.headers.get("Host", "")

    def from_this_page(self, request: web.Request, stream: bool = False) -> bool:
        """A button's POST or a stream from this server's own page: its browser says so with
        ``Sec-Fetch-Site: same-origin`` or, where it sends no Sec-Fetch-Site, this server's
        ``Origin`` (a POST always has one). A request with neither is refused, but for a stream
        over plain HTTP to a host name that is not loopback: browsers send Sec-Fetch-Site only to
        trustworthy origins (TLS, localhost) and no Origin on a same-origin GET, so the page's own
        stream has neither there (its SameSite=Strict cookie still comes only from this site)."""
        site = request.headers.get("Sec-Fetch-Site")
        if site is not None:
            return site == "same-origin"
        origin = request.headers.get("Origin")
        if origin is not None:
            return origin.split("://", 1)[-1] == request.headers.get("Host", "")
        return stream and not self.secure(request) and not is_loopback_name(host_name(request.headers.get("Host", "")))

    def secure(self, request: web.Request) -> bool:
        """The cookie is ``Secure`` on TLS, and behind a TLS proxy the operator named
        (``gateway.tls_proxies``) when it says it took the request on https."""
        if request.secure:
            return True
        proxies = self.g.cfg.tls_proxies
        return bool(proxies) and request.remote in proxies and \
            request.headers.get("X-Forwarded-Proto", "").lower() == "https"

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
        try:
            form = parse_qs((await request.read()).decode("utf-8", "replace"), max_num_fields=4)
        except ValueError:
            raise HttpError(400, "send the form's one field, key") from None
        key = (form.get("key") or [""])[0].strip().encode()
        access = self.g.keys.access(key)
        if access is Access.NONE:  # audited without a fingerprint: what was typed may be any secret
            self.g.admin.refused(request, None, 401, "status page sign-in: not a configured key")
            return self.login_page(True, status=401)
        resp = web.Response(status=303, headers={**SECURITY_HEADERS, "Location": "/ui"})
        token = self.sessions.issue(access, fingerprint(key), time.time(), self.port(request))
        resp.set_cookie(self.cookie_name(request), token, max_age=SESSION_TTL_S, path="/ui", httponly=True,
                        samesite="Strict", secure=self.secure(request))
        return resp

    async def logout(self, request: web.Request) -> web.Response:
        if not self.same_origin(request):
            raise HttpError(403, "a logout from another origin", "permission_error")
        resp = web.Response(status=303, headers={**SECURITY_HEADERS, "Location": "/ui"})
        resp.del_cookie(self.cookie_name(request), path="/ui")
        return resp

    async def stream(self, request: web.Request) -> web.StreamResponse:
        if not self.from_this_page(request, stream=True):
            raise HttpError(403, "the status page's stream is for its own page (Sec-Fetch-Site or Origin)",
                            "permission_error")
        access, token = self.access(request)
        if not self.may_view(access):
            raise HttpError(401, "sign in on /ui first (an API key)", "authentication_error")
        admin = access is Access.ADMIN
        wanted = request.query.get("log") or None
        if wanted is not None and not admin:
            raise HttpError(403, "log tails need an admin key (they can hold request text)", "permission_error")
        remote = request.remote or ""
        refusal = self.hub.refusal(remote, stream_cap(connection_cap(self.g.cfg.max_connections)))
        if refusal is not None:
            raise HttpError(503, refusal, "service_unavailable", code="too_many_streams", headers={"Retry-After": "5"})
        resp = web.StreamResponse(headers={**SECURITY_HEADERS, "Content-Type": "text/event-stream",
                                           "X-Accel-Buffering": "no"})
        issued = token.split(".")[2] if token.count(".") == 4 else ""
        expires = int(issued) + self.sessions.ttl_s if issued.isdigit() else float("inf")
        page = Page(admin, wanted, token, expires, remote)
        page.scope = self.port(request)
        # Joined before the first await, so streams that arrive together are counted against the cap
        # together (the check above and the join are one step of the event loop).
        self.hub.join(page, sse("hello", {
            "admin": admin, "signed_in": access is not Access.NONE,
            "csrf": self.sessions.csrf(token, self.port(request)) if admin else None,
            "admin_keys": self.g.keys.admin_enabled, "log": wanted}))
        try:
            await resp.prepare(request)
            while not page.closed:
                try:
                    # event-proof: a write's bound: a page that reads nothing is closed, not waited on.
                    await asyncio.wait_for(resp.write(page.take() or b": keep-alive\n\n"), self.write_timeout_s)
                except asyncio.TimeoutError:
                    log.info("status page from %s read nothing for %gs: closed", remote, self.write_timeout_s)
                    if request.transport is not None:
                        request.transport.abort()  # its unsent bytes dropped, its slot freed
                    break
                try:
                    # event-proof: a page is open; the keep-alive's bound (and its session's end).
                    await asyncio.wait_for(page.wake.wait(), min(KEEPALIVE_S, max(0.0, expires - time.time())))
                except asyncio.TimeoutError:
                    if time.time() >= expires:
                        break  # its session ended: the browser reconnects and signs in again
        except (ConnectionResetError, ConnectionError):
            pass
        finally:
            self.hub.leave(page)
        return resp

    def keys_changed(self) -> None:
        """A reload changed the keys: a page whose session opens less now is closed (it reconnects
        with what its session still opens, or signs in again)."""
        if not self.g.keys.api_open or self.g.keys.admin_enabled:
            now = time.time()
            for page in list(self.hub.pages):
                access = self.sessions.check(page.token, self.g.keys, now, page.scope) if page.token else Access.NONE
                if (page.admin and access is not Access.ADMIN) or not self.may_view(access):
                    page.close()

    async def action(self, request: web.Request) -> web.Response:
        access, token = self.access(request)
        if access is not Access.ADMIN:
            raise HttpError(403, "the buttons need an admin key", "permission_error")
        if not self.from_this_page(request) or not hmac.compare_digest(
                request.headers.get("X-CSRF-Token", "").encode("utf-8", "surrogateescape"),
                self.sessions.csrf(token, self.port(request)).encode()):
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
        # The page follows the change in the model's events: the button is answered once it is under
        # way (202, done: false), not when it is done.
        message = {"load": lambda: MP.LoadConfigured(name=name, http=who, wait_s=0),
                   "unload": lambda: MP.UnloadModel(name=name, http=who, wait_s=0),
                   "restart": lambda: MP.RestartRequest(model=name, http=who, wait_s=0),
                   "freeze": lambda: MP.SetFreezing(model=name, enabled=True, http=who),
                   "thaw": lambda: MP.SetFreezing(model=name, enabled=False, http=who)}[verb]()
        return self.g.admin.answer(name, verb, await self.g.admin.ask(message))
