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

from builders import delta
from gateway_harness import served
import zmq
import zmq.asyncio

from api_gateway import openai_types as H
from api_gateway.accumulator import ResponseAccumulator
from api_gateway.engines import TRANSITIONS, EngineLink, EngineUnavailable, LinkState
from api_gateway.errors import EngineRequestError, HttpError, refused_by_engine, validation_error
from api_gateway.translate import (check_messages, chat_logprobs, completion_logprobs, generate_messages,
                                   normalize_prompts)
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


def test_text_parts_are_checked_media_parts_left_to_vllm():
    check_messages(chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]},
                                  {"role": "assistant", "content": None}]).messages)
    check_messages(chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]).messages)
    req = chat(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}])
    err = raises_http(check_messages, req.messages)
    assert (err.status, err.param) == (400, "messages")


def test_generate_messages_one_per_prompt_with_the_fields_as_sent():
    ids = iter(["r1", "r2"])
    forward = {"model": "m", "prompt": ["text", [5, 6]], "echo": True, "n": 2, "stop_token_ids": [3]}
    gens = generate_messages(forward, ["text", [5, 6]], lambda: next(ids))
    assert gens == [
        EP.Generate(request_id="r1", kind="completion", body={**forward, "prompt": "text"}),
        EP.Generate(request_id="r2", kind="completion", body={**forward, "prompt": [5, 6]})]
    body = {"messages": [{"role": "user", "content": "hi", "x-extra": 1}], "structured_outputs": {"choice": ["a"]}}
    assert generate_messages(body, None, lambda: "c1") == [EP.Generate(request_id="c1", kind="chat", body=body)]


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

# [token, logprob, alternatives, bytes] as the engine sends them (already chosen as vLLM's API would).
ENTRIES = [["Hi", None, None, [72, 105]], ["a", -0.1, [["a", -0.1], ["b", -2.0]], [97]],
           ["bc", -0.5, [["bc", -0.5], ["d", -1.0]], None]]


def test_completion_logprobs():
    lp, offset = completion_logprobs(ENTRIES, 1)
    assert lp == H.CompletionLogprobs(
        tokens=["Hi", "a", "bc"], token_logprobs=[None, -0.1, -0.5],
        top_logprobs=[None, {"a": -0.1, "b": -2.0}, {"bc": -0.5, "d": -1.0}], text_offset=[1, 3, 4])
    assert offset == 6


def test_completion_logprobs_alternatives_collapse_like_a_dict():
    """vLLM keys the alternatives by their text: two tokens that decode alike keep one entry."""
    lp, _ = completion_logprobs([["a", -0.1, [["a", -0.1], ["a", -3.0]], None]])
    assert lp.top_logprobs == [{"a": -3.0}]


def test_chat_logprobs():
    assert chat_logprobs(ENTRIES[:2]) == H.ChatLogprobs(content=[
        H.ChatTokenLogprob(token="Hi", logprob=-9999.0, bytes=[72, 105], top_logprobs=[]),
        H.ChatTokenLogprob(token="a", logprob=-0.1, bytes=[97], top_logprobs=[
            H.TopLogprob(token="a", logprob=-0.1, bytes=[97]), H.TopLogprob(token="b", logprob=-2.0, bytes=[98])])])


# ---- the response accumulator -------------------------------------------------------------

# Two prompts, n=2: prompt 0 reports 3 prompt tokens, prompt 1 reports 2.
TWO_BY_TWO = [
    (0, delta("a", [1], prompt=3)), (0, delta("x", [2], index=1)),
    (1, delta("p", [3], prompt=2)), (1, delta("q", [4], index=1)),
    (0, delta("b", [5], "stop", stop_reason="END")), (1, delta("", [], "length")),
    (0, delta("y", [6, 7], "stop", stop_reason=9, index=1)), (1, delta("r", [8], "stop", index=1)),
]


def run(acc: ResponseAccumulator, items) -> list:
    return [chunk for pi, d in items for chunk in acc.chunks(acc.add(pi, d), created=1)]


def test_accumulator_whole_response_maps_prompt_and_choice_to_index():
    acc = ResponseAccumulator(completion(n=2), False, prompts=2, response_id="cmpl-1")
    run(acc, TWO_BY_TWO)
    body = acc.response(created=5)
    assert [(c.index, c.text, c.finish_reason, c.stop_reason) for c in body.choices] == [
        (0, "ab", "stop", "END"), (1, "xy", "stop", 9), (2, "p", "length", None), (3, "qr", "stop", None)]
    assert body.usage == H.Usage(prompt_tokens=5, completion_tokens=8, total_tokens=13,
                                 prompt_tokens_details=None, completion_tokens_details=None)  # whole: vLLM writes nulls
    assert (body.id, body.created, body.model) == ("cmpl-1", 5, "m")
    # Every field vLLM's model_dump writes, null or not (issue 51; tests/test_response_keys.py).
    assert set(json.loads(H.encoder.encode(body))["choices"][0]) == {
        "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_token_ids",
        "prompt_logprobs", "routed_experts"}


def test_accumulator_stream_and_whole_agree():
    whole = ResponseAccumulator(completion(n=2), False, prompts=2, response_id="cmpl-1")
    run(whole, TWO_BY_TWO)
    streamed = ResponseAccumulator(completion(n=2), False, prompts=2, response_id="cmpl-1", keep=False)
    texts: dict[int, str] = {}
    finish: dict[int, tuple] = {}
    for chunk in run(streamed, TWO_BY_TWO):
        [c] = chunk.choices
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.finish_reason is not None:
            finish[c.index] = (c.finish_reason, c.stop_reason)
    body = whole.response(created=1)
    assert texts == {c.index: c.text for c in body.choices}
    assert finish == {c.index: (c.finish_reason, c.stop_reason) for c in body.choices}
    assert streamed.usage() == whole.usage()
    assert streamed.usage_chunk(created=1) == H.CompletionResponse(
        id="cmpl-1", object="text_completion", created=1, model="m", choices=[], usage=whole.usage())
    assert all(not c.texts for c in streamed.choices.values())  # a stream keeps nothing per choice


ECHO_PROMPT = EP.PromptInfo(tokens=2, echo_text="Say hi", echo_logprobs=[
    ["Say", None, None, None], [" hi", -1.0, [[" hi", -1.0]], None]])


def test_accumulator_echo_puts_the_prompt_before_each_choice():
    items = [(0, delta(" there", [9], prompt=ECHO_PROMPT, logprobs=[[" there", -0.5, [[" there", -0.5]], None]])),
             (0, delta(" you", [8], logprobs=[[" you", -0.7, [[" you", -0.7]], None]], index=1)),
             (0, delta("!", [7], "stop", logprobs=[["!", -0.2, [["!", -0.2]], None]]))]
    req = completion(n=2, echo=True, logprobs=1)
    whole = ResponseAccumulator(req, False, prompts=1, response_id="cmpl-1")
    chunks = run(whole, items)
    assert [c.choices[0].text for c in chunks] == ["Say hi there", "Say hi you", "!"]
    body = whole.response(created=1)
    assert [c.text for c in body.choices] == ["Say hi there!", "Say hi you"]
    assert body.choices[0].logprobs == H.CompletionLogprobs(
        tokens=["Say", " hi", " there", "!"], token_logprobs=[None, -1.0, -0.5, -0.2],
        top_logprobs=[None, {" hi": -1.0}, {" there": -0.5}, {"!": -0.2}], text_offset=[0, 3, 6, 12])
    # A stream's offsets run on from the choice's earlier chunks (vLLM's next_text_offsets).
    assert chunks[2].choices[0].logprobs == H.CompletionLogprobs(
        tokens=["!"], token_logprobs=[-0.2], top_logprobs=[{"!": -0.2}], text_offset=[12])
    assert whole.usage() == H.Usage(prompt_tokens=2, completion_tokens=3, total_tokens=5)


def test_accumulator_echo_with_max_tokens_0_shows_the_prompt_only():
    """vLLM generates one token for it and shows none of it, but counts it in usage."""
    req = completion(echo=True, max_tokens=0, logprobs=0)
    acc = ResponseAccumulator(req, False, prompts=1, response_id="cmpl-1")
    run(acc, [(0, delta("zz", [9], "length", prompt=ECHO_PROMPT, logprobs=[["zz", -0.1, [], None]]))])
    [c] = acc.response(created=1).choices
    assert (c.text, c.logprobs.tokens, c.finish_reason) == ("Say hi", ["Say", " hi"], "length")
    assert acc.usage() == H.Usage(prompt_tokens=2, completion_tokens=1, total_tokens=3)


def test_accumulator_without_echo_leaves_the_prompt_out():
    items = [(0, delta(" there", [9], "stop", prompt=EP.PromptInfo(tokens=2)))]
    acc = ResponseAccumulator(completion(), False, prompts=1, response_id="cmpl-1")
    run(acc, items)
    assert acc.response(created=1).choices == [H.CompletionChoice(index=0, text=" there", logprobs=None,
                                                                  finish_reason="stop", stop_reason=None,
                                                                  prompt_logprobs=None, routed_experts=None)]


def test_accumulator_token_ids_and_prompt_logprobs():
    info = EP.PromptInfo(tokens=2, token_ids=[4, 5], prompt_logprobs=[None, {"5": {"logprob": -1.0, "rank": 1,
                                                                                   "decoded_token": "x"}}])
    acc = ResponseAccumulator(completion(return_token_ids=True), False, prompts=1, response_id="cmpl-1")
    chunks = run(acc, [(0, delta("a", [7], prompt=info)), (0, delta("b", [8], "stop"))])
    [c] = acc.response(created=1).choices
    assert (c.token_ids, c.prompt_token_ids, c.prompt_logprobs) == ([7, 8], [4, 5], info.prompt_logprobs)
    assert [(k.choices[0].token_ids, k.choices[0].prompt_token_ids) for k in chunks] == [([7], [4, 5]), ([8], None)]


def test_accumulator_chat_stream_opens_with_roles_then_echo_then_content():
    info = EP.PromptInfo(tokens=4, role="assistant", echo_text="def")
    items = [(0, delta("He", [1], prompt=info)), (0, delta("Yo", [2], index=1)),
             (0, delta("llo", [3], "stop", stop_reason=2)), (0, delta("", [], "length", index=1))]
    req = chat(n=2, echo=True, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    acc = ResponseAccumulator(req, True, prompts=1, response_id="chatcmpl-1", keep=False)
    chunks = run(acc, items)
    unset = msgspec.UNSET  # stop_reason is written on a choice's last chunk only
    assert [(c.choices[0].index, c.choices[0].delta, c.choices[0].finish_reason, c.choices[0].stop_reason,
             c.usage.completion_tokens) for c in chunks] == [
        (0, H.DeltaMessage(role="assistant", content=""), None, unset, 0),
        (1, H.DeltaMessage(role="assistant", content=""), None, unset, 0),
        (0, H.DeltaMessage(content="def"), None, unset, 0),
        (1, H.DeltaMessage(content="def"), None, unset, 0),
        (0, H.DeltaMessage(content="He"), None, unset, 1),
        (1, H.DeltaMessage(content="Yo"), None, unset, 1),
        (0, H.DeltaMessage(content="llo"), "stop", 2, 2),
        (1, H.DeltaMessage(content=""), "length", None, 1)]
    assert b'"stop_reason":null' in H.encoder.encode(chunks[7]) and b"stop_reason" not in H.encoder.encode(chunks[5])
    assert H.encoder.encode(chunks[6].choices[0].delta) == b'{"content":"llo"}'
    assert acc.usage() == H.Usage(prompt_tokens=4, completion_tokens=3, total_tokens=7)


def test_accumulator_chat_whole_response():
    lp = [["ok", -0.3, [["ok", -0.3]], [111, 107]]]
    info = EP.PromptInfo(tokens=1, role="user", echo_text="Q: ", prompt_text="<t>", token_ids=[3])
    acc = ResponseAccumulator(chat(logprobs=True, return_token_ids=True), True, prompts=1, response_id="chatcmpl-1")
    run(acc, [(0, delta("ok", [5], None, prompt=info, logprobs=lp))])
    assert acc.response(created=2) == H.ChatCompletionResponse(
        id="chatcmpl-1", object="chat.completion", created=2, model="m", prompt_text="<t>", prompt_token_ids=[3],
        usage=H.Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2, prompt_tokens_details=None,
                      completion_tokens_details=None),
        choices=[H.ChatChoice(index=0, message=H.ResponseMessage(role="user", content="Q: ok"), finish_reason="stop",
                              stop_reason=None, logprobs=chat_logprobs(lp), token_ids=[5])])


def test_stream_chunks_carry_the_keys_vllm_sets_nulls_included():
    """Issue 51: vLLM's stream writes a chunk's explicitly set fields (``exclude_unset``), nulls
    included: the role chunk's prompt_token_ids and prompt_text, an output chunk's token_ids, a
    chat's running usage's completion_tokens_details; a completion choice's ids."""
    def keys(chunk) -> tuple[set, set]:
        body = json.loads(H.encoder.encode(chunk))
        return set(body), set(body["choices"][0]) if body["choices"] else set()

    acc = ResponseAccumulator(chat(stream=True, stream_options={"include_usage": True,
                                                                "continuous_usage_stats": True}),
                              True, prompts=1, response_id="c", keep=False)
    role, out = run(acc, [(0, delta("hi", [5], prompt=EP.PromptInfo(tokens=1, role="assistant")))])
    top = {"id", "object", "created", "model", "choices", "usage"}
    assert keys(role) == (top | {"prompt_token_ids", "prompt_text"}, {"index", "delta", "logprobs", "finish_reason"})
    assert keys(out) == (top, {"index", "delta", "logprobs", "finish_reason", "token_ids"})
    assert json.loads(H.encoder.encode(out))["usage"]["completion_tokens_details"] is None
    [last] = run(acc, [(0, delta("", [6], "stop"))])
    assert keys(last)[1] == {"index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"}
    acc = ResponseAccumulator(completion(stream=True), False, prompts=1, response_id="c", keep=False)
    [first] = run(acc, [(0, delta("a", [5], prompt=1))])
    assert keys(first) == ({"id", "object", "created", "model", "choices"}, {
        "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_token_ids"})


def test_accumulator_first_token_time_is_the_first_delta_with_tokens():
    times = iter([10.0, 20.0])
    acc = ResponseAccumulator(completion(), False, prompts=1, response_id="cmpl-1", clock=lambda: next(times))
    acc.add(0, delta("", [], prompt=1))
    assert acc.first_token_at is None
    acc.add(0, delta("a", [1]))
    acc.add(0, delta("b", [2], "stop"))
    assert acc.first_token_at == 10.0


# ---- the engine link's state machine ------------------------------------------------------

def test_transition_table():
    assert TRANSITIONS[S.REMOVED] == frozenset()
    # READY needs an answered Hello: never from a state without a pending one, or (RELEASED: a
    # sleeping engine woke) one answered before.
    assert [s for s in S if S.READY in TRANSITIONS[s]] == [S.STARTING, S.CONNECTING, S.DRAINING, S.RELEASED]
    # Every live state can be left for every other the manager can announce, and removed.
    for s in set(S) - {S.REMOVED}:
        assert {S.STARTING, S.DRAINING, S.DOWN, S.FAILED, S.REMOVED, S.CONNECTING, S.RELEASED} - {s} \
            <= TRANSITIONS[s]


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
    ("backoff", S.DOWN), ("stopped", S.DOWN), ("failed", S.FAILED), ("released", S.RELEASED),
    ("asleep", S.RELEASED)])
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
        asyncio.run(served(link).wait_ready(60))
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
    await link.submit([(g.request_id, EP.encoder.encode(g)) for g in gens], sink,
                      {g.request_id: choices for g in gens})


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
        await submit(link, sink, EP.Generate(request_id="g1", kind="completion", body={"prompt": "x"}))
        _, gen = await engine.recv()
        assert gen == EP.Generate(request_id="g1", kind="completion", body={"prompt": "x"})
        link.on_model_state("exited", "", "signal 9")
        assert (link.state, link.status, link.sock, link.ready.is_set()) == (S.DOWN, "exited", None, False)
        rid, failed = sink.get_nowait()
        assert rid == "g1" and isinstance(failed, EngineUnavailable)
        assert str(failed) == "the engine for model 'm' exited (signal 9)"
        with pytest.raises(EngineUnavailable):
            await submit(link, sink, EP.Generate(request_id="g2", kind="completion", body={"prompt": "x"}))
        assert link.streams == {}

    with_engine(scenario)


def test_tokenizer_questions_get_their_answer_or_refusal_and_fail_when_the_engine_goes():
    async def scenario(link: EngineLink, engine: FakeEngine):
        with pytest.raises(EngineUnavailable):  # no engine yet
            await link.tokenizer(EP.Tokenizer(request_id="t0", kind="tokenizer_info"), 1)
        link.on_model_state("ready", "inc1", None)
        await engine.accept(link, "inc1")
        await asyncio.wait_for(link.ready.wait(), 10)
        ok = asyncio.ensure_future(link.tokenizer(EP.Tokenizer(request_id="t1", kind="tokenize",
                                                               body={"prompt": "x"}), 10))
        bad = asyncio.ensure_future(link.tokenizer(EP.Tokenizer(request_id="t2", kind="detokenize",
                                                                body={"tokens": [-1]}), 10))
        for _ in range(2):
            peer, msg = await engine.recv()
            reply = (EP.TokenizerReply(incarnation="inc1", request_id="t1", body={"count": 1, "tokens": [7]})
                     if msg.request_id == "t1" else
                     EP.RequestError(incarnation="inc1", request_id="t2", message="bad id", param="tokens"))
            await engine.sock.send_multipart([peer, EP.encoder.encode(reply)])
        assert await ok == {"count": 1, "tokens": [7]}
        with pytest.raises(EngineRequestError) as info:
            await bad
        assert (str(info.value), info.value.status, info.value.param) == ("bad id", 400, "tokens")
        pending = asyncio.ensure_future(link.tokenizer(EP.Tokenizer(request_id="t3", kind="tokenizer_info"), 10))
        await engine.recv()
        link.on_model_state("exited", "", "signal 9")
        with pytest.raises(EngineUnavailable):
            await pending
        assert link.replies == {}

    with_engine(scenario)


def test_draining_lets_requests_in_flight_run_and_holds_new_ones():
    async def scenario(link: EngineLink, engine: FakeEngine):
        link.on_model_state("ready", "inc1", None)
        await engine.accept(link, "inc1")
        await asyncio.wait_for(link.ready.wait(), 10)
        sink = asyncio.Queue()
        await submit(link, sink, EP.Generate(request_id="g1", kind="completion", body={"prompt": "x"}))
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
            await served(link).wait_ready(0.05)
        assert str(info.value) == "model 'm' is not available (draining) after waiting 0.05s"
        with pytest.raises(EngineUnavailable):
            await submit(link, sink, EP.Generate(request_id="g2", kind="completion", body={"prompt": "x"}))

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
            await served(link).wait_ready(10)
        assert info.value.retry_after is None

    with_engine(scenario)


def test_a_models_tasks_come_in_one_order_whatever_order_the_engine_says_them():
    """vLLM's pooling models give their tasks from a set: /v1/models lists them sorted."""
    async def scenario(link: EngineLink, engine: FakeEngine):
        for tasks in (["token_embed", "embed", "classify"], ["classify", "token_embed", "embed"]):
            link.on_model_state("ready", "inc1", None)
            link.on_engine_message(EP.HelloReply(version=EP.PROTOCOL_VERSION, incarnation="inc1", model="m",
                                                 max_model_len=128, tasks=tasks), "inc1")
            assert link.supported_tasks == ["classify", "embed", "token_embed"]

    with_engine(scenario)


def test_remove_wakes_waiters_and_refuses_them():
    async def scenario(link: EngineLink, engine: FakeEngine):
        waiter = asyncio.ensure_future(served(link).wait_ready(10))
        await asyncio.sleep(0)
        assert served(link).waiting == 1
        link.remove()
        with pytest.raises(EngineUnavailable) as info:
            await waiter
        assert (str(info.value), info.value.retry_after) == ("model 'm' was unloaded", None)
        assert (link.state, link.status, link.ready.is_set()) == (S.REMOVED, "removed", True)
        # Later waits are refused at once: the ready event is set but nothing will ever serve.
        with pytest.raises(EngineUnavailable):
            await served(link).wait_ready(10)
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
