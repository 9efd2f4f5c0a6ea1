"""Requests ride through an engine restart (issue 14), against a scripted engine.

The test plays the manager (the model exits, a new incarnation is ready) and
both engine lifetimes, so what the gateway sends the new engine is checked
exactly: the output so far as token ids, the characters of text delivered,
the choice's index; prompts with no output yet go again as they were.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest

from api_gateway import engines
from api_gateway.resume import Choice, CannotContinue, plan, why_not_exact
from engine_core.resume import ResumeError, continue_request, continued_params
from conftest import json_lines
from gateway_harness import run
from builders import delta
from servectl.wire import engine as EP

pytestmark = pytest.mark.unit

BODY = {"model": "m", "prompt": "x", "max_tokens": 6, "ignore_eos": True}


def events(body: str) -> list[dict]:
    return json_lines(body)


async def crash_and_return(h, incarnation: str = "inc2") -> None:
    h.model_state("exited", "", "signal 9")
    h.model_state("starting")
    await h.ready(incarnation)


def test_a_stream_goes_on_after_the_engine_restarts():
    async def scenario(h):
        await h.ready()
        client = asyncio.ensure_future(h.post("/v1/completions", {**BODY, "stream": True,
                                                                   "stream_options": {"include_usage": True}}))
        gen = await h.engine.recv()
        await h.engine.step(delta("ab", [1], first=True, rid=gen.request_id))
        await h.engine.step(delta("c", [2], rid=gen.request_id))
        await asyncio.sleep(0.05)
        await crash_and_return(h)
        again = await h.engine.recv()
        assert again.resume == EP.Resume(index=0, token_ids=[1, 2], text_chars=3)
        assert (again.kind, again.body) == (gen.kind, gen.body)
        assert again.request_id != gen.request_id
        for i, text in enumerate(["d", "e", "f"]):
            await h.engine.step(delta(text, [3 + i], "length" if i == 2 else None, first=i == 0, rid=again.request_id))
        status, body = await client
        chunks = events(body)
        assert status == 200 and not any("error" in c for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "abcdef"
        assert chunks[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}
        assert body.rstrip().endswith("data: [DONE]")

    run(scenario)


def test_each_unfinished_choice_goes_on_and_prompts_without_output_go_again_whole():
    async def scenario(h):
        await h.ready()
        client = asyncio.ensure_future(h.post("/v1/completions", {
            **BODY, "prompt": ["p0", "p1"], "n": 2, "temperature": 0.7, "echo": True, "logprobs": 1}))
        g0, g1 = await h.engine.recv(), await h.engine.recv()
        await h.engine.step(delta("a", [1], index=0, first=True, echo="p0", rid=g0.request_id),
                            delta("b", [2], "stop", index=1, rid=g0.request_id))
        await asyncio.sleep(0.05)
        await crash_and_return(h)
        sent = [await h.engine.recv() for _ in range(2)]
        by_prompt = {g.body["prompt"]: g for g in sent}
        assert by_prompt["p0"].resume == EP.Resume(index=0, token_ids=[1], text_chars=1)
        assert by_prompt["p0"].body == g0.body
        assert by_prompt["p1"].resume is None and by_prompt["p1"].body == g1.body and g1.body["n"] == 2
        r0, r1 = by_prompt["p0"].request_id, by_prompt["p1"].request_id
        # A resumed request's prompt information is not the client's: ignored.
        await h.engine.step(delta("c", [3], "length", index=0, first=True, echo="p0 + a", rid=r0),
                            delta("x", [4], "length", index=0, first=True, echo="p1", rid=r1),
                            delta("y", [5], "length", index=1, rid=r1))
        status, body = await client
        assert status == 200, body
        texts = {c["index"]: c["text"] for c in body["choices"]}
        assert texts == {0: "p0ac", 1: "p0b", 2: "p1x", 3: "p1y"}
        assert body["usage"]["completion_tokens"] == 5

    run(scenario)


def test_a_whole_answer_that_cannot_be_continued_exactly_runs_again_from_its_start():
    async def scenario(h):
        await h.ready()
        client = asyncio.ensure_future(h.post("/v1/completions", {**BODY, "seed": 7, "temperature": 1.0}))
        gen = await h.engine.recv()
        await h.engine.step(delta("ab", [1], first=True, rid=gen.request_id))
        await asyncio.sleep(0.05)
        await crash_and_return(h)
        again = await h.engine.recv()
        assert again.resume == EP.Resume(index=0, token_ids=[], text_chars=0) and again.body == gen.body
        await h.engine.step(delta("xyz", [9], "length", first=True, rid=again.request_id))
        status, body = await client
        assert status == 200 and body["choices"][0]["text"] == "xyz"
        assert body["usage"]["completion_tokens"] == 1

    run(scenario)


def test_a_stream_that_cannot_be_continued_exactly_ends_with_todays_error_event():
    async def scenario(h):
        await h.ready()
        client = asyncio.ensure_future(h.post("/v1/completions", {**BODY, "stream": True,
                                                                   "presence_penalty": 0.5}))
        gen = await h.engine.recv()
        await h.engine.step(delta("ab", [1], first=True, rid=gen.request_id))
        await asyncio.sleep(0.05)
        await crash_and_return(h)
        status, body = await client
        chunks = events(body)
        assert status == 200 and chunks[0]["choices"][0]["text"] == "ab"
        err = chunks[-1]["error"]
        assert err["code"] == "engine_unavailable" and "presence_penalty" in err["message"]
        assert body.rstrip().endswith("data: [DONE]")

    run(scenario)


def test_a_failed_model_ends_held_requests_at_once_and_the_hold_clock_starts_at_the_crash():
    async def scenario(h):
        await h.ready()
        client = asyncio.ensure_future(h.post("/v1/completions", BODY))
        gen = await h.engine.recv()
        await h.engine.step(delta("a", [1], first=True, rid=gen.request_id))
        await asyncio.sleep(0.05)
        h.model_state("exited", "", "signal 9")
        await asyncio.sleep(0.1)
        h.model_state("failed", "", "5 exits within 120s")
        status, body = await asyncio.wait_for(client, 2)  # not the 30 s hold
        assert status == 503 and "failed" in body["error"]["message"]
        # Past the hold timeout (counted from the crash), today's 503 too.
        h.model_state("starting")
        await h.ready("inc3")
        client = asyncio.ensure_future(h.post("/v1/completions", BODY))
        gen = await h.engine.recv()
        await h.engine.step(delta("a", [1], first=True, rid=gen.request_id))
        await asyncio.sleep(0.05)
        h.model_state("exited", "", "signal 9")
        status, body = await asyncio.wait_for(client, 5)
        assert status == 503 and "after waiting" in body["error"]["message"]

    run(scenario, hold_timeout_s=0.5)


def test_a_hung_engine_is_reported_and_its_restart_continues_the_request():
    async def scenario(h):
        await h.ready()
        client = asyncio.ensure_future(h.post("/v1/completions", BODY))
        gen = await h.engine.recv()
        await h.engine.step(delta("a", [1], first=True, rid=gen.request_id))
        probe = await h.engine.recv(timeout=5)
        assert isinstance(probe, EP.Stats)  # unanswered: hung
        for _ in range(50):
            if h.hangs:
                break
            await asyncio.sleep(0.02)
        assert h.hangs == ["m"]
        await crash_and_return(h)  # the manager killed and restarted the group
        again = await h.engine.recv()
        assert again.resume.token_ids == [1]
        await h.engine.step(delta("b", [2], "length", first=True, rid=again.request_id))
        status, body = await client
        assert status == 200 and body["choices"][0]["text"] == "ab"

    run(scenario, output_timeout_s=0.3)


def test_a_slow_step_the_engine_announced_is_waited_for_not_reported_hung(monkeypatch):
    """The first step that needs a sampler path vLLM compiles takes seconds; the engine publishes
    a longer deadline for it, and a probe it cannot answer meanwhile is not a hang.

    No clock is read: the margin is scaled down so the probe comes in milliseconds, the engine
    publishes the generous deadline while the probe waits (its order in the real engine: the
    step is armed, then nothing answers), and the test waits for the probe's verdict itself."""
    monkeypatch.setattr(engines, "PROBE_MARGIN_S", 0.04)

    async def scenario(h):
        await h.ready()
        h.gw.manager.on_deadline("m", 0.01)  # warm: output timeout 0.05 s (under the cold 3 s)
        verdicts: list = []
        probed = asyncio.Event()
        stats = h.link.stats

        async def slow_step_then_stats(*args, **kwargs):
            h.gw.manager.on_deadline("m", 60.0)  # the engine arms a step with the generous deadline
            try:
                reply = await stats(*args, **kwargs)
            finally:
                probed.set()
            verdicts.append(reply)
            return reply

        h.link.stats = slow_step_then_stats
        client = asyncio.ensure_future(h.post("/v1/completions", BODY))
        gen = await h.engine.recv()
        await h.engine.step(delta("a", [1], first=True, rid=gen.request_id))
        probe = await h.engine.recv(timeout=10)
        assert isinstance(probe, EP.Stats)  # unanswered: the engine waits for its worker
        await asyncio.wait_for(probed.wait(), 10)
        await asyncio.sleep(0)  # the probe's caller decides on the same turn
        assert verdicts == [None] and h.hangs == []
        await h.engine.step(delta("b", [2], "length", rid=gen.request_id))
        status, body = await asyncio.wait_for(client, 10)
        assert status == 200 and body["choices"][0]["text"] == "ab" and h.hangs == []

    run(scenario, output_timeout_s=3.0)


def test_more_restarts_than_the_bound_fail_the_request():
    async def scenario(h):
        await h.ready()
        client = asyncio.ensure_future(h.post("/v1/completions", BODY))
        rid = (await h.engine.recv()).request_id
        for i in range(4):
            await h.engine.step(delta("a", [1], first=True, rid=rid))
            await asyncio.sleep(0.05)
            h.model_state("exited", "", "signal 9")
            if i == 3:
                break
            h.model_state("starting")
            await h.ready(f"inc{i + 2}")
            rid = (await h.engine.recv()).request_id
        status, body = await client
        assert status == 503 and "restarted 3 times" in body["error"]["message"]

    run(scenario)


def test_a_step_deadline_published_by_the_engine_shortens_the_output_timeout():
    async def scenario(h):
        await h.ready()
        assert h.link.output_timeout(120) == 120
        h.gw.manager.on_deadline("m", 3.0)
        assert h.link.output_timeout(120) == 5.0
        text = h.gw.metrics.render()[0].decode()
        assert 'servectl_engine_step_deadline_seconds{model="m"} 3.0' in text
        await crash_and_return(h)  # a new lifetime is cold until it publishes its own
        assert h.link.output_timeout(120) == 120

    run(scenario)


# ---- the plan and the engine's side, pure ------------------------------------------------------

def test_what_cannot_be_continued_exactly():
    def gen(**body):
        return EP.Generate(request_id="r", kind="completion", body={"model": "m", "prompt": "x", **body})

    assert why_not_exact(gen(temperature=0.7, top_p=0.9, stop=["x"], logit_bias={"1": 2.0}, n=2, logprobs=1,
                             echo=True, response_format={"type": "text"}, presence_penalty=0)) is None
    assert why_not_exact(gen(seed=1, temperature=0)) is None  # greedy: the seed plays no part
    assert "seeded" in why_not_exact(gen(seed=1))
    assert "presence_penalty" in why_not_exact(gen(presence_penalty=0.1))
    assert "structured" in why_not_exact(gen(response_format={"type": "json_object"}))
    assert "structured" in why_not_exact(gen(structured_outputs={"choice": ["a"]}))
    assert "bad_words" in why_not_exact(gen(bad_words=["x"]))
    assert "vllm_xargs" in why_not_exact(gen(vllm_xargs={"a": 1}))


def test_a_streamed_choice_that_cannot_go_on_raises_and_one_with_nothing_runs_again():
    gens = [EP.Generate(request_id="r", kind="completion", body={"prompt": "x", "n": 2, "presence_penalty": 1.0})]
    choices = [[Choice(tokens=[1], text_chars=1, started=True), Choice()]]
    with pytest.raises(CannotContinue):
        plan(gens, choices, lambda: "new", whole_answer=False, restart=lambda pi, c: None)
    choices = [[Choice(started=True, finished=True), Choice()]]
    (pi, g), = plan(gens, choices, lambda: "new", whole_answer=False, restart=lambda pi, c: None)
    assert g.resume == EP.Resume(index=1) and g.request_id == "new" and g.body == gens[0].body


def test_the_engine_continues_with_the_output_as_prompt_and_what_is_left():
    resume = EP.Resume(index=1, token_ids=[7, 8, 9], text_chars=4)
    assert continued_params(2, 10, 5, 40, resume) == {"n": 1, "max_tokens": 7, "min_tokens": 2, "seed": 41}
    assert continued_params(1, None, 0, None, EP.Resume(token_ids=[5])) == {"n": 1}  # no max_tokens: the context
    with pytest.raises(ResumeError):
        continued_params(1, 3, 0, None, EP.Resume(token_ids=[5, 6, 7]))
    with pytest.raises(ResumeError):
        continued_params(2, None, 0, None, EP.Resume(index=2))
    params = SimpleNamespace(n=2, max_tokens=10, min_tokens=0, seed=None, prompt_logprobs=1,
                             skip_reading_prefix_cache=True)
    built = SimpleNamespace(engine_input={"type": "token", "prompt_token_ids": [1, 2], "prompt": "ab",
                                          "prompt_token_offsets": [(0, 1), (1, 2)], "cache_salt": "s"},
                            params=params, spec=SimpleNamespace(echo=True, echo_only=False))
    assert continue_request(built, resume) == [1, 2]
    assert built.engine_input == {"type": "token", "prompt_token_ids": [1, 2, 7, 8, 9], "cache_salt": "s"}
    assert (params.n, params.max_tokens, params.prompt_logprobs, params.skip_reading_prefix_cache) == (1, 7, None,
                                                                                                       False)
    assert not built.spec.echo
    with pytest.raises(ResumeError):
        continue_request(SimpleNamespace(engine_input={"type": "embeds"}, params=params, spec=built.spec), resume)


def test_resume_round_trips_on_the_wire():
    g = EP.Generate(request_id="r", kind="completion", body={"prompt": "x"},
                    resume=EP.Resume(index=1, token_ids=[3], text_chars=2))
    assert EP.from_gateway_decoder.decode(EP.encoder.encode(g)) == g
    assert "resume" not in msgspec.msgpack.decode(EP.encoder.encode(EP.Generate(request_id="r", kind="chat",
                                                                                body={})))


def test_a_speech_request_runs_again_from_its_audio_whole_or_not_at_all():
    """Speech asks the engine several times a request: a new engine takes it from the start."""
    gen = EP.Generate(request_id="r", kind="transcription", body={"model": "s", "file": b"RIFF"})
    choice = Choice(tokens=[5, 6], text_chars=3, started=True, deltas=[EP.ReplayedDelta("ab", [5, 6])])
    restarted = []
    (pi, again), = plan([gen], [[choice]], lambda: "new", whole_answer=True,
                        restart=lambda pi, c: restarted.append((pi, c)))
    assert (pi, again.request_id, again.resume, again.body) == (0, "new", None, gen.body)
    assert restarted == [(0, 0)]
    with pytest.raises(CannotContinue, match="speech"):
        plan([gen], [[Choice(tokens=[5], text_chars=1, started=True, deltas=[])]], lambda: "new",
             whole_answer=False, restart=lambda pi, c: None)
