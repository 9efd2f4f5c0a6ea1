"""Issue 39, item 1: the gateway never calls an engine hung while it answers other work.

A request that sees no output is probed (``Stats``); an engine whose answer to the probe
waits behind other work (tokenizer questions, other requests' steps) still answers that
work, and is not reported hung for it (api_gateway/sequences.py ``_probe``). A silent one
still is (tests/test_gateway_http_unit.py ``test_queued_is_not_hung_and_silent_is``).
"""

from __future__ import annotations

import asyncio

import pytest

from gateway_harness import run
from builders import delta
from servectl.wire import engine as EP

pytestmark = pytest.mark.unit

COMPLETION = {"model": "m", "prompt": "x", "max_tokens": 4}


def test_an_engine_that_answers_other_work_during_a_probe_is_busy_not_hung():
    async def scenario(h):
        await h.ready()
        quiet = asyncio.ensure_future(h.post("/v1/completions", COMPLETION))
        a = await h.engine.recv()
        busy = asyncio.ensure_future(h.post("/v1/completions", {**COMPLETION, "max_tokens": 40}))
        b = await h.engine.recv()
        # For 0.6 s (four probe periods) the engine answers no probe and gives the first request
        # nothing, but it goes on with other work: the second request's tokens.
        for i in range(12):
            await h.engine.step(delta("b", [7], first=i == 0, rid=b.request_id))
            await asyncio.sleep(0.05)
        probes = []
        while True:
            try:
                probes.append(await h.engine.recv(timeout=0.05))
            except asyncio.TimeoutError:
                break
        assert any(p == EP.Stats(request_ids=[a.request_id]) for p in probes), probes  # it was probed
        assert h.hangs == [], "called hung while it answered other work"
        await h.engine.step(delta("a", [7], "length", first=True, rid=a.request_id),
                            delta("b", [7], "length", rid=b.request_id))
        status, body = await quiet
        assert status == 200 and body["choices"][0]["text"] == "a"
        status, body = await busy
        assert status == 200 and body["choices"][0]["text"] == "b" * 13
        # Silent, it is hung, as before.
        quiet = asyncio.ensure_future(h.post("/v1/completions", COMPLETION))
        await h.engine.recv()
        status, body = await quiet
        # (Reported at least once: on a loaded machine a second probe period may pass before the
        # 503, and each silent period is a report; the manager restarts a group once either way.)
        assert status == 503 and h.hangs and set(h.hangs) == {"m"}, h.hangs

    run(scenario, output_timeout_s=0.15)
