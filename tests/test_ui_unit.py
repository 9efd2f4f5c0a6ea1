"""The status page's pure parts and its routes on a real gateway (no manager, no vLLM):
sessions, CSRF, who may see what, headers, assets."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest

from api_gateway.keys import Access, KeyRing, fingerprint
from api_gateway.ui import ASSETS, COOKIE, CSP, STATIC, Sessions
from gateway_harness import run

pytestmark = pytest.mark.unit

API, ADMIN = "api-key-0123456789abcdef", "admin-key-0123456789abcdef"


def test_a_session_opens_what_its_key_opens_while_the_key_is_configured():
    keys = KeyRing([API], [ADMIN])
    s = Sessions(b"k" * 32, ttl_s=100)
    admin = s.issue(Access.ADMIN, fingerprint(ADMIN), 1000)
    api = s.issue(Access.API, fingerprint(API), 1000)
    assert s.check(admin, keys, 1050) is Access.ADMIN
    assert s.check(api, keys, 1050) is Access.API
    assert s.check(admin, keys, 1101) is Access.NONE  # expired
    assert s.check(admin, keys, 999) is Access.NONE  # from the future
    assert s.check(admin, KeyRing([API], []), 1050) is Access.NONE  # its key was removed
    assert s.check(admin, KeyRing([API, ADMIN], []), 1050) is Access.API  # demoted: an API key now
    assert s.check(api, KeyRing([], [API]), 1050) is Access.API  # promoted keys do not promote sessions
    assert s.check(admin, keys, 1050) is not Access.NONE
    forged = admin.replace(".admin.", ".admin.", 1)[:-1] + ("0" if admin[-1] != "0" else "1")
    assert s.check(forged, keys, 1050) is Access.NONE
    assert s.check(api.replace("api.", "admin.", 1), keys, 1050) is Access.NONE  # the MAC covers the level
    assert Sessions(b"j" * 32).check(admin, keys, 1050) is Access.NONE  # another daemon's secret
    for junk in ("", "a.b", "x" * 300, "admin.x.y.z.w"):
        assert s.check(junk, keys, 1050) is Access.NONE
    assert s.csrf(admin) == s.csrf(admin) != s.csrf(api)


async def fetch(h, method: str, path: str, cookie: str | None = None, **kw):
    """As the page's own script: its browser says Sec-Fetch-Site: same-origin (issue 53)."""
    headers = {"Sec-Fetch-Site": "same-origin", **kw.pop("headers", {})}
    if cookie:
        headers["Cookie"] = f"{h.gw.ui.cookie}_{h.port}={cookie}"
    async with aiohttp.ClientSession() as session:
        async with session.request(method, h.url + path, headers=headers, allow_redirects=False, **kw) as r:
            return r.status, dict(r.headers), await r.text(), r.cookies


def test_the_page_needs_a_key_when_the_api_does_and_login_sets_a_strict_cookie():
    async def scenario(h):
        status, headers, text, _ = await fetch(h, "GET", "/ui")
        assert status == 200 and "<form" in text and "sign in" in text
        assert headers["Content-Security-Policy"] == CSP and "'unsafe-inline'" not in CSP
        assert (await fetch(h, "GET", "/ui/stream"))[0] == 401
        status, _, text, _ = await fetch(h, "POST", "/ui/login", data={"key": "nope"})
        assert status == 401 and "not one this server accepts" in text
        status, headers, _, cookies = await fetch(h, "POST", "/ui/login", data={"key": API})
        assert status == 303 and headers["Location"] == "/ui"
        morsel = cookies[f"{h.gw.ui.cookie}_{h.port}"]
        assert h.gw.ui.cookie.startswith(COOKIE + "_")  # the daemon's own: two on one host keep theirs
        assert morsel["httponly"] and morsel["samesite"] == "Strict" and morsel["path"] == "/ui"
        status, _, text, _ = await fetch(h, "GET", "/ui", cookie=morsel.value)
        assert status == 200 and 'src="/ui/static/ui.js"' in text
        # A login posted by another site's page is refused (the form's Origin is checked).
        status, *_ = await fetch(h, "POST", "/ui/login", data={"key": API},
                                 headers={"Origin": "http://evil.example"})
        assert status == 403
    run(scenario, api_keys=[API], admin_keys=[ADMIN])


def test_buttons_and_logs_need_an_admin_session_and_its_csrf_token():
    async def scenario(h):
        sessions, port = h.gw.ui.sessions, str(h.port)
        api = sessions.issue(Access.API, fingerprint(API), time.time(), port)
        admin = sessions.issue(Access.ADMIN, fingerprint(ADMIN), time.time(), port)
        body = {"verb": "restart", "model": "m"}
        assert (await fetch(h, "POST", "/ui/action", api, json=body,
                            headers={"X-CSRF-Token": sessions.csrf(api, port)}))[0] == 403
        assert (await fetch(h, "POST", "/ui/action", admin, json=body))[0] == 403  # no token
        assert (await fetch(h, "POST", "/ui/action", admin, json=body,
                            headers={"X-CSRF-Token": sessions.csrf(api, port)}))[0] == 403  # another session's
        assert (await fetch(h, "POST", "/ui/action", admin, json={"verb": "rm", "model": "m"},
                            headers={"X-CSRF-Token": sessions.csrf(admin, port)}))[0] == 400
        assert (await fetch(h, "GET", "/ui/stream?log=gateway:0", api))[0] == 403
    run(scenario, api_keys=[API], admin_keys=[ADMIN])


def test_an_open_api_shows_the_page_and_only_listed_assets_are_served():
    async def scenario(h):
        status, _, text, _ = await fetch(h, "GET", "/ui")
        assert status == 200 and 'src="/ui/static/ui.js"' in text  # no API keys: open, as the API
        for name, kind in STATIC.items():
            status, headers, _, _ = await fetch(h, "GET", f"/ui/static/{name}")
            assert status == 200 and headers["Content-Type"].startswith(kind), name
        for name in ("index.html", "..%2fapp.py", "login.html", "nope.js"):
            assert (await fetch(h, "GET", f"/ui/static/{name}"))[0] == 404, name
    run(scenario)


def test_the_apis_host_rule_holds_for_the_page():
    async def scenario(h):
        assert (await fetch(h, "GET", "/ui", headers={"Host": "evil.example"}))[0] == 421  # DNS rebinding
        assert (await fetch(h, "GET", "/ui/stream", headers={"Host": "evil.example"}))[0] == 421
        assert (await fetch(h, "GET", "/ui", headers={"Host": "localhost"}))[0] == 200
    run(scenario, host="127.0.0.1")


def test_the_script_writes_text_only():
    """Every value from the server reaches the DOM as text: the script never parses HTML."""
    script = (ASSETS / "ui.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in script, sink
    page = (ASSETS / "index.html").read_text()
    assert "<script>" not in page and not re.search(r"\son[a-z]+\s*=", page)  # no inline code


def test_rates_and_engine_figures():
    from api_gateway.ui_hub import Rates, engine_figures

    r = Rates()
    assert r.rate("m", 100.0, 10.0) is None  # a first sample has no rate
    assert r.rate("m", 160.0, 12.0) == 30.0
    assert r.rate("m", 150.0, 13.0) == 0.0  # a counter reset (a restarted engine): not negative
    r.keep_only(set())
    assert r.rate("m", 10.0, 14.0) is None
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()  # as an engine renders vLLM's metrics (engine_core/metrics.py)
    Gauge("vllm:num_requests_running", "x", ["engine", "model_name"], registry=registry).labels("0", "m").set(3)
    tokens = Counter("vllm:generation_tokens", "x", ["engine", "model_name"], registry=registry)
    tokens.labels("0", "m").inc(120)
    tokens.labels("0", "sql-adapter").inc(5)  # an adapter's requests: its model's
    text = generate_latest(registry).decode()
    assert engine_figures(text) == {"running": 3.0, "waiting": 0.0, "tokens": 125.0}
    assert engine_figures("not { prometheus") == {"running": 0.0, "waiting": 0.0, "tokens": 0.0}


def test_a_page_gets_the_newest_snapshot_and_every_event():
    from api_gateway.ui_hub import Page, sse

    page = Page(False, None, "", float("inf"))
    page.push(sse("event", {"n": 1}))
    page.push_snapshot(b"S1")
    page.push_snapshot(b"S2")  # a slow page skips to the newest
    page.push(sse("event", {"n": 2}))
    data = page.take()
    assert data.count(b"event: event") == 2 and data.endswith(b"S2") and b"S1" not in data
    assert page.take() == b"" and not page.wake.is_set()
    page.close()
    assert page.closed and page.wake.is_set()


def test_the_sampler_runs_only_while_a_page_is_open_and_keys_close_pages(monkeypatch):
    from api_gateway import ui_hub
    from api_gateway.ui_hub import Page

    monkeypatch.setattr(ui_hub, "SAMPLE_S", 0.05)  # a sampler left running would sample within 0.3 s

    async def scenario(h):
        hub = h.gw.ui.hub
        samples = []

        async def sample_once():
            samples.append(1)
        hub.sample_once = sample_once
        sessions = h.gw.ui.sessions
        admin_token = sessions.issue(Access.ADMIN, fingerprint(ADMIN), time.time())
        page = Page(True, None, admin_token, float("inf"))
        hub.join(page, b"hello")
        await asyncio.sleep(0.05)
        assert samples and hub.sampler is not None and not hub.sampler.done()
        assert page.take().startswith(b"hello")
        h.gw.set_api_keys(__import__("servectl.wire.control", fromlist=["ApiKeys"]).ApiKeys(
            keys=[API], admin_keys=[]))  # its admin key removed by a reload
        assert page.closed
        sampler = hub.sampler
        hub.leave(page)
        await asyncio.sleep(0.05)
        assert hub.sampler is None and sampler.done()
        count = len(samples)
        await asyncio.sleep(0.3)  # six sampling periods
        assert len(samples) == count  # nothing samples for no page
    run(scenario, api_keys=[API], admin_keys=[ADMIN])


def test_the_log_sink_says_what_is_new(tmp_path):
    from manager.logs import LogSink

    sink = LogSink("c", tmp_path / "c.log")
    sink.write(b"one\ntwo\n")
    assert sink.since(0) == ["one", "two"] and sink.since(1) == ["two"] and sink.since(2) == []
    for i in range(300):
        sink.write(f"{i}\n".encode())
    assert sink.written == 302 and len(sink.since(0)) == 200 and sink.since(300) == ["298", "299"]
