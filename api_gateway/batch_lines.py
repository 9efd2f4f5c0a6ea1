"""Pure: a batch's input lines read and checked, and its output and error lines written, in
OpenAI's line format (https://platform.openai.com/docs/api-reference/batch/request-input).

An input line: ``{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body":
{...}}``. An output line: ``{"id": "batch_req_...", "custom_id": ..., "response": {"status_code":
200, "request_id": ..., "body": {...}}, "error": null}``; a request the server answered with an
error goes to the error file in the same shape, and a line that could not be sent (not JSON, no
``custom_id``, another ``url``) as ``{"response": null, "error": {"code", "message"}}``.
"""

from __future__ import annotations

import secrets
from typing import Any, NamedTuple

import msgspec

from api_gateway.batch_store import BatchError

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


class Line(NamedTuple):
    number: int  # 1-based, as an editor shows it
    custom_id: str
    body: dict[str, Any]


class Checked(NamedTuple):
    lines: list[Line]  # to send
    bad: list[bytes]  # their error lines (the error file's first lines)
    fatal: list[BatchError]  # the batch fails with these (duplicate custom_ids)
    model: str | None  # the first line's model


def check(data: bytes, endpoint: str) -> Checked:
    """Every non-blank line of an input file, checked (``endpoint``: the batch's)."""
    lines: list[Line] = []
    bad: list[bytes] = []
    fatal: list[BatchError] = []
    seen: dict[str, int] = {}
    model = None
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        line = parse(raw, number, endpoint)
        custom_id = line.custom_id if isinstance(line, Line) else custom_id_of(raw)
        if custom_id is not None and custom_id in seen:
            fatal.append(BatchError(code="duplicate_custom_id", line=number, param="custom_id",
                                    message=f"custom_id {custom_id!r} is also on line {seen[custom_id]}: "
                                            "each line's must be unique"))
            continue
        if custom_id is not None:
            seen[custom_id] = number
        if isinstance(line, BatchError):
            bad.append(error_line(custom_id, line.code, line.message, number))
            continue
        if model is None and isinstance(line.body.get("model"), str):
            model = line.body["model"]
        lines.append(line)
    return Checked(lines, bad, fatal, model)


def parse(raw: bytes, number: int, endpoint: str) -> Line | BatchError:
    try:
        obj = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        return BatchError(code="invalid_json_line", line=number, message=f"line {number} is not JSON: {exc}")
    if not isinstance(obj, dict):
        return BatchError(code="invalid_request", line=number, message=f"line {number} is not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchError(code="missing_required_parameter", line=number, param="custom_id",
                          message=f"line {number} has no custom_id (a non-empty string)")
    if obj.get("method") != "POST":
        return BatchError(code="invalid_method", line=number, param="method",
                          message=f"line {number}: method must be \"POST\"")
    if obj.get("url") != endpoint:
        return BatchError(code="mismatched_url", line=number, param="url",
                          message=f"line {number}: url {obj.get('url')!r} is not the batch's endpoint {endpoint!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return BatchError(code="invalid_request", line=number, param="body",
                          message=f"line {number}: body must be a JSON object")
    if body.get("stream"):
        return BatchError(code="invalid_request", line=number, param="body.stream",
                          message=f"line {number}: a batch's requests cannot stream")
    return Line(number, custom_id, body)


def custom_id_of(raw: bytes) -> str | None:
    """A line's ``custom_id`` when it has one (a bad line's answer names it)."""
    try:
        obj = _decoder.decode(raw)
    except msgspec.DecodeError:
        return None
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    return custom_id if isinstance(custom_id, str) and custom_id else None


def _request_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


def output_line(custom_id: str, status: int, request_id: str, body: Any) -> bytes:
    return _encoder.encode({"id": _request_id(), "custom_id": custom_id,
                            "response": {"status_code": status, "request_id": request_id, "body": body},
                            "error": None}) + b"\n"


def error_line(custom_id: str | None, code: str, message: str, number: int | None = None) -> bytes:
    error: dict[str, Any] = {"code": code, "message": message}
    if number is not None:
        error["line"] = number
    return _encoder.encode({"id": _request_id(), "custom_id": custom_id, "response": None, "error": error}) + b"\n"


def answered(data: bytes) -> tuple[set[str], int, int, int]:
    """What a results file already holds: (the custom_ids answered, how many answers were a
    success (2xx), failures, the length of its whole lines). A last line without its newline
    (cut by a crash mid-write) is not counted, and the caller cuts it off."""
    done: set[str] = set()
    ok = failed = 0
    end = data.rfind(b"\n") + 1
    for raw in data[:end].split(b"\n"):
        if not raw:
            continue
        try:
            obj = _decoder.decode(raw)
        except msgspec.DecodeError:
            continue
        custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
        if isinstance(custom_id, str):
            done.add(custom_id)
        response = obj.get("response") if isinstance(obj, dict) else None
        if isinstance(response, dict) and 200 <= response.get("status_code", 0) < 300:
            ok += 1
        else:
            failed += 1
    return done, ok, failed, end
