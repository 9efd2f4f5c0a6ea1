"""An OTLP/HTTP trace receiver for tests: the real protocol (``opentelemetry-proto``), decoded.

``OtlpReceiver`` serves ``POST /v1/traces`` on 127.0.0.1 from a thread with its own event loop
and keeps every span it is sent as a ``Span`` (ids as hex, attributes, events and links as
plain values, the resource's attributes beside it), as a collector would see them.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
from dataclasses import dataclass, field

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)


def value_of(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value_of(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value_of(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def attrs(kvs) -> dict:
    return {kv.key: value_of(kv.value) for kv in kvs}


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent: str  # "" for a root
    kind: int  # the protocol's SpanKind: 1 internal, 2 server, 3 client
    start_ns: int
    end_ns: int
    attributes: dict
    events: list[tuple[str, dict]]
    links: list[tuple[str, str, dict]]  # (trace id, span id, attributes)
    status: int  # 0 unset, 1 ok, 2 error
    resource: dict = field(default_factory=dict)

    @property
    def component(self) -> str:
        return self.resource.get("servectl.component", "")


def decode(body: bytes) -> list[Span]:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        resource = attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(
                    name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent=s.parent_span_id.hex(),
                    kind=s.kind, start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    attributes=attrs(s.attributes), events=[(e.name, attrs(e.attributes)) for e in s.events],
                    links=[(link.trace_id.hex(), link.span_id.hex(), attrs(link.attributes)) for link in s.links],
                    status=s.status.code, resource=resource))
    return out


class OtlpReceiver:
    def __init__(self):
        self.spans: list[Span] = []
        self.requests = 0
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.port = 0
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def env(self, delay_ms: int = 100) -> dict[str, str]:
        """The environment that sends a servectl tree's traces here (exported within ``delay_ms``)."""
        return {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.endpoint,
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": str(delay_ms),
                "OTEL_TRACES_SAMPLER": "always_on"}

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def traces(request: web.Request) -> web.Response:
            body = await request.read()
            if request.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            spans = decode(body)
            with self.lock:
                self.spans.extend(spans)
                self.requests += 1
            return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                                content_type="application/x-protobuf")

        async def start() -> None:
            app = web.Application(client_max_size=64 * 2**20)
            app.router.add_post("/v1/traces", traces)
            self.runner = web.AppRunner(app, access_log=None)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            started.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def named(self, name: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.name == name]

    def close(self) -> None:
        async def stop() -> None:
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
