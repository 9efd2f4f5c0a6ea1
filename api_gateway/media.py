"""Media refused in every request body, before anything reaches an engine (pure).

The engines serve text only until media is deliberately enabled. vLLM's
renderer takes a dict in a request's content for a media part by its ``type``
(``image_url``, ``input_image``, Anthropic's ``image``, ...) or, when the part
has no ``type`` or carries a ``uuid``, by its keys (``{"image_url": URL}``,
vLLM's ``_MEDIA_CONTENT_PART_KEYS``), and fetches the URL on the engine's
thread. So ``bodies.read_body`` walks every body of every route with
``refuse_media``: any dict anywhere in it with a media ``type`` or a media key
is a 400 (Cohere's ``/v2/embed`` ``inputs``, a score's ``queries``, a chat
message's parts, a tool result's). Top-level fields that hold JSON schemas or
tool definitions, not content, are not walked (a tool whose parameter is
named ``image_url`` is not media), nor a tool call's arguments. The engine's
second line, should anything get through, is engine_core/media.py: it fetches
nothing unless the operator allowed domains.
"""

from __future__ import annotations

from api_gateway.errors import HttpError

# `type` values of media parts: vLLM's chat parts, the Responses API's, Anthropic's.
MEDIA_TYPES = frozenset({
    "input_image", "input_file", "input_audio", "input_video", "image", "document", "image_url", "audio_url",
    "video_url", "file", "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "image_pil", "video",
    "audio",
})
# Keys that make vLLM take a part for media whatever its `type` (a superset of vLLM's
# _MEDIA_CONTENT_PART_KEYS; tests/test_security.py holds the two together).
MEDIA_KEYS = frozenset({
    "image_url", "input_image", "image_embeds", "image_pil", "audio_url", "input_audio", "audio_embeds",
    "video_url", "video_embeds", "prompt_embeds", "file", "file_url", "file_data", "file_id",
})
# Top-level fields that hold schemas, tool definitions or options: never content.
NOT_CONTENT = frozenset({"tools", "tool_choice", "response_format", "structured_outputs", "text", "metadata",
                         "chat_template_kwargs", "vllm_xargs", "logit_bias", "reasoning", "output_config"})
# Parts whose `input` is a tool call's arguments (Anthropic's), not content.
TOOL_CALL_TYPES = frozenset({"tool_use", "server_tool_use"})


def refuse_media(body: dict) -> None:
    """A 400 naming the top-level field when any content in ``body`` is a media part."""
    for field, value in body.items():
        if field not in NOT_CONTENT:
            check_text_only(value, field)


def check_text_only(value, field: str) -> None:
    """Refuse media anywhere in ``value`` (items, messages, parts, tool results)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            kind = v.get("type")
            if isinstance(kind, str) and kind in MEDIA_TYPES:
                raise HttpError(400, f"multimodal input is not supported (a `{kind[:32]}` part)", param=field,
                                code="unsupported_parameter")
            key = next((k for k in v if k in MEDIA_KEYS), None)
            if key is not None:
                raise HttpError(400, f"multimodal input is not supported (a part with `{key}`)", param=field,
                                code="unsupported_parameter")
            stack.extend(x for k, x in v.items() if not (k == "input" and kind in TOOL_CALL_TYPES))
        elif isinstance(v, list):
            stack.extend(v)
