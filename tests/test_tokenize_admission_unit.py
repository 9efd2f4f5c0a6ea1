"""Tokenizer calls are admitted like generation (issue 39): counted as a sequence of the model's
queue, so a flood of them is capped with a 429 instead of piling onto the engine (a scripted
engine, no vLLM)."""

from __future__ import annotations

import asyncio

import pytest

from gateway_harness import run
from servectl.wire import engine as EP

pytestmark = pytest.mark.unit


def test_a_flood_of_tokenize_calls_is_capped_by_the_models_queue():
    async def scenario(h):
        await h.ready(max_num_seqs=1)
        posts = [asyncio.ensure_future(h.post("/tokenize", {"model": "m", "prompt": f"p{i}"})) for i in range(2)]
        asked = [await h.engine.recv(), await h.engine.recv()]  # both reached the engine
        assert all(isinstance(m, EP.Tokenizer) for m in asked)
        assert h.model.admitted == 2
        status, body = await h.post("/tokenize", {"model": "m", "prompt": "one too many"})
        assert status == 429 and body["error"]["code"] == "too_many_waiting", body
        for m in asked:
            await h.engine.send(EP.TokenizerReply(incarnation=h.engine.incarnation, request_id=m.request_id,
                                                  body={"count": 1, "tokens": [5]}))
        assert [(await p)[0] for p in posts] == [200, 200]
        assert h.model.admitted == 0  # nothing left counted once answered
        status, _ = await asyncio.wait_for(asyncio.gather(
            h.post("/tokenize", {"model": "m", "prompt": "again"}), answer_one(h)), 10)
        assert status[0] == 200

    run(scenario, max_waiting_per_model=1)


async def answer_one(h) -> None:
    m = await h.engine.recv()
    await h.engine.send(EP.TokenizerReply(incarnation=h.engine.incarnation, request_id=m.request_id,
                                          body={"count": 1, "tokens": [5]}))
