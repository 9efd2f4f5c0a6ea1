"""aiohttp's server as the gateway runs it: timeouts, cancellation, protocol errors in OpenAI's shape.

- ``handler_cancellation``: a client that goes away cancels its handler, which
  aborts its sequences in the engine (streaming or not).
- ``keepalive_timeout`` is aiohttp's bound on a connection that has not sent
  a complete request head: it closes a connection still waiting for headers
  at that time (from its opening, or the end of its previous response), and
  data trickling in does not extend it. So it is ``header_timeout_s`` (and how
  long an idle keep-alive connection stays open). The body's deadline is the
  handler's (``body_timeout_s`` in app.py); after answering a body that did
  not arrive, aiohttp reads what still comes for ``lingering_time`` before it
  closes, bounded by the same timeout.
- Requests aiohttp's parser refuses before any handler runs (a control
  character in a header, a line too long) get their 4xx as an OpenAI error
  body, like every other error, instead of aiohttp's plain text.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from api_gateway.errors import error_body
from servectl.config import GatewayConfig

log = logging.getLogger("api_gateway.http")


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


class _OpenAIErrorsServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _OpenAIErrorsHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _OpenAIErrorsServer  # the same server; its connections' handlers are ours
        return server


def make_runner(app: web.Application, cfg: GatewayConfig) -> GatewayRunner:
    return GatewayRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                         keepalive_timeout=cfg.header_timeout_s, lingering_time=min(10.0, cfg.body_timeout_s))
