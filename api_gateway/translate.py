"""OpenAI requests to engine messages, and the engine's logprob entries to OpenAI's shapes.

Pure functions (no aiohttp, no zmq, no I/O): a validated request becomes the
``Generate`` messages the engine takes (one per prompt, each carrying the
client's supported fields for vLLM's request class), and the engine's
per-token logprob entries become the completions or chat API's logprobs
objects. Every client mistake found here is an ``HttpError`` 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Callable

from api_gateway import openai_types as H
from api_gateway.errors import HttpError
from servectl.wire import engine as EP

FLOOR = -9999.0  # vLLM's logprob for a token without one (chat), and its stand-in for -inf


def normalize_prompts(prompt) -> list[str | list[int]]:
    """The completions API's `prompt` as a list of prompts, one engine request each.

    msgspec's union holds a single array type, so the shapes of a list are told apart here.
    """
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise HttpError(400, "prompt must not be empty", param="prompt")

    def token_ids(p) -> bool:
        return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

    if token_ids(prompt):
        prompts = [prompt]
    elif all(isinstance(p, str) for p in prompt):
        return list(prompt)
    elif all(token_ids(p) for p in prompt):
        if any(not p for p in prompt):
            raise HttpError(400, "token id lists must not be empty", param="prompt")
        prompts = list(prompt)
    else:
        raise HttpError(400, "prompt must be a string, a list of strings, token ids or lists of token ids",
                        param="prompt")
    # The engine checks them against its vocabulary; here only what no vocabulary holds.
    if any(t < 0 or t > H.INT64_MAX for p in prompts for t in p):
        raise HttpError(400, "token ids must be non-negative 64-bit integers", param="prompt")
    return prompts


def check_logit_bias(logit_bias: dict[str, float] | None) -> None:
    """Keys are token ids: integers a 64-bit engine frame carries (the engine checks the vocabulary)."""
    for key in logit_bias or ():
        try:
            token = int(key)
        except ValueError:
            raise HttpError(400, f"logit_bias keys must be token ids, got {key[:32]!r}", param="logit_bias") from None
        if token < 0 or token > H.INT64_MAX:
            raise HttpError(400, "logit_bias keys must be non-negative 64-bit token ids", param="logit_bias")


def check_messages(messages: list[H.ChatMessage]) -> None:
    """A text part's ``text`` is a string; other parts (images, audio, video) are vLLM's to take or
    refuse in the engine (a text-only model's 400)."""
    for m in messages:
        if isinstance(m.content, list):
            if any(p.get("type") == "text" and not isinstance(p.get("text", ""), str) for p in m.content):
                raise HttpError(400, "a text content part's `text` must be a string", param="messages")


def generate_messages(forward: dict[str, Any], prompts: list | None, new_request_id: Callable[[], str],
                      tenant: str = "") -> list[EP.Generate]:
    """One engine request per prompt (completions: ``prompts``; chat: None, one request)."""
    if prompts is None:
        return [EP.Generate(request_id=new_request_id(), kind="chat", body=forward, tenant=tenant)]
    return [EP.Generate(request_id=new_request_id(), kind="completion", body={**forward, "prompt": p}, tenant=tenant)
            for p in prompts]


# Logprob entries, as the engine sends them: one [token, logprob or None, alternatives
# [[token, logprob], ...] or None, UTF-8 bytes or None] per token, chosen as vLLM's API would.

def completion_logprobs(entries: list, offset: int = 0) -> tuple[H.CompletionLogprobs, int]:
    """The completions API's logprobs (parallel lists, offsets into the text from ``offset``)
    and the offset after them, for the next chunk of a stream."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token, lp, alts, _ in entries:
        tokens.append(token)
        token_lps.append(lp)
        tops.append(None if alts is None else dict(alts))
        offsets.append(offset)
        offset += len(token)
    return H.CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops,
                                text_offset=offsets), offset


def chat_logprobs(entries: list) -> H.ChatLogprobs:
    """The chat API's logprobs: one object per token, its bytes and its alternatives."""
    return H.ChatLogprobs(content=[
        H.ChatTokenLogprob(token=token, logprob=FLOOR if lp is None else lp, bytes=data,
                           top_logprobs=[H.TopLogprob(token=t, logprob=a, bytes=list(t.encode("utf-8", "replace")))
                                         for t, a in alts or ()])
        for token, lp, alts, data in entries])
