"""Issue 32, without vLLM: how the engine drives vLLM's serving code, and the gateway's side.

``Driven`` runs a serving coroutine or async generator with no event loop, turn by
turn, as it waits for the feed; ids drawn while it runs come from the request's own
seeded generator. The gateway keeps each Responses / Messages delta (``Choice.deltas``)
and sends them in ``Resume.deltas``; what continues exactly; media refused; the APIs'
error shapes.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from api_gateway import resume as R
from api_gateway.errors import HttpError
from api_gateway.media import media_parts
from api_gateway.passthrough import anthropic_error_body, error_event
from engine_core.driven import Driven, OutputFeed, ServingEngineClient, _SeededIds
from servectl.wire import engine as EP

pytestmark = pytest.mark.unit


def test_a_whole_answer_runs_until_the_feed_is_empty_then_ends_with_its_result():
    feed = OutputFeed()

    async def serving():
        got = []
        async for out in feed:
            got.append(out)
        return {"answer": got, "id": uuid.uuid4().hex}

    driven = Driven(_SeededIds("a"), serving())
    assert driven.turn() == [] and not driven.done  # waiting for the first output
    feed.outputs.append(1)
    assert driven.turn() == [] and not driven.done
    feed.outputs.extend([2, 3])
    feed.ended = True
    driven.turn()
    assert driven.done and driven.result["answer"] == [1, 2, 3]
    again = Driven(_SeededIds("a"), _just_an_id())
    again.turn()
    assert again.result == driven.result["id"]  # the same request's ids: the same sequence
    other = Driven(_SeededIds("b"), _just_an_id())
    other.turn()
    assert other.result != driven.result["id"]


async def _just_an_id():
    return uuid.uuid4().hex


def test_a_stream_yields_its_items_turn_by_turn():
    feed = OutputFeed()

    async def events():
        yield "created"
        async for out in feed:
            yield f"delta {out}"
        yield "completed"

    async def create():
        return events()  # as create_responses returns its stream generator

    driven = Driven(_SeededIds("s"), create())
    assert driven.turn() == ["created"]
    feed.outputs.append("a")
    assert driven.turn() == ["delta a"]
    feed.outputs.extend(["b", "c"])
    feed.ended = True
    assert driven.turn() == ["delta b", "delta c", "completed"] and driven.done


def test_uuid4_is_the_real_one_outside_a_turn():
    real = uuid.uuid4
    driven = Driven(_SeededIds("x"), _just_an_id())
    driven.turn()
    assert uuid.uuid4 is real and uuid.uuid4() != uuid.uuid4()


def test_serving_code_that_waits_for_anything_else_is_a_clear_error():
    async def sleeps():
        await asyncio.sleep(0)

    driven = Driven(_SeededIds("x"), sleeps())
    with pytest.raises(RuntimeError, match="without an event loop"):
        driven.turn()
    driven.close()


def test_closing_an_abandoned_stream_runs_its_cleanup():
    cleaned = []

    async def events():
        try:
            yield "created"
            await OutputFeed().__anext__()
        finally:
            cleaned.append(True)

    async def create():
        return events()

    driven = Driven(_SeededIds("c"), create())
    assert driven.turn() == ["created"]
    driven.close()
    assert cleaned == [True] and driven.done


def test_the_engine_client_records_generate_and_hands_back_its_feed():
    client = ServingEngineClient(type("C", (), {"model_config": "mc"})(), "renderer", "inputs")
    feed = client.generate({"prompt_token_ids": [1]}, "params", "req-1", priority=3, reasoning_ended=None)
    (call,) = client.calls
    assert call.feed is feed and call.params == "params" and call.kwargs["priority"] == 3
    assert client.model_config == "mc" and client.check_admission(1) is None and not client.errored


# ---- the gateway ------------------------------------------------------------------------------------

def test_resume_sends_the_deltas_as_they_came():
    gen = EP.Generate(request_id="r", kind="responses", body={"input": "hi", "stream": True}, answer_id="ab")
    c = R.Choice(tokens=[1, 2, 3], text_chars=3, started=True,
                 deltas=[EP.ReplayedDelta("a", [1]), EP.ReplayedDelta("bc", [2, 3])])
    [(pi, again)] = R.plan([gen], [[c]], lambda: "r2", whole_answer=False, restart=lambda *a: None)
    assert again.resume.deltas == c.deltas and again.resume.token_ids == [1, 2, 3]
    assert again.answer_id == "ab" and again.request_id == "r2"  # the same answer, a new engine request


@pytest.mark.parametrize("kind,body,why", [
    ("responses", {"input": "x", "tools": [], "reasoning": {"effort": "low"}, "text": {"format": {"type": "text"}}},
     None),
    ("responses", {"input": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ("responses", {"input": "x", "watermarking": {"k": 1}}, "watermarking"),
    ("messages", {"messages": [], "max_tokens": 5, "system": "s", "stop_sequences": ["a"],
                  "thinking": {"type": "disabled"}}, None),
    ("messages", {"messages": [], "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 9}},
     "thinking budget"),
    ("messages", {"messages": [], "max_tokens": 5, "vllm_xargs": {"a": 1}}, "vllm_xargs"),
])
def test_what_continues_exactly_on_the_passthrough_endpoints(kind, body, why):
    got = R.why_not_exact(EP.Generate(request_id="r", kind=kind, body=body))
    assert (got is None) if why is None else (why in got), got


def test_media_anywhere_in_the_input_is_found_before_the_engine():
    assert media_parts({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}) == []
    for value in ([{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}],
                  [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                      {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}]):
        assert len(media_parts({"messages": value})) == 1


def test_errors_keep_each_apis_shape():
    exc = HttpError(404, "model 'x' not found", param="model")
    assert json.loads(anthropic_error_body(exc)) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "model 'x' not found"}}
    name, data = error_event("responses", HttpError(503, "gone", "service_unavailable"), 7).split("\n")[:2]
    assert name == "event: error" and json.loads(data[6:])["sequence_number"] == 7
    assert json.loads(error_event("messages", exc, 3).split("\n")[1][6:])["error"]["message"] == exc.message


# ---- issue 33: pooling routes in the gateway ------------------------------------------------------

def test_a_request_to_the_wrong_kind_of_model_names_the_endpoints_that_fit():
    from api_gateway.passthrough import check_kind

    check_kind("m", ["generate"], "/v1/chat/completions")
    check_kind("e", ["embed", "token_embed"], "/v1/embeddings")
    check_kind("x", [], "/v1/embeddings")  # not told: the engine's own answer stands
    with pytest.raises(HttpError) as info:
        check_kind("m", ["generate"], "/rerank")
    assert info.value.status == 400 and "/v1/chat/completions" in info.value.message
    with pytest.raises(HttpError) as info:
        check_kind("e", ["embed", "token_embed"], "/v1/responses")
    assert info.value.status == 400 and "/v1/embeddings" in info.value.message


def test_the_pooling_routes_outside_v1_take_the_api_keys():
    from api_gateway.middleware import KEYED_PATHS
    from api_gateway.passthrough import POOLING_PATHS

    assert {p for p in POOLING_PATHS if not p.startswith(("/v1/", "/v2/"))} <= KEYED_PATHS
