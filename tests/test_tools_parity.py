"""Issue 31: tool and reasoning requests get the same answers from servectl as from `vllm serve`
with the same flags (same venv, same model, float32, greedy).

`vllm serve` runs once per configuration (module-scoped, one at a time: the
fixture is parametrised over TOOL_MODELS); servectl's `tools_daemon` serves both.
Whole bodies are compared after masking what differs by nature (response and call
ids, timestamps, fingerprints) and dropping null fields; streams as their sequence
of events (role, reasoning, content, each call's header and arguments, finish
reasons, usage), adjacent pieces of one kind joined: vLLM's API server may hand
two steps' tokens to one chunk when it falls behind, servectl's never does.
"""

from __future__ import annotations

import json
import re

import pytest

from bench.run import VllmServe
from conftest import TOOL_MODELS, http, json_lines

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
STRICT = {"type": "function", "function": {**WEATHER["function"], "strict": True, "parameters": {
    **WEATHER["function"]["parameters"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
HELLO = [{"role": "user", "content": "Hello!"}]
CALLED = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
    "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "rainy, 7 C"}]
TWO = [{"role": "user", "content": "What is the weather in Oslo and in Rome?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
USAGE = {"include_usage": True}

CC = "/v1/chat/completions"
CASES = {
    "tools": [
        (CC, {"messages": ASK, "tools": [WEATHER]}),
        (CC, {"messages": ASK, "tools": [WEATHER, TIME], "stream": True, "stream_options": USAGE}),
        (CC, {"messages": HELLO, "tools": [WEATHER]}),
        (CC, {"messages": HELLO, "tools": [WEATHER], "stream": True}),
        (CC, {"messages": HELLO}),
        (CC, {"messages": CALLED, "tools": [WEATHER]}),
        (CC, {"messages": CALLED, "tools": [WEATHER], "stream": True}),
        (CC, {"messages": TWO, "tools": [WEATHER]}),
        (CC, {"messages": TWO, "tools": [WEATHER], "parallel_tool_calls": False, "stream": True}),
        (CC, {"messages": ASK, "tools": [WEATHER], "tool_choice": "none"}),
        (CC, {"messages": ASK, "tools": [WEATHER], "include_reasoning": False, "return_token_ids": True}),
        (CC, {"messages": ASK, "tools": [WEATHER], "include_reasoning": False, "stream": True,
              "return_token_ids": True, "logprobs": True}),
        (CC, {"messages": ASK, "tools": [WEATHER], "logprobs": True, "top_logprobs": 2, "stream": True}),
        (CC, {"messages": ASK, "tools": [STRICT], "tool_choice": NAMED}),
        (CC, {"messages": ASK, "tools": [STRICT], "tool_choice": "required", "stream": True}),
        (CC, {"messages": ASK, "tools": [WEATHER], "max_tokens": 12}),  # cut inside the reasoning
        (CC, {"messages": ASK, "tools": [WEATHER], "max_tokens": 12, "stream": True}),
        ("/tokenize", {"messages": ASK, "tools": [WEATHER]}),
    ],
    "default-hermes": [
        (CC, {"messages": ASK, "tools": [STRICT], "tool_choice": "required", "parallel_tool_calls": False,
              "max_tokens": 40}),
        (CC, {"messages": ASK, "tools": [STRICT], "tool_choice": "required", "parallel_tool_calls": False,
              "max_tokens": 40, "stream": True}),
        (CC, {"messages": ASK, "tools": [STRICT], "tool_choice": NAMED, "max_tokens": 40}),
        (CC, {"messages": ASK, "tools": [STRICT], "tool_choice": NAMED, "max_tokens": 40, "stream": True,
              "stream_options": USAGE}),
        (CC, {"messages": ASK, "tools": [WEATHER], "max_tokens": 20}),
        (CC, {"messages": ASK, "tools": [WEATHER], "max_tokens": 20, "stream": True}),
    ],
}
ERRORS = [
    (CC, {"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    (CC, {"messages": ASK, "tools": [WEATHER], "tool_choice": "sometimes"}),
    (CC, {"messages": ASK, "tool_choice": "required"}),
    (CC, {"messages": ASK, "tools": [{"type": "function"}]}),
    (CC, {"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function"}}),
    (CC, {"messages": ASK, "tools": "get_weather"}),
]


@pytest.fixture(scope="module", params=list(TOOL_MODELS))
def vllm_tools(request, tmp_path_factory):
    """`vllm serve` of one TOOL_MODELS configuration (one at a time: module scope, one param live)."""
    model, flags, max_len = TOOL_MODELS[request.param]
    server = VllmServe(tmp_path_factory.mktemp(f"vllm-{request.param}"), model=model, served=request.param,
                       flags=tuple(flags), max_model_len=max_len)
    server.start()
    log = server.workdir / "vllm.log"
    try:
        import time

        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and server.proc.poll() is None:
            try:
                if http(server.base, "GET", "/health", key=None, timeout=5).status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else ""
            raise AssertionError(f"vllm serve ({request.param}) did not become healthy:\n{tail}")
        yield request.param, server.base
    finally:
        server.stop()


def clean(value):
    """Nulls dropped, ids and times masked (a call id keeps its format)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if v is None or k in ("created", "system_fingerprint"):
                continue
            if k == "id" and isinstance(v, str):
                v = re.sub(r"[0-9a-f]{8,}$", "<hex>", v) if v.startswith("chatcmpl-tool-") else "<id>"
            out[k] = clean(v)
        return out
    if isinstance(value, list):
        return [clean(v) for v in value]
    return value


def events(chunks: list[dict]) -> list:
    """A stream as its events, in order; adjacent pieces of one kind joined."""
    out: list = []

    def put(kind, index, piece):
        if out and out[-1][:2] == (kind, index) and isinstance(piece, str):
            out[-1] = (kind, index, out[-1][2] + piece)
        else:
            out.append((kind, index, piece))

    for chunk in chunks:
        if chunk.get("usage") and not chunk["choices"]:
            out.append(("usage", None, clean(chunk["usage"])))
        for c in chunk["choices"]:
            i, d = c["index"], c.get("delta") or {}
            if "role" in d:
                out.append(("role", i, d["role"]))
            if d.get("reasoning"):
                put("reasoning", i, d["reasoning"])
            if d.get("content"):
                put("content", i, d["content"])
            for tc in d.get("tool_calls") or ():
                fn = tc.get("function") or {}
                if tc.get("id") or fn.get("name"):
                    out.append(("call", (i, tc["index"]), clean({k: v for k, v in tc.items() if k != "function"})
                                | {"name": fn.get("name")}))
                if fn.get("arguments"):
                    put("arguments", (i, tc["index"]), fn["arguments"])
            if c.get("token_ids"):
                put("token_ids", i, "," + ",".join(map(str, c["token_ids"])))
            if c.get("logprobs"):
                put("logprobs", i, json.dumps(clean(c["logprobs"]["content"])))
            if c.get("finish_reason"):
                out.append(("finish", i, c["finish_reason"]))
    return out


def ask(base: str, model: str, path: str, body: dict):
    payload = {"model": model, **body} if path == "/tokenize" else {"model": model, "temperature": 0,
                                                                     "max_tokens": 200, **body}
    r = http(base, "POST", path, payload, key=None, timeout=300)
    if r.status != 200:
        return r.status, None
    if body.get("stream"):
        return 200, events(json_lines(r.text))
    got = r.json()
    if path == "/tokenize":
        return 200, got
    return 200, {"choices": clean(got["choices"]), "usage": clean(got["usage"])}


def test_tool_and_reasoning_answers_equal_vllm_serves(vllm_tools, tools_daemon):
    name, vllm_base = vllm_tools
    differ = []
    for path, body in CASES[name]:
        theirs = ask(vllm_base, name, path, body)
        ours = ask(tools_daemon.base_url, name, path, body)
        assert theirs[0] == 200, (body, theirs)
        if ours != theirs:
            differ.append((body, theirs, ours))
    assert not differ, "\n\n".join(f"{b}\n vllm serve: {t}\n servectl:   {o}" for b, t, o in differ)


def test_refusals_equal_vllm_serves(vllm_tools, tools_daemon):
    name, vllm_base = vllm_tools
    for path, body in ERRORS:
        theirs = http(vllm_base, "POST", path, {"model": name, **body}, key=None)
        ours = http(tools_daemon, "POST", path, {"model": name, **body})
        assert theirs.status >= 400 and ours.status == theirs.status, (body, theirs.status, ours.status,
                                                                        theirs.body[:300], ours.body[:300])
