"""The gateway's errors and how each becomes an OpenAI-shaped error body.

Pure (msgspec only, no aiohttp, no zmq), so translate.py and the unit tests
can raise and inspect them without a server. The aiohttp response around a
body is made by the middleware in middleware.py.
"""

from __future__ import annotations

import msgspec

from api_gateway import openai_types as H


class HttpError(Exception):
    """A request that ends with this status and an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}


class EngineUnavailable(Exception):
    """The model's engine cannot take or finish this request now (restarting, failed, unloaded)."""

    def __init__(self, message: str, retry_after: int | None = 5, hung: bool = False):
        super().__init__(message)
        self.retry_after = retry_after
        self.hung = hung  # its engine was killed as hung (the manager's event said so)


class EngineStalled(EngineUnavailable):
    """The engine did not take a frame for the send deadline: it is not reading (hung)."""


class EngineRequestError(Exception):
    """The engine refused one request (a RequestError frame: too long a prompt, a bad parameter)."""

    def __init__(self, message: str, status: int, param: str | None):
        super().__init__(message)
        self.status = status
        self.param = param


def error_body(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return H.encoder.encode(H.ErrorResponse(error=H.ErrorBody(message=message, type=type_, param=param,
                                                              code=code if code is not None else status)))


def http_error_body(exc: HttpError) -> bytes:
    return error_body(exc.status, exc.message, exc.type, exc.param, exc.code)


def unavailable(exc: EngineUnavailable) -> HttpError:
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else {}
    return HttpError(503, str(exc), "service_unavailable", code="engine_unavailable", headers=headers)


def refused_by_engine(exc: EngineRequestError) -> HttpError:
    """The engine's own status: its 503 (draining) is an unavailable engine, other 5xx are internal."""
    if exc.status == 503:
        return unavailable(EngineUnavailable(str(exc)))
    if exc.status >= 500:
        return HttpError(exc.status, str(exc), "internal_error", exc.param)
    return HttpError(exc.status, str(exc), param=exc.param)


def validation_error(exc: msgspec.ValidationError) -> HttpError:
    """msgspec's message, with the offending top-level field named as OpenAI's `param`."""
    text = str(exc)
    param = None
    if " - at `$." in text:
        text, where = text.split(" - at `$.", 1)
        param = where.rstrip("`").split("[")[0].split(".")[0]
    elif text.startswith("Object missing required field"):
        param = text.split("`")[1]
    if text.startswith("Expected `object`") and param is None:
        text = "the request body must be a JSON object"
    return HttpError(400, f"{text}" + (f" (field `{param}`)" if param else ""), param=param)
