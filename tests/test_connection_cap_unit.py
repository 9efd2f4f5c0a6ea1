"""Connections capped below the descriptor limit (issue 39, item 3): idle ones are closed first,
a clear 503 past the cap; the gateway raises its soft RLIMIT_NOFILE to the hard limit."""

from __future__ import annotations

import asyncio
import resource

import msgspec
import pytest

from api_gateway import http_server
from gateway_harness import run
from servectl import config as C

pytestmark = pytest.mark.unit

VERSION = b"GET /version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


async def idle_connections(h, count: int):
    conns = [await asyncio.open_connection("127.0.0.1", h.port) for _ in range(count)]
    await asyncio.sleep(0.1)  # accepted
    return conns


def test_past_the_cap_an_idle_connection_is_closed_and_the_new_client_is_served():
    async def scenario(h):
        conns = await idle_connections(h, 3)
        # A keep-alive connection that answered a request is idle too.
        reader, writer = conns[0]
        writer.write(VERSION)
        await writer.drain()
        assert b"200 OK" in await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        # A fourth connection: the oldest idle one goes, the new client is answered.
        async with __import__("aiohttp").ClientSession() as s:
            async with s.get(h.url + "/version") as r:
                assert r.status == 200
        async def at_eof(reader) -> bool:  # the server closed it (it was closed before the answer came)
            try:
                await asyncio.wait_for(reader.read(), 0.5)
                return True
            except (asyncio.TimeoutError, ConnectionError):
                return False

        closed = sum(await asyncio.gather(*(at_eof(reader) for reader, _ in conns)))
        for _, writer in conns:
            writer.close()
        assert closed == 1  # one made room; the others are still open

    run(scenario, max_connections=3)


def test_with_every_connection_busy_a_new_one_gets_a_503_and_is_closed():
    async def scenario(h):
        # Held requests (the model is not ready): their connections are busy.
        held = [asyncio.ensure_future(h.post("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1}))
                for _ in range(2)]
        await asyncio.sleep(0.3)
        answer = await h.raw(b"", timeout=5)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"Connection: close" in head, answer
        err = msgspec.json.decode(body)["error"]
        assert err["code"] == "too_many_connections" and "too many open connections" in err["message"]
        # The held ones were not touched.
        assert not any(t.done() for t in held)
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await asyncio.sleep(0.2)  # the server sees them go

    run(scenario, max_connections=2, hold_timeout_s=30)


def test_the_configured_cap_and_the_derived_one():
    assert C.GatewayConfig().max_connections == 0
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"max_connections": -1}, C.GatewayConfig)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert http_server.connection_cap(0) == soft - http_server.FD_RESERVE
    assert http_server.connection_cap(10) == 10
    assert http_server.connection_cap(soft * 2) == soft - http_server.FD_RESERVE  # never above the limit


def test_config_file_takes_max_connections(tmp_path):
    path = tmp_path / "servectl.toml"
    path.write_text("[gateway]\nmax_connections = 500\n")
    cfg, _ = C.effective_config(str(path), C.Overrides(), search=False)
    assert cfg.gateway.max_connections == 500


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if hard != resource.RLIM_INFINITY and hard > 256:
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        assert http_server.raise_fd_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if hard != resource.RLIM_INFINITY:
            assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_every_zeromq_socket_that_reads_from_a_peer_has_a_maximum_message_size():
    """Each function that makes a ROUTER, DEALER or SUB socket in the product packages sets
    ZMQ_MAXMSGSIZE there (the inproc PAIRs are a process's own threads)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    missing, seen = [], 0
    for pkg in ("servectl", "manager", "engine_core", "api_gateway"):
        for path in (root / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                makes = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                         and n.func.attr == "socket" and n.args and isinstance(n.args[0], ast.Attribute)
                         and n.args[0].attr in ("ROUTER", "DEALER", "SUB")]
                if not makes:
                    continue
                seen += 1
                if "MAXMSGSIZE" not in ast.unparse(fn):
                    missing.append(f"{path.relative_to(root)}:{fn.lineno} {fn.name}")
    assert seen >= 8 and not missing, missing
