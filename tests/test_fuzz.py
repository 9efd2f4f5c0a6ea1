"""No 5xx from any input: property-based tests of the generation endpoints (issues 4, 15, 32).

Every field of both request schemas, drawn mostly valid (so requests get past
validation into the engine) and otherwise at the edges: integers at and beyond
int64/uint64, negative and huge values, NaN and infinities, huge and nested
lists, empty strings, unicode and control characters, wrong types; plus
non-UTF-8 header values, arbitrary JSON and arbitrary bytes. Against the
shared daemon over one kept-alive connection: no 5xx (nor a 5xx error event
in a stream), every 4xx in OpenAI's error shape, the server still answers and
nothing is left running afterwards (conftest checks that after every test).
Derandomized: the same examples every run.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import http as http_request, requests_running, sse_lines, wait_for

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
LOG = os.environ.get("SERVECTL_FUZZ_LOG")  # a file: one line per request (status, seconds), to see the time go

# ---- values ------------------------------------------------------------------------------

INT_EDGES = [0, 1, -1, 2, 3, 255, 256, 257, 511, 512, 2**31 - 1, 2**31, -2**31, 2**53 + 1, 2**63 - 1, 2**63,
             -2**63, -2**63 - 1, 2**64 - 1, 2**64, -2**64, 10**30, -10**30, 10**400]
ints = st.sampled_from(INT_EDGES) | st.integers(-2**70, 2**70)
floats = st.sampled_from([0.0, -0.0, 1e-9, 0.5, 1.0, 2.0, 2.0000001, 100.0, -1.0, 1e308, -1e308, 5e-324,
                          math.inf, -math.inf, math.nan]) | st.floats()
# Unicode, control characters, lone surrogates escaped in JSON, line separators, the empty string.
SPECIAL_TEXT = ["", " ", "\x00", "\n", "\r\n", "\x1b[31m", "\u2028", "\u0085", "\ud800", "\udfff\ud800", "💥💥",
                "\u202e", "ﬀ", "def ", "</s>", "<|im_start|>", "\\", '"']
texts = st.sampled_from(SPECIAL_TEXT) | st.text(max_size=40) | st.integers(100, 3000).map(lambda n: "ab " * n)
short_texts = st.sampled_from(SPECIAL_TEXT[:14]) | st.text(max_size=8)
scalars = st.none() | st.booleans() | ints | floats | texts
wrong = scalars | st.lists(scalars, max_size=4) | st.dictionaries(short_texts, scalars, max_size=3)
nested = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(short_texts, c, max_size=3),
                      max_leaves=10)
huge_list = st.integers(0, 5000).map(lambda n: [7] * n) | st.integers(0, 400).map(lambda n: ["x"] * n)
# Nesting deeper than Python's json can build: a marker string that encode() replaces by the raw text.
DEEP = "\x00deep:"
deep_list = st.integers(1, 5000).map(lambda d: f"{DEEP}{d}")


anything = wrong | nested | huge_list | deep_list
DELETE = object()  # a mutation that removes the field


def edges(*specific):
    """What a field is fuzzed with: its own edge values, then anything of any type."""
    return st.sampled_from(list(specific)) | anything if specific else anything


token_ids = st.lists(st.integers(0, 3000), min_size=1, max_size=6)
short_lists = st.lists(short_texts, min_size=1, max_size=3)
# Each field: (valid values, edge values). Valid ones keep a request cheap for the engine
# (1-2 tokens); max_tokens is only large where it is under test (as an edge).
SAMPLING = {
    "max_tokens": (st.integers(1, 2), edges(0, -1, 512, 513, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, "2", 2.0, True)),
    "temperature": (st.floats(0.1, 2), edges(0, -0.0, 2.0000001, -1e-9, 100, math.inf, math.nan, "1")),
    "top_p": (st.floats(0.01, 1), edges(0, 1.0000001, -1, math.nan)),
    "top_k": (st.integers(-1, 50), edges(-2, 0, 2**31, 2**63 - 1, 2**63, 2**64, -2**63 - 1)),
    "min_p": (st.floats(0, 1), edges(-0.1, 1.1, math.inf)),
    "seed": (ints.filter(lambda v: -2**63 <= v < 2**63), edges(*INT_EDGES)),
    "n": (st.integers(1, 3), edges(0, -1, 64, 65, 257, 2**63, 2**64)),
    "stop": (short_texts.filter(bool) | st.lists(short_texts.filter(bool), max_size=3),
             edges("", [""], ["a", ""], [1], [None], ["x" * 10_000])),
    "presence_penalty": (st.floats(-2, 2), edges(-2.1, 2.1, math.inf)),
    "frequency_penalty": (st.floats(-2, 2), edges(-2.1, 2.1, -math.inf)),
    "repetition_penalty": (st.floats(0.5, 2), edges(0, -1, 10.1, math.nan)),
    "stream": (st.booleans(), edges("true", 1, 0)),
    "stream_options": (st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
                       edges({"include_usage": 1}, {"x": 1}, [])),
    "ignore_eos": (st.booleans(), edges("yes", 2)),
    "logit_bias": (st.dictionaries(st.integers(0, 3000).map(str), st.floats(-100, 100), max_size=3),
                   edges({"-1": 1}, {" 7": 1}, {"٣": 1}, {"1_0": 1}, {str(2**64): 1}, {str(2**63): 1},
                         {"99999": 1}, {"x": 1}, {"": 1}, {"5": 101}, {"5": math.nan}, {"5": "1"})),
    "response_format": (st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}) | st.builds(
        lambda schema: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, st.sampled_from([
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "string", "maxLength": 3}, {"anyOf": [{"type": "null"}, {"type": "boolean"}]}, {}])),
        edges({"type": "json_schema"}, {"type": "xml"}, {"type": "json_schema", "json_schema": {"schema": 1}},
              *({"type": "json_schema", "json_schema": {"schema": schema}} for schema in (
                  {"type": "integer", "minimum": 5, "maximum": 1}, {"type": "strin"}, {"$ref": "#/nope"},
                  {"type": "string", "pattern": "(unclosed"}, {"enum": []}, {"type": "integer", "maximum": 2**64},
                  {"type": "integer", "maximum": 2**63}, {"type": "object", "required": [1]})))),
    "user": (texts, anything),
    "an_unknown_field": (anything, anything),
}
COMPLETION = {
    **SAMPLING,
    "logprobs": (st.integers(0, 5), edges(-1, 21, 2**63, True)),
    "echo": (st.booleans(), edges("1")),
    "suffix": (st.none(), edges("x")),
    "best_of": (st.none() | st.just(1), edges(2, 0)),
}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer"]),
     "content": texts | st.none() | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                                             max_size=3)},
    optional={"name": short_texts})
odd_message = st.fixed_dictionaries(
    {"role": edges("tool", "robot", "", None), "content": edges([{"type": "image_url"}], [{"type": "text"}],
                                                                [{"type": "text", "text": 1}], [{}], 7)},
    optional={"name": anything})
CHAT = {
    **SAMPLING,
    "max_completion_tokens": (st.integers(1, 2), SAMPLING["max_tokens"][1]),
    "logprobs": (st.booleans(), edges(1, "true")),
    "top_logprobs": (st.integers(0, 5), edges(-1, 21, 2**64)),
    "tools": (st.none(), edges([{"type": "function"}], [])),
}
REQUIRED_COMPLETION = {
    "model": (st.just("default"), edges("", "nope", "default ", "DEFAULT", None, 1)),
    "prompt": (texts | short_lists | token_ids | st.lists(token_ids, min_size=1, max_size=3),
               edges("", [], [[]], [-1], [2**63], [2**64], [[1], ["a"]], [True], ["a"] * 257, [[1]] * 257,
                     ["ab " * 3000] * 4)),
}
REQUIRED_CHAT = {
    "model": REQUIRED_COMPLETION["model"],
    "messages": (st.lists(message, min_size=1, max_size=3), edges([], [{}], [{"role": "user"}])
                 | st.lists(odd_message, min_size=1, max_size=2)),
}


@st.composite
def bodies(draw, required: dict, optional: dict, tokens_field: str):
    """A request body: valid (a third), one field at its edges (half), or several fields anything."""
    body = draw(st.fixed_dictionaries({k: v for k, (v, _) in required.items()},
                                      optional={k: v for k, (v, _) in optional.items() if k != tokens_field}))
    body[tokens_field] = draw(optional[tokens_field][0])  # small unless under test
    fields = {**required, **optional}
    mode = draw(st.sampled_from(["valid", "valid", "one", "one", "one", "many"]))
    if mode == "one":
        name = draw(st.sampled_from(sorted(fields)))
        body[name] = draw(fields[name][1] | st.just(DELETE))
    elif mode == "many":
        for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=2, max_size=5, unique=True)):
            body[name] = draw(fields[name][1] | st.just(DELETE))
    return {k: v for k, v in body.items() if v is not DELETE}


# Issue 32: the Responses and Messages APIs (vLLM's classes take them whole, in the engine).
input_item = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer"]),
     "content": texts | st.lists(st.fixed_dictionaries({"type": st.just("input_text"), "text": texts}), max_size=2)})
RESPONSES = {
    **{k: SAMPLING[k] for k in ("temperature", "top_p", "top_k", "seed", "stop", "presence_penalty",
                                "frequency_penalty", "repetition_penalty", "stream", "user", "an_unknown_field")},
    "max_output_tokens": SAMPLING["max_tokens"],
    "instructions": (st.none() | texts, anything),
    "tools": (st.none(), edges([{"type": "function"}], [], [{"type": "function", "name": "f", "parameters": {}}],
                               [{"type": "web_search"}], [{"type": "mcp", "server_label": "x"}])),
    "tool_choice": (st.sampled_from(["auto", "none"]), edges("required", {"type": "function", "name": "x"}, 1)),
    "include": (st.none(), edges(["message.output_text.logprobs"], ["nope"], "x")),
    "top_logprobs": (st.integers(0, 5), edges(-1, 21, 2**64)),
    "text": (st.none(), edges({"format": {"type": "json_object"}}, {"format": 1}, {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "string", "maxLength": 2}}})),
    "reasoning": (st.none(), edges({"effort": "low"}, {"effort": 5})),
    "store": (st.booleans(), anything),
    "background": (st.just(False), edges(True, "x")),
    "previous_response_id": (st.none(), edges("resp_0123456789abcdef", 5)),
    "metadata": (st.none(), anything),
}
REQUIRED_RESPONSES = {
    "model": REQUIRED_COMPLETION["model"],
    "input": (texts | st.lists(input_item, min_size=1, max_size=3),
              edges("", [], [{}], 5, [{"type": "function_call_output", "call_id": "c", "output": "x"}],
                    [{"type": "function_call", "name": "f", "arguments": "{"}],
                    [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}])),
}
a_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]),
     "content": texts | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2)})
MESSAGES = {
    **{k: SAMPLING[k] for k in ("temperature", "top_p", "top_k", "stream", "an_unknown_field")},
    "max_tokens": SAMPLING["max_tokens"],
    "system": (st.none() | texts, anything),
    "stop_sequences": (st.none() | short_lists, edges([""], "x", [1])),
    "tools": (st.none(), edges([{"name": "t"}], [{"name": "t", "input_schema": {}}], [])),
    "tool_choice": (st.none(), edges({"type": "any"}, {"type": "tool"}, {"type": "tool", "name": "t"}, "auto")),
    "thinking": (st.none(), edges({"type": "enabled", "budget_tokens": 1}, {"type": "disabled"}, {"type": "x"})),
    "metadata": (st.none(), anything),
}
REQUIRED_MESSAGES = {
    "model": REQUIRED_COMPLETION["model"],
    "messages": (st.lists(a_message, min_size=1, max_size=3), edges([], [{}], [{"role": "user"}], [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": 5}]}], [
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}])),
}

completion_bodies = bodies(REQUIRED_COMPLETION, COMPLETION, "max_tokens")
responses_bodies = bodies(REQUIRED_RESPONSES, RESPONSES, "max_output_tokens")
messages_bodies = bodies(REQUIRED_MESSAGES, MESSAGES, "max_tokens")
chat_bodies = bodies(REQUIRED_CHAT, CHAT, "max_completion_tokens")
# Header values: the key, a wrong one, bytes that are not UTF-8 (never CR/LF: that is another request).
header_bytes = st.binary(max_size=12).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"").replace(b"\0", b""))
headers = st.fixed_dictionaries({}, optional={
    "Authorization": st.sampled_from(["key", "key", "key", "key", "wrong", "none"]) | header_bytes,
    "X-Request-Id": header_bytes | short_texts.filter(lambda t: t.isprintable() and t.isascii()),
    "X-Anything": header_bytes,
})


# ---- one request -----------------------------------------------------------------------------

class Client:
    """One kept-alive HTTP/1.1 connection to the daemon, reopened when the server closes it."""

    def __init__(self, daemon):
        self.daemon = daemon
        self.conn: http.client.HTTPConnection | None = None

    def send(self, path: str, body: bytes, hdrs: dict) -> tuple[int, bytes, str]:
        out = {"Content-Type": "application/json", "Authorization": f"Bearer {self.daemon.api_key}"}
        for name, value in hdrs.items():
            if name == "Authorization" and value == "none":
                out.pop(name)
            elif name == "Authorization" and value in ("key", "wrong"):
                out[name] = f"Bearer {self.daemon.api_key if value == 'key' else 'sk-wrong'}"
            elif isinstance(value, bytes):
                out[name] = value  # raw bytes on the wire
            else:
                out[name] = value
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.daemon.port, timeout=120)
            try:
                self.conn.request("POST", path, body, out)
                resp = self.conn.getresponse()
                data = resp.read()
                if resp.will_close:
                    self.close()
                return resp.status, data, resp.getheader("Content-Type", "")
            except (ConnectionError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def check_api(path: str, status: int, data: bytes, ctype: str) -> None:
    """Responses / Messages: no 5xx, each API's error shape, streams that end as vLLM's do."""
    assert status < 500, (status, data[:500])
    if status >= 400:
        assert ctype.startswith("application/json"), (status, ctype, data[:200])
        body = json.loads(data)
        err = body["error"]
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and err["type"] and err["message"], body
        else:
            assert isinstance(err["message"], str) and err["message"] and {"type", "param", "code"} <= set(err), err
    elif ctype.startswith("text/event-stream"):
        events = [(line[7:], json.loads(nxt[6:])) for line, nxt in zip(*[iter(
            [x for x in sse_lines(data.decode()) if x.startswith(("event: ", "data: "))])] * 2)]
        assert events, data[-300:]
        for name, body in events:
            assert name == body["type"], (name, body)
            assert name != "error" or not str(body.get("code", body.get("error", {}).get("type"))).startswith("5"), body
        assert events[-1][0] in ("response.completed", "message_stop", "error"), events[-1]
    else:
        body = json.loads(data)
        assert body["object"] == "response" if path == "/v1/responses" else body["type"] == "message", body


def check(status: int, data: bytes, ctype: str) -> None:
    assert status < 500, (status, data[:500])
    if status >= 400:
        assert ctype.startswith("application/json"), (status, ctype, data[:200])
        err = json.loads(data)["error"]
        assert isinstance(err["message"], str) and err["message"], err
        assert {"type", "param", "code"} <= set(err), err
    elif ctype.startswith("text/event-stream"):
        events = [line[6:] for line in sse_lines(data.decode()) if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", data[-300:]
        for e in events[:-1]:
            body = json.loads(e)
            if "error" in body:
                assert body["error"]["code"] in range(400, 500) or not isinstance(body["error"]["code"], int), body
    else:
        body = json.loads(data)
        assert body["choices"] and "usage" in body, body


def encode(body, nan_ok: bool, ascii_only: bool) -> bytes:
    text = json.dumps(body, allow_nan=nan_ok, ensure_ascii=ascii_only)
    marker = json.dumps(DEEP, ensure_ascii=ascii_only)[:-1]
    while marker in text:
        start = text.index(marker)
        end = text.index('"', start + len(marker))
        depth = int(text[start + len(marker):end])
        text = text[:start] + "[" * depth + "]" * depth + text[end + 1:]
    return text.encode("utf-8", "surrogatepass")


# Fast enough for the whole suite: ~2,000 examples per endpoint in well under a minute each.
SCHEMA = settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
ODDS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                database=None)


def fuzz_endpoint(daemon, path: str, bodies):
    client = Client(daemon)

    @SCHEMA
    @given(body=bodies, hdrs=headers, nan_ok=st.booleans(), ascii_only=st.booleans())
    # Found by the fuzzer: U+2028 in a streamed JSON string is not a line break in SSE (the
    # parser once split it with str.splitlines()).
    @example(body={"model": "default", "prompt": ["\u2028"], "stream": True, "echo": True, "max_tokens": 1}, hdrs={},
             nan_ok=False, ascii_only=False)
    def one(body, hdrs, nan_ok, ascii_only):
        try:
            raw = encode(body, nan_ok, ascii_only)
        except ValueError:  # NaN with allow_nan=False
            raw = encode(body, True, ascii_only)
        started = time.monotonic()
        result = client.send(path, raw, hdrs)
        if LOG:
            with open(LOG, "a") as f:
                f.write(f"{path} {result[0]} {time.monotonic() - started:.4f} {len(raw)} {raw[:150]!r}\n")
        check(*result)

    try:
        one()
    finally:
        client.close()


def test_completions_schema(daemon):
    fuzz_endpoint(daemon, "/v1/completions", completion_bodies)


def test_chat_schema(daemon):
    fuzz_endpoint(daemon, "/v1/chat/completions", chat_bodies)


API = settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_responses_and_messages_schema(daemon, path):
    client = Client(daemon)

    @API
    @given(body=responses_bodies if path == "/v1/responses" else messages_bodies, nan_ok=st.booleans())
    def one(body, nan_ok):
        try:
            raw = encode(body, nan_ok, False)
        except ValueError:
            raw = encode(body, True, False)
        check_api(path, *client.send(path, raw, {}))

    try:
        one()
    finally:
        client.close()


def test_arbitrary_json_and_bytes(daemon):
    client = Client(daemon)

    @ODDS
    @given(value=nested | huge_list | deep_list, raw=st.none() | st.binary(max_size=200),
           endpoint=st.sampled_from(ENDPOINTS))
    def one(value, raw, endpoint):
        check(*client.send(endpoint, raw if raw is not None else encode(value, True, False), {}))

    try:
        one()
    finally:
        client.close()


def test_still_serving_after_fuzzing(daemon):
    r = http_request(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "def ", "max_tokens": 3,
                                                         "ignore_eos": True})
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert requests_running(daemon) == 0
    # Idle again: past the freeze grace the worker is frozen, everything else ready; nothing restarted.
    daemon.wait_standbys_warm(2)
    wait_for(lambda: daemon.child("worker:default:0").state == "idle (frozen)", 30, what="the worker frozen")
    children = daemon.status().children
    expected = {"gateway:0": "ready", "engine_core:default": "ready", "worker:default:0": "idle (frozen)",
                "standby:engine_core:default": "ready", "standby:worker:default:0": "ready"}
    assert {c.component: c.state for c in children} == expected
    assert {c.component: c.restarts for c in children} == dict.fromkeys(expected, 0)
