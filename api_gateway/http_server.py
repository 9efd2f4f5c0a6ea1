"""aiohttp's server as the gateway runs it: timeouts, cancellation, protocol errors in OpenAI's shape.

- ``handler_cancellation``: a client that goes away cancels its handler, which
  aborts its sequences in the engine (streaming or not).
- ``keepalive_timeout`` is aiohttp's bound on a connection that has not sent
  a complete request head: it closes a connection still waiting for headers
  at that time (from its opening, or the end of its previous response), and
  data trickling in does not extend it. So it is ``header_timeout_s`` (and how
  long an idle keep-alive connection stays open). The body's deadline is the
  handler's (``body_timeout_s`` in bodies.py); after answering a body that did
  not arrive, aiohttp reads what still comes for ``lingering_time`` before it
  closes, bounded by the same timeout.
- Connections are capped (``gateway.max_connections``; by default the
  descriptor limit, raised to the hard limit at start, less ``FD_RESERVE``
  for the gateway's own sockets and files): a connection past the cap closes
  the oldest idle one (no request in progress: a keep-alive between requests,
  or one that has not sent a whole request head), or, with none idle, is
  answered a 503 (JSON body, ``Connection: close``) and closed. So idle
  connections cannot take every descriptor and lock a new client out.
- Requests aiohttp's parser refuses before any handler runs (a control
  character in a header, a line too long) get their 4xx as an OpenAI error
  body, like every other error, instead of aiohttp's plain text.
"""

from __future__ import annotations

import logging
import resource
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from api_gateway.errors import error_body
from servectl.config import GatewayConfig

log = logging.getLogger("api_gateway.http")

# Descriptors kept for the gateway itself beyond its connections: the ZeroMQ sockets (one per
# engine, the manager's two) and their I/O threads' pipes, the listening socket, logs, metrics files.
FD_RESERVE = 64

_REFUSAL_BODY = error_body(503, "too many open connections to this server; try again",
                           "service_unavailable", code="too_many_connections")
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\nRetry-After: 1\r\nConnection: close\r\n\r\n" % len(_REFUSAL_BODY)) + _REFUSAL_BODY


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (a daemon started from a
    shell inherits 1,024); the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, hard, exc)
    return soft


def connection_cap(configured: int) -> int:
    """At most this many open connections: the configured cap, else (0) the descriptor limit
    less FD_RESERVE; never more than that."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = max(1, (soft if soft != resource.RLIM_INFINITY else 1 << 20) - FD_RESERVE)
    if configured > limit:
        log.warning("gateway.max_connections = %d is above the descriptor limit less %d; capped at %d",
                    configured, FD_RESERVE, limit)
    return min(configured, limit) if configured else limit


def _idle(handler: RequestHandler) -> bool:
    """No request in progress or queued: waiting for a request head (keep-alive, or new)."""
    return not handler._request_in_progress and not handler._messages and handler.transport is not None


class _OpenAIErrorsHandler(RequestHandler):
    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: a response was started, the connection is broken
            raise ConnectionError("a response was started; cannot send another with the error")
        if status >= 500:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
        else:
            # A client's malformed HTTP: one line, repr'd (no raw bytes in the log), no traceback.
            log.info("%d from %s: %r", status, request.remote, (message or str(exc or ""))[:300])
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "error"
        first = (message or "").strip().splitlines()[0] if (message or "").strip() else ""
        text = f"{phrase}: {first}" if first and status < 500 else phrase
        resp = web.Response(status=status, content_type="application/json",
                            body=error_body(status, text, "invalid_request_error" if status < 500 else "internal_error"))
        resp.force_close()
        return resp


def _worth_a_line(count: int) -> bool:
    """The 1st, 2nd, 4th, 8th, ... time: a flood of connections cannot flood the log."""
    return count & (count - 1) == 0


class _OpenAIErrorsServer(web.Server):
    max_connections = 0  # set by GatewayRunner (0: no cap)
    closed_idle = 0  # connections closed to make room, and refused, since the start
    refused = 0

    def __call__(self) -> RequestHandler:
        return _OpenAIErrorsHandler(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport) -> None:
        super().connection_made(handler, transport)
        cap = self.max_connections
        if not cap or len(self._connections) <= cap:
            return
        for other in self._connections:  # oldest first
            if other is not handler and _idle(other):
                self.closed_idle += 1
                if _worth_a_line(self.closed_idle):
                    log.info("%d connections open (gateway.max_connections = %d): the oldest idle one closed "
                             "(%d so far)", cap + 1, cap, self.closed_idle)
                other.force_close()
                return
        self.refused += 1
        if _worth_a_line(self.refused):
            log.warning("%d connections open, none idle (gateway.max_connections = %d): a new one refused "
                        "(%d so far)", cap + 1, cap, self.refused)
        transport.write(REFUSAL)
        transport.close()


class GatewayRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _OpenAIErrorsServer  # the same server; its connections' handlers are ours
        server.max_connections = self.max_connections
        return server


def make_runner(app: web.Application, cfg: GatewayConfig) -> GatewayRunner:
    runner = GatewayRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                           keepalive_timeout=cfg.header_timeout_s, lingering_time=min(10.0, cfg.body_timeout_s))
    runner.max_connections = connection_cap(cfg.max_connections)
    return runner
