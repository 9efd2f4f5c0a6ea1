"""Security issue 53, item 2: a request that was in an engine the manager killed as hung is not
sent to the next engine if its output had not begun (it may be what hung it: a poison pill); a
stream whose output had begun goes on there (a scripted engine and manager, no vLLM)."""

from __future__ import annotations

import asyncio

import pytest

from conftest import json_lines
from gateway_harness import MODEL, run
from servectl.wire import engine as EP

pytestmark = pytest.mark.unit

BODY = {"model": "m", "prompt": "x", "max_tokens": 3, "ignore_eos": True}


async def killed_then_back(h, hung: bool) -> None:
    h.gw.manager.on_model_event(MODEL, "exited", "", "engine_core:m signal 9 (killed as hung)", hung=hung)
    h.model_state("starting")
    await h.ready("inc2")


@pytest.mark.parametrize("hung", [True, False])
def test_after_a_hang_kill_the_unstarted_request_is_refused_and_the_started_stream_goes_on(hung):
    async def scenario(h):
        await h.ready()
        stream = asyncio.ensure_future(h.post("/v1/completions", {**BODY, "stream": True}))
        s = await h.engine.recv()
        await h.engine.step(EP.Delta(request_id=s.request_id, text="a", token_ids=[1],
                                     prompt=EP.PromptInfo(tokens=1)))
        culprit = asyncio.ensure_future(h.post("/v1/completions", {**BODY, "prompt": "huge"}))
        c = await h.engine.recv()
        assert c.body["prompt"] == "huge"
        await asyncio.sleep(0.05)
        await killed_then_back(h, hung)
        sent = [await h.engine.recv()]
        if not hung:  # a crash: both go on (the culprit from its start)
            sent.append(await h.engine.recv())
        again = next(g for g in sent if g.resume is not None)
        assert again.resume.token_ids == [1]
        assert [g.body["prompt"] for g in sent if g.resume is None] == ([] if hung else ["huge"])
        await h.engine.step(EP.Delta(request_id=again.request_id, text="bc", token_ids=[2, 3], finish_reason="length"))
        status, body = await stream
        assert status == 200 and "".join(c["choices"][0]["text"] for c in json_lines(body) if c["choices"]) == "abc"
        if hung:
            status, body = await culprit
            assert status == 503 and body["error"]["code"] == "engine_hung", body
            assert "killed as hung" in body["error"]["message"] and "not send" in body["error"]["message"]
            with pytest.raises(asyncio.TimeoutError):
                await h.engine.recv(timeout=0.3)  # never sent to the new engine
        else:
            again_c = next(g for g in sent if g.resume is None)
            await h.engine.step(EP.Delta(request_id=again_c.request_id, text="xyz", token_ids=[4, 5, 6],
                                         finish_reason="length", prompt=EP.PromptInfo(tokens=1)))
            assert (await culprit)[0] == 200

    run(scenario)
