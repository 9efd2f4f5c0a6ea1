"""Issue 31: agents work unchanged — tool calls and reasoning in chat, real clients, real daemon.

The `tools_daemon` serves the bundled tool-calling model (`tools`: hermes calls,
qwen3 reasoning) and the default model with the hermes parser
(`default-hermes`: it calls tools only where a grammar makes it). Clients: the
`openai` SDK, the OpenAI Agents SDK (tracing off: nothing leaves the machine)
and `langchain-openai`. Parity with `vllm serve` is in test_tools_parity.py,
crashes in test_tools_resume.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import jsonschema
import pytest

from conftest import SERVECTL, TOOLS_MODEL_DIR, http

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True, "parameters": {
    **WEATHER["function"]["parameters"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
PLACE = {"type": "function", "function": {**WEATHER["function"], "parameters": {  # not strict
    "type": "object", "properties": {"place": {"type": "string"}}, "required": ["place"]}}}


@pytest.fixture(scope="module")
def api(tools_daemon):
    return tools_daemon.openai()


def chat(api, **kw):
    return api.chat.completions.create(**{"model": "tools", "temperature": 0, "max_tokens": 200, **kw})


def test_the_model_ships_in_the_wheel_layout():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (TOOLS_MODEL_DIR / name).is_file(), name


def test_auto_calls_a_tool_on_free_text_with_its_reasoning_apart(api):
    r = chat(api, messages=ASK, tools=[WEATHER])
    [choice] = r.choices
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    reasoning = choice.message.model_extra.get("reasoning")
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert not choice.message.content or "<tool_call>" not in choice.message.content
    assert r.usage.completion_tokens_details.reasoning_tokens > 0


def test_a_plain_answer_when_no_tool_fits(api):
    r = chat(api, messages=[{"role": "user", "content": "Hello!"}], tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content and "<think>" not in choice.message.content


def test_streamed_tool_call_deltas_assemble_to_the_same_call(api):
    whole = chat(api, messages=ASK, tools=[WEATHER]).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish, reasoning = None, ""
    for chunk in chat(api, messages=ASK, tools=[WEATHER], stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
            for tc in c.delta.tool_calls or ():
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    assert entry["id"] is None, "a call's id comes once"
                    entry["id"] = tc.id
                entry["name"] += tc.function.name or "" if tc.function else ""
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and reasoning
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (w.function.name, json.loads(w.function.arguments)) for w in whole]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls.values())


def test_the_tool_result_becomes_the_answer(api):
    first = chat(api, messages=ASK, tools=[WEATHER]).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "rainy, 7 C"}]
    r = chat(api, messages=history, tools=[WEATHER])
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert "rainy, 7 C" in r.choices[0].message.content


def test_include_reasoning_false_leaves_the_thinking_out(api):
    r = chat(api, messages=ASK, tools=[WEATHER], extra_body={"include_reasoning": False})
    assert not r.choices[0].message.model_extra.get("reasoning")
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_tool_choice_none_answers_without_a_call(api):
    r = chat(api, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_choices_give_a_valid_call(api, tool_choice, stream):
    calls, finish, _ = forced_call(api, "tools", tool_choice, stream, tools=[STRICT_WEATHER])
    assert len(calls) == 1, calls
    name, arguments = calls[0]
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), STRICT_WEATHER["function"]["parameters"])
    assert finish == ("tool_calls" if tool_choice == "required" else "stop"), finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_the_grammar_forces_a_call_on_a_model_that_knows_no_tools(api, tool_choice):
    """The default model writes Python; under a `required` or named choice its first tokens are
    the call's envelope all the same (it then loops in the whitespace JSON allows, as under
    `vllm serve`: test_tools_parity.py)."""
    r = chat(api, model="default-hermes", messages=ASK, tools=[STRICT_WEATHER], tool_choice=tool_choice,
             parallel_tool_calls=False, max_tokens=40)
    text = r.choices[0].message.content or ""
    calls = r.choices[0].message.tool_calls or []
    assert calls or text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {'), (text, calls)
    plain = chat(api, model="default-hermes", messages=ASK, tools=[STRICT_WEATHER], max_tokens=40)
    assert not (plain.choices[0].message.content or "").startswith("<tool_call>")


def forced_call(api, model: str, tool_choice, stream: bool, **kw) -> tuple[list, str | None, str | None]:
    """The calls of a forced choice, streamed (its deltas assembled) or whole, the finish reason and
    the content."""
    kw = dict(model=model, messages=ASK, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False) | kw
    if not stream:
        r = chat(api, **kw)
        return [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or ()], \
            r.choices[0].finish_reason, r.choices[0].message.content
    parts: dict[int, list] = {}
    finish, content = None, ""
    for chunk in chat(api, stream=True, **kw):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or ():
                p = parts.setdefault(tc.index, ["", ""])
                p[0] += (tc.function.name or "") if tc.function else ""
                p[1] += (tc.function.arguments or "") if tc.function else ""
            finish = c.finish_reason or finish
            content += c.delta.content or ""
    return [tuple(p) for p in parts.values()], finish, content


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("model", ["tools", "default-hermes"])
def test_a_forced_call_of_a_non_strict_tool_keeps_to_its_schema(api, model, tool_choice, stream):
    """Issue 51: `required` or a named choice holds a tool's arguments to its parameters, `strict`
    or not (beyond `vllm serve`, which holds only a `strict` tool's: test_tools_parity.py).

    The default model knows no tools: held to the schema it starts `{"city": "` and writes
    Python into the string until `max_tokens` (free, it loops in whitespace instead), so its
    arguments are checked as far as they go."""
    calls, finish, content = forced_call(api, model, tool_choice, stream, max_tokens=60)
    if model == "tools":
        assert [name for name, _ in calls] == ["get_weather"], (calls, finish, content)
        jsonschema.validate(json.loads(calls[0][1]), WEATHER["function"]["parameters"])
        # A parameter the model was not trained on: free, it writes its habit (`city`).
        calls, finish, content = forced_call(api, model, tool_choice, stream, max_tokens=60, tools=[PLACE])
        assert [name for name, _ in calls] == ["get_weather"], (calls, finish, content)
        jsonschema.validate(json.loads(calls[0][1]), PLACE["function"]["parameters"])
        return
    assert finish == "length", (calls, finish, content)
    # A call cut short: streamed, its arguments so far; whole, vLLM's parser shows the text.
    arguments = calls[0][1] if calls else content.split('<tool_call>\n{"name": "get_weather", "arguments": ', 1)[1]
    assert re.match(r'\{\s*"city"\s*:\s*"', arguments), (calls, content)


def test_langchain_structured_output_by_function_calling(tools_daemon):
    """Issue 51: LangChain's `with_structured_output(method="function_calling")` (a named choice
    of a non-strict tool) gets a valid object."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Weather(BaseModel):
        """The weather in a city."""

        city: str

    llm = ChatOpenAI(model="tools", base_url=f"{tools_daemon.base_url}/v1", api_key="unused", temperature=0,
                     max_retries=0, max_tokens=60)
    got = llm.with_structured_output(Weather, method="function_calling").invoke("What is the weather in Paris?")
    assert isinstance(got, Weather) and got.city, got


def test_bad_tool_requests_are_vllms_400s(tools_daemon):
    bad = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, None),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
    ]
    for extra, param in bad:
        r = http(tools_daemon, "POST", "/v1/chat/completions", {"model": "tools", "messages": ASK, **extra})
        assert r.status == 400, (extra, r.status, r.body[:300])
        err = r.json()["error"]
        assert err["message"] and "Traceback" not in err["message"], err
        if param:
            assert param in (err.get("param") or "") + err["message"], (extra, err)
    assert tools_daemon.status().models  # nothing died of it
    assert all(m.state == "ready" for m in tools_daemon.status().models)


def test_tokenize_renders_the_tools(tools_daemon):
    def count(**extra):
        r = http(tools_daemon, "POST", "/tokenize", {"model": "tools", "messages": ASK, **extra})
        assert r.status == 200, r.body
        return r.json()["count"]

    assert count(tools=[WEATHER]) > count() + 10


def test_the_openai_agents_sdk_runs_an_agent_with_a_function_tool(tools_daemon):
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    ran = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        ran.append(city)
        return "sunny, 21 C"

    client = AsyncOpenAI(base_url=f"{tools_daemon.base_url}/v1", api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="You are a helpful assistant.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model="tools", openai_client=client))
    result = Runner.run_sync(agent, "What is the weather in Oslo?", max_turns=4)
    assert ran == ["Oslo"], ran  # the tool ran exactly once, with the city asked about
    assert "sunny, 21 C" in result.final_output, result.final_output


def test_langchain_bind_tools_gets_tool_calls(tools_daemon):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(model="tools", base_url=f"{tools_daemon.base_url}/v1", api_key="unused", temperature=0,
                     max_retries=0)
    msg = llm.bind_tools([get_weather]).invoke("What is the weather in Paris?")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Paris"})], msg


def test_config_check_names_the_parsers(tools_daemon):
    def check(path):  # started now, read later: the two checks import vLLM side by side
        return subprocess.Popen([*SERVECTL, "config", "check", str(path)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)

    bad = tools_daemon.config_path.with_name("bad.toml")
    text = tools_daemon.config_path.read_text()
    bad.write_text(text.replace('tool_call_parser = "hermes"', 'tool_call_parser = "nope"', 1))  # model `tools`'s
    assert bad.read_text() != text
    good_check, bad_check = check(tools_daemon.config_path), check(bad)
    err = good_check.communicate(timeout=300)[1]
    assert good_check.returncode == 0, err
    assert "model tools: tool_call_parser: hermes" in err
    assert "model tools: engine_args.reasoning_parser: qwen3" in err
    err = bad_check.communicate(timeout=300)[1]
    assert bad_check.returncode != 0 and "'nope' is not registered" in err and "hermes" in err, err


def test_a_parser_that_does_not_fit_the_tokenizer_fails_the_model_at_once(daemon_factory):
    from conftest import DEFAULT_MODEL_DIR

    d = daemon_factory(f'[manager]\nwarm_standby = false\n[[models]]\nname = "m"\nmodel = "{DEFAULT_MODEL_DIR}"\n'
                       '[models.engine_args]\nreasoning_parser = "deepseek_r1"\n', expect_ok=False)
    [m] = d.status().models
    assert m.state == "failed" and m.restarts == 0, m
    # vLLM's own message (its engine config builds the parser before servectl's chat settings do)
    assert "could not locate think start/end tokens in the tokenizer" in (m.reason or ""), m
    assert "model m failed" in d.start_output.stderr, d.start_output.stderr
