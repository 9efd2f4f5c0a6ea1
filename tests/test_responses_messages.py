"""Issue 32: the Responses and Messages APIs, as `vllm serve` serves them — real clients, real daemon.

The `tools_daemon` serves the bundled tool-calling model (`tools`: hermes calls,
qwen3 reasoning). Clients: the `openai` SDK's `responses.create` and its stream,
the OpenAI Agents SDK with its default (Responses) model, the `anthropic` SDK's
`messages.create`, its stream and `count_tokens`. Parity with `vllm serve` is in
test_tools_parity.py, crashes in test_tools_resume.py.
"""

from __future__ import annotations

import json
import os
from http.client import HTTPConnection

import pytest

from conftest import SHARED_API_KEY, http

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
A_WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
             "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def api(tools_daemon):
    return tools_daemon.openai()


@pytest.fixture(scope="module")
def claude(tools_daemon):
    import anthropic

    return anthropic.Anthropic(base_url=tools_daemon.base_url, api_key="unused", max_retries=0)


def sse(d, path: str, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """(event name, data) of a stream, read as the wire has it."""
    conn = HTTPConnection("127.0.0.1", d.port, timeout=300)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:300]
    assert resp.getheader("Content-Type", "").startswith("text/event-stream")
    out, name = [], None
    for raw in resp:
        line = raw.rstrip(b"\r\n")
        if line.startswith(b"event: "):
            name = line[7:].decode()
        elif line.startswith(b"data: "):
            out.append((name, json.loads(line[6:])))
    conn.close()
    return out


# ---- /v1/responses --------------------------------------------------------------------------

def test_responses_create_calls_the_tool_with_its_reasoning_apart(api):
    r = api.responses.create(model="tools", input="What is the weather in Oslo?", tools=[WEATHER],
                             max_output_tokens=200, **GREEDY)
    assert r.status == "completed" and r.id.startswith("resp_"), r
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "function_call"], kinds
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert "get_weather" in r.output[0].content[0].text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_a_function_output_becomes_the_answer(api):
    r = api.responses.create(model="tools", tools=[WEATHER], max_output_tokens=200, **GREEDY, input=[
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}])
    assert "sunny, 21 C" in r.output_text, r.output_text
    assert not [i for i in r.output if i.type == "function_call"]


def test_the_responses_stream_is_vllms_event_sequence(tools_daemon, api):
    events = sse(tools_daemon, "/v1/responses", {"model": "tools", "input": "Hello!", "stream": True,
                                                  "max_output_tokens": 200, **GREEDY})
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed", names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(n == data["type"] for n, data in events)
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    final = events[-1][1]["response"]
    message = [i for i in final["output"] if i["type"] == "message"]
    assert text and message[0]["content"][0]["text"] == text, (text, final["output"])
    # Every delta names an item announced before it, and the items keep their ids to the end.
    added = {d["item"]["id"] for n, d in events if n == "response.output_item.added"}
    assert {d["item_id"] for n, d in events if n.endswith(".delta")} <= added
    assert {i["id"] for i in final["output"]} == added
    # The SDK's stream helper assembles the same answer.
    with api.responses.stream(model="tools", input="Hello!", max_output_tokens=200, **GREEDY) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == text


def test_instructions_and_max_output_tokens(api):
    r = api.responses.create(model="tools", input="Hello!", instructions="Answer briefly.", max_output_tokens=5,
                             **GREEDY)
    assert r.status == "incomplete" and r.usage.output_tokens == 5, r
    assert r.instructions == "Answer briefly." and r.max_output_tokens == 5


def test_the_store_is_off_as_in_vllm(tools_daemon):
    r = http(tools_daemon, "POST", "/v1/responses", {"model": "tools", "input": "Hi", "max_output_tokens": 3,
                                                     "store": True})
    assert r.status == 200 and "store" in r.headers.get("x-servectl-ignored-fields", ""), r.headers
    rid = r.json()["id"]
    for method, path in (("GET", f"/v1/responses/{rid}"), ("POST", f"/v1/responses/{rid}/cancel")):
        got = http(tools_daemon, method, path)
        assert got.status == 404 and rid in got.json()["error"]["message"], got.body
    gone = http(tools_daemon, "POST", "/v1/responses", {"model": "tools", "input": "Hi", "previous_response_id": rid})
    assert gone.status == 404, gone.body
    background = http(tools_daemon, "POST", "/v1/responses", {"model": "tools", "input": "Hi", "background": True})
    assert background.status == 400 and background.json()["error"]["param"] == "background"


def test_the_agents_sdk_default_model_runs_an_agent_with_a_function_tool(tools_daemon):
    """The Agents SDK's default model speaks the Responses API."""
    from agents import Agent, Runner, function_tool, set_default_openai_api, set_default_openai_client
    from agents import set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    set_default_openai_api("responses")
    ran = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        ran.append(city)
        return "sunny, 21 C"

    set_default_openai_client(AsyncOpenAI(base_url=f"{tools_daemon.base_url}/v1", api_key="unused", max_retries=0),
                              use_for_tracing=False)
    agent = Agent(name="weather", instructions="You are a helpful assistant.", tools=[get_weather], model="tools")
    result = Runner.run_sync(agent, "What is the weather in Oslo?", max_turns=4)
    assert ran == ["Oslo"], ran  # the tool ran exactly once, with the city asked about
    assert "sunny, 21 C" in result.final_output, result.final_output


# ---- /v1/messages -----------------------------------------------------------------------------

def test_messages_create_with_tools_gives_a_tool_use_block(claude):
    m = claude.messages.create(model="tools", max_tokens=200, tools=[A_WEATHER], extra_body=GREEDY,
                               messages=[{"role": "user", "content": "What is the weather in Oslo?"}])
    assert m.stop_reason == "tool_use" and m.role == "assistant", m
    kinds = [b.type for b in m.content]
    assert kinds == ["thinking", "tool_use"], kinds
    use = m.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Oslo"} and use.id
    assert m.usage.input_tokens > 0 and m.usage.output_tokens > 0


def test_a_tool_result_becomes_the_answer(claude):
    m = claude.messages.create(model="tools", max_tokens=200, tools=[A_WEATHER], extra_body=GREEDY, messages=[
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}]}])
    text = "".join(b.text for b in m.content if b.type == "text")
    assert m.stop_reason == "end_turn" and "sunny, 21 C" in text, m


def test_the_messages_stream_assembles_to_the_whole_answer(tools_daemon, claude):
    body = {"model": "tools", "max_tokens": 200, "tools": [A_WEATHER], **GREEDY,
            "messages": [{"role": "user", "content": "What is the weather in Oslo?"}]}
    events = sse(tools_daemon, "/v1/messages", {**body, "stream": True})
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert all(n == d["type"] for n, d in events)
    blocks: dict[int, dict] = {}
    for n, d in events:
        if n == "content_block_start":
            assert d["index"] == len(blocks)  # blocks open in order, one at a time
            blocks[d["index"]] = {"type": d["content_block"]["type"], "text": "", "json": ""}
        elif n == "content_block_delta":
            delta, b = d["delta"], blocks[d["index"]]
            b["text"] += delta.get("text", "") + delta.get("thinking", "")
            b["json"] += delta.get("partial_json", "")
    whole = claude.messages.create(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY)
    # vLLM streams the blank line between the thinking and the call as a text block; the whole
    # answer has no blank text (parity with `vllm serve` is checked in test_tools_parity.py).
    shown = [b for b in blocks.values() if b["type"] != "text" or b["text"].strip()]
    assert [b["type"] for b in shown] == [b.type for b in whole.content]
    use = [b for b in blocks.values() if b["type"] == "tool_use"][0]
    assert json.loads(use["json"]) == whole.content[-1].input == {"city": "Oslo"}
    assert events[-2][1]["delta"]["stop_reason"] == whole.stop_reason == "tool_use"
    with claude.messages.stream(model="tools", max_tokens=200, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Hello!"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and any(b.type == "text" and b.text for b in final.content), final


def test_system_prompt_and_stop_sequences(claude):
    plain = claude.messages.create(model="tools", max_tokens=60, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Hello!"}])
    text = "".join(b.text for b in plain.content if b.type == "text")
    word = text.split()[0]
    stopped = claude.messages.create(model="tools", max_tokens=60, extra_body=GREEDY, stop_sequences=[word],
                                     messages=[{"role": "user", "content": "Hello!"}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word, stopped
    with_system = claude.messages.count_tokens(model="tools", system="You are terse.",
                                               messages=[{"role": "user", "content": "Hello!"}])
    without = claude.messages.count_tokens(model="tools", messages=[{"role": "user", "content": "Hello!"}])
    assert with_system.input_tokens > without.input_tokens > 0
    assert without.input_tokens == plain.usage.input_tokens


def test_count_tokens_renders_the_tools(claude):
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    assert claude.messages.count_tokens(model="tools", messages=ask, tools=[A_WEATHER]).input_tokens > \
        claude.messages.count_tokens(model="tools", messages=ask).input_tokens + 10


def test_the_anthropic_sdk_authenticates_with_x_api_key(daemon):
    """The shared daemon requires a key; Anthropic's SDK sends it as x-api-key."""
    import anthropic

    good = anthropic.Anthropic(base_url=daemon.base_url, api_key=SHARED_API_KEY, max_retries=0)
    m = good.messages.create(model="default", max_tokens=8, messages=[{"role": "user", "content": "def"}])
    assert m.usage.output_tokens == 8 and m.stop_reason == "max_tokens", m
    bad = anthropic.Anthropic(base_url=daemon.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model="default", max_tokens=8, messages=[{"role": "user", "content": "def"}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "authentication_error"


# ---- bad input ------------------------------------------------------------------------------------

BAD = [
    ("/v1/responses", {"model": "tools"}),  # no input
    ("/v1/responses", {"model": "tools", "input": 5}),
    ("/v1/responses", {"model": "tools", "input": [{"type": "nope"}]}),
    ("/v1/responses", {"model": "tools", "input": "x", "max_output_tokens": -1}),
    ("/v1/responses", {"model": "tools", "input": "x", "tools": [{"type": "function"}]}),
    ("/v1/responses", {"model": "tools", "input": "x", "tool_choice": {"type": "function", "name": "nope"},
                       "tools": [WEATHER]}),
    ("/v1/responses", {"model": "tools", "input": "x", "temperature": "hot"}),
    ("/v1/responses", {"model": "tools", "input": "x", "previous_input_messages": 3}),
    ("/v1/responses", {"model": "nope", "input": "x"}),
    ("/v1/responses", {"model": "tools", "input": [{"role": "user", "content": [{"type": "input_image",
                                                                                 "image_url": "file:///etc/passwd"}]}]}),
    ("/v1/messages", {"model": "tools", "messages": [{"role": "user", "content": "x"}]}),  # no max_tokens
    ("/v1/messages", {"model": "tools", "max_tokens": 5}),
    ("/v1/messages", {"model": "tools", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}),
    ("/v1/messages", {"model": "tools", "max_tokens": 5, "messages": [{"role": "user", "content": 7}]}),
    ("/v1/messages", {"model": "tools", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                      "tools": [{"name": "t"}]}),
    ("/v1/messages", {"model": "tools", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                      "tool_choice": {"type": "tool"}}),
    ("/v1/messages", {"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/messages", {"model": "tools", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}}]}]}),
    ("/v1/messages/count_tokens", {"model": "tools"}),
    ("/v1/messages/count_tokens", {"model": "tools", "messages": "x"}),
]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_is_a_4xx_in_the_apis_shape_and_loses_nothing(tools_daemon, stream):
    for path, body in BAD:
        if stream and path.endswith("count_tokens"):
            continue
        r = http(tools_daemon, "POST", path, {**body, "stream": True} if stream else body)
        assert 400 <= r.status < 500, (path, body, r.status, r.body[:300])
        got = r.json()
        if path.startswith("/v1/messages"):
            assert got["type"] == "error" and got["error"]["message"], got
        else:
            assert got["error"]["message"], got
    for raw in (b"{", b"[]", b'{"input": "x", "stream": "yes"}'):
        for path in ("/v1/responses", "/v1/messages"):
            assert http(tools_daemon, "POST", path, raw).status == 400
    # Nothing died of it: both endpoints answer.
    assert http(tools_daemon, "POST", "/v1/responses", {"model": "tools", "input": "Hi",
                                                        "max_output_tokens": 3}).status == 200
    assert http(tools_daemon, "POST", "/v1/messages", {"model": "tools", "max_tokens": 3,
                                                       "messages": [{"role": "user", "content": "Hi"}]}).status == 200


def test_the_endpoints_are_in_openapi_and_metrics(tools_daemon):
    paths = http(tools_daemon, "GET", "/openapi.json").json()["paths"]
    assert {"/v1/responses", "/v1/messages", "/v1/messages/count_tokens"} <= set(paths)
    metrics = http(tools_daemon, "GET", "/metrics").text
    assert 'endpoint="/v1/responses",status="200"' in metrics and 'endpoint="/v1/messages",status="200"' in metrics
