"""bench/tracing.py without servers: its OTLP receiver decodes the real protocol and counts spans,
the arguments it hands bench.rounds, and the void flag when tracing exported nothing."""

from __future__ import annotations

import gzip
import urllib.error
import urllib.request

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                        ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from bench import rounds as R
from bench import tracing as T

pytestmark = pytest.mark.unit


def export_request(spans_by_resource: list[tuple[dict[str, str], list[int]]]) -> bytes:
    """An ExportTraceServiceRequest as an exporter sends it: per resource, scopes of n spans each."""
    req = ExportTraceServiceRequest()
    for attrs, scopes in spans_by_resource:
        rs = ResourceSpans(resource=Resource(attributes=[KeyValue(key=k, value=AnyValue(string_value=v))
                                                         for k, v in attrs.items()]))
        for n in scopes:
            rs.scope_spans.append(ScopeSpans(spans=[Span(trace_id=bytes(16 * [i + 1]), span_id=bytes(8 * [i + 1]),
                                                         name=f"span {i}") for i in range(n)]))
        req.resource_spans.append(rs)
    return req.SerializeToString()


GATEWAY = {"service.name": "servectl", "servectl.component": "gateway"}
ENGINE = {"service.name": "servectl", "servectl.component": "engine", "service.instance.id": "e1"}


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, str, bytes]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/x-protobuf", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("Content-Type"), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read()


def test_the_sink_answers_as_a_collector_and_counts_each_process_kinds_spans_per_round():
    with T.Sink() as sink:
        assert sink.endpoint.startswith("http://127.0.0.1:") and sink.endpoint.endswith("/v1/traces")
        status, ctype, body = post(sink.endpoint, export_request([(GATEWAY, [2, 1]), (ENGINE, [4])]))
        assert (status, ctype) == (200, "application/x-protobuf")
        ExportTraceServiceResponse.FromString(body)  # what an exporter parses: no partial_success
        assert not ExportTraceServiceResponse.FromString(body).HasField("partial_success")
        # a gzip body (OTEL_EXPORTER_OTLP_COMPRESSION=gzip), and a resource with no attributes
        status, _, _ = post(sink.endpoint, gzip.compress(export_request([({}, [1]), (GATEWAY, [1])])),
                            {"Content-Encoding": "gzip"})
        assert status == 200
        assert sink.take() == {"total": 9, "by_source": {"servectl/engine": 4, "servectl/gateway": 4, "unknown": 1}}
        assert sink.take() == {"total": 0, "by_source": {}}  # counts are per round
        status, _, _ = post(sink.endpoint, b"{\"resourceSpans\": []}", {"Content-Type": "application/json"})
        assert status == 400 and sink.bad == 1
        assert post(sink.endpoint, export_request([({"service.name": "x"}, [3])]))[0] == 200
        assert sink.take()["by_source"] == {"x": 3} and sum(sink.total.values()) == 12 and sink.bodies == 3
        # a body still gzipped (no Content-Encoding header) is inflated; garbage is not counted
        assert sink.record(gzip.compress(export_request([(ENGINE, [2])]))) == 2
        assert sink.record(b"\x0a\xff\xff") == -1 and sink.bad == 2
    assert sink._loop is None


def test_spans_the_sdks_own_exporter_sends_are_counted():
    """The exporter servectl's processes use (opentelemetry-exporter-otlp-proto-http), when installed."""
    pytest.importorskip("opentelemetry.sdk")
    exporter_mod = pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    from opentelemetry.sdk.resources import Resource as SdkResource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    with T.Sink() as sink:
        provider = TracerProvider(resource=SdkResource.create({"service.name": "servectl",
                                                               "servectl.component": "manager"}))
        provider.add_span_processor(SimpleSpanProcessor(exporter_mod.OTLPSpanExporter(endpoint=sink.endpoint)))
        tracer = provider.get_tracer("bench-test")
        with tracer.start_as_current_span("restart"):
            with tracer.start_as_current_span("wait"):
                pass
        provider.shutdown()
        assert sink.take() == {"total": 2, "by_source": {"servectl/manager": 2}} and sink.bad == 0


def test_rounds_gets_servectl_against_itself_with_the_sdks_variables_on_side_b_start_only(tmp_path):
    out = tmp_path / "t.json"
    p = T.parser().parse_args(["--rounds", "1", "--prompts", "8", "--out", str(out)])
    argv = T.rounds_argv(p, "http://127.0.0.1:4318/v1/traces", ["--ceiling"])
    rp = R.parser().parse_args(argv)
    R.check(rp)
    assert (rp.only, rp.no_standby, rp.rounds, rp.prompts, rp.concurrency, rp.out, rp.ceiling) == (
        "servectl", True, 1, 8, "1,16", out, True)
    assert rp.env_a == rp.env_b == rp.engine_arg_a == rp.engine_arg_b == rp.start_env_a == []
    off, on = R.plan(rp)
    assert (off.name, on.name) == (T.OFF, T.ON) and off.kind == on.kind == "servectl"
    assert off.start_env == {} and off.env == on.env == {}
    assert on.start_env == {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces",
                            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                            "OTEL_TRACES_SAMPLER": "always_on"}
    assert T.parser().parse_args([]).concurrency == "1,16" and T.parser().parse_args([]).out.name.endswith(
        "-tracing.json")


def test_names_need_only_and_differ():
    with pytest.raises(SystemExit, match="--only"):
        R.check(R.parser().parse_args(["--name-a", "x"]))
    with pytest.raises(SystemExit, match="two names"):
        R.check(R.parser().parse_args(["--only", "servectl", "--name-a", "x", "--name-b", "x"]))


def rnd(spans: int) -> dict:
    return {"stream": {"1": {"output_throughput": 100.0}}, "non_stream_c16": {"tok_s": 10.0},
            "spans": {"total": spans, "by_source": {"servectl/gateway": spans} if spans else {}}}


def test_tracing_on_rounds_with_no_spans_void_the_figures_and_the_table_says_so():
    raw = {T.OFF: [rnd(0), rnd(0)], T.ON: [rnd(120), rnd(0)]}
    spans, notes, void = T.span_notes(raw)
    assert void and spans["per_round"] == {T.OFF: [0, 0], T.ON: [120, 0]}
    assert notes[0].startswith(f"**{T.VOID}**") and "round(s) 2" in notes[0]
    res = {"date": "d", "machine": {"cores": 2, "cpu": "x"}, "rounds": 2, "params": {"input_len": 32, "output_len": 64},
           "raw": raw, "notes": notes, "summary": {s: R.summarize(raw[s]) for s in raw}}
    md = R.markdown(res, T.OFF, T.ON)
    assert T.VOID in md and md.index(T.VOID) < md.index("| figure |")
    _, notes, void = T.span_notes({T.OFF: [rnd(0)], T.ON: [rnd(0)]})
    assert void and "in any round" in notes[0]


def test_spans_in_every_on_round_leave_the_figures_standing():
    spans, notes, void = T.span_notes({T.OFF: [rnd(0)] * 3, T.ON: [rnd(1500), rnd(1400), rnd(1600)]})
    assert not void and spans["on_by_source"] == {"servectl/gateway": 4500}
    assert not any(T.VOID in n for n in notes) and "1,500, 1,400, 1,600" in notes[0]
    _, notes, void = T.span_notes({T.OFF: [rnd(7)], T.ON: [rnd(10)]})
    assert not void and any(f"during {T.OFF}" in n for n in notes)  # flagged, not voided
