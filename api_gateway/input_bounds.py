"""Pure: how much engine work a pooling, Responses, Messages or chat body asks for, and its bounds.

The engine renders a request's inputs on its only thread (security issue 53): a
pooling request of 200,000 inputs or a Responses input of 118,000 items held it
for seconds to minutes. The gateway counts that work from the body, before the
engine sees it:

- a pooling request's sequences (``pooling_sequences``): each input, text,
  image, query, document or item is one engine request there, so it counts as
  one for admission (the model's queue cap) and for ``max_sequences_per_request``,
  like a completion's prompts;
- a Responses input's, a Messages request's or a chat's (and a chat `/tokenize`'s) items and characters
  (``check_input``): at most ``max_input_items`` items, and no more of either
  than the model's context can hold — an item renders to a token at least, and
  its text to a token per ``max_chars_per_token`` characters at least (vLLM's
  own figure for refusing a text before tokenising it, sent by the engine as
  ``HelloReply.max_prompt_chars``).
"""

from __future__ import annotations

from typing import Any

from api_gateway.errors import HttpError
from api_gateway.media import is_media_part

# The fields of vLLM's pooling request classes that hold prompts (EmbeddingRequest,
# CohereEmbedRequest, PoolingRequest, ClassificationRequest, ScoreRequest's forms, RerankRequest).
POOLING_PROMPT_FIELDS = ("input", "texts", "images", "inputs", "text_1", "text_2", "data_1", "data_2",
                         "queries", "documents", "items", "query")
# What each API's renderer turns into the prompt.
INPUT_FIELDS = {"responses": ("input", "instructions"), "messages": ("messages", "system"), "chat": ("messages",)}


def _prompts(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return 1  # one prompt of token ids
        return len(value)
    return 1


def pooling_sequences(body: dict[str, Any]) -> int:
    """The engine requests a pooling body becomes: one per input, text, document or query (a
    chat-style ``messages`` request is one)."""
    return max(1, sum(_prompts(body.get(field)) for field in POOLING_PROMPT_FIELDS))


def check_sequences(seqs: int, cap: int, body: dict[str, Any]) -> None:
    """More inputs than one request may hold: a 400 naming the field."""
    if seqs > cap:
        field = max(POOLING_PROMPT_FIELDS, key=lambda f: _prompts(body.get(f)))
        raise HttpError(400, f"{seqs} inputs; at most {cap} per request (each input, text, document or query "
                             "is a sequence)", param=field, code="too_many_sequences")


def measure(value: Any) -> tuple[int, int]:
    """(items, characters): the list elements and the characters of every string, keys aside.
    A media part is an item whose characters are not text (a data: URL's base64 becomes the
    model's image or audio tokens, bounded by ``max_media_bytes``, not a tokenised prompt)."""
    items = chars = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            chars += len(v)
        elif isinstance(v, dict):
            if not is_media_part(v):
                stack.extend(v.values())
        elif isinstance(v, list):
            items += len(v)
            stack.extend(v)
    return items, chars


def check_input(kind: str, body: dict[str, Any], max_model_len: int | None, max_prompt_chars: int,
                max_items: int) -> None:
    """A Responses input or a Messages request the model's context cannot hold, or of more than
    ``max_items`` items: a 400 before the engine renders it."""
    fields = INPUT_FIELDS.get(kind)
    if fields is None:
        return
    items = chars = 0
    for field in fields:
        i, c = measure(body.get(field))
        items, chars = items + i, chars + c
    param = fields[0]
    limit = min(max_items, max_model_len) if max_model_len else max_items
    if items > limit:
        why = "" if limit == max_items else \
            f" (each renders to a token at least; the model's context is {max_model_len})"
        raise HttpError(400, f"`{param}` has {items} items; at most {limit}{why}", param=param,
                        code="too_many_items")
    if max_prompt_chars and chars > max_prompt_chars:
        # In vLLM's words for a prompt too long in characters (clients match on them).
        raise HttpError(400, f"This model's maximum context length is {max_model_len} tokens. However, `{param}` "
                             f"contains {chars} characters (more than {max_prompt_chars} characters, the upper "
                             "bound for its input tokens). Please reduce the length of the input.",
                        param=param, code="input_too_long")
