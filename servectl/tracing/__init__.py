"""OpenTelemetry traces: on in every process of the tree when an OTLP endpoint is configured.

The switch is the OpenTelemetry SDK's own environment (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_ENDPOINT``; ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` ``grpc`` or
``http/protobuf``; ``OTEL_SERVICE_NAME``; ``OTEL_TRACES_SAMPLER``; ``OTEL_SDK_DISABLED``), given to
``servectl start`` or the unit, or ``[manager] otlp_traces_endpoint``, which the manager puts in
that environment for the whole tree (as the log format). Every process calls ``start`` once it
knows what it is; with no endpoint it returns None, imports nothing of OpenTelemetry and each
call site's ``if tracer is None`` is all tracing costs.

Each process exports under its own ``service.instance.id`` with ``servectl.component``
(``gateway``, ``engine``, ``manager``) and, where it has one, ``servectl.model``. Spans leave
through ``QuietBatchProcessor`` (export.py): batched off the hot path, and nothing ticks while
no span waits. The SDK (``opentelemetry-sdk`` and its OTLP exporters) comes with vLLM.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

log = logging.getLogger("servectl.tracing")

ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACES_ENDPOINT_ENV = ENDPOINT_ENVS[0]
PROTOCOLS = ("grpc", "http/protobuf")
COMPONENT_ATTR = "servectl.component"


def endpoint(env: dict[str, str] | os._Environ = os.environ) -> str | None:
    """The OTLP endpoint traces go to, or None: tracing is off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    return next((env[name] for name in ENDPOINT_ENVS if env.get(name)), None)


def protocol(env: dict[str, str] | os._Environ = os.environ) -> str:
    """The OTLP protocol: the SDK's variables, else ``grpc`` (what `vllm serve
    --otlp-traces-endpoint` uses, so the same collector address works)."""
    value = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    return value.strip().lower()


def check_env(env: dict[str, str] | os._Environ = os.environ) -> str | None:
    """What is wrong with the tracing environment, for ``servectl start`` to refuse it; None if fine."""
    if endpoint(env) is None:
        return None
    if protocol(env) not in PROTOCOLS:
        return (f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol(env)!r}: servectl exports traces with "
                f"{' or '.join(PROTOCOLS)}")
    return None


def start(component: str, model: str | None = None, **attributes: str) -> Any:
    """This process's tracer (an OpenTelemetry ``Tracer``), or None when tracing is off.

    Sets the global tracer provider, so vLLM's own spans (its ``llm_request``) in this process go
    out the same way, under the same resource."""
    url = endpoint()
    if url is None:
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        from servectl.tracing.export import QuietBatchProcessor
    except ImportError as exc:  # vLLM brings the SDK; a stripped environment may not have it
        log.error("tracing is configured (%s) but OpenTelemetry's SDK cannot be imported: %s", url, exc)
        return None
    attrs = {"service.name": os.environ.get("OTEL_SERVICE_NAME") or "servectl",
             "service.instance.id": f"{component}-{uuid.uuid4().hex[:12]}",
             COMPONENT_ATTR: component, "process.pid": os.getpid(), **attributes}
    if model is not None:
        attrs["servectl.model"] = model
    # Resource.create adds OTEL_RESOURCE_ATTRIBUTES; OTEL_SERVICE_NAME wins over ours (above).
    provider = TracerProvider(resource=Resource.create(attrs))  # sampler: OTEL_TRACES_SAMPLER
    provider.add_span_processor(QuietBatchProcessor(exporter(url)))
    trace.set_tracer_provider(provider)
    log.info("tracing to %s (%s) as %s", url, protocol(), attrs["service.instance.id"])
    return provider.get_tracer("servectl")


def exporter(url: str) -> Any:
    """The SDK's OTLP span exporter for the configured protocol; it reads the rest (headers,
    certificates, timeout, compression) from the SDK's environment itself."""
    if protocol() == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        # The signal's own variable is used as given; the generic one gets the signal's path.
        if os.environ.get(TRACES_ENDPOINT_ENV):
            return OTLPSpanExporter(endpoint=url)
        return OTLPSpanExporter(endpoint=url.rstrip("/") + "/v1/traces")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    return GrpcExporter(endpoint=url)


def flush(timeout_s: float) -> None:
    """Export what is queued, waiting at most ``timeout_s`` (a process about to die of a signal)."""
    try:
        from opentelemetry import trace

        provider = trace.get_tracer_provider()
        if hasattr(provider, "force_flush"):
            provider.force_flush(int(timeout_s * 1000))
    except Exception:  # noqa: BLE001 - a collector that is gone costs the spans, never the exit
        log.debug("tracing flush", exc_info=True)
