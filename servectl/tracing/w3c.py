"""W3C Trace Context between servectl's processes: ``traceparent`` strings in and out.

A span's context crosses a process boundary as its ``traceparent`` (``00-<trace>-<span>-<flags>``,
https://www.w3.org/TR/trace-context/): in a ``Generate`` to the engine (so the engine's spans and
vLLM's ``llm_request`` join the gateway's trace), in the engine's ``HelloReply`` (its start span,
which a resumed request links to), and back to a client as ``traceresponse``. OpenTelemetry is
imported only by the functions that need it, which run only with tracing on.
"""

from __future__ import annotations

import re
from typing import Any

_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def parse_traceparent(value: str) -> tuple[int, int, int] | None:
    """(trace id, span id, flags), or None for anything that is not a valid version-00 header."""
    m = _TRACEPARENT.fullmatch(value.strip()) if value else None
    if m is None:
        return None
    trace_id, span_id = int(m[1], 16), int(m[2], 16)
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, int(m[3], 16)


def traceparent(span: Any) -> str:
    """A span's context as a ``traceparent`` value ("" for a span that is not recording)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return format_traceparent(ctx.trace_id, ctx.span_id, int(ctx.trace_flags))


def log_ids(span: Any) -> dict[str, str]:
    """The log fields that tie a line to a span (JSON logs, the journal): {} for no valid span."""
    ctx = span.get_span_context()
    return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"} if ctx.is_valid else {}


def context_of(value: str) -> Any:
    """The OpenTelemetry ``SpanContext`` a ``traceparent`` names (remote), or None."""
    parsed = parse_traceparent(value)
    if parsed is None:
        return None
    from opentelemetry.trace import SpanContext, TraceFlags

    return SpanContext(parsed[0], parsed[1], is_remote=True, trace_flags=TraceFlags(parsed[2] & 1))


def parent_of(value: str) -> Any:
    """An OpenTelemetry ``Context`` whose current span is the one a ``traceparent`` names (None: a root)."""
    span_context = context_of(value)
    if span_context is None:
        return None
    from opentelemetry import trace

    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))
