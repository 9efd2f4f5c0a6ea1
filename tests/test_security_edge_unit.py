"""Issue 53, items 3 and 6-9, the pure parts: media found in every body (and its inline bytes bounded); the status page's
streams capped; control-ro refusals rate-limited in the audit log; LoRA adapter roots; the
page's cookie named and signed with its port, its actions and streams same-origin only.
No daemon; no vLLM or torch.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

import aiohttp
import pytest

from api_gateway.errors import HttpError
from api_gateway.media import check_media, media_parts
from api_gateway.ui_hub import STREAMS_MAX, STREAMS_PER_ADDRESS, stream_cap
from gateway_harness import run

pytestmark = pytest.mark.unit

URL = "http://127.0.0.1:9/x"


# -- item 3: every content part of every route, typed or not --------------------------------

@pytest.mark.parametrize("body", [
    # untyped parts, which vLLM takes by their keys
    {"messages": [{"role": "user", "content": [{"image_url": URL}]}]},
    {"messages": [{"role": "user", "content": [{"audio_url": {"url": URL}}]}]},
    {"input": [{"role": "user", "content": [{"video_url": URL}]}]},
    # a text part with a uuid: vLLM then reads it by its keys
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "uuid": "u", "image_url": URL}]}]},
    # Cohere's /v2/embed and the score routes' content lists
    {"inputs": [{"content": [{"type": "image_url", "image_url": {"url": URL}}]}]},
    {"inputs": [{"content": [{"image_url": URL}]}]},
    {"queries": "q", "documents": {"content": [{"type": "image_url", "image_url": {"url": URL}}]}},
    {"query": "q", "documents": [{"content": [{"image_url": URL}]}]},
    {"data_1": "a", "data_2": {"content": [{"image_url": URL}]}},
    # the Responses API, Anthropic's Messages (a tool result's image), a system prompt
    {"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": URL}]}]},
    {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file",
                                                                             "file_url": URL}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "url", "url": URL}}]}]}]},
    {"system": [{"type": "document", "source": {"type": "url", "url": URL}}]},
    {"instructions": [{"type": "message", "role": "system", "content": [{"image_url": URL}]}]},
])
def test_media_in_any_field_typed_or_not_is_found_and_its_inline_bytes_bounded(body):
    assert len(media_parts({"model": "m", **body})) == 1
    assert check_media({"model": "m", **body}, 1 << 20) == 1
    with pytest.raises(HttpError) as info:  # a URL's few characters count: a limit below them refuses
        check_media({"model": "m", **body}, 4)
    assert info.value.status == 413 and "max_media_bytes" in info.value.message


def test_inline_media_counts_its_decoded_bytes_across_parts():
    b64 = "A" * 4000  # 3000 bytes decoded
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}},
        {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}]}]}
    assert check_media(body, 6100) == 2
    with pytest.raises(HttpError) as info:
        check_media(body, 5900)
    assert info.value.status == 413 and "2 part(s)" in info.value.message


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "image_url"}]}]},
    {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
    # a tool whose parameter is named image_url, a schema, a tool call's arguments: not content
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"image_url": {"type": "string"}}}}}]},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "properties": {"file": {"type": "string"}}}}}},
    {"text": {"format": {"type": "json_schema", "schema": {"properties": {"image_url": {}}}}}},
    {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                     "input": {"image_url": "a string argument"}}]}]},
    {"inputs": [{"content": [{"type": "text", "text": "hello"}]}], "texts": ["a"]},
])
def test_text_and_non_content_fields_are_not_media(body):
    assert media_parts({"model": "m", **body}) == []
    assert check_media({"model": "m", **body}, 1) == 0


# -- item 6: status page streams capped per gateway and per address, writes bounded ----------

async def open_stream(h, local: str = "127.0.0.1"):
    """A /ui/stream on a raw connection from ``local`` that reads nothing: (status line, writer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", h.port, local_addr=(local, 0))
    writer.write(b"GET /ui/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nSec-Fetch-Site: same-origin\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    return head.split(b"\r\n", 1)[0], writer


def quiet_sampler(h):
    async def sample_once():  # no manager in the harness
        return None
    h.gw.ui.hub.sample_once = sample_once


def test_streams_are_capped_per_gateway_and_the_api_keeps_its_connections():
    async def scenario(h):
        quiet_sampler(h)
        assert stream_cap(12) == 3 and stream_cap(3) == 1 and stream_cap(10_000) == STREAMS_MAX
        streams = [await open_stream(h, f"127.0.0.{i + 1}") for i in range(3)]
        assert all(b" 200 " in line for line, _ in streams)
        line, writer = await open_stream(h, "127.0.0.9")
        assert b" 503 " in line  # a fourth: refused, not held
        writer.close()
        async with aiohttp.ClientSession() as s:  # the API is served beside them
            for _ in range(3):
                async with s.get(h.url + "/version") as r:
                    assert r.status == 200
        for _, w in streams:
            w.close()
    run(scenario, max_connections=12)


def test_streams_are_capped_per_address():
    async def scenario(h):
        quiet_sampler(h)
        streams = [await open_stream(h) for _ in range(STREAMS_PER_ADDRESS)]
        assert all(b" 200 " in line for line, _ in streams)
        line, writer = await open_stream(h)
        assert b" 503 " in line
        writer.close()
        other, w2 = await open_stream(h, "127.0.0.2")  # another address still may
        assert b" 200 " in other
        for _, w in [*streams, (other, w2)]:
            w.close()
    run(scenario, max_connections=400)


def test_a_stream_that_reads_nothing_is_closed_when_a_write_stalls():
    async def scenario(h):
        quiet_sampler(h)
        h.gw.ui.write_timeout_s = 0.3
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", h.port))
        sock.sendall(b"GET /ui/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nSec-Fetch-Site: same-origin\r\n\r\n")
        hub = h.gw.ui.hub
        for _ in range(100):  # the page opens
            if hub.pages:
                break
            await asyncio.sleep(0.02)
        assert len(hub.pages) == 1
        page = next(iter(hub.pages))
        page.push(b": " + b"x" * (64 << 20) + b"\n\n")  # far more than any buffer: the write stalls
        for _ in range(100):
            if not hub.pages:
                break
            await asyncio.sleep(0.1)
        assert not hub.pages  # the page was dropped, its slot free
        sock.close()
    run(scenario)


# -- item 8: LoRA adapters over HTTP from configured roots only, errors that say nothing -------

def test_outside_roots_resolves_links_and_parents(tmp_path):
    from manager.loras import outside_roots

    root = tmp_path / "adapters"
    (root / "sql").mkdir(parents=True)
    (root / "out").symlink_to("/etc")
    roots = [str(root)]
    assert not outside_roots(str(root / "sql"), roots)
    assert not outside_roots(str(root / "missing"), roots)  # the same answer whether it exists or not
    for path in ("/etc", str(root / "out"), str(root / ".." / "x"), str(tmp_path / "adapters-2"), "org/hub-id"):
        assert outside_roots(path, roots), path
    assert outside_roots(str(root / "sql"), []) and outside_roots(str(root / "sql"), ["relative"])
    # Relative paths (resolved against the manager's directory; `~` a home; a hub id) and a NUL
    # byte are outside whatever the working directory: never an exception, never a way in.
    cwd = os.getcwd()
    try:
        os.chdir(root)
        for path in ("sql", "~root/x", "~/x", "org/repo", str(root / "sql") + "\0x", "./sql"):
            assert outside_roots(path, roots), path
    finally:
        os.chdir(cwd)


class FakeGroup:
    """What manager.loras.change uses of an EngineGroup: its engine answers as the test says."""

    def __init__(self, answer):
        from servectl import config as C
        from servectl.wire.vocab import ModelState

        self.model = "m"
        self.cfg = C.ModelConfig(name="m", model="/m", engine_args={"enable_lora": True})
        self.state = ModelState.READY
        self.loras = []
        self.answer = answer
        self.calls = []

    async def change_lora(self, call, timeout_s):
        self.calls.append(call)
        return self.answer


def lora_load(path: str, http: bool):
    from servectl.config import LoraModule
    from servectl.wire import control as P

    who = P.HttpCaller(key_id="abc", address="192.0.2.1", gateway="gateway:0") if http else None
    return P.LoadLora(lora=LoraModule(name="sql", path=path), http=who)


def test_an_http_load_outside_the_roots_never_reaches_the_engine(tmp_path):
    from manager import loras

    g = FakeGroup(None)
    for roots in ([], [str(tmp_path / "adapters")]):
        reply = asyncio.run(loras.change({"m": g}, lora_load("/etc", http=True), 5, roots=roots))
        assert not reply.ok and reply.status == 400 and "lora_roots" in reply.message and "/etc" not in reply.message
    assert g.calls == []


def test_an_engine_s_refusal_of_a_path_reaches_an_http_caller_without_its_reason(tmp_path):
    from manager import loras
    from servectl.wire import control as P

    root = str(tmp_path)
    detail = f"No adapter found for {tmp_path}/x"
    refused = P.LoraDone(model="m", incarnation="i", call_id=1, ok=False, status=400, message=detail, files=True)
    reply = asyncio.run(loras.change({"m": FakeGroup(refused)}, lora_load(f"{root}/x", http=True), 5, roots=[root]))
    assert not reply.ok and reply.status == 400 and "No adapter" not in reply.message and root not in reply.message
    # the owner's CLI gets vLLM's reason; a refusal of the request itself (a name) is told as it is
    reply = asyncio.run(loras.change({"m": FakeGroup(refused)}, lora_load(f"{root}/x", http=False), 5))
    assert reply.message == detail
    named = P.LoraDone(model="m", incarnation="i", call_id=1, ok=False, status=400,
                       message="The lora adapter 'sql' has already been loaded.")
    reply = asyncio.run(loras.change({"m": FakeGroup(named)}, lora_load(f"{root}/x", http=True), 5, roots=[root]))
    assert reply.message == named.message


def test_lora_roots_is_a_manager_setting(tmp_path):
    from servectl import config as C

    path = tmp_path / "c.toml"
    path.write_text('[manager]\nlora_roots = ["/srv/adapters"]\n')
    assert C.load_config(path)[0].manager.lora_roots == ["/srv/adapters"]
    path.write_text('[manager]\nlora_roots = ["adapters"]\n')
    with pytest.raises(C.ConfigError, match="lora_roots: 'adapters' is not an absolute path"):
        C.load_config(path)


# -- item 9: the session is the port's; actions and streams from this page only; Secure --------

API, ADMIN = "api-key-0123456789abcdef", "admin-key-0123456789abcdef"


def test_a_session_is_valid_on_the_port_it_was_made_for_only():
    from api_gateway.keys import Access, KeyRing, fingerprint
    from api_gateway.ui import Sessions

    keys, s = KeyRing([API], [ADMIN]), Sessions(b"k" * 32)
    token = s.issue(Access.ADMIN, fingerprint(ADMIN), 1000, "8000")
    assert s.check(token, keys, 1001, "8000") is Access.ADMIN
    assert s.check(token, keys, 1001, "8001") is Access.NONE  # another service's port on the same host
    assert s.csrf(token, "8000") != s.csrf(token, "8001")


async def ui_request(h, method: str, path: str, headers: dict, cookie: str | None = None, **kw):
    if cookie:
        headers = {**headers, "Cookie": f"{h.gw.ui.cookie}_{h.port}={cookie}"}
    async with aiohttp.ClientSession() as session:
        async with session.request(method, h.url + path, headers=headers, allow_redirects=False, **kw) as r:
            if r.status == 200 and path == "/ui/stream":
                return r.status, r.cookies
            await r.read()
            return r.status, r.cookies


def test_actions_and_streams_need_sec_fetch_site_or_this_server_s_origin():
    from api_gateway.keys import Access, fingerprint

    async def scenario(h):
        quiet_sampler(h)
        sessions, port = h.gw.ui.sessions, str(h.port)
        admin = sessions.issue(Access.ADMIN, fingerprint(ADMIN), time.time(), port)
        csrf = {"X-CSRF-Token": sessions.csrf(admin, port)}
        here = f"http://127.0.0.1:{h.port}"
        body = {"verb": "nope", "model": "m"}  # past the checks, a 400 (no manager is asked)
        for headers, want in (({}, 403),  # no Origin, no Sec-Fetch-Site: a form or tool elsewhere
                              ({"Sec-Fetch-Site": "cross-site"}, 403), ({"Sec-Fetch-Site": "same-site"}, 403),
                              ({"Sec-Fetch-Site": "none"}, 403),
                              ({"Origin": "http://evil.example"}, 403),
                              ({"Sec-Fetch-Site": "same-origin"}, 400), ({"Origin": here}, 400)):
            status, _ = await ui_request(h, "POST", "/ui/action", {**csrf, **headers}, admin, json=body)
            assert status == want, (headers, status)
            status, _ = await ui_request(h, "GET", "/ui/stream", headers, admin)
            assert status == (200 if want == 400 else 403), (headers, status)
            await asyncio.sleep(0.05)
        # a cookie from another port's session (the same name on another port) opens nothing
        other = sessions.issue(Access.ADMIN, fingerprint(ADMIN), time.time(), str(h.port + 1))
        status, _ = await ui_request(h, "GET", "/ui/stream", {"Sec-Fetch-Site": "same-origin"}, other)
        assert status == 401
    run(scenario, api_keys=[API], admin_keys=[ADMIN])


def test_the_cookie_is_named_for_the_port_and_secure_behind_a_named_tls_proxy():
    async def scenario(h):
        name = f"{h.gw.ui.cookie}_{h.port}"
        login = {"Origin": f"http://127.0.0.1:{h.port}"}
        for headers, secure in (({}, False), ({"X-Forwarded-Proto": "https"}, True)):
            status, cookies = await ui_request(h, "POST", "/ui/login", {**login, **headers}, data={"key": API})
            assert status == 303 and bool(cookies[name]["secure"]) is secure, headers
    run(scenario, api_keys=[API], tls_proxies=["127.0.0.1"])

    async def unnamed(h):  # a proxy not named: its X-Forwarded-Proto is not believed
        status, cookies = await ui_request(h, "POST", "/ui/login", {"X-Forwarded-Proto": "https"}, data={"key": API})
        assert status == 303 and not cookies[f"{h.gw.ui.cookie}_{h.port}"]["secure"]
    run(unnamed, api_keys=[API], tls_proxies=["192.0.2.7"])


# -- item 7: a read-only peer's refusals are rate-limited and cannot rotate accepted lines away --

def test_the_refusal_limiter_writes_a_burst_then_counts_per_peer():
    from manager.audit import RefusalLimiter

    lim = RefusalLimiter(per_s=1.0, burst=3)
    assert [lim.take("a", 0.0) for _ in range(5)] == [0, 0, 0, None, None]
    assert lim.take("b", 0.0) == 0  # another peer has its own budget
    assert lim.take("a", 1.0) == 2  # a token back: written, saying the two not written
    assert lim.take("a", 1.0) is None and lim.owed() == [("a", 1)] and lim.owed() == []
    small = RefusalLimiter(max_peers=4)
    for i in range(100):
        small.take(i, float(i))
    assert len(small.peers) <= 4


class Sock:
    def send_multipart(self, frames, flags=0):
        pass


def test_a_flood_of_refusals_on_control_ro_leaves_accepted_lines_and_says_how_many(tmp_path):
    import json
    import os
    from types import SimpleNamespace

    import zmq.asyncio

    from manager.audit import Peer, RefusalLimiter
    from manager.control import Caller, ControlServer
    from servectl.wire import control as P

    ctx = zmq.asyncio.Context()
    try:
        srv = ControlServer(SimpleNamespace(state_dir=tmp_path, groups={}), ctx)
        srv.audit.rotate_bytes = 256 * 1024
        srv.refusals = RefusalLimiter(per_s=0.0)  # no token back during the flood, however slow the host
        owner = Caller(Sock(), b"o", Peer(os.geteuid(), os.getegid(), 10), "control")
        srv.record(owner, P.SetFreezing(model="m", enabled=True), "accepted")
        group = Caller(Sock(), b"g", Peer(65534, 65534, 11), "control-ro")
        big = P.encoder.encode(P.UnloadModel(name="x" * 4096))
        for _ in range(1006):  # as the audit's 45 s flood
            srv.take(group, big)
        accepted = (tmp_path / "audit.log").read_text().splitlines()
        assert [json.loads(x)["outcome"] for x in accepted] == ["accepted"]
        denied = [json.loads(x) for x in (tmp_path / "audit-denied.log").read_text().splitlines()]
        assert len(denied) == 20 and all(d["uid"] == 65534 and d["command"] == "unload" for d in denied)
        srv.record(owner, P.SetFreezing(model="m", enabled=False), "accepted")  # the count is said first
        last = json.loads((tmp_path / "audit-denied.log").read_text().splitlines()[-1])
        assert last["suppressed"] == 986 and last["uid"] == 65534 and last["via"] == "control-ro"
        assert len((tmp_path / "audit.log").read_text().splitlines()) == 2
    finally:
        ctx.destroy(linger=0)


def test_over_plain_http_to_a_lan_name_the_page_s_own_stream_has_neither_header_and_is_served():
    """Browsers send Sec-Fetch-Site only to trustworthy origins, and no Origin on a same-origin
    GET: there the stream is served without them; the buttons (a POST: Origin) never are."""
    from api_gateway.keys import Access, fingerprint

    async def scenario(h):
        quiet_sampler(h)
        sessions, port = h.gw.ui.sessions, str(h.port)
        admin = sessions.issue(Access.ADMIN, fingerprint(ADMIN), time.time(), port)
        lan = {"Host": f"llm.lan:{h.port}"}
        assert (await ui_request(h, "GET", "/ui/stream", lan, admin))[0] == 200
        assert (await ui_request(h, "POST", "/ui/action", {**lan, "X-CSRF-Token": sessions.csrf(admin, port)},
                                 admin, json={"verb": "nope", "model": "m"}))[0] == 403
        # behind a TLS proxy the browser sends Sec-Fetch-Site: without it, refused
        tls = {**lan, "X-Forwarded-Proto": "https"}
        assert (await ui_request(h, "GET", "/ui/stream", tls, admin))[0] == 403
    run(scenario, api_keys=[API], admin_keys=[ADMIN], allowed_hosts=["llm.lan"], tls_proxies=["127.0.0.1"])
