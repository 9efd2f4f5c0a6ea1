"""OpenAI requests to engine messages, and engine logprobs to OpenAI's shapes.

Pure functions (no aiohttp, no zmq, no I/O): what a client sent becomes the
``Generate`` messages the engine takes, and the engine's per-token logprob
entries become the completions or chat API's logprobs objects. Every client
mistake found here is an ``HttpError`` 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec

from api_gateway import openai_types as H
from api_gateway.errors import HttpError
from servectl.wire import engine as EP

# A prompt as the engine takes it: text, token ids, or (chat) the messages.
Prompt = str | list[int] | list[dict[str, Any]]


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


def chat_messages(messages: list[H.ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the engine's chat template takes them: content is always a string.

    Content given as parts is joined when every part is text; other parts (images, audio) are refused.
    """
    out = [msgspec.to_builtins(m) for m in messages]
    for m in out:
        if isinstance(m.get("content"), list):
            parts = m["content"]
            if any(p.get("type") != "text" for p in parts):
                raise HttpError(400, "only text content parts are supported", param="messages")
            if any(not isinstance(p.get("text", ""), str) for p in parts):
                raise HttpError(400, "a text content part's `text` must be a string", param="messages")
            m["content"] = "".join(p.get("text", "") for p in parts)
        if m.get("content") is None:
            m["content"] = ""
    return out


def sampling_params(req, chat: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(vLLM SamplingParams keyword arguments, structured output or None) for one request."""
    s: dict[str, Any] = {"n": req.n}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            s[name] = value
    if req.stop is not None:
        s["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if not all(s["stop"]):
            raise HttpError(400, "stop strings must not be empty", param="stop")  # as vLLM
    if req.n > 1 and req.temperature is not None and req.temperature < 1e-5:
        raise HttpError(400, f"n must be 1 when using greedy sampling (temperature 0), got {req.n}",
                        param="n")  # as vLLM
    if req.stream_options is not None and not req.stream:
        raise HttpError(400, "stream_options can only be given with stream: true", param="stream_options")
    if req.ignore_eos:
        s["ignore_eos"] = True
    # The chat API renamed max_tokens to max_completion_tokens; the new name wins.
    max_tokens = (req.max_completion_tokens or req.max_tokens) if chat else req.max_tokens
    if max_tokens is not None:
        s["max_tokens"] = max_tokens
    if req.logit_bias:
        try:
            s["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError:
            raise HttpError(400, "logit_bias keys must be token ids", param="logit_bias") from None
        # The engine checks them against its vocabulary; here only what no vocabulary holds.
        if any(t < 0 or t > H.INT64_MAX for t in s["logit_bias"]):
            raise HttpError(400, "logit_bias keys must be non-negative token ids", param="logit_bias")
    if chat:
        if req.logprobs:
            s["logprobs"] = req.top_logprobs or 0
        elif req.top_logprobs:
            raise HttpError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    elif req.logprobs is not None:
        s["logprobs"] = req.logprobs
    structured = None
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            structured = {"json_object": True}
        else:
            if rf.json_schema is None:
                raise HttpError(400, "response_format json_schema needs a `json_schema` object",
                                param="response_format")
            structured = {"json": rf.json_schema.schema_}
    return s, structured


def generate_messages(req, prompts: list[Prompt], chat: bool, new_request_id: Callable[[], str]) -> list[EP.Generate]:
    """One engine request per prompt; its n choices are the engine's (sampling `n`)."""
    sampling, structured = sampling_params(req, chat)
    echo = bool(getattr(req, "echo", False))  # completions only
    gens = []
    for prompt in prompts:
        g = EP.Generate(request_id=new_request_id(), sampling=sampling, structured=structured, echo=echo)
        if chat:
            g.messages = prompt
        elif isinstance(prompt, str):
            g.prompt = prompt
        else:
            g.prompt_token_ids = prompt
        gens.append(g)
    return gens


# Logprob entries, as the engine sends them: one [token text, logprob, [[alternative, logprob], ...]]
# per token; a prompt's first token has no logprob (None).

def completion_logprobs(entries: list, k: int) -> H.CompletionLogprobs:
    """The completions API's logprobs: parallel lists, top-k alternatives, offsets into the text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for text, lp, alts in entries:
        tokens.append(text)
        token_lps.append(lp)
        tops.append({t: a for t, a in alts[:k]} if lp is not None and k else None)
        offsets.append(offset)
        offset += len(text)
    return H.CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets)


def chat_logprobs(entries: list) -> H.ChatLogprobs:
    """The chat API's logprobs: one object per token, with its UTF-8 bytes."""
    return H.ChatLogprobs(content=[
        H.ChatTokenLogprob(token=text, logprob=lp if lp is not None else float("-inf"),
                           bytes=list(text.encode()),
                           top_logprobs=[H.TopLogprob(token=t, logprob=a, bytes=list(t.encode())) for t, a in alts])
        for text, lp, alts in entries])
