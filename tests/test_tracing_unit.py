"""Tracing without a daemon: the switch, traceparent strings, the quiet batch processor (batches,
flushes, and a thread that sleeps with no timeout while nothing waits), the exporters of both OTLP
protocols against real receivers, and the manager's episodes from state changes."""

from __future__ import annotations

import sys
import threading
import time
from concurrent import futures

import pytest
from opentelemetry.sdk.trace import TracerProvider

from manager.spans import GroupSpans, episode
from servectl import tracing
from servectl.tracing.export import QuietBatchProcessor
from servectl.tracing.w3c import context_of, format_traceparent, parse_traceparent
from servectl.wire.vocab import ModelState as S

pytestmark = pytest.mark.unit

ENDPOINT = "http://collector:4318/v1/traces"


# ---- the switch -----------------------------------------------------------------------------
def test_tracing_is_on_only_with_an_endpoint_and_not_disabled():
    assert tracing.endpoint({}) is None
    assert tracing.endpoint({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT}) == ENDPOINT
    assert tracing.endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == "http://c:4318"
    assert tracing.endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT}) == ENDPOINT  # the signal's own wins
    assert tracing.endpoint({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT, "OTEL_SDK_DISABLED": "true"}) is None
    assert tracing.endpoint({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}) is None


def test_the_protocol_defaults_to_grpc_as_vllm_and_a_wrong_one_is_refused():
    on = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT}
    assert tracing.protocol(on) == "grpc"
    assert tracing.protocol({**on, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    assert tracing.protocol({**on, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}) == "grpc"
    assert tracing.check_env(on) is None
    assert tracing.check_env({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}) is None  # off: not read
    bad = tracing.check_env({**on, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})
    assert "http/json" in bad and "grpc" in bad


# ---- traceparent ----------------------------------------------------------------------------
def test_traceparent_round_trip_and_invalid_values():
    value = format_traceparent(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 1)
    assert value == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert parse_traceparent(value) == (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 1)
    for bad in ("", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331", "01-" + value[3:],
                "00-" + "0" * 32 + "-b7ad6b7169203331-01", "00-0af7651916cd43dd8448eb211c80319c-" + "0" * 16 + "-01",
                value.upper(), value + "-extra"):
        assert parse_traceparent(bad) is None, bad
    ctx = context_of(value)
    assert ctx.is_remote and ctx.trace_id == 0x0AF7651916CD43DD8448EB211C80319C and ctx.trace_flags.sampled
    assert context_of("nonsense") is None


# ---- the quiet batch processor ----------------------------------------------------------------
class Exporter:
    def __init__(self):
        self.batches: list[list[str]] = []
        self.exported = threading.Event()
        self.shut = False

    def export(self, batch):
        self.batches.append([s.name for s in batch])
        self.exported.set()

    def shutdown(self):
        self.shut = True


def provider_with(processor) -> TracerProvider:
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(processor)
    return provider


def waiting_forever(thread: threading.Thread) -> bool:
    """Whether ``thread`` is blocked in Condition.wait() with no timeout (its frame says so)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_locals.get("timeout", 0) is None:
            return True
        frame = frame.f_back
    return False


def test_the_export_thread_sleeps_with_no_timeout_while_nothing_waits():
    exporter = Exporter()
    p = QuietBatchProcessor(exporter, delay_s=0.05)
    tracer = provider_with(p).get_tracer("t")
    time.sleep(0.1)
    assert waiting_forever(p.thread)  # idle: no timed wake-up at all
    tracer.start_span("a").end()
    assert exporter.exported.wait(5)
    assert exporter.batches == [["a"]]
    time.sleep(0.1)
    assert waiting_forever(p.thread)  # and asleep again once the queue is empty
    p.shutdown()


def test_spans_within_the_delay_share_one_export_and_a_full_batch_goes_at_once():
    exporter = Exporter()
    p = QuietBatchProcessor(exporter, delay_s=30, max_batch=3)
    tracer = provider_with(p).get_tracer("t")
    for name in "abc":
        tracer.start_span(name).end()
    assert exporter.exported.wait(5)  # three: a full batch, long before the 30 s delay
    assert exporter.batches == [["a", "b", "c"]]
    exporter.exported.clear()
    tracer.start_span("d").end()
    assert not exporter.exported.wait(0.3)  # one span waits for its delay (or a flush)
    assert p.force_flush(5000)
    assert exporter.batches[-1] == ["d"]
    tracer.start_span("e").end()
    p.shutdown()  # what is queued goes out on shutdown
    assert exporter.batches[-1] == ["e"] and exporter.shut
    tracer.start_span("f").end()  # after shutdown: dropped, no error
    assert exporter.batches[-1] == ["e"]


def test_a_full_queue_drops_and_an_unsampled_span_is_not_queued():
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    gate = threading.Event()

    class Slow(Exporter):
        def export(self, batch):
            super().export(batch)
            gate.wait(10)  # a slow collector: the queue fills meanwhile

    exporter = Slow()
    p = QuietBatchProcessor(exporter, delay_s=30, max_queue=2)
    provider = provider_with(p)
    for name in "ab":
        provider.get_tracer("t").start_span(name).end()
    assert exporter.exported.wait(5)  # a full batch (2), being exported
    for name in "cdef":
        provider.get_tracer("t").start_span(name).end()
    assert p.dropped == 2 and len(p.queue) == 2
    off = TracerProvider(sampler=ALWAYS_OFF, shutdown_on_exit=False)
    off.add_span_processor(p)
    off.get_tracer("t").start_span("unsampled").end()
    assert len(p.queue) == 2
    gate.set()
    p.shutdown()
    assert exporter.batches == [["a", "b"], ["c", "d"]]


def test_a_failing_exporter_costs_the_batch_not_the_thread():
    class Failing(Exporter):
        def export(self, batch):
            super().export(batch)
            if len(self.batches) == 1:
                raise ConnectionError("collector down")

    exporter = Failing()
    p = QuietBatchProcessor(exporter, delay_s=0)
    tracer = provider_with(p).get_tracer("t")
    tracer.start_span("lost").end()
    assert exporter.exported.wait(5)
    exporter.exported.clear()
    tracer.start_span("sent").end()
    assert exporter.exported.wait(5) and exporter.batches == [["lost"], ["sent"]]
    p.shutdown()


# ---- both protocols against real receivers ----------------------------------------------------
def export_one(monkeypatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    exporter = tracing.exporter(tracing.endpoint())
    p = QuietBatchProcessor(exporter, delay_s=0)
    provider_with(p).get_tracer("t").start_span("over-the-wire", attributes={"k": "v"}).end()
    assert p.force_flush(10000)
    p.shutdown()


def test_http_protobuf_export_reaches_a_receiver(monkeypatch):
    from otlp_receiver import OtlpReceiver

    r = OtlpReceiver()
    try:
        export_one(monkeypatch, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": r.endpoint,
                                 "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
        assert [(s.name, s.attributes) for s in r.spans] == [("over-the-wire", {"k": "v"})]
    finally:
        r.close()


def test_grpc_export_reaches_a_receiver(monkeypatch):
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    got = []

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            got.extend(s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        # No protocol given: grpc, as `vllm serve --otlp-traces-endpoint`.
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
        export_one(monkeypatch, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}"})
        assert got == ["over-the-wire"]
    finally:
        server.stop(None)


# ---- the manager's episodes ------------------------------------------------------------------
def test_episodes_begin_from_the_states_that_begin_them():
    assert episode(S.READY, S.EXITED, "worker died", None) == "servectl.restart"
    assert episode(S.STARTING, S.EXITED, "worker died", "servectl.start") == "servectl.restart"
    assert episode(S.BACKOFF, S.STARTING, None, "servectl.restart") is None  # part of the restart
    assert episode(S.READY, S.RELEASING, "evicted: model b needs room", None) == "servectl.evict"
    assert episode(S.READY, S.RELEASING, "idle for 30s", None) == "servectl.release"
    assert episode(S.RELEASED, S.STARTING, "waking", None) == "servectl.wake"
    assert episode(S.ASLEEP, S.STARTING, "waking", None) == "servectl.wake"
    assert episode(S.STOPPED, S.STARTING, None, None) == "servectl.start"
    assert episode(S.READY, S.DRAINING, None, None) == "servectl.stop"
    assert episode(S.STARTING, S.READY, None, None) is None


class Recorded:
    def __init__(self, name, attributes):
        self.name, self.attributes, self.events, self.status, self.ended = name, dict(attributes), [], None, False

    def add_event(self, name, attributes=None):
        self.events.append(name)

    def set_attribute(self, key, value):
        self.attributes[key] = value

    def set_status(self, status):
        self.status = status.status_code.name

    def end(self):
        self.ended = True


class Tracer:
    def __init__(self):
        self.spans: list[Recorded] = []

    def start_span(self, name, attributes=None):
        self.spans.append(Recorded(name, attributes or {}))
        return self.spans[-1]


def test_a_crash_loop_restart_an_eviction_and_a_wake_as_spans():
    t = Tracer()
    g = GroupSpans(t)
    for state, reason, inc in [(S.STARTING, None, "i1"), (S.READY, None, "i1"),
                               (S.EXITED, "worker:a:0 killed by SIGKILL", "i1"), (S.BACKOFF, "backoff 1s", "i1"),
                               (S.STARTING, None, "i2"), (S.READY, None, "i2"),
                               (S.RELEASING, "evicted: model b needs room", "i2"), (S.STOPPING, None, "i2"),
                               (S.RELEASED, None, ""), (S.STARTING, "waking", "i3"), (S.EXITED, "died", "i3"),
                               (S.FAILED, "crash loop", "i3")]:
        g.changed("a", "a", state, reason, inc)
    names = [(s.name, s.ended, s.status) for s in t.spans]
    assert names == [("servectl.start", True, None), ("servectl.restart", True, None),
                     ("servectl.evict", True, None), ("servectl.wake", True, "ERROR"),
                     ("servectl.restart", True, "ERROR")]
    start, restart, evict, wake, failed = t.spans
    assert restart.attributes["servectl.reason"] == "worker:a:0 killed by SIGKILL"
    assert restart.attributes["servectl.new_incarnation"] == "i2" and restart.events == ["backoff", "starting", "ready"]
    assert evict.attributes["servectl.end_state"] == "released"
    assert failed.attributes["servectl.end_state"] == "failed"
    assert not g.open


def test_force_flush_waits_for_the_batch_being_exported():
    """A flush (the engine's, before it dies of SIGTERM) returns once what was taken off the queue
    is out too, not only once the queue is empty."""
    gate, exporting = threading.Event(), threading.Event()

    class Slow(Exporter):
        def export(self, batch):
            exporting.set()
            gate.wait(10)
            super().export(batch)

    exporter = Slow()
    p = QuietBatchProcessor(exporter, delay_s=0)
    provider_with(p).get_tracer("t").start_span("a").end()
    assert exporting.wait(5) and not p.queue  # taken off the queue, being exported
    assert not p.force_flush(300)  # not out yet: the flush says so at its timeout
    threading.Timer(0.2, gate.set).start()
    assert p.force_flush(5000) and exporter.batches == [["a"]]
    p.shutdown()
