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
from conftest import TOOL_MODELS, http, json_lines, vllm_serving

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
    with vllm_serving(server, request.param) as base:
        yield request.param, base


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


def test_a_forced_non_strict_call_is_held_to_its_schema_beyond_vllm_serve(vllm_tools, tools_daemon):
    """Deliberately beyond `vllm serve` (issue 51): under `required` or a named choice servectl
    holds a non-strict tool's arguments to its parameters; `vllm serve`'s hermes structural tag
    leaves them free (any JSON object), so its answer is shown, not compared."""
    import jsonschema

    name, vllm_base = vllm_tools
    if name != "tools":
        pytest.skip("the default model's forced calls run to max_tokens (test_tools.py)")
    for choice in ("required", NAMED):
        body = {"messages": ASK, "tools": [WEATHER], "tool_choice": choice, "parallel_tool_calls": False}
        theirs = ask(vllm_base, name, CC, body)
        ours = ask(tools_daemon.base_url, name, CC, body)
        print("vllm serve:", theirs)  # free arguments: not compared
        [call] = ours[1]["choices"][0]["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


# ---- issue 32: the Responses and Messages APIs ------------------------------------------------

RS, MS = "/v1/responses", "/v1/messages"
R_WEATHER = {"type": "function", **WEATHER["function"]}
A_WEATHER = {"name": "get_weather", "description": WEATHER["function"]["description"],
             "input_schema": WEATHER["function"]["parameters"]}
R_CALLED = [*ASK, {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                   "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "rainy, 7 C"}]
A_CALLED = [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                      "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "rainy, 7 C"}]}]
API_CASES = {
    "tools": [
        (RS, {"input": "What is the weather in Oslo?", "tools": [R_WEATHER]}),
        (RS, {"input": "What is the weather in Oslo?", "tools": [R_WEATHER], "stream": True}),
        (RS, {"input": "Hello!"}),
        (RS, {"input": "Hello!", "instructions": "Be brief.", "stream": True}),
        (RS, {"input": R_CALLED, "tools": [R_WEATHER]}),
        (RS, {"input": R_CALLED, "tools": [R_WEATHER], "stream": True}),
        (RS, {"input": "What is the weather in Oslo?", "tools": [R_WEATHER], "max_output_tokens": 12}),
        (RS, {"input": "What is the weather in Oslo?", "tools": [R_WEATHER], "max_output_tokens": 12,
              "stream": True}),
        (RS, {"input": "Hello!", "include": ["message.output_text.logprobs"], "top_logprobs": 2}),
        (RS, {"input": "What is the weather in Oslo?", "tools": [R_WEATHER], "tool_choice": "none"}),
        (RS, {"input": "What is the weather in Oslo?", "tools": [R_WEATHER], "include_reasoning": False,
              "stream": True}),
        (MS, {"messages": ASK, "tools": [A_WEATHER]}),
        (MS, {"messages": ASK, "tools": [A_WEATHER], "stream": True}),
        (MS, {"messages": HELLO, "system": "Be brief."}),
        (MS, {"messages": HELLO, "stream": True}),
        (MS, {"messages": A_CALLED, "tools": [A_WEATHER]}),
        (MS, {"messages": A_CALLED, "tools": [A_WEATHER], "stream": True}),
        (MS, {"messages": HELLO, "stop_sequences": ["help"]}),
        (MS, {"messages": HELLO, "stop_sequences": ["help"], "stream": True}),
        (MS, {"messages": ASK, "tools": [A_WEATHER], "max_tokens": 12}),
        (MS + "/count_tokens", {"messages": ASK, "tools": [A_WEATHER], "system": "Be brief."}),
    ],
    "default-hermes": [
        (RS, {"input": "def", "max_output_tokens": 20}),
        (RS, {"input": "def", "max_output_tokens": 20, "stream": True}),
        (MS, {"messages": [{"role": "user", "content": "def"}], "max_tokens": 20}),
        (MS, {"messages": [{"role": "user", "content": "def"}], "max_tokens": 20, "stream": True}),
    ],
}
API_ERRORS = [
    (RS, {}),
    (RS, {"input": 5}),
    (RS, {"input": "x", "previous_response_id": "resp_0123456789abcdef"}),
    (RS, {"input": "x", "store": True, "background": True}),
    (RS, {"input": "x", "tool_choice": "sometimes", "tools": [R_WEATHER]}),
    (MS, {"messages": ASK}),
    (MS, {"max_tokens": 5}),
    (MS, {"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}),
    (MS + "/count_tokens", {}),
]
ID_KEYS = ("id", "call_id", "item_id", "signature", "tool_use_id")


def clean_api(value):
    """Ids keep their format (prefix) with their random hex masked; times zeroed."""
    if isinstance(value, dict):
        return {k: (re.sub(r"[0-9a-f]{8,}", "<hex>", v) if k in ID_KEYS and isinstance(v, str)
                    else 0 if k == "created_at" else clean_api(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [clean_api(v) for v in value]
    return value


def api_events(text: str) -> list:
    """A Responses or Messages stream as its events, ids masked, sequence numbers dropped, and
    adjacent deltas of one part joined (vLLM's API server may hand two steps to one event)."""
    out: list = []
    name = None
    for line in text.split("\n"):
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = clean_api(json.loads(line[6:]))
            data.pop("sequence_number", None)
            prev = out[-1][1] if out and out[-1][0] == name else None
            if name.endswith(".delta") and name.startswith("response.") and prev is not None and \
                    {k: v for k, v in prev.items() if k not in ("delta", "logprobs")} == \
                    {k: v for k, v in data.items() if k not in ("delta", "logprobs")}:
                prev["delta"] += data["delta"]
                prev["logprobs"] = (prev.get("logprobs") or []) + (data.get("logprobs") or [])
                continue
            if name == "content_block_delta" and prev is not None and prev["index"] == data["index"] and \
                    prev["delta"]["type"] == data["delta"]["type"] != "signature_delta":
                for k in ("text", "thinking", "partial_json"):
                    if k in data["delta"]:
                        prev["delta"][k] += data["delta"][k]
                continue
            out.append((name, data))
    return out


def ask_api(base: str, model: str, path: str, body: dict):
    limit = {} if path.endswith("count_tokens") else \
        {"max_output_tokens": 200} if path == RS else {"max_tokens": 200}
    r = http(base, "POST", path, {"model": model, "temperature": 0, **limit, **body}
             if not path.endswith("count_tokens") else {"model": model, **body}, key=None, timeout=300)
    if r.status != 200:
        return r.status, None
    return 200, api_events(r.text) if body.get("stream") else clean_api(r.json())


def test_responses_and_messages_equal_vllm_serves(vllm_tools, tools_daemon):
    name, vllm_base = vllm_tools
    differ = []
    for path, body in API_CASES[name]:
        theirs = ask_api(vllm_base, name, path, body)
        ours = ask_api(tools_daemon.base_url, name, path, body)
        assert theirs[0] == 200, (path, body, theirs)
        if ours != theirs:
            differ.append((path, body, theirs, ours))
    assert not differ, "\n\n".join(f"{p} {b}\n vllm serve: {t}\n servectl:   {o}" for p, b, t, o in differ)


def test_responses_and_messages_refusals_equal_vllm_serves(vllm_tools, tools_daemon):
    name, vllm_base = vllm_tools
    for path, body in API_ERRORS:
        theirs = http(vllm_base, "POST", path, {"model": name, **body}, key=None)
        ours = http(tools_daemon, "POST", path, {"model": name, **body})
        assert theirs.status >= 400 and ours.status == theirs.status, (path, body, theirs.status, ours.status,
                                                                        theirs.body[:300], ours.body[:300])
