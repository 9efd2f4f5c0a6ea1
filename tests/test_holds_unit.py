"""Holds that know the model (issue 39): a held request's wait covers the model's measured start,
and a request never resumes onto a model a reload changed (a scripted engine, no vLLM)."""

from __future__ import annotations

import asyncio

import pytest

from api_gateway.engines import START_MARGIN, EngineLink
from conftest import json_lines
from gateway_harness import MODEL, run
from builders import delta
from servectl import config as C
from servectl.wire import engine as EP

pytestmark = pytest.mark.unit

BODY = {"model": "m", "prompt": "x", "max_tokens": 6, "ignore_eos": True}


def model(**kw) -> C.ModelConfig:
    return C.ModelConfig(name="m", model="/models/m", **kw)


def test_what_a_models_outputs_depend_on_is_its_identity():
    base = C.output_identity(model())
    assert base == C.output_identity(model())
    for same in (dict(idle_release_s=30.0), dict(hold_timeout_s=5.0), dict(devices="1"), dict(autostart=False)):
        assert C.output_identity(model(**same)) == base, same
    for changed in (dict(engine_args={"dtype": "float16"}), dict(env={"X": "1"}), dict(tensor_parallel_size=2),
                    dict(override_generation_config={"temperature": 0.5}), dict(trust_request_chat_template=True)):
        assert C.output_identity(model(**changed)) != base, changed
    assert C.output_identity(C.ModelConfig(name="m", model="/models/other")) != base


def link() -> EngineLink:
    return EngineLink.__new__(EngineLink)


def test_a_hold_covers_the_models_measured_start_unless_the_model_sets_its_own():
    lk = link()
    lk.hold_timeout_s, lk.start_s = None, None
    assert lk.hold_s(60.0) == 60.0  # nothing measured yet
    lk.start_s = 73.0  # a cold start on a loaded host
    assert lk.hold_s(60.0) == START_MARGIN * 73.0 > 73.0
    lk.start_s = 3.0  # quick starts never shorten the gateway's hold
    assert lk.hold_s(60.0) == 60.0
    lk.hold_timeout_s, lk.start_s = 20.0, 73.0  # configured per model: as configured
    assert lk.hold_s(60.0) == 20.0


async def back_as(h, incarnation: str, config_id: str) -> None:
    h.gw.manager.on_model_event(MODEL, "exited", "", "replaced by a reload")
    h.gw.manager.on_model_event(MODEL, "starting", "", None)
    h.gw.manager.on_model_event(MODEL, "ready", incarnation, None, config_id=config_id)
    await h.engine.accept(incarnation)
    await asyncio.wait_for(h.link.ready.wait(), 10)


async def started(h, config_id: str = "cfg-a"):
    h.gw.manager.on_model_event(MODEL, "ready", "inc1", None, config_id=config_id)
    await h.engine.accept("inc1")
    await asyncio.wait_for(h.link.ready.wait(), 10)


def test_a_stream_is_not_resumed_onto_a_changed_model_it_ends_with_an_error_event():
    async def scenario(h):
        await started(h)
        client = asyncio.ensure_future(h.post("/v1/completions", {**BODY, "stream": True}))
        gen = await h.engine.recv()
        await h.engine.step(delta("ab", [1], first=True, rid=gen.request_id))
        await asyncio.sleep(0.05)
        await back_as(h, "inc2", "cfg-b")
        status, body = await client
        chunks = json_lines(body)
        assert status == 200 and chunks[0]["choices"][0]["text"] == "ab"
        err = chunks[-1]["error"]
        assert err["code"] == "engine_unavailable" and "changed configuration" in err["message"]
        # and nothing was sent to the new engine for it
        with pytest.raises(asyncio.TimeoutError):
            await h.engine.recv(timeout=0.3)

    run(scenario)


def test_a_whole_answer_is_a_503_on_a_changed_model_and_resumes_on_the_same_one():
    async def scenario(h):
        await started(h)
        client = asyncio.ensure_future(h.post("/v1/completions", BODY))
        gen = await h.engine.recv()
        await h.engine.step(delta("ab", [1], first=True, rid=gen.request_id))
        await asyncio.sleep(0.05)
        await back_as(h, "inc2", "cfg-b")
        status, body = await client
        assert status == 503 and "changed configuration" in body["error"]["message"], body

        client = asyncio.ensure_future(h.post("/v1/completions", BODY))  # began on cfg-b
        gen = await h.engine.recv()
        await h.engine.step(delta("ab", [1], first=True, rid=gen.request_id))
        await asyncio.sleep(0.05)
        await back_as(h, "inc3", "cfg-b")  # a crash, the same configuration: resumed
        again = await h.engine.recv()
        assert again.resume is not None and again.resume.token_ids == [1]
        await h.engine.step(EP.Delta(request_id=again.request_id, index=0, text="cdefg", token_ids=[2, 3, 4, 5, 6],
                                     finish_reason="length", prompt=EP.PromptInfo(tokens=2)))
        status, body = await client
        assert status == 200 and body["choices"][0]["text"] == "abcdefg", body

    run(scenario)
