"""A real gateway (its aiohttp app, its engine link) in the test's event loop, against a
scripted engine: a ROUTER where the engine's socket would be, driven by the test.

No manager, no vLLM: the test plays the manager (``model_state``) and the engine
(``FakeEngine``), so what the gateway does at each frame is deterministic.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path

import aiohttp
import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from api_gateway.app import Gateway
from api_gateway.http_server import make_runner
from servectl.config import GatewayConfig
from servectl.wire import engine as EP
from servectl.wire.spawn import GatewaySpec

MODEL = "m"


class FakeEngine:
    """The engine's ROUTER, scripted: receive what the gateway sends, answer as the test says."""

    def __init__(self, ctx: zmq.asyncio.Context, path: str, rcvhwm: int | None = None):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # As the engine's: a gateway that reconnects under its identity (a new engine lifetime
        # here is the same socket) takes the name over.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if rcvhwm is not None:
            self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.bind(f"ipc://{path}")
        self.peer: bytes | None = None
        self.incarnation = ""

    async def recv(self, timeout: float = 10):
        peer, body = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        self.peer = peer
        return EP.from_gateway_decoder.decode(body)

    async def recv_until(self, cls, timeout: float = 10):
        """Frames until one of ``cls``; returns (that frame, the ones before it)."""
        before = []
        while True:
            msg = await self.recv(timeout)
            if isinstance(msg, cls):
                return msg, before
            before.append(msg)

    async def send(self, msg) -> None:
        await self.sock.send_multipart([self.peer, EP.encoder.encode(msg)])

    async def accept(self, incarnation: str, max_num_seqs: int = 4) -> None:
        hello = await self.recv()
        assert isinstance(hello, EP.Hello), hello
        self.incarnation = incarnation
        await self.send(EP.HelloReply(version=EP.PROTOCOL_VERSION, incarnation=incarnation, model=MODEL,
                                      max_model_len=128, max_num_seqs=max_num_seqs))

    async def step(self, *deltas: EP.Delta) -> None:
        await self.send(EP.StepOutput(incarnation=self.incarnation, deltas=list(deltas)))

    async def stats_reply(self, missing: list[str] = (), unfinished: int = 0) -> None:
        await self.send(EP.StatsReply(incarnation=self.incarnation, unfinished=unfinished, rejected_frames=0,
                                      missing=list(missing)))

    def close(self) -> None:
        self.sock.close(linger=0)


class Harness:
    def __init__(self, gw: Gateway, engine: FakeEngine, port: int, ctx: zmq.asyncio.Context):
        self.gw = gw
        self.engine = engine
        self.port = port
        self.ctx = ctx
        self.hangs: list[str] = []
        gw.manager.report_hang = lambda link: self.hangs.append(link.model)

    @property
    def link(self):
        return self.gw.links[MODEL]

    @property
    def model(self):
        return self.gw.served[MODEL]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def model_state(self, state: str, incarnation: str = "", reason: str | None = None) -> None:
        self.gw.manager.on_model_event(MODEL, state, incarnation, reason)

    async def ready(self, incarnation: str = "inc1", max_num_seqs: int = 4) -> None:
        """The manager announces the engine, which answers the gateway's Hello."""
        self.model_state("ready", incarnation)
        await self.engine.accept(incarnation, max_num_seqs)
        await asyncio.wait_for(self.link.ready.wait(), 10)

    async def post(self, path: str, body, headers: dict | None = None, timeout: float = 30):
        """(status, parsed JSON body or SSE text)."""
        async with aiohttp.ClientSession() as s:
            async with s.post(self.url + path, data=body if isinstance(body, bytes) else msgspec.json.encode(body),
                              headers={"Content-Type": "application/json", **(headers or {})},
                              timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                raw = await r.read()
                if r.content_type == "application/json":
                    return r.status, msgspec.json.decode(raw)
                return r.status, raw.decode()

    async def raw(self, data: bytes, read: bool = True, timeout: float = 10) -> bytes:
        """Bytes on a fresh connection; what comes back until the server closes it."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(data)
        await writer.drain()
        try:
            if not read:
                return b""
            return await asyncio.wait_for(reader.read(), timeout)
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def gateway(rcvhwm: int | None = None, **cfg):
    """A gateway serving model ``m`` on a free port, with a FakeEngine where its engine would be."""
    tmp = tempfile.mkdtemp(prefix="gwh-", dir="/tmp")  # short: ipc paths have a length limit
    spec = GatewaySpec(index=0, runtime_dir=tmp, instance="test", gateway=GatewayConfig(**cfg), models=[MODEL])
    gw = Gateway(spec)
    engine = FakeEngine(gw.ctx, str(Path(tmp) / f"engine-{MODEL}"), rcvhwm)
    runner = make_runner(gw.build_app(), gw.cfg)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield Harness(gw, engine, port, gw.ctx)
    finally:
        await runner.cleanup()
        for link in list(gw.links.values()):
            link.remove()
        engine.close()
        gw.ctx.destroy(linger=0)


def run(scenario, **cfg):
    """Run ``scenario(harness)`` on a fresh gateway (cfg: GatewayConfig fields)."""
    async def main():
        async with gateway(**cfg) as h:
            await scenario(h)
    asyncio.run(main())


def served(link):
    """The link's model (a ServedModel of this one link), made once: where requests wait."""
    from api_gateway.served import ServedModel

    owner = getattr(link.on_change, "__self__", None)
    if isinstance(owner, ServedModel):
        return owner
    model = ServedModel(link.model)
    model.add(link)
    return model
