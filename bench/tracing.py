"""The cost of tracing: servectl exporting every request's spans (100 % sampling) against servectl
with tracing off, per step, in alternating rounds.

    python -m bench.tracing                     # 3 rounds: off, on, off, on, off, on; ~10 minutes on 2 cores
    python -m bench.tracing --rounds 5 --out bench/results/2026-12-05-tracing-5.json
    python -m bench.tracing --rounds 1 --prompts 8 --concurrency 1 --non-stream-requests 8   # the harness only

It is ``bench.rounds --only servectl`` (fresh servers, the same load, medians and spreads, tokens
per engine step and the mean step from vLLM's /metrics) with side B's ``servectl start`` given the
OpenTelemetry SDK's own variables, which every process of its tree inherits:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (a receiver in this process),
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`` and ``OTEL_TRACES_SAMPLER=always_on``. Side A
starts with no ``OTEL_*`` variable at all (any in this shell are dropped first). Warm standbys are
off on both sides: they are not under test and cost a vLLM import each.

The receiver is OTLP/HTTP: it answers ``POST …/v1/traces`` as a collector does (200, an empty
``ExportTraceServiceResponse``) and decodes every body with opentelemetry-proto, counting the spans
per process kind (resource attributes ``service.name`` / ``servectl.component``). Each round's
counts go into its raw result (``spans``) and the totals beside the figures: a tracing-on round
whose processes exported nothing measured nothing, and the table says so (``tracing did not export:
figures void``); the exit status is then 2.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from bench import rounds as R
from bench.run import ROOT

OFF, ON = "tracing-off", "tracing-on"
VOID = "tracing did not export: figures void"


def source(resource) -> str:
    """The exporting process as the counts name it: ``service.name/servectl.component`` (either
    alone if the other is missing, ``unknown`` if both are)."""
    attrs = {kv.key: kv.value.string_value for kv in resource.attributes}
    parts = [attrs.get("service.name"), attrs.get("servectl.component")]
    return "/".join(p for p in parts if p) or "unknown"


class Sink:
    """An OTLP/HTTP trace receiver on 127.0.0.1, its own event loop in a daemon thread.

    Spans are counted, not kept: a run at c=16 exports hundreds a second."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._round: Counter[str] = Counter()  # since the last take()
        self.total: Counter[str] = Counter()
        self.bodies = 0
        self.bad = 0  # bodies that did not decode: a protocol the receiver does not speak
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def record(self, body: bytes) -> int:
        """Count the spans of one ExportTraceServiceRequest; the number, or -1 if it is not one.

        aiohttp inflates a body sent with Content-Encoding itself; one still gzipped (its magic
        bytes, never the start of a protobuf message: field 3, wire type 7) is inflated here."""
        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        try:
            if body[:2] == b"\x1f\x8b":
                body = gzip.decompress(body)
            req = ExportTraceServiceRequest.FromString(body)
        except (DecodeError, OSError, EOFError):
            with self._lock:
                self.bad += 1
            return -1
        counts: Counter[str] = Counter()
        for rs in req.resource_spans:
            name = source(rs.resource)
            counts[name] += sum(len(ss.spans) for ss in rs.scope_spans)
        with self._lock:
            self.bodies += 1
            self._round.update(counts)
            self.total.update(counts)
        return sum(counts.values())

    def take(self) -> dict:
        """The spans received since the last take(): ``{"total": n, "by_source": {...}}``."""
        with self._lock:
            got, self._round = self._round, Counter()
        return {"total": sum(got.values()), "by_source": dict(sorted(got.items()))}

    async def _traces(self, request):
        from aiohttp import web
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        body = await request.read()
        if self.record(body) < 0:
            return web.Response(status=400, text="not an OTLP/protobuf ExportTraceServiceRequest")
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def _serve(self, ready: threading.Event) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        ready.set()

    def start(self) -> Sink:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.create_task(self._serve(ready))
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="otlp-sink", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the OTLP receiver did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> Sink:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def tracing_env(endpoint: str) -> dict[str, str]:
    """What turns tracing on for every process of a `servectl start`: the SDK's own variables."""
    return {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_TRACES_SAMPLER": "always_on"}


def rounds_argv(p: argparse.Namespace, endpoint: str, extra: list[str]) -> list[str]:
    """bench.rounds' arguments for this run: servectl against itself, B with tracing on."""
    argv = ["--only", "servectl", "--name-a", OFF, "--name-b", ON, "--no-standby",
            "--rounds", str(p.rounds), "--concurrency", p.concurrency, "--prompts", str(p.prompts),
            "--non-stream-requests", str(p.non_stream_requests), "--input-len", str(p.input_len),
            "--output-len", str(p.output_len), "--out", str(p.out)]
    for k, v in tracing_env(endpoint).items():
        argv += ["--start-env-b", f"{k}={v}"]
    return argv + extra


def span_notes(raw: dict[str, list[dict]], sink_bad: int = 0) -> tuple[dict, list[str], bool]:
    """The spans each side's rounds exported, the lines the table opens with, and whether the
    figures are void (a tracing-on round that exported nothing)."""
    per_round = {side: [r.get("spans", {}).get("total", 0) for r in raw.get(side, [])] for side in (OFF, ON)}
    by_source: Counter[str] = Counter()
    for r in raw.get(ON, []):
        by_source.update(r.get("spans", {}).get("by_source", {}))
    spans = {"per_round": per_round, "on_by_source": dict(sorted(by_source.items())), "undecoded_bodies": sink_bad}
    empty = [i + 1 for i, n in enumerate(per_round[ON]) if n == 0]
    void = bool(empty) or not per_round[ON]
    notes = []
    if void:
        which = "in any round" if len(empty) == len(per_round[ON]) else f"in round(s) {', '.join(map(str, empty))}"
        notes.append(f"**{VOID}**: 0 spans reached the OTLP receiver from {ON} {which}.")
    sources = ", ".join(f"{k} {v:,}" for k, v in spans["on_by_source"].items()) or "none"
    notes.append(f"Spans exported (OTLP/HTTP protobuf, `always_on`): {ON} per round "
                 f"{', '.join(f'{n:,}' for n in per_round[ON]) or '-'} ({sources}); "
                 f"{OFF} per round {', '.join(f'{n:,}' for n in per_round[OFF]) or '-'}.")
    if any(per_round[OFF]):
        notes.append(f"Spans arrived during {OFF} rounds: late exports of the previous server, or tracing "
                     "not off; read its figures with that in mind.")
    if sink_bad:
        notes.append(f"{sink_bad} bodies did not decode as OTLP/protobuf.")
    return spans, notes, void


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.tracing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Any other option goes to bench.rounds (python -m bench.rounds --help).")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16")
    # 384 streams of 64 tokens: ~60 s at c=1 (~400 tok/s here), ~7 s at c=16; with the start,
    # the warm-up and the stop (~15 s without standbys) and 384 non-streamed requests (~6 s),
    # ~1.5 minutes a side on 2 cores: 3 rounds ~10 minutes.
    ap.add_argument("--prompts", type=int, default=384, help="requests per streaming cell")
    ap.add_argument("--non-stream-requests", type=int, default=384)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", type=Path, help="the result (.json; the .md beside it)",
                    default=ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-tracing.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    p, extra = parser().parse_known_args(argv)
    if p.out.suffix != ".json":
        raise SystemExit("--out: a .json file")
    for k in [k for k in os.environ if k.startswith("OTEL_")]:
        del os.environ[k]  # side A inherits this process's environment: it must not trace
    with Sink() as sink:
        rp = R.parser().parse_args(rounds_argv(p, sink.endpoint, extra))
        R.check(rp)
        sides = R.plan(rp)

        def after_round(side: R.Side, r: dict) -> None:
            r["spans"] = sink.take()  # `servectl stop` returned: every process exited, its exporter flushed
            print(f"== {side.name}: {r['spans']['total']} spans received", flush=True)

        void = []

        def before_write(res: dict) -> None:
            res["spans"], res["notes"], is_void = span_notes(res["raw"], sink.bad)
            void.append(is_void)

        rc = R.run_rounds(rp, sides, [int(c) for c in rp.concurrency.split(",")], after_round, before_write)
    return rc or (2 if void and void[0] else 0)


if __name__ == "__main__":
    sys.exit(main())
