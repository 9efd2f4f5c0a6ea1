"""The gateway's pure parts, without a daemon: translation, logprobs, the response
accumulator and the engine link's state machine (against an in-process socket)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from api_gateway import openai_types as H
from api_gateway.accumulator import ResponseAccumulator
from api_gateway.engines import TRANSITIONS, EngineLink, EngineUnavailable, LinkState
from api_gateway.errors import EngineRequestError, HttpError, refused_by_engine, validation_error
from api_gateway.translate import (chat_logprobs, chat_messages, completion_logprobs, generate_messages,
                                   normalize_prompts, sampling_params)
from servectl.wire import engine as EP

pytestmark = pytest.mark.unit

S = LinkState


def completion(**fields) -> H.CompletionRequest:
    return msgspec.convert({"model": "m", "prompt": "x", **fields}, H.CompletionRequest)


def chat(**fields) -> H.ChatCompletionRequest:
    return msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields},
                           H.ChatCompletionRequest)


def raises_http(fn, *args) -> HttpError:
    with pytest.raises(HttpError) as info:
        fn(*args)
    return info.value


# ---- translate: prompts and messages ----------------------------------------------------

@pytest.mark.parametrize("prompt, expected", [
    ("a", ["a"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_normalize_prompts(prompt, expected):
    assert normalize_prompts(prompt) == expected


@pytest.mark.parametrize("prompt, message", [
    ([], "prompt must not be empty"),
    ([[1], []], "token id lists must not be empty"),
    (["a", 1], "prompt must be a string, a list of strings, token ids or lists of token ids"),
    ([True, False], "prompt must be a string, a list of strings, token ids or lists of token ids"),
    ([[1], ["a"]], "prompt must be a string, a list of strings, token ids or lists of token ids"),
])
def test_normalize_prompts_refuses(prompt, message):
    err = raises_http(normalize_prompts, prompt)
    assert (err.status, err.message, err.param) == (400, message, "prompt")


def test_chat_messages_join_text_parts_and_fill_missing_content():
    req = msgspec.convert({"model": "m", "messages": [
        {"role": "system", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c", "name": "bot"}]}, H.ChatCompletionRequest)
    assert chat_messages(req.messages) == [
        {"role": "system", "content": "", "name": None},
        {"role": "user", "content": "ab", "name": None},
        {"role": "assistant", "content": "c", "name": "bot"}]


def test_chat_messages_refuse_non_text_parts():
    req = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    err = raises_http(chat_messages, req.messages)
    assert (err.status, err.message, err.param) == (400, "only text content parts are supported", "messages")


# ---- translate: sampling parameters -------------------------------------------------------

def test_sampling_defaults():
    assert sampling_params(completion(), chat=False) == ({"n": 1, "max_tokens": 16}, None)
    assert sampling_params(chat(), chat=True) == ({"n": 1}, None)


def test_sampling_passes_set_fields_through():
    req = completion(temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=7, presence_penalty=0.5,
                     frequency_penalty=-0.5, repetition_penalty=1.2, stop="END", ignore_eos=True, n=3,
                     max_tokens=9, logprobs=2)
    assert sampling_params(req, chat=False) == ({
        "n": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 7, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.2, "stop": ["END"], "ignore_eos": True,
        "max_tokens": 9, "logprobs": 2}, None)


def test_sampling_stop_list_and_zero_logprobs():
    s, _ = sampling_params(completion(stop=["a", "b"], logprobs=0), chat=False)
    assert s == {"n": 1, "stop": ["a", "b"], "max_tokens": 16, "logprobs": 0}


@pytest.mark.parametrize("fields, max_tokens", [
    ({"max_completion_tokens": 5, "max_tokens": 9}, 5),
    ({"max_tokens": 9}, 9),
    ({"max_completion_tokens": 4}, 4),
])
def test_chat_max_completion_tokens_wins(fields, max_tokens):
    s, _ = sampling_params(chat(**fields), chat=True)
    assert s["max_tokens"] == max_tokens


def test_logit_bias_keys_become_token_ids():
    s, _ = sampling_params(completion(logit_bias={"5": 1.5, "10": -100}), chat=False)
    assert s["logit_bias"] == {5: 1.5, 10: -100.0}


def test_logit_bias_refuses_non_token_keys():
    err = raises_http(sampling_params, completion(logit_bias={"a": 1}), False)
    assert (err.status, err.message, err.param) == (400, "logit_bias keys must be token ids", "logit_bias")


@pytest.mark.parametrize("fields, logprobs", [
    ({"logprobs": True, "top_logprobs": 3}, 3),
    ({"logprobs": True}, 0),
])
def test_chat_logprobs_sampling(fields, logprobs):
    s, _ = sampling_params(chat(**fields), chat=True)
    assert s["logprobs"] == logprobs


def test_chat_top_logprobs_needs_logprobs():
    err = raises_http(sampling_params, chat(top_logprobs=2), True)
    assert (err.status, err.message, err.param) == (400, "top_logprobs needs logprobs: true", "top_logprobs")


@pytest.mark.parametrize("response_format, structured", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"json_object": True}),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}, {"json": {"type": "object"}}),
])
def test_response_format(response_format, structured):
    assert sampling_params(chat(response_format=response_format), chat=True)[1] == structured


def test_response_format_json_schema_needs_its_object():
    err = raises_http(sampling_params, chat(response_format={"type": "json_schema"}), True)
    assert (err.status, err.param) == (400, "response_format")
    assert err.message == "response_format json_schema needs a `json_schema` object"


def test_generate_messages_one_per_prompt():
    ids = iter(["r1", "r2"])
    gens = generate_messages(completion(echo=True, n=2), ["text", [5, 6]], False, lambda: next(ids))
    assert gens == [
        EP.Generate(request_id="r1", prompt="text", sampling={"n": 2, "max_tokens": 16}, echo=True),
        EP.Generate(request_id="r2", prompt_token_ids=[5, 6], sampling={"n": 2, "max_tokens": 16}, echo=True)]
    messages = [{"role": "user", "content": "hi"}]
    [g] = generate_messages(chat(response_format={"type": "json_object"}), [messages], True, lambda: "c1")
    assert g == EP.Generate(request_id="c1", messages=messages, sampling={"n": 1}, structured={"json_object": True})


# ---- errors -----------------------------------------------------------------------------------

def test_validation_error_names_the_field():
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.convert({"model": "m", "prompt": "x", "n": 0}, H.CompletionRequest)
    err = validation_error(info.value)
    assert (err.status, err.param) == (400, "n")
    assert err.message == "Expected `int` >= 1 (field `n`)"


@pytest.mark.parametrize("status, http_status, type_", [
    (400, 400, "invalid_request_error"), (500, 500, "internal_error"), (503, 503, "service_unavailable")])
def test_refused_by_engine(status, http_status, type_):
    err = refused_by_engine(EngineRequestError("no", status, "prompt"))
    assert (err.status, err.type) == (http_status, type_)


# ---- logprobs -----------------------------------------------------------------------------

ENTRIES = [["Hi", None, []], ["a", -0.1, [["a", -0.1], ["b", -2.0]]], ["bc", -0.5, [["bc", -0.5], ["d", -1.0]]]]


def test_completion_logprobs():
    assert completion_logprobs(ENTRIES, 1) == H.CompletionLogprobs(
        tokens=["Hi", "a", "bc"], token_logprobs=[None, -0.1, -0.5], top_logprobs=[None, {"a": -0.1}, {"bc": -0.5}],
        text_offset=[0, 2, 3])
    assert completion_logprobs(ENTRIES, 0).top_logprobs == [None, None, None]


def test_chat_logprobs():
    assert chat_logprobs(ENTRIES[:2]) == H.ChatLogprobs(content=[
        H.ChatTokenLogprob(token="Hi", logprob=float("-inf"), bytes=[72, 105], top_logprobs=[]),
        H.ChatTokenLogprob(token="a", logprob=-0.1, bytes=[97], top_logprobs=[
            H.TopLogprob(token="a", logprob=-0.1, bytes=[97]), H.TopLogprob(token="b", logprob=-2.0, bytes=[98])])])


# ---- the response accumulator -------------------------------------------------------------

def delta(index=0, text="", tokens=(), finish=None, prompt_tokens=None, logprobs=None, echo=None) -> EP.Delta:
    d = EP.Delta(request_id="r", index=index, text=text, token_ids=list(tokens), finish_reason=finish,
                 prompt_tokens=prompt_tokens, logprobs=logprobs)
    if echo is not None:
        d.prompt_text, d.prompt_logprobs = echo
    return d


# Two prompts, n=2: prompt 0 reports 3 prompt tokens, prompt 1 reports 2.
TWO_BY_TWO = [
    (0, delta(0, "a", [1], prompt_tokens=3)), (0, delta(1, "x", [2], prompt_tokens=3)),
    (1, delta(0, "p", [3], prompt_tokens=2)), (1, delta(1, "q", [4], prompt_tokens=2)),
    (0, delta(0, "b", [5], "stop")), (1, delta(0, "", [], "length")),
    (0, delta(1, "y", [6, 7], "stop")), (1, delta(1, "r", [8], "stop")),
]


def run(acc: ResponseAccumulator, items) -> list:
    return [acc.chunk(acc.add(pi, d), created=1) for pi, d in items]


def test_accumulator_whole_response_maps_prompt_and_choice_to_index():
    acc = ResponseAccumulator(completion(n=2), False, prompts=2, response_id="cmpl-1")
    run(acc, TWO_BY_TWO)
    body = acc.response(created=5)
    assert [(c.index, c.text, c.finish_reason) for c in body.choices] == [
        (0, "ab", "stop"), (1, "xy", "stop"), (2, "p", "length"), (3, "qr", "stop")]
    assert body.usage == H.Usage(prompt_tokens=5, completion_tokens=8, total_tokens=13)
    assert (body.id, body.created, body.model) == ("cmpl-1", 5, "m")


def test_accumulator_stream_and_whole_agree():
    whole = ResponseAccumulator(completion(n=2), False, prompts=2, response_id="cmpl-1")
    run(whole, TWO_BY_TWO)
    streamed = ResponseAccumulator(completion(n=2), False, prompts=2, response_id="cmpl-1", keep=False)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in run(streamed, TWO_BY_TWO):
        [c] = chunk.choices
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.finish_reason is not None:
            finish[c.index] = c.finish_reason
    body = whole.response(created=1)
    assert texts == {c.index: c.text for c in body.choices}
    assert finish == {c.index: c.finish_reason for c in body.choices}
    assert streamed.usage() == whole.usage()
    assert streamed.usage_chunk(created=1) == H.CompletionResponse(id="cmpl-1", created=1, model="m", choices=[],
                                                                   usage=whole.usage())
    assert streamed.texts == {}  # a stream keeps nothing per choice


def test_accumulator_echo_puts_the_prompt_before_each_choice():
    prompt_entries = [["Say", None, []], [" hi", -1.0, [[" hi", -1.0]]]]
    items = [(0, delta(0, " there", [9], prompt_tokens=2, logprobs=[[" there", -0.5, [[" there", -0.5]]]],
                       echo=("Say hi", prompt_entries))),
             (0, delta(1, " you", [8], prompt_tokens=2, logprobs=[[" you", -0.7, [[" you", -0.7]]]],
                       echo=("Say hi", prompt_entries))),
             (0, delta(0, "!", [7], "stop", logprobs=[["!", -0.2, [["!", -0.2]]]]))]
    req = completion(n=2, echo=True, logprobs=1)
    whole = ResponseAccumulator(req, False, prompts=1, response_id="cmpl-1")
    chunks = run(whole, items)
    assert [c.choices[0].text for c in chunks] == ["Say hi there", "Say hi you", "!"]
    body = whole.response(created=1)
    assert [c.text for c in body.choices] == ["Say hi there!", "Say hi you"]
    assert body.choices[0].logprobs == H.CompletionLogprobs(
        tokens=["Say", " hi", " there", "!"], token_logprobs=[None, -1.0, -0.5, -0.2],
        top_logprobs=[None, {" hi": -1.0}, {" there": -0.5}, {"!": -0.2}], text_offset=[0, 3, 6, 12])
    assert chunks[2].choices[0].logprobs == H.CompletionLogprobs(
        tokens=["!"], token_logprobs=[-0.2], top_logprobs=[{"!": -0.2}], text_offset=[0])
    assert whole.usage() == H.Usage(prompt_tokens=2, completion_tokens=3, total_tokens=5)


def test_accumulator_without_echo_leaves_the_prompt_out():
    items = [(0, delta(0, " there", [9], "stop", prompt_tokens=2, echo=("Say hi", [["Say", None, []]])))]
    acc = ResponseAccumulator(completion(), False, prompts=1, response_id="cmpl-1")
    run(acc, items)
    assert acc.response(created=1).choices == [H.CompletionChoice(index=0, text=" there", finish_reason="stop")]


def test_accumulator_chat_stream_names_the_role_once_per_choice():
    items = [(0, delta(0, "He", [1], prompt_tokens=4)), (0, delta(1, "Yo", [2], prompt_tokens=4)),
             (0, delta(0, "llo", [3], "stop")), (0, delta(1, "", [], "length"))]
    acc = ResponseAccumulator(chat(n=2), True, prompts=1, response_id="chatcmpl-1", keep=False)
    chunks = run(acc, items)
    assert [(c.choices[0].index, c.choices[0].delta, c.choices[0].finish_reason) for c in chunks] == [
        (0, H.DeltaMessage(role="assistant", content="He"), None),
        (1, H.DeltaMessage(role="assistant", content="Yo"), None),
        (0, H.DeltaMessage(content="llo"), "stop"),
        (1, H.DeltaMessage(content=""), "length")]
    assert H.encoder.encode(chunks[2].choices[0].delta) == b'{"content":"llo"}'
    assert acc.usage() == H.Usage(prompt_tokens=4, completion_tokens=3, total_tokens=7)


def test_accumulator_chat_whole_response_with_logprobs():
    lp = [["ok", -0.3, [["ok", -0.3]]]]
    acc = ResponseAccumulator(chat(logprobs=True), True, prompts=1, response_id="chatcmpl-1")
    run(acc, [(0, delta(0, "ok", [5], "stop", prompt_tokens=1, logprobs=lp))])
    assert acc.response(created=2) == H.ChatCompletionResponse(
        id="chatcmpl-1", created=2, model="m", usage=H.Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
        choices=[H.ChatChoice(index=0, message=H.ResponseMessage(content="ok"), finish_reason="stop",
                              logprobs=chat_logprobs(lp))])


def test_accumulator_first_token_time_is_the_first_delta_with_tokens():
    times = iter([10.0, 20.0])
    acc = ResponseAccumulator(completion(), False, prompts=1, response_id="cmpl-1", clock=lambda: next(times))
    acc.add(0, delta(0, "", [], prompt_tokens=1))
    assert acc.first_token_at is None
    acc.add(0, delta(0, "a", [1]))
    acc.add(0, delta(0, "b", [2], "stop"))
    assert acc.first_token_at == 10.0


# ---- the engine link's state machine ------------------------------------------------------

def test_transition_table():
    assert TRANSITIONS[S.REMOVED] == frozenset()
    # READY needs an answered Hello: never from a state without a pending one.
    assert [s for s in S if S.READY in TRANSITIONS[s]] == [S.STARTING, S.CONNECTING, S.DRAINING]
    # Every live state can be left for every other the manager can announce, and removed.
    for s in set(S) - {S.REMOVED}:
        assert {S.STARTING, S.DRAINING, S.DOWN, S.FAILED, S.REMOVED, S.CONNECTING} - {s} <= TRANSITIONS[s]


def bare_link() -> EngineLink:
    return EngineLink("m", "/nonexistent/engine-m", None, b"gw-test")


def test_swap_keeps_the_ready_event_in_sync():
    for old in S:
        for new in S:
            link = bare_link()
            link.state = old
            swapped = link._swap(frozenset(S), new)
            assert swapped == (new in TRANSITIONS[old])
            assert link.state == (new if swapped else old)
            if swapped:
                assert link.ready.is_set() == (new in (S.READY, S.REMOVED))


def test_swap_refuses_an_unexpected_state():
    link = bare_link()
    assert link._swap(frozenset({S.CONNECTING}), S.READY) is False
    assert (link.state, link.ready.is_set()) == (S.STARTING, False)


@pytest.mark.parametrize("word, state", [
    ("starting", S.STARTING), ("draining", S.DRAINING), ("stopping", S.DRAINING), ("exited", S.DOWN),
    ("backoff", S.DOWN), ("stopped", S.DOWN), ("failed", S.FAILED)])
def test_manager_words_drive_the_link_and_are_reported(word, state):
    link = bare_link()
    link.on_model_state(word, "", "why")
    assert (link.state, link.status, link.reason, link.ready.is_set()) == (state, word, "why", False)


def test_an_unknown_manager_word_is_ignored():
    link = bare_link()
    link.on_model_state("exploded", "", None)
    assert (link.state, link.status) == (S.STARTING, "starting")


def test_failed_model_refuses_waiters_at_once():
    link = bare_link()
    link.on_model_state("failed", "", "3 exits within 60s")
    with pytest.raises(EngineUnavailable) as info:
        asyncio.run(link.wait_ready(60))
    assert str(info.value) == ("model 'm' failed: 3 exits within 60s; an operator must run `servectl restart m`")
    assert info.value.retry_after is None


class FakeEngine:
    """An in-process ROUTER where the engine's socket would be: answers Hello, records the rest."""

    def __init__(self, ctx: zmq.asyncio.Context):
        self.dir = tempfile.mkdtemp(prefix="gwu-", dir="/tmp")  # short: ipc paths have a length limit
        self.path = str(Path(self.dir) / "engine-m")
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"ipc://{self.path}")

    async def recv(self):
        peer, body = await asyncio.wait_for(self.sock.recv_multipart(), 10)
        return peer, EP.from_gateway_decoder.decode(body)

    async def accept(self, link: EngineLink, incarnation: str, version: int = EP.PROTOCOL_VERSION) -> None:
        peer, hello = await self.recv()
        assert hello == EP.Hello(version=EP.PROTOCOL_VERSION)
        await self.sock.send_multipart([peer, EP.encoder.encode(EP.HelloReply(
            version=version, incarnation=incarnation, model="m", max_model_len=128, max_num_seqs=4))])


async def submit(link: EngineLink, sink: asyncio.Queue, *gens: EP.Generate, choices: int = 1) -> None:
    await link.submit([(g.request_id, EP.encoder.encode(g)) for g in gens], choices, sink)


def with_engine(scenario):
    async def main():
        ctx = zmq.asyncio.Context()
        engine = FakeEngine(ctx)
        link = EngineLink("m", engine.path, ctx, b"gw-test")
        try:
            await scenario(link, engine)
        finally:
            link.remove()
            engine.sock.close(linger=0)
            ctx.destroy(linger=0)
    asyncio.run(main())


def test_ready_after_hello_then_exit_fails_streams_in_flight():
    async def scenario(link: EngineLink, engine: FakeEngine):
        link.on_model_state("ready", "inc1", None)
        assert (link.state, link.status, link.ready.is_set()) == (S.CONNECTING, "starting", False)
        await engine.accept(link, "inc1")
        await asyncio.wait_for(link.ready.wait(), 10)
        assert (link.state, link.status, link.incarnation, link.max_model_len) == (S.READY, "ready", "inc1", 128)
        sink = asyncio.Queue()
        await submit(link, sink, EP.Generate(request_id="g1", prompt="x"))
        _, gen = await engine.recv()
        assert gen == EP.Generate(request_id="g1", prompt="x")
        link.on_model_state("exited", "", "signal 9")
        assert (link.state, link.status, link.sock, link.ready.is_set()) == (S.DOWN, "exited", None, False)
        rid, failed = sink.get_nowait()
        assert rid == "g1" and isinstance(failed, EngineUnavailable)
        assert str(failed) == "the engine for model 'm' exited (signal 9)"
        with pytest.raises(EngineUnavailable):
            await submit(link, sink, EP.Generate(request_id="g2", prompt="x"))
        assert link.streams == {}

    with_engine(scenario)


def test_draining_lets_requests_in_flight_run_and_holds_new_ones():
    async def scenario(link: EngineLink, engine: FakeEngine):
        link.on_model_state("ready", "inc1", None)
        await engine.accept(link, "inc1")
        await asyncio.wait_for(link.ready.wait(), 10)
        sink = asyncio.Queue()
        await submit(link, sink, EP.Generate(request_id="g1", prompt="x"))
        link.on_model_state("draining", "inc1", None)
        assert (link.state, link.status, link.ready.is_set()) == (S.DRAINING, "draining", False)
        assert link.sock is not None and sink.empty()
        # Output of the request in flight still arrives.
        peer, _ = await engine.recv()
        await engine.sock.send_multipart([peer, EP.encoder.encode(EP.StepOutput(
            incarnation="inc1", deltas=[EP.Delta(request_id="g1", text="y", token_ids=[1], finish_reason="stop")]))])
        rid, got = await asyncio.wait_for(sink.get(), 10)
        assert (rid, got.text, got.finish_reason) == ("g1", "y", "stop")
        with pytest.raises(EngineUnavailable) as info:
            await link.wait_ready(0.05)
        assert str(info.value) == "model 'm' is not available (draining) after waiting 0.05s"
        with pytest.raises(EngineUnavailable):
            await submit(link, sink, EP.Generate(request_id="g2", prompt="x"))

    with_engine(scenario)


def test_a_stale_starting_does_not_outrank_the_engines_hello():
    async def scenario(link: EngineLink, engine: FakeEngine):
        link.on_model_state("ready", "inc1", None)
        link.on_model_state("starting", "inc1", None)  # an older snapshot, read after the event
        assert (link.state, link.sock is not None) == (S.STARTING, True)
        await engine.accept(link, "inc1")
        await asyncio.wait_for(link.ready.wait(), 10)
        assert link.state == S.READY

    with_engine(scenario)


def test_a_repeated_ready_does_not_reconnect():
    async def scenario(link: EngineLink, engine: FakeEngine):
        link.on_model_state("ready", "inc1", None)
        first = link.sock
        link.on_model_state("ready", "inc1", None)
        await engine.accept(link, "inc1")
        await asyncio.wait_for(link.ready.wait(), 10)
        link.on_model_state("ready", "inc1", None)
        assert (link.sock is first, link.state) == (True, S.READY)

    with_engine(scenario)


def test_protocol_mismatch_fails_the_link():
    async def scenario(link: EngineLink, engine: FakeEngine):
        link.on_model_state("ready", "inc1", None)
        link.on_engine_message(EP.HelloReply(version=EP.PROTOCOL_VERSION + 1, incarnation="inc1", model="m",
                                             max_model_len=128), "inc1")
        assert (link.state, link.status, link.reason) == (S.FAILED, "failed", "protocol version mismatch")
        with pytest.raises(EngineUnavailable) as info:
            await link.wait_ready(10)
        assert info.value.retry_after is None

    with_engine(scenario)


def test_remove_wakes_waiters_and_refuses_them():
    async def scenario(link: EngineLink, engine: FakeEngine):
        waiter = asyncio.ensure_future(link.wait_ready(10))
        await asyncio.sleep(0)
        assert link.waiting == 1
        link.remove()
        with pytest.raises(EngineUnavailable) as info:
            await waiter
        assert (str(info.value), info.value.retry_after) == ("model 'm' was unloaded", None)
        assert (link.state, link.status, link.ready.is_set()) == (S.REMOVED, "removed", True)
        # Later waits are refused at once: the ready event is set but nothing will ever serve.
        with pytest.raises(EngineUnavailable):
            await link.wait_ready(10)
        assert link._swap(frozenset(S), S.STARTING) is False

    with_engine(scenario)


# ---- no vLLM, no torch ----------------------------------------------------------------------

def test_the_gateway_imports_no_vllm_or_torch():
    # A fresh interpreter: other tests of a full run import torch into this one.
    code = ("import sys, json; import api_gateway.app, api_gateway.openapi, api_gateway.generate, "
            "api_gateway.translate, api_gateway.accumulator, api_gateway.manager_link, api_gateway.engines; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == []
