"""Security issue 53, items 2 and 5, in the gateway (a scripted engine, no vLLM): a pooling
request's inputs are sequences (admission, the per-request cap); a Responses or Messages input
is bounded in items and characters by configuration and the model's limits before the engine
renders any of it (api_gateway/input_bounds.py)."""

from __future__ import annotations

import asyncio

import pytest

from api_gateway.errors import HttpError
from api_gateway.input_bounds import check_input, pooling_sequences
from gateway_harness import MODEL, run
from servectl.wire import engine as EP

pytestmark = pytest.mark.unit


def test_each_input_text_document_and_query_is_a_sequence():
    assert pooling_sequences({"input": "x"}) == 1
    assert pooling_sequences({"input": [1, 2, 3]}) == 1  # one prompt of token ids
    assert pooling_sequences({"input": [[1, 2], [3]] * 100_000}) == 200_000
    assert pooling_sequences({"input": ["a", "b", "c"]}) == 3
    assert pooling_sequences({"texts": ["a", "b"]}) == 2
    assert pooling_sequences({"text_1": "q", "text_2": ["a", "b", "c"]}) == 4
    assert pooling_sequences({"query": "q", "documents": ["a", "b"]}) == 3
    assert pooling_sequences({"queries": ["q", "r"], "items": ["a", "b"]}) == 4
    assert pooling_sequences({"messages": [{"role": "user", "content": "x"}] * 50}) == 1


def refused(*args) -> HttpError:
    with pytest.raises(HttpError) as e:
        check_input(*args)
    assert e.value.status == 400
    return e.value


def test_a_responses_input_is_bounded_by_the_cap_the_context_and_its_characters():
    item = {"type": "message", "role": "user", "content": "x"}
    check_input("responses", {"input": [item] * 100}, 512, 10_000, 4096)
    assert refused("responses", {"input": [item] * 100}, 512, 10_000, 50).code == "too_many_items"
    e = refused("responses", {"input": [item] * 600}, 512, 10_000, 4096)
    assert e.code == "too_many_items" and "512" in e.message and e.param == "input"
    # characters: the input's strings and the instructions, against the model's figure
    check_input("responses", {"input": "x" * 1000, "instructions": "y" * 1000}, 512, 2000, 4096)
    assert refused("responses", {"input": "x" * 1000, "instructions": "y" * 1001}, 512, 2000, 4096).code == \
        "input_too_long"
    e = refused("messages", {"messages": [item] * 10, "system": "s" * 3000}, 512, 2000, 4096)
    assert e.code == "input_too_long" and e.param == "messages"
    check_input("messages", {"messages": [item] * 10}, None, 0, 4096)  # limits not told yet: the cap alone
    check_input("embeddings", {"input": ["x"] * 10_000}, 512, 10, 1)  # not a rendered chat: the sequences' job


def test_a_pictures_base64_is_not_counted_as_prompt_characters():
    """A media part is one item; its data: URL is the media's bytes (max_media_bytes), not text."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 50_000}}
    text = {"type": "text", "text": "What is in the picture?"}
    check_input("chat", {"messages": [{"role": "user", "content": [image, text]}]}, 256, 6400, 4096)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "A" * 50_000}}
    check_input("messages", {"messages": [{"role": "user", "content": [block, text]}]}, 256, 6400, 4096)
    too_long = {"type": "text", "text": "x" * 6401}
    assert refused("chat", {"messages": [{"role": "user", "content": [image, too_long]}]}, 256, 6400,
                   4096).code == "input_too_long"


async def hello(h, tasks: list[str], max_prompt_chars: int = 0) -> None:
    h.model_state("ready", "inc1")
    msg = await h.engine.recv()
    assert isinstance(msg, EP.Hello)
    h.engine.incarnation = "inc1"
    await h.engine.send(EP.HelloReply(version=EP.PROTOCOL_VERSION, incarnation="inc1", model=MODEL,
                                      max_model_len=128, max_num_seqs=4, tasks=tasks,
                                      max_prompt_chars=max_prompt_chars))
    await asyncio.wait_for(h.link.ready.wait(), 10)


def test_a_pooling_requests_inputs_are_admitted_as_sequences_and_capped():
    async def scenario(h):
        await hello(h, ["embed"])
        status, body = await h.post("/v1/embeddings", {"model": "m", "input": [[1, 2]] * 9})
        assert status == 400 and body["error"]["code"] == "too_many_sequences", body
        assert body["error"]["param"] == "input" and "at most 8" in body["error"]["message"]
        post = asyncio.ensure_future(h.post("/v1/embeddings", {"model": "m", "input": ["a", "b", "c"]}))
        gen = await h.engine.recv()  # the 400 sent nothing: this is the second request
        assert isinstance(gen, EP.Generate) and gen.body["input"] == ["a", "b", "c"]
        assert h.model.admitted == 3
        await h.engine.step(EP.Delta(request_id=gen.request_id, finish_reason="stop", api_output='{"data": []}'))
        assert (await post)[0] == 200 and h.model.admitted == 0

    run(scenario, max_sequences_per_request=8)


def test_a_responses_input_past_the_limits_never_reaches_the_engine():
    async def scenario(h):
        await hello(h, ["generate"], max_prompt_chars=1000)
        item = {"type": "message", "role": "user", "content": "hi"}
        status, body = await h.post("/v1/responses", {"model": "m", "input": [item] * 129})
        assert status == 400 and body["error"]["code"] == "too_many_items", body
        status, body = await h.post("/v1/responses", {"model": "m", "input": [item] * 11})
        assert status == 400 and body["error"]["code"] == "too_many_items" and "at most 10" in \
            body["error"]["message"], body
        status, body = await h.post("/v1/responses", {"model": "m", "input": "x" * 1001, "stream": True})
        assert status == 400 and body["error"]["code"] == "input_too_long", body
        status, body = await h.post("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [item] * 11})
        assert status == 400 and body["error"]["type"], body
        # A chat's messages (and a chat /tokenize's) are rendered by the same template: bounded alike.
        chat = [{"role": "user", "content": ""}] * 11
        status, body = await h.post("/v1/chat/completions", {"model": "m", "messages": chat})
        assert status == 400 and body["error"]["code"] == "too_many_items", body
        status, body = await h.post("/v1/chat/completions", {"model": "m", "messages": [
            {"role": "user", "content": "x" * 1001}], "stream": True})
        assert status == 400 and body["error"]["code"] == "input_too_long", body
        status, body = await h.post("/tokenize", {"model": "m", "messages": chat})
        assert status == 400 and body["error"]["code"] == "too_many_items", body
        assert h.model.admitted == 0
        with pytest.raises(asyncio.TimeoutError):
            await h.engine.recv(timeout=0.3)  # nothing was sent

    run(scenario, max_input_items=10)
