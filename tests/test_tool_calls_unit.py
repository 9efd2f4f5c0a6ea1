"""Issue 31, the gateway's half: a parsed chat (a model with a tool-call or reasoning parser) is
shown as the engine's parsers said, streamed and whole, with vLLM's usage and hiding rules; the
request fields that ask for tools are forwarded, the deprecated ones refused; a constrained
choice is not continued across a restart. Pure: no vLLM, no daemon."""

from __future__ import annotations

import json

import msgspec
import pytest

from api_gateway import fields as F
from api_gateway import openai_types as H
from api_gateway.accumulator import ResponseAccumulator
from api_gateway.errors import HttpError
from builders import delta
from api_gateway.resume import CannotContinue, Choice, plan, why_not_exact
from servectl import config as C
from servectl.wire import engine as EP

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PARSED = EP.PromptInfo(tokens=7, role="assistant", parsed=True, reasoning_usage=True)


def chat(**fields) -> H.ChatCompletionRequest:
    return msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields},
                           H.ChatCompletionRequest)


CALL_DELTAS = [
    delta("<think>", [1], prompt=PARSED),  # the parser shows nothing yet
    delta("ok", [2], message={"reasoning": "ok"}),
    delta("</think>", [3]),
    delta("<tool_call>", [4]),
    delta('{"name": "get_weather"', [5], message={"tool_calls": [
        {"index": 0, "id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather"}}]}),
    delta(', "arguments": {"city": "Oslo"}}', [6], message={"tool_calls": [
        {"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]}),
    delta("</tool_call>", [7], "tool_calls", message=None, reasoning_tokens=2),
]


def stream(acc, deltas):
    return [json.loads(H.encoder.encode(c)) for d in deltas for c in acc.chunks(acc.add(0, d), created=1)]


def test_a_parsed_stream_shows_the_parsers_deltas_and_skips_what_they_hold():
    acc = ResponseAccumulator(chat(stream=True, tools=TOOLS), True, prompts=1, response_id="chatcmpl-1", keep=False)
    chunks = stream(acc, CALL_DELTAS)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"reasoning": "ok"},
        {"tool_calls": [{"index": 0, "id": "chatcmpl-tool-1", "type": "function",
                         "function": {"name": "get_weather"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]},
        {},  # the finishing chunk: no text of the tag, the finish reason
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "<tool_call>" not in json.dumps(chunks)
    usage = json.loads(H.encoder.encode(acc.usage_chunk(created=1)))["usage"]
    assert usage == {"prompt_tokens": 7, "completion_tokens": 7, "total_tokens": 14,
                     "completion_tokens_details": {"reasoning_tokens": 2}}


def test_a_parsed_whole_answer_is_the_message_the_engine_parsed():
    message = {"content": None, "reasoning": "ok", "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    deltas = [*CALL_DELTAS[:-1], delta("</tool_call>", [7], "tool_calls", message=message, reasoning_tokens=2)]
    for d in deltas[1:-1]:
        d.message = None  # a whole answer's deltas carry no parse: its last one the message
    acc = ResponseAccumulator(chat(tools=TOOLS), True, prompts=1, response_id="chatcmpl-1")
    for d in deltas:
        acc.add(0, d)
    body = json.loads(H.encoder.encode(acc.response(created=1)))
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", **{"refusal": None, "annotations": None, "audio": None, "function_call": None}, **message}
    assert choice["finish_reason"] == "tool_calls"
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}


def test_a_plain_chat_keeps_its_shape():
    acc = ResponseAccumulator(chat(), True, prompts=1, response_id="chatcmpl-1")
    acc.add(0, delta("hello", [1], "stop", prompt=EP.PromptInfo(tokens=3, role="assistant")))
    body = json.loads(H.encoder.encode(acc.response(created=1)))
    # vLLM's ChatMessage as its model_dump writes it (issue 51), reasoning null.
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello", **{"refusal": None, "annotations": None, "audio": None, "function_call": None}, "reasoning": None}
    assert body["usage"]["completion_tokens_details"] is None


def test_hidden_reasoning_hides_token_ids_in_a_stream():
    info = EP.PromptInfo(tokens=3, role="assistant", parsed=True, metadata_hidden=True)
    acc = ResponseAccumulator(chat(stream=True, return_token_ids=True, include_reasoning=False), True, prompts=1,
                              response_id="c", keep=False)
    chunks = stream(acc, [delta("<think>x", [1, 2], prompt=info), delta("Hi", [3], "stop", message={"content": "Hi"})])
    assert not any(c["choices"][0].get("token_ids") for c in chunks)  # null where vLLM writes the key
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "Hi"}]


def test_tool_fields_are_forwarded_and_the_deprecated_api_is_refused():
    body = {"model": "m", "messages": [], "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    forward, unknown = F.classify("chat", body)
    assert forward == body and unknown == []
    for key, value in (("functions", [{"name": "f"}]), ("function_call", "auto")):
        with pytest.raises(HttpError) as info:
            F.classify("chat", {**body, key: value})
        assert info.value.param == key and "tools" in str(info.value)
    assert F.classify("tokenize", {"messages": [], "tools": TOOLS})[0]["tools"] == TOOLS
    req = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert req.tool_choice.function.name == "get_weather"


def gen(**body):
    return EP.Generate(request_id="r", kind="chat", body={"messages": [], **body})


def test_free_text_tool_calls_continue_and_constrained_ones_do_not():
    assert why_not_exact(gen(tools=TOOLS, tool_choice="auto", parallel_tool_calls=True)) is None
    assert "constrained" in why_not_exact(gen(tools=TOOLS), constrained=True)
    ids = iter(f"n{i}" for i in range(10))
    started = [[Choice(tokens=[1, 2], text_chars=5, started=True)]]
    with pytest.raises(CannotContinue):  # a stream the client saw part of
        plan([gen(tools=TOOLS)], started, lambda: next(ids), False, lambda *a: None, [True])
    restarted = []
    sends = plan([gen(tools=TOOLS)], [[Choice(tokens=[1, 2], text_chars=5, started=True)]], lambda: next(ids), True,
                 lambda *a: restarted.append(a), [True])
    assert restarted == [(0, 0)] and sends[0][1].resume.token_ids == []  # a whole answer: again from the start
    [(_, resumed)] = plan([gen(tools=TOOLS)], started, lambda: next(ids), False, lambda *a: None, [False])
    assert resumed.resume.token_ids == [1, 2] and resumed.resume.text_chars == 5


def test_chat_settings_are_model_keys_not_engine_args(tmp_path):
    for key in ("tool_call_parser", "enable_auto_tool_choice", "chat_template"):
        path = tmp_path / f"{key}.toml"
        path.write_text(f'[[models]]\nname = "m"\nmodel = "x"\n[models.engine_args]\n{key} = "hermes"\n')
        with pytest.raises(C.ConfigError) as info:
            C.load_config(path)
        assert f"models.m.engine_args.{key}" in str(info.value) and "set it on the model" in str(info.value)
    path = tmp_path / "auto.toml"
    path.write_text('[[models]]\nname = "m"\nmodel = "x"\nenable_auto_tool_choice = true\n')
    with pytest.raises(C.ConfigError, match="needs tool_call_parser"):
        C.load_config(path)
    path.write_text('[[models]]\nname = "m"\nmodel = "x"\nenable_auto_tool_choice = true\ntool_call_parser = "hermes"\n'
                    'tool_strict_level = "function"\n[models.engine_args]\nreasoning_parser = "qwen3"\n')
    cfg, _ = C.load_config(path)
    m = cfg.models[0]
    assert (m.tool_call_parser, m.tool_strict_level, m.engine_args["reasoning_parser"]) == ("hermes", "function",
                                                                                              "qwen3")
    plain = msgspec.structs.replace(m, tool_call_parser="pythonic")
    assert C.output_identity(plain) != C.output_identity(m)  # a resumed request never changes parser


def test_the_tools_cell_summarises_rounds_as_median_and_spread():
    from bench import tools as B

    def cell(tps):
        return {"output_throughput": tps, "requests_per_s": tps / 50, "median_ttft_ms": 10.0, "median_e2e_ms": 90.0}

    rounds = {"vllm serve": [{"1": cell(100.0)}, {"1": cell(120.0)}, {"1": cell(110.0)}],
              "servectl": [{"1": cell(99.0)}, {"1": cell(130.0)}, {"1": cell(121.0)}]}
    s = B.summarize(rounds)
    assert s["servectl"]["1"]["output_throughput"] == {"median": 121.0, "min": 99.0, "max": 130.0}
    md = B.markdown({"summary": s, "date": "d", "rounds": 3, "machine": {"cpu": "x", "cores": 2}})
    assert "| c=1 | output_throughput | 110.0 [100.0–120.0] | 121.0 [99.0–130.0] | 1.10× |" in md
