"""A request's JSON body: read within its limits, its fields sorted, its shapes checked.

``read_body`` refuses what is not a JSON object of the right content type and
size (415, 413, 408, 400), sorts the fields (fields.classify: refused and
legacy ones are a 400 naming them; unknown ones are named in a warning and in
the response's ``x-servectl-ignored-fields`` header), bounds the media any of
them carries inline (media.py) and checks the supported ones against the
endpoint's msgspec type. It returns the validated request and
the supported fields as the client sent them (what goes to the engine).
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from aiohttp import web

from api_gateway import openai_types as H
from api_gateway.errors import HttpError, validation_error
from api_gateway.fields import IGNORED_HEADER, classify
from api_gateway.http_policy import is_json_content_type
from api_gateway.logfields import escape
from api_gateway.media import check_media
from servectl.config import GatewayConfig

log = logging.getLogger("api_gateway")

TYPES = {"completion": H.CompletionRequest, "chat": H.ChatCompletionRequest, "tokenize": H.TokenizeRequest,
         "detokenize": H.DetokenizeRequest, "responses": H.PassthroughRequest, "messages": H.PassthroughRequest,
         "count_tokens": H.PassthroughRequest,
         **dict.fromkeys(("embeddings", "embed", "pooling", "score", "rerank", "classify"), H.PassthroughRequest)}


async def read_bounded(request: web.Request, reading, cfg: GatewayConfig):
    """What ``reading`` (the request's ``read()`` or ``post()``) gives, within ``max_body_bytes``
    (413) and ``body_timeout_s`` (408)."""
    if request.content_length is not None and request.content_length > cfg.max_body_bytes:
        reading.close()
        raise HttpError(413, f"request body of {request.content_length} bytes exceeds the limit of "
                             f"{cfg.max_body_bytes}")
    try:
        # event-proof: a client sending its body; past the deadline it is a 408.
        async with asyncio.timeout(cfg.body_timeout_s):
            return await reading
    except web.HTTPRequestEntityTooLarge:
        raise HttpError(413, f"request body exceeds the limit of {cfg.max_body_bytes} bytes") from None
    except TimeoutError:
        raise HttpError(408, f"the request body did not arrive within {cfg.body_timeout_s:g}s",
                        code="body_timeout") from None


async def read_body(request: web.Request, cfg: GatewayConfig, endpoint: str):
    """(the validated request, the supported fields as sent) of ``request``'s body for ``endpoint``."""
    ctype = request.headers.get("Content-Type")
    if not is_json_content_type(ctype):
        # Not text/plain nor a form: those a page may POST cross-site without a preflight.
        raise HttpError(415, f"unsupported content type {ctype or '(none)'!r}: send application/json")
    body = await read_bounded(request, request.read(), cfg)
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise HttpError(400, f"invalid JSON: {exc}") from None
    except RecursionError:
        raise HttpError(400, "invalid JSON: nested too deeply") from None
    if not isinstance(raw, dict):
        raise HttpError(400, "the request body must be a JSON object")
    forward, unknown = classify(endpoint, raw)
    if unknown:
        # Client-given names: escaped and capped for the log line and the header alike.
        shown = [escape(k, 64).encode("ascii", "backslashreplace").decode() for k in sorted(unknown)[:16]]
        names = ", ".join(shown) + (f", ... ({len(unknown)} in all)" if len(unknown) > 16 else "")
        log.warning("%s %s: ignored field(s) (unknown, or ignored by vLLM): %s (rid=%s)", escape(request.method),
                    escape(request.path), names, request["request_id"])
        request.setdefault("extra_headers", {})[IGNORED_HEADER] = names
    check_media(forward, cfg.max_media_bytes)  # inline media bounded; the engine reads it (media.py)
    try:
        return msgspec.convert(forward, TYPES[endpoint]), forward
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise HttpError(400, "the request is nested too deeply") from None
