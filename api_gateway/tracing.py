"""The gateway's spans: one server span per HTTP request, its admission, holds and engine lifetimes.

``tracer`` is None unless tracing is on (servectl/tracing); every function here is called only
behind ``if tracing.tracer is not None`` (or is a no-op without it), so tracing off costs a
comparison. A request's trace:

- the server span (``Middleware``): ``<METHOD> <route>``, an incoming W3C ``traceparent``
  continued, ``traceresponse`` returned; the model, the status, the token counts;
- ``servectl.admission``: the checks before anything is queued (a 4xx there ends it);
- ``servectl.hold``: a wait for the model (loading, waking, a restart, another model's eviction),
  with the model's state when it began;
- ``servectl.engine``: each engine lifetime the request ran on (``RunTrace``), linked to that
  engine's start span; the engine's own spans (queue, prefill, decode, vLLM's ``llm_request``)
  are its children, across the process boundary (``Generate.trace_parent``). An engine that
  went away under the request and the request's resume on another one are events on the server
  span (``servectl.engine_gone``, ``servectl.resume``), the resume with a link to the new
  engine's start span.
"""

from __future__ import annotations

import contextlib
from typing import Any

from servectl import tracing
from servectl.tracing.w3c import context_of, traceparent

tracer: Any = None  # this process's Tracer, or None: tracing is off


def start(index: int) -> None:
    global tracer
    tracer = tracing.start("gateway", **{"servectl.gateway.index": str(index)})


def server_span(request: Any) -> Any:
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract(request.headers)  # a client's traceparent
    route = request.match_info.route.resource
    path = route.canonical if route is not None else request.path
    return tracer.start_span(f"{request.method} {path}", context=parent, kind=SpanKind.SERVER,
                             attributes={"http.request.method": request.method, "url.path": request.path,
                                         "http.route": path, "servectl.request_id": request["request_id"]})


def current(span: Any):
    """``span`` made the current one for a block (it is ended elsewhere)."""
    from opentelemetry import trace

    return trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)


def end_server_span(span: Any, status: int, info: dict) -> None:
    """The answer's status and what the request was (model, tokens), then the span ends."""
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("http.response.status_code", status)
    for attr, key in (("gen_ai.request.model", "model"), ("gen_ai.usage.input_tokens", "prompt_tokens"),
                      ("gen_ai.usage.output_tokens", "completion_tokens")):
        if info.get(key) is not None:
            span.set_attribute(attr, info[key])
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
    span.end()


def span(name: str, **attributes: Any):
    """A child of the current span, made current (nothing without tracing)."""
    if tracer is None:
        return contextlib.nullcontext()
    return tracer.start_as_current_span(name, attributes=attributes)


def hold(model: str, state: str, why: str = ""):
    """``servectl.hold``: the request waits for its model (nothing without tracing)."""
    attrs = {"gen_ai.request.model": model, "servectl.model.state": state}
    if why:
        attrs["servectl.hold.reason"] = why
    return span("servectl.hold", **attrs)


class RunTrace:
    """The engine lifetimes one request ran on (sequences.py's ``RequestRun``), as spans."""

    def __init__(self):
        self.request_span: Any = None  # the span current when it first runs: the server span
        self.current: Any = None
        self.first_token = False

    def attempt(self, model: str, incarnation: str, replica: str, start_span: str, resumed: bool) -> str:
        """A ``servectl.engine`` span for one engine lifetime; its ``traceparent`` for the engine."""
        from opentelemetry import trace
        from opentelemetry.trace import Link, SpanKind

        if self.request_span is None:  # (made during admission; run after it, in the handler's span)
            self.request_span = trace.get_current_span()
        target = context_of(start_span)
        self.current = tracer.start_span(
            "servectl.engine", context=trace.set_span_in_context(self.request_span), kind=SpanKind.CLIENT,
            links=[Link(target, {"servectl.link": "engine_start"})] if target is not None else None,
            attributes={"gen_ai.request.model": model, "servectl.incarnation": incarnation,
                        "servectl.replica": replica, "servectl.resumed": resumed})
        return traceparent(self.current)

    def token(self) -> None:
        if not self.first_token and self.current is not None:
            self.first_token = True
            self.current.add_event("first_token")

    def gone(self, why: str, hung: bool) -> None:
        """The engine went away under the request (a crash, a hang, a release)."""
        from opentelemetry.trace import Status, StatusCode

        attrs = {"servectl.reason": why[:500], "servectl.hung": hung}
        self.request_span.add_event("servectl.engine_gone", attrs)
        if self.current is not None:
            self.current.set_status(Status(StatusCode.ERROR, why[:200]))
            self.current.end()
            self.current = None

    def resumed(self, model: str, replica: str, incarnation: str, start_span: str, restarts: int,
                requests: int) -> None:
        """The request goes on on a new engine lifetime (a restart, or another replica: a failover)."""
        attrs = {"gen_ai.request.model": model, "servectl.replica": replica, "servectl.incarnation": incarnation,
                 "servectl.restarts": restarts, "servectl.engine_requests": requests}
        self.request_span.add_event("servectl.resume", attrs)
        target = context_of(start_span)
        if target is not None and hasattr(self.request_span, "add_link"):
            self.request_span.add_link(target, {"servectl.link": "resumed_on", "servectl.incarnation": incarnation})

    def end(self, error: BaseException | None = None) -> None:
        if self.current is None:
            return
        if error is not None and not isinstance(error, GeneratorExit):
            from opentelemetry.trace import Status, StatusCode

            self.current.set_status(Status(StatusCode.ERROR, type(error).__name__))
        self.current.end()
        self.current = None
