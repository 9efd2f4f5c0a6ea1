"""``/v1/audio/transcriptions`` and ``/v1/audio/translations``: a form upload, answered by vLLM in the engine.

The client posts ``multipart/form-data`` (what the ``openai`` SDK's
``audio.transcriptions.create`` sends): ``file`` and the request's fields
(``model``, ``language``, ``prompt``, ``response_format``, ``temperature``,
``timestamp_granularities[]``, ``stream``, vLLM's extras). The gateway reads
it within ``max_body_bytes`` and ``body_timeout_s`` (413, 408), names the
model, and sends the fields as vLLM's form has them (strings; vLLM's request
class converts them) with the file's bytes, through the admission every
request takes (passthrough.py ``ApiEndpoints.answer``). vLLM's transcription
serving classes answer it in the engine (engine_core/speech_apis.py): its
JSON body, or its SSE stream; its errors are its 400s.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from api_gateway.bodies import read_bounded
from api_gateway.errors import HttpError
from api_gateway.passthrough import SPEECH_PATHS, ApiEndpoints
from servectl.config import GatewayConfig

LIST_FIELDS = frozenset({"timestamp_granularities[]", "timestamp_granularities"})


async def read_form(request: web.Request, cfg: GatewayConfig) -> dict:
    """The form's fields (strings, a repeated list field as a list) and ``file`` / ``filename``."""
    if request.content_type != "multipart/form-data":
        raise HttpError(415, f"unsupported content type {request.content_type or '(none)'!r}: send "
                             "multipart/form-data with the audio as `file`")
    try:
        form = await read_bounded(request, request.post(), cfg)
    except ValueError as exc:  # a malformed multipart body
        raise HttpError(400, f"invalid form data: {exc}") from None
    fields: dict = {}
    for key, value in form.items():
        if isinstance(value, web.FileField):
            if key != "file":
                raise HttpError(400, f"unexpected file field {key[:64]!r}: send the audio as `file`", param=key)
            fields["file"] = value.file.read()
            fields["filename"] = value.filename
        elif key in LIST_FIELDS:
            fields.setdefault("timestamp_granularities[]", []).append(value)
        else:
            fields[key] = value
    if "file" not in fields:
        raise HttpError(400, "the form has no `file`: send the audio as a file field named `file`", param="file")
    return fields


class SpeechEndpoints:
    """The speech-to-text routes; admission and the answer are ``ApiEndpoints``'s."""

    def __init__(self, apis: ApiEndpoints, cfg: Callable[[], GatewayConfig]):
        self.apis = apis
        self.cfg = cfg  # the gateway's config as it is now

    def add_to(self, app: web.Application) -> None:
        for path in SPEECH_PATHS:
            app.router.add_post(path, self.speech)

    async def speech(self, request: web.Request) -> web.StreamResponse:
        fields = await read_form(request, self.cfg())
        stream = str(fields.get("stream", "")).lower() in ("true", "1", "yes", "on")
        return await self.apis.answer(request, SPEECH_PATHS[request.path], fields.get("model") or None, fields,
                                      stream)
