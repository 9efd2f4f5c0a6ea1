"""Traces (issue 56, items 1 and 4) on a real daemon, received by an OTLP/HTTP receiver in this
process that decodes the real protocol (tests/otlp_receiver.py).

One daemon with the OpenTelemetry SDK's environment pointing at the receiver (and JSON logs, whose
access line carries the trace): a completion that continues a client's ``traceparent``, a streamed
chat through the `openai` SDK, an embeddings request (vLLM's span per input), a request held while
its released model starts again, and a stream across a worker SIGKILL each give one trace: the
gateway's server span, its admission, hold and ``servectl.engine`` children, the engine's queue /
prefill / decode spans and vLLM's own ``llm_request`` under the engine span, each process under its
own resource; the crash and the resume as events with a link to the new engine's start span; a
replica's crash and the failover to the other replica likewise. The manager's restart, release
and wake are spans of their own. With tracing on and no traffic the tree still sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import threading
import time

import pytest

from conftest import DaemonFactory, context_switches, http, wait_for
from otlp_receiver import OtlpReceiver
from servectl.config import DEFAULT_MODEL_DIR

MODEL = "traced"
RELEASE_S = 15
CONFIG = f"""
[manager]
warm_standby = false
freeze_grace_s = 0.5
log_format = "json"
[[models]]
name = "{MODEL}"
model = "{DEFAULT_MODEL_DIR}"
idle_release_s = {RELEASE_S}
[[models]]
name = "twin"
model = "{DEFAULT_MODEL_DIR}"
replicas = 2
[[models]]
name = "embed"
model = "{DEFAULT_MODEL_DIR}"
[models.engine_args]
runner = "pooling"
convert = "embed"
dtype = "float32"
"""
SERVER, CLIENT = 2, 3  # the protocol's SpanKind values


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced(tmp_path_factory, receiver):
    with DaemonFactory(tmp_path_factory, "traced") as make:
        yield make(CONFIG, env=receiver.env())


def parent_header() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def sampled_response(value: str) -> tuple[str, str]:
    """(trace id, span id) of a ``traceresponse`` whose sampled flag is set (W3C level 2 may add
    the random-trace-id flag, 0x02)."""
    version, trace_id, span_id, flags = value.split("-")
    assert version == "00" and int(flags, 16) & 1, value
    return trace_id, span_id


def whole_trace(receiver, trace_id: str, names: set[str], timeout: float = 60):
    """The trace's spans once every name in ``names`` arrived."""
    return wait_for(lambda: (spans := receiver.trace(trace_id)) and names <= {s.name for s in spans} and spans,
                    timeout, what=f"spans {sorted(names)} of trace {trace_id}",
                    diagnose=lambda: str(sorted((s.name, s.component) for s in receiver.trace(trace_id))))


def one(spans, name: str):
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.name, s.span_id) for s in spans])
    return found[0]


def server_span(spans, route: str):
    return one([s for s in spans if s.kind == SERVER and s.component == "gateway"], f"POST {route}")


def check_engine_side(spans, engine_span) -> None:
    """The engine's spans and vLLM's under the gateway's engine span, from the engine's process."""
    for name in ("servectl.queue", "servectl.prefill", "servectl.decode", "llm_request"):
        s = one(spans, name)
        assert s.parent == engine_span.span_id, name
        assert s.component == "engine" and s.resource["servectl.model"] == MODEL, name
        assert s.resource["servectl.incarnation"] == engine_span.attributes["servectl.incarnation"], name
    llm = one(spans, "llm_request")  # vLLM's own span, with its gen_ai attributes
    assert llm.attributes["gen_ai.usage.completion_tokens"] > 0
    assert llm.attributes["gen_ai.usage.prompt_tokens"] > 0
    for attr in ("gen_ai.latency.time_to_first_token", "gen_ai.latency.time_in_queue",
                 "gen_ai.latency.time_in_model_decode"):
        assert attr in llm.attributes, attr
    queue, prefill, decode = (one(spans, n) for n in ("servectl.queue", "servectl.prefill", "servectl.decode"))
    assert queue.end_ns <= prefill.start_ns + 1 and prefill.end_ns <= decode.start_ns + 1
    assert engine_span.start_ns <= queue.start_ns and decode.end_ns <= engine_span.end_ns + 50_000_000


def test_a_completion_continues_the_clients_trace(traced, receiver):
    header, trace_id, client_span = parent_header()
    r = http(traced, "POST", "/v1/completions", {"model": MODEL, "prompt": "def ", "max_tokens": 6,
                                                  "ignore_eos": True}, headers={"traceparent": header}, timeout=300)
    assert r.status == 200, r.body[:300]
    spans = whole_trace(receiver, trace_id, {"POST /v1/completions", "servectl.admission", "servectl.engine",
                                             "servectl.decode", "llm_request"})
    server = server_span(spans, "/v1/completions")
    assert server.parent == client_span  # the client's span is its parent
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["gen_ai.request.model"] == MODEL
    assert server.attributes["gen_ai.usage.output_tokens"] == 6
    assert server.attributes["servectl.request_id"] == r.headers["X-Request-Id"]
    # traceresponse: the same trace, the server span.
    assert sampled_response(r.headers["traceresponse"]) == (trace_id, server.span_id)
    assert one(spans, "servectl.admission").parent == server.span_id
    engine = one(spans, "servectl.engine")
    assert engine.parent == server.span_id and engine.kind == CLIENT and engine.status != 2
    assert [e[0] for e in engine.events] == ["first_token"]
    check_engine_side(spans, engine)
    # One instance per process: the gateway's and the engine's resources differ.
    gateway_res, engine_res = server.resource, one(spans, "llm_request").resource
    assert gateway_res["service.name"] == "servectl" and engine_res["service.name"] == "servectl"
    assert gateway_res["service.instance.id"] != engine_res["service.instance.id"]
    assert gateway_res["process.pid"] == traced.child("gateway:0").pid
    assert engine_res["process.pid"] == traced.child(f"engine_core:{MODEL}").pid
    # The JSON access line carries the trace.
    log = traced.runtime_dir / "state" / "logs" / "gateway-0.log"
    line = wait_for(lambda: next((o for o in map(json.loads, log.read_text().splitlines())
                                  if o.get("request_id") == r.headers["X-Request-Id"]
                                  and o["logger"] == "api_gateway.access"), None), 30, what="the access line")
    assert (line["trace_id"], line["span_id"]) == (trace_id, server.span_id)


def test_a_streamed_chat_through_the_sdk_is_one_trace(traced, receiver):
    client = traced.openai()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
        extra_body={"ignore_eos": True})
    trace_id = raw.headers["traceresponse"].split("-")[1]  # no traceparent sent: a new trace
    chunks = list(raw.parse())
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 0
    spans = whole_trace(receiver, trace_id, {"POST /v1/chat/completions", "servectl.engine", "llm_request"})
    server = server_span(spans, "/v1/chat/completions")
    assert server.parent == ""  # a root
    assert sampled_response(raw.headers["traceresponse"]) == (trace_id, server.span_id)
    engine = one(spans, "servectl.engine")
    assert engine.parent == server.span_id
    check_engine_side(spans, engine)


def test_an_embeddings_request_is_one_trace_with_vllms_span_per_input(traced, receiver):
    header, trace_id, _ = parent_header()
    r = http(traced, "POST", "/v1/embeddings", {"model": "embed", "input": ["def foo():", "import os"]},
             headers={"traceparent": header}, timeout=300)
    assert r.status == 200, r.body[:300]
    spans = whole_trace(receiver, trace_id, {"POST /v1/embeddings", "servectl.engine", "llm_request"})
    server = server_span(spans, "/v1/embeddings")
    engine = one(spans, "servectl.engine")
    assert engine.parent == server.span_id
    wait_for(lambda: len([s for s in receiver.trace(trace_id) if s.name == "llm_request"]) == 2, 30,
             what="vLLM's span for each input")
    llm = [s for s in receiver.trace(trace_id) if s.name == "llm_request"]
    assert all(s.parent == engine.span_id and s.component == "engine" for s in llm)
    assert all(s.resource["servectl.model"] == "embed" for s in llm)


def test_the_idle_tree_sleeps_with_tracing_on(traced, receiver):
    http(traced, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=300)
    wait_for(lambda: all(c.state == "idle (frozen)" for c in traced.status().children if c.kind == "worker"),
             30, what="workers frozen")
    time.sleep(0.5)  # the spans of that request exported (100 ms delay here)
    pids = [traced.manager_pid] + [c.pid for c in traced.status().children if c.pid]
    exported = receiver.requests
    before = context_switches(pids)
    time.sleep(5)  # the measurement: what the idle, traced tree does over a fixed window
    quiet = context_switches(pids) - before
    assert quiet <= 25, f"{quiet} context switches in 5 s of idle with tracing on"
    assert receiver.requests == exported  # and nothing was exported meanwhile


def test_a_request_held_while_its_model_starts_again(traced, receiver):
    wait_for(lambda: next(m for m in traced.status().models if m.name == MODEL).state == "released",
             RELEASE_S + 60, what="the model released")
    header, trace_id, _ = parent_header()
    r = http(traced, "POST", "/v1/completions", {"model": MODEL, "prompt": "def ", "max_tokens": 4},
             headers={"traceparent": header}, timeout=600)
    assert r.status == 200, r.body[:300]
    spans = whole_trace(receiver, trace_id, {"POST /v1/completions", "servectl.hold", "llm_request"})
    server = server_span(spans, "/v1/completions")
    hold = one(spans, "servectl.hold")
    assert hold.parent == server.span_id and hold.attributes["servectl.model.state"] == "released"
    engine = one(spans, "servectl.engine")
    assert hold.end_ns <= engine.start_ns  # held, then sent
    check_engine_side(spans, engine)
    # The manager's side: the release, and the wake that started it again, as spans of their own.
    release = wait_for(lambda: [s for s in receiver.named("servectl.release") if s.component == "manager"],
                       30, what="the manager's release span")
    wake = wait_for(lambda: [s for s in receiver.named("servectl.wake") if s.component == "manager"
                             and s.attributes.get("servectl.end_state") == "ready"], 30, what="the wake span")
    assert release[-1].attributes["gen_ai.request.model"] == MODEL and wake[-1].status != 2
    assert wake[-1].start_ns <= engine.start_ns <= wake[-1].end_ns + 1_000_000_000


def test_a_stream_across_a_worker_sigkill_is_one_trace_with_its_resume(traced, receiver):
    header, trace_id, _ = parent_header()
    client = traced.openai(default_headers={"traceparent": header})
    before = traced.child(f"engine_core:{MODEL}").pid
    worker = traced.child(f"worker:{MODEL}:0").pid
    stream = client.completions.create(model=MODEL, prompt="def ", max_tokens=480, stream=True,
                                       extra_body={"ignore_eos": True}, temperature=0)
    got, killed = [], False
    for chunk in stream:
        got.append(chunk.choices[0].text)
        if not killed and len(got) >= 3:
            killed = True
            os.kill(worker, signal.SIGSTOP)  # no step more (the stream cannot end before the kill)
            os.kill(worker, signal.SIGKILL)
    assert killed and len(got) > 3
    spans = whole_trace(receiver, trace_id, {"POST /v1/completions", "llm_request"}, timeout=120)
    def both_engine_spans():
        spans = receiver.trace(trace_id)
        return spans if len([s for s in spans if s.name == "servectl.engine"]) == 2 else None

    spans = wait_for(both_engine_spans, 60, what="both engine spans")
    server = server_span(spans, "/v1/completions")
    events = [name for name, _ in server.events]
    assert events == ["servectl.engine_gone", "servectl.resume"], events
    first, second = sorted((s for s in spans if s.name == "servectl.engine"), key=lambda s: s.start_ns)
    assert first.status == 2 and second.status != 2
    assert first.attributes["servectl.incarnation"] != second.attributes["servectl.incarnation"]
    assert second.attributes["servectl.resumed"] is True
    resume = dict(server.events)["servectl.resume"]
    assert resume["servectl.incarnation"] == second.attributes["servectl.incarnation"]
    # The link: to the new engine's start span, exported by the new engine.
    starts = wait_for(lambda: [s for s in receiver.named("servectl.engine.start")
                               if s.resource.get("servectl.incarnation") == resume["servectl.incarnation"]],
                      60, what="the new engine's start span")
    assert (starts[0].trace_id, starts[0].span_id) in {(t, s) for t, s, _ in server.links}
    assert (starts[0].trace_id, starts[0].span_id) in {(t, s) for t, s, _ in second.links}
    # The gateway's log line about the resume, made inside the request's span, carries its trace.
    log = traced.runtime_dir / "state" / "logs" / "gateway-0.log"
    going_on = [o for o in map(json.loads, log.read_text().splitlines()) if "going on with" in o["message"]
                and o.get("trace_id") == trace_id]
    assert going_on and going_on[0]["span_id"] == server.span_id
    check_engine_side([s for s in spans if s.parent == second.span_id], second)
    assert traced.child(f"engine_core:{MODEL}").pid != before
    # The manager's restart, with the new incarnation.
    restart = wait_for(lambda: [s for s in receiver.named("servectl.restart") if s.component == "manager"
                                and s.attributes.get("servectl.end_state") == "ready"], 60, what="the restart span")
    assert restart[-1].attributes["servectl.new_incarnation"] == resume["servectl.incarnation"]


def cpu_ticks(pid: int) -> int:
    """The process's user and system time so far, in clock ticks (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def busy_one(pids: list[int], window_s: float = 0.3) -> int:
    """Which of ``pids`` runs steps: an idle worker sleeps in the kernel and gains no ticks."""
    before = [cpu_ticks(p) for p in pids]
    time.sleep(window_s)
    gained = [cpu_ticks(p) - b for p, b in zip(pids, before)]
    assert max(gained) > 0 and gained.count(max(gained)) == 1, gained
    return pids[gained.index(max(gained))]


def test_a_failover_to_the_other_replica_is_an_event_with_a_link_to_it(traced, receiver):
    """A stream on one replica of "twin", its worker stopped once the stream has begun; a second
    stream then goes to the other replica (the least loaded takes the next), whose worker is stopped
    once it has begun too, so neither can finish. Then the first replica's worker is killed and the
    other's continued: the first stream goes on at once on the other replica, whose start span the
    resume links to. One at a time, because a stream sent with the other could end before the
    other's began (480 tokens take a few seconds)."""
    headers = [parent_header() for _ in range(2)]
    started = [threading.Event() for _ in headers]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            client = traced.openai(default_headers={"traceparent": headers[i][0]}, timeout=300)
            for n, _ in enumerate(client.completions.create(model="twin", prompt=f"def f{i}(", max_tokens=480,
                                                            stream=True, extra_body={"ignore_eos": True})):
                if n >= 2:
                    started[i].set()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = {traced.child(f"worker:twin@{r}:0").pid: f"twin@{r}" for r in range(2)}
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    stopped: list[int] = []
    try:
        for i, t in enumerate(threads):
            t.start()
            assert started[i].wait(120), errors
            pid = busy_one([p for p in workers if p not in stopped])
            os.kill(pid, signal.SIGSTOP)  # this replica takes no step more
            stopped.append(pid)
    except BaseException:
        for pid in stopped:  # the module's later tests need both replicas running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        raise
    first, other = stopped
    with contextlib.suppress(ProcessLookupError):  # gone already if its engine judged it hung
        os.kill(first, signal.SIGKILL)
    os.kill(other, signal.SIGCONT)
    for t in threads:
        t.join(300)
    assert not errors, errors
    moved = []
    for _, trace_id, _ in headers:
        spans = whole_trace(receiver, trace_id, {"POST /v1/completions", "llm_request"}, timeout=120)
        server = server_span(spans, "/v1/completions")
        if server.events:
            moved.append((server, spans))
    assert len(moved) == 1, "one stream ran on the killed replica"
    server, spans = moved[0]
    resume = dict(server.events)["servectl.resume"]
    assert resume["servectl.replica"] == workers[other]
    starts = [s for s in receiver.named("servectl.engine.start")
              if s.resource.get("servectl.replica") == workers[other]
              and s.resource.get("servectl.incarnation") == resume["servectl.incarnation"]]
    assert len(starts) == 1
    assert (starts[0].trace_id, starts[0].span_id) in {(t, s) for t, s, _ in server.links}
    engines = sorted((s for s in spans if s.name == "servectl.engine"), key=lambda s: s.start_ns)
    assert [e.attributes["servectl.replica"] for e in engines] == [workers[first], workers[other]]
