"""The engine's spans (tracing on): its start, and each request's queue, prefill and decode.

``EngineTracing`` exists only with tracing on (servectl/tracing). It turns on vLLM's own request
tracing in the output processor (vLLM's ``llm_request`` span with its gen_ai attributes, made by
vLLM's tracing module from the ``trace_headers`` the request was added with) without vLLM's
``init_tracer``, whose ``BatchSpanProcessor`` would wake every 5 s: the process's provider is
servectl's, so vLLM's span leaves through it. Both are children of the gateway's
``servectl.engine`` span the request's ``Generate.trace_parent`` names, so one trace shows the
HTTP request, its holds, and what the engine did with it.

The queue, prefill and decode spans are made when the request finishes, from the timestamps
vLLM's output processor kept (``RequestStateStats``: engine-core monotonic times, put on the wall
clock here): no per-step cost.
"""

from __future__ import annotations

import atexit
import logging
import time
from typing import Any

from servectl import tracing
from servectl.tracing.w3c import parent_of, traceparent

log = logging.getLogger("engine_core")


class EngineTracing:
    def __init__(self, tracer: Any, model: str, incarnation: str):
        self.tracer = tracer
        self.model = model
        self.incarnation = incarnation
        self.parents: dict[str, str] = {}  # request id -> its traceparent (the gateway's span)
        self.start_span = tracer.start_span("servectl.engine.start", attributes={
            "gen_ai.request.model": model, "servectl.incarnation": incarnation})
        # Current until loaded: vLLM's own load spans (its ``@instrument``) are its children.
        from opentelemetry import context, trace

        self._loading = context.attach(trace.set_span_in_context(self.start_span))
        # Registered after the provider's shutdown (tracing.start): runs before it, so a start
        # that ends in an exit or a crash is exported, in error.
        atexit.register(self.exited)

    @classmethod
    def start(cls, model: str, incarnation: str, group: str) -> EngineTracing | None:
        tracer = tracing.start("engine", model=model, **{"servectl.incarnation": incarnation,
                                                          "servectl.replica": group})
        return cls(tracer, model, incarnation) if tracer is not None else None

    def loaded(self, engine: Any) -> str:
        """The model is loaded: the start span ends; vLLM's request spans on. Its traceparent
        (for the HelloReply: requests resumed here link to it)."""
        from opentelemetry import context

        context.detach(self._loading)
        processor = getattr(engine, "output_processor", None)
        if processor is not None and hasattr(processor, "tracing_enabled"):
            if getattr(engine, "log_stats", False):
                processor.tracing_enabled = True
            else:  # vLLM's span is made from its request stats (it asserts they are kept)
                log.warning("disable_log_stats is set: vLLM's llm_request spans and servectl's queue, "
                            "prefill and decode spans are not made")
        self.start_span.end()
        return traceparent(self.start_span)

    def exited(self) -> None:
        """At exit: a start that never got to ready ends in error (the engine's log says why)."""
        from opentelemetry.trace import Status, StatusCode

        if self.start_span.is_recording():
            self.start_span.set_status(Status(StatusCode.ERROR, "the engine exited before it was ready"))
            self.start_span.end()

    def added(self, request_id: str, parent: str) -> dict[str, str] | None:
        """A request added with its gateway span's traceparent: the trace headers vLLM gets."""
        if not parent:
            return None
        self.parents[request_id] = parent
        return {"traceparent": parent}

    def headers(self, request_id: str) -> dict[str, str] | None:
        """The trace headers of a request's next call to vLLM (speech: one per window)."""
        parent = self.parents.get(request_id)
        return {"traceparent": parent} if parent else None

    def finished(self, request_id: str, output: Any) -> None:
        """Its queue, prefill and decode spans (of one call to vLLM), from vLLM's timestamps."""
        parent = self.parents.get(request_id, "")
        stats = getattr(output, "metrics", None)
        if not parent or stats is None or not getattr(stats, "scheduled_ts", 0):
            return
        context = parent_of(parent)
        to_wall = time.time() - time.monotonic()  # the stats' monotonic times on the wall clock

        def ns(mono: float) -> int:
            return int((mono + to_wall) * 1e9)

        attrs = {"gen_ai.request.model": self.model, "gen_ai.request.id": request_id}
        phases = [("servectl.queue", stats.queued_ts or stats.scheduled_ts, stats.scheduled_ts)]
        if stats.first_token_ts:
            phases.append(("servectl.prefill", stats.scheduled_ts, stats.first_token_ts))
            if stats.last_token_ts > stats.first_token_ts:
                phases.append(("servectl.decode", stats.first_token_ts, stats.last_token_ts))
        for name, begin, end in phases:
            span = self.tracer.start_span(name, context=context, start_time=ns(begin), attributes=attrs)
            if name == "servectl.decode":
                span.set_attribute("gen_ai.usage.output_tokens", stats.num_generation_tokens)
                span.set_attribute("servectl.preemptions", stats.num_preemptions)
            span.end(end_time=ns(end))

    def forget(self, request_id: str) -> None:
        self.parents.pop(request_id, None)

    def flush(self) -> None:
        """Before the engine dies of the manager's SIGTERM (no atexit runs): what is queued goes."""
        tracing.flush(2.0)
