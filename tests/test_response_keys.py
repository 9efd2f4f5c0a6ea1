"""Issue 51: servectl's whole chat and completion bodies carry every field `vllm serve` writes,
nulls included (strictly typed clients read them). vLLM's route writes a whole answer as its
response class's ``model_dump()``; the same body read into that class and dumped again must
have servectl's keys, level by level. Imports vLLM: not in the unit tier."""

from __future__ import annotations

import json

import msgspec
import pytest

from api_gateway import openai_types as H
from api_gateway.accumulator import ResponseAccumulator
from servectl.wire import engine as EP

pytestmark = pytest.mark.vllm_unit

ENTRY = [["a", -0.1, [["a", -0.1], ["b", -2.0]], [97]]]


def keys(value, where="$") -> set[str]:
    """Every key path of a JSON value (lists: their items' keys, under one name)."""
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(f"{where}.{k}")
            out |= keys(v, f"{where}.{k}")
    elif isinstance(value, list):
        for v in value:
            out |= keys(v, f"{where}[]")
    return out


def whole(req, chat: bool, deltas) -> dict:
    acc = ResponseAccumulator(req, chat, prompts=1, response_id="x-1")
    for d in deltas:
        acc.add(0, d)
    return json.loads(H.encoder.encode(acc.response(created=1)))


def same_keys(ours: dict, cls) -> None:
    theirs = cls.model_validate(ours).model_dump(mode="json")
    assert keys(ours) == keys(theirs), (sorted(keys(theirs) - keys(ours)), sorted(keys(ours) - keys(theirs)))


def test_a_whole_chat_body_has_vllms_keys():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    req = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, H.ChatCompletionRequest)
    body = whole(req, True, [EP.Delta(request_id="r", index=0, text="hi", token_ids=[5], finish_reason="stop",
                                      prompt=EP.PromptInfo(tokens=2, role="assistant"))])
    assert body["system_fingerprint"] is None and body["choices"][0]["message"]["reasoning"] is None
    same_keys(body, ChatCompletionResponse)


def test_a_whole_parsed_chat_body_with_a_call_and_logprobs_has_vllms_keys():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    req = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                           "top_logprobs": 2}, H.ChatCompletionRequest)
    message = {"content": None, "reasoning": "so", "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    body = whole(req, True, [EP.Delta(request_id="r", index=0, text="", token_ids=[5], finish_reason="tool_calls",
                                      logprobs=ENTRY, message=message,
                                      prompt=EP.PromptInfo(tokens=2, role="assistant", parsed=True))])
    same_keys(body, ChatCompletionResponse)


def test_a_whole_completion_body_has_vllms_keys():
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse

    req = msgspec.convert({"model": "m", "prompt": "x", "logprobs": 1}, H.CompletionRequest)
    body = whole(req, False, [EP.Delta(request_id="r", index=0, text="a", token_ids=[5], finish_reason="length",
                                       logprobs=ENTRY, prompt=EP.PromptInfo(tokens=2))])
    assert body["system_fingerprint"] is None
    same_keys(body, CompletionResponse)
