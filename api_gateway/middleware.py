"""What every request goes through before and after its route: the gateway's aiohttp middleware.

``Middleware``: the Host allowlist, the CORS preflight and headers, the API-key check (on
``/v1``, ``/v2`` and ``KEYED_PATHS``), an X-Request-Id for every answer, errors in the shape
of the API asked (``error_response``), the access log line with its request counter and, with
tracing on, the request's server span (api_gateway/tracing.py) around all of it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import Callable

from aiohttp import web

from api_gateway import tracing as T
from api_gateway.admin import LORA_PATHS
from api_gateway.batch_runner import OWNER_HEADER as BATCH_OWNER
from api_gateway.batch_runner import SECRET_HEADER as BATCH_SECRET
from api_gateway.batch_runner import BatchAuth
from api_gateway.errors import HttpError, error_body, http_error_body
from api_gateway.http_policy import CorsPolicy, HostPolicy
from api_gateway.keys import OPEN, KeyRing, RequestKey, bearer_token
from api_gateway.logfields import escape
from api_gateway.metrics import Metrics
from api_gateway.passthrough import MESSAGES_PREFIX, POOLING_PATHS, anthropic_error_body
from servectl.tracing.w3c import log_ids, traceparent

log = logging.getLogger("api_gateway")
access_log = logging.getLogger("api_gateway.access")

# Outside /v1 but guarded by the API keys like it (vLLM's tokenizer and pooling endpoints; where
# the KV-cache events are, which say what the engines cache).
KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info", "/kv_event_sources", *POOLING_PATHS})


def error_response(exc: HttpError, path: str = "") -> web.Response:
    """The error in the shape of the API asked: Anthropic's on /v1/messages, else OpenAI's."""
    body = anthropic_error_body(exc) if path.startswith(MESSAGES_PREFIX) else http_error_body(exc)
    resp = web.Response(status=exc.status, body=body, content_type="application/json", headers=exc.headers)
    if exc.status in (408, 413):
        resp.force_close()  # the body was not read: the connection cannot carry another request
    return resp


# An X-Request-Id we echo back and log: a client's, if it is plain enough, else our own.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")



def on_unix_socket(request: web.Request) -> bool:
    """Came through a Unix socket (the batch runner's), not the public listener."""
    transport = request.transport
    return transport is not None and isinstance(transport.get_extra_info("sockname"), str)


class Middleware:
    """The gateway's middleware; ``keys`` gives the keys in force now (a reload replaces them)."""

    def __init__(self, hosts: HostPolicy, cors: CorsPolicy, metrics: Metrics, keys: Callable[[], KeyRing],
                 finished: Callable[[web.Request, int], None] = lambda request, status: None):
        self.hosts = hosts
        self.cors = cors
        self.metrics = metrics
        self.keys = keys
        self.finished = finished  # the end of every request: its key's usage and slot (tenancy.py)
        self.batch: BatchAuth | None = None  # the batch runner's lines (set by the gateway)

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        started = time.monotonic()
        rid = request.headers.get("X-Request-Id", "")
        if not _REQUEST_ID.fullmatch(rid):
            rid = secrets.token_hex(8)
        request["request_id"] = rid
        request["log"] = {}
        span = None
        if T.tracer is not None:
            span = request["span"] = T.server_span(request)
        try:
            if not self.hosts.allows(request.headers.get("Host")):
                raise HttpError(421, f"this server does not answer for host {request.headers['Host']!r} "
                                     "(gateway.allowed_hosts)", code="misdirected_request")
            origin = request.headers.get("Origin")
            if request.method == "OPTIONS" and self.cors.allows(origin) and \
                    "Access-Control-Request-Method" in request.headers:
                response = web.Response(status=204, headers=self.cors.preflight_headers(
                    origin, request.headers.get("Access-Control-Request-Headers")))
            else:
                if (request.path.startswith(("/v1/", "/v2/")) or request.path in KEYED_PATHS) \
                        and request.path not in LORA_PATHS:  # the admin keys' (admin.py checks them)
                    if BATCH_SECRET in request.headers and self.batch is not None and on_unix_socket(request):
                        request["key"] = self.batch_line(request)
                    else:
                        request["key"] = OPEN if self.keys().api_open else self.check_auth(request)
                if span is None:
                    response = await handler(request)
                else:
                    with T.current(span):  # the handler's spans are its children
                        response = await handler(request)
        except asyncio.CancelledError:
            # The client went away (aiohttp cancels the handler): whatever it ran is aborted.
            self.access(request, 499, started, rid)
            raise
        except HttpError as exc:
            response = error_response(exc, request.path)
        except web.HTTPException as exc:
            status = exc.status
            message = {404: f"no route for {request.method} {request.path}",
                       405: f"method {request.method} not allowed on {request.path}"}.get(status, exc.reason)
            response = web.Response(status=status, body=error_body(status, message, "invalid_request_error"),
                                    content_type="application/json",
                                    headers={k: v for k, v in exc.headers.items() if k == "Allow"})
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            response = error_response(HttpError(500, "internal error", "internal_error"), request.path)
        if not response.prepared:
            response.headers["X-Request-Id"] = rid
            response.headers.update(request.get("extra_headers", {}))
        self.access(request, 499 if request["log"].get("client") == "gone" else response.status, started, rid)
        return response

    def access(self, request: web.Request, status: int, started: float, rid: str) -> None:
        """The access log line (every client-given field escaped) and the request counter."""
        # A stream that failed after its headers (status 200 sent) counts as an error in its key's usage.
        self.finished(request, request["log"].get("stream_error") or status)
        info = request["log"]
        ms = (time.monotonic() - started) * 1000
        # The JSON log (servectl/logjson.py) shows the same as fields (a text log ignores them).
        key = request.get("key")
        fields = {"method": request.method, "path": request.path, "status": status, "model": info.get("model"),
                  "key": key.label if key is not None else None,
                  "prompt_tokens": info.get("prompt_tokens"), "completion_tokens": info.get("completion_tokens"),
                  "duration_ms": round(ms, 1)}
        span = request.get("span")
        if span is not None:
            fields.update(log_ids(span))
            T.end_server_span(span, status, info)
        access_log.info("%s %s %d model=%s prompt_tokens=%s completion_tokens=%s %.1fms rid=%s%s",
                        escape(request.method), escape(request.path), status, escape(str(info.get("model", "-"))),
                        info.get("prompt_tokens", "-"), info.get("completion_tokens", "-"), ms, rid,
                        f" key={key.label}" if key is not None and key is not OPEN else "",
                        extra={"request_id": rid, "fields": fields})
        self.metrics.requests.labels(endpoint=request.path if request.path in self.metrics.endpoints else "other",
                                     status=str(status)).inc()

    def batch_line(self, request: web.Request) -> RequestKey:
        """A batch's line, sent by this gateway's runner (api_gateway/batch_runner.py): it runs as
        the batch's key (its usage, its models), marked so that it goes at the lowest priority."""
        key = self.batch.key_of(request.headers[BATCH_SECRET], request.headers.get(BATCH_OWNER, ""))
        if key is None:
            raise HttpError(401, "not this gateway's batch runner, or the batch's key is no longer configured",
                            "authentication_error", code="invalid_api_key")
        request["batch"] = True
        return key

    def check_auth(self, request: web.Request) -> RequestKey:
        # Header values arrive decoded with surrogateescape: encode them back the same way,
        # so bytes that are not UTF-8 are just a wrong key.
        header = request.headers.get("Authorization")
        # Anthropic's SDK sends its key as x-api-key (`vllm serve` reads only Authorization).
        token = bearer_token(header.encode("utf-8", "surrogateescape")) if header is not None else \
            request.headers.get("x-api-key", "").encode("utf-8", "surrogateescape")
        key = self.keys().identify(token)  # an admin key is an API key too
        if key is None:
            raise HttpError(401, "missing or invalid API key (send `Authorization: Bearer <key>` or `x-api-key`)",
                            "authentication_error", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        return key

    async def add_cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every answer to an allowed origin says so (streams too: this runs as headers go out)."""
        self.add_traceresponse(request, response)
        origin = request.headers.get("Origin")
        if self.cors.allows(origin):
            for name, value in self.cors.headers(origin).items():
                response.headers.setdefault(name, value)


    @staticmethod
    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        """Without CORS: only the trace's header (``add_cors_headers`` adds it with CORS)."""
        Middleware.add_traceresponse(request, response)

    @staticmethod
    def add_traceresponse(request: web.Request, response: web.StreamResponse) -> None:
        span = request.get("span")
        if span is not None:  # tracing on: the client learns its request's trace (W3C Trace Context 2)
            response.headers["traceresponse"] = traceparent(span)
