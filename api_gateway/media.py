"""Media in request bodies: found wherever vLLM would take it, and its inline bytes bounded (pure).

vLLM's renderer takes a dict in a request's content for a media part by its
``type`` (``image_url``, ``input_image``, Anthropic's ``image``, ...) or, when
the part has no ``type`` or carries a ``uuid``, by its keys (``{"image_url":
URL}``, vLLM's ``_MEDIA_CONTENT_PART_KEYS``). ``inline_media_bytes`` walks a
body the same way and adds up what its media parts carry inline (base64 data:
URLs, Anthropic's base64 ``source``, ``input_audio``'s ``data``): past the
gateway's ``max_media_bytes`` that is a 413 naming the limit, before any
engine decodes a byte. What a part names by URL is fetched (or not) by the
engine's connector (engine_core/media.py), under vLLM's download cap.
Top-level fields that hold JSON schemas or tool definitions, not content, are
not walked (a tool whose parameter is named ``image_url`` is not media), nor
a tool call's arguments. Whether the model reads media at all is vLLM's
answer (a text-only model's 400), given by the engine.
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
# _MEDIA_CONTENT_PART_KEYS; tests/test_security_edge.py holds the two together).
MEDIA_KEYS = frozenset({
    "image_url", "input_image", "image_embeds", "image_pil", "audio_url", "input_audio", "audio_embeds",
    "video_url", "video_embeds", "prompt_embeds", "file", "file_url", "file_data", "file_id",
})
# Top-level fields that hold schemas, tool definitions or options: never content.
NOT_CONTENT = frozenset({"tools", "tool_choice", "response_format", "structured_outputs", "text", "metadata",
                         "chat_template_kwargs", "vllm_xargs", "logit_bias", "reasoning", "output_config"})
# Parts whose `input` is a tool call's arguments (Anthropic's), not content.
TOOL_CALL_TYPES = frozenset({"tool_use", "server_tool_use"})


def is_media_part(v: dict) -> bool:
    kind = v.get("type")
    return (isinstance(kind, str) and kind in MEDIA_TYPES) or any(k in MEDIA_KEYS for k in v)


def media_parts(body: dict) -> list[dict]:
    """Every media part in ``body``'s content, outermost first."""
    found: list[dict] = []
    stack = [v for field, v in body.items() if field not in NOT_CONTENT]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if is_media_part(v):
                found.append(v)
                continue
            kind = v.get("type")
            stack.extend(x for k, x in v.items() if not (k == "input" and kind in TOOL_CALL_TYPES))
        elif isinstance(v, list):
            stack.extend(v)
    return found


def inline_bytes(part) -> int:
    """The bytes a media part carries inline: its strings' base64 text decoded (an upper bound
    within 2 bytes a string); a URL's few characters count too, harmlessly."""
    total, stack = 0, [part]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) * 3 // 4
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


def check_media(body: dict, max_media_bytes: int) -> int:
    """The number of media parts in ``body``; a 413 naming ``max_media_bytes`` when what they
    carry inline is more."""
    parts = media_parts(body)
    if parts:
        size = sum(inline_bytes(p) for p in parts)
        if size > max_media_bytes:
            raise HttpError(413, f"the request's inline media ({size} bytes decoded, {len(parts)} part(s)) "
                                 f"exceeds the limit of {max_media_bytes} bytes (gateway max_media_bytes)",
                            code="media_too_large")
    return len(parts)
