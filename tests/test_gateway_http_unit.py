"""The gateway over HTTP against a scripted engine (tests/gateway_harness.py): sends that
are never dropped, aborts, deadlines, admission in sequences, timeouts, escaping, errors."""

from __future__ import annotations

import asyncio
import logging

import pytest

from api_gateway.engine_requests import YIELD_EVERY
from gateway_harness import run
from servectl.wire import engine as EP

pytestmark = pytest.mark.unit

COMPLETION = {"model": "m", "prompt": "x", "max_tokens": 4}


def error_shape(body) -> dict:
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err and "param" in err, body
    return err


def finish(rid: str, text: str = "y", index: int = 0, prompt_tokens: int | None = 1) -> EP.Delta:
    return EP.Delta(request_id=rid, index=index, text=text, token_ids=[7], finish_reason="length",
                    prompt=None if prompt_tokens is None else EP.PromptInfo(tokens=prompt_tokens))


def test_a_batch_larger_than_the_socket_queue_arrives_whole_and_is_aborted_whole():
    """Every Generate reaches the engine (none dropped on a full queue); a client that goes
    away gets every one of them aborted."""
    async def scenario(h):
        h.link.sndhwm = 2
        await h.ready()
        prompts = [f"p{i}" for i in range(200)]
        client = asyncio.ensure_future(h.post("/v1/completions", {**COMPLETION, "prompt": prompts}))
        got = []
        while len(got) < 200:
            msg = await h.engine.recv()
            assert isinstance(msg, EP.Generate), msg
            got.append(msg)
        assert [g.body["prompt"] for g in got] == prompts
        assert len(h.link.streams) == 200
        client.cancel()  # the client walks away
        aborted = set()
        while len(aborted) < 200:
            msg = await h.engine.recv()
            assert isinstance(msg, EP.Abort), msg
            aborted.update(msg.request_ids)
        assert aborted == {g.request_id for g in got}
        await asyncio.sleep(0.05)
        assert (h.link.streams, h.model.admitted, h.gw.in_flight) == ({}, 0, 0)

    run(scenario)


def test_an_engine_that_takes_nothing_fails_the_request_and_registers_nothing():
    async def scenario(h):
        h.link.sndhwm = 1
        await h.ready()
        h.link.send_timeout_s = 0.3
        # 3 MB: more than the socket queues and the kernel's buffers hold. Bounded by the send
        # deadline, not by the 120 s a stuck send would otherwise wait (a hang guard, not a figure).
        status, body = await asyncio.wait_for(
            h.post("/v1/completions", {**COMPLETION, "prompt": ["p" * 100_000] * 30}), 30)
        # Reported hung; its restart is awaited as long again, and did not come.
        assert status == 503 and "did not take a request" in error_shape(body)["message"], body
        assert "not restarted" in body["error"]["message"] and h.hangs == ["m"]
        assert (h.link.streams, h.model.admitted, h.gw.in_flight) == ({}, 0, 0)

    run(scenario, rcvhwm=1, output_timeout_s=0.5)


def test_an_integer_msgpack_cannot_carry_is_a_400_and_nothing_is_sent():
    async def scenario(h):
        await h.ready()
        schema = {"type": "integer", "maximum": 2**70}
        status, body = await h.post("/v1/completions", {**COMPLETION, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})  # vLLM requires a name
        assert status == 400 and "64-bit" in error_shape(body)["message"]
        for field, value in (("seed", 2**64), ("prompt", [2**64]), ("logit_bias", {str(2**64): 1}),
                             ("max_tokens", 2**63), ("top_k", 2**64)):
            status, body = await h.post("/v1/completions", {**COMPLETION, field: value})
            assert status == 400 and error_shape(body)["param"] == field, (field, body)
        status, body = await h.post("/v1/chat/completions", {"model": "m", "messages": [
            {"role": "user", "content": [{"type": "text", "text": -2**65}]}]})
        assert status == 400, body
        assert h.link.streams == {}
        with pytest.raises(asyncio.TimeoutError):
            await h.engine.recv(timeout=0.2)

    run(scenario)


def test_a_request_the_engine_lost_fails_instead_of_waiting_forever():
    async def scenario(h):
        await h.ready()
        client = asyncio.ensure_future(h.post("/v1/completions", COMPLETION))
        gen = await h.engine.recv()
        probe = await h.engine.recv(timeout=5)  # no output for output_timeout_s: is it still there?
        assert probe == EP.Stats(request_ids=[gen.request_id])
        await h.engine.stats_reply(missing=[gen.request_id])
        status, body = await client
        assert status == 503 and "lost this request" in error_shape(body)["message"]
        assert h.hangs == []

    run(scenario, output_timeout_s=0.3)


def test_queued_is_not_hung_and_silent_is():
    async def scenario(h):
        await h.ready()
        client = asyncio.ensure_future(h.post("/v1/completions", COMPLETION))
        gen = await h.engine.recv()
        await h.engine.recv(timeout=5)
        await h.engine.stats_reply(unfinished=3)  # still there, queued: wait on
        await h.engine.recv(timeout=5)  # asked again: the output comes before the answer
        await h.engine.step(finish(gen.request_id))
        await h.engine.stats_reply()
        status, body = await client
        assert status == 200 and body["choices"][0]["text"] == "y"
        # A silent engine is hung: reported, and the request fails.
        client = asyncio.ensure_future(h.post("/v1/completions", COMPLETION))
        await h.engine.recv()
        status, body = await client
        assert status == 503 and h.hangs == ["m"]

    run(scenario, output_timeout_s=0.3)


def test_a_non_streaming_client_that_goes_away_is_aborted():
    async def scenario(h):
        await h.ready()
        client = asyncio.ensure_future(h.post("/v1/completions", {**COMPLETION, "n": 2}))
        gen = await h.engine.recv()
        await h.engine.step(EP.Delta(request_id=gen.request_id, text="a", token_ids=[1],
                                     prompt=EP.PromptInfo(tokens=1)))
        await asyncio.sleep(0.05)
        client.cancel()
        abort = await h.engine.recv()
        assert abort == EP.Abort(request_ids=[gen.request_id])
        await asyncio.sleep(0.05)
        assert (h.link.streams, h.model.admitted) == ({}, 0)

    run(scenario)


def test_sequences_are_capped_and_admission_counts_them():
    async def scenario(h):
        await h.ready(max_num_seqs=2)
        status, body = await h.post("/v1/completions", {**COMPLETION, "prompt": ["a"] * 5, "n": 2})
        assert status == 400 and error_shape(body)["code"] == "too_many_sequences"
        assert "10 sequences; at most 8" in body["error"]["message"]
        # 2 run in the engine, 4 more may wait: a request of 4 sequences is admitted ...
        first = asyncio.ensure_future(h.post("/v1/completions", {**COMPLETION, "prompt": ["a"] * 3, "n": 2}))
        gens = [await h.engine.recv() for _ in range(3)]
        assert h.model.queued() == 4
        # ... and the next one (2 more) is refused: the queue would hold 6 > 4.
        status, body = await h.post("/v1/completions", {**COMPLETION, "n": 2})
        assert status == 429 and "4 sequences" in error_shape(body)["message"]
        for g in gens:
            await h.engine.step(finish(g.request_id, index=0), finish(g.request_id, index=1))
        status, body = await first
        assert status == 200 and len(body["choices"]) == 6

    run(scenario, max_sequences_per_request=8, max_waiting_per_model=4)


def test_header_and_body_timeouts():
    async def scenario(h):
        # Half the headers, never finished: closed at the header timeout, nothing answered (the
        # read's own bound is a hang guard: without the timeout the connection stays open).
        assert await h.raw(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n", timeout=30) == b""
        # A body that stops: a 408 that names the body timeout, which nothing else answers.
        out = await h.raw(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"model\":", timeout=30)
        assert out.startswith(b"HTTP/1.1 408"), out
        assert b'"code":"body_timeout"' in out

    run(scenario, header_timeout_s=0.2, body_timeout_s=0.2)


def test_protocol_errors_and_bad_headers_answer_in_openais_shape(caplog):
    async def scenario(h):
        out = await h.raw(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Bad: a\x01b\r\n\r\n")
        assert out.startswith(b"HTTP/1.0 400") and b'"error":{"message":"Bad Request: Invalid header' in out, out
        # Not UTF-8: a wrong key, not a 500.
        out = await h.raw(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xff\xfe\r\n"
                          b"X-Request-Id: \xc3\x28\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        assert out.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in out, out

    with caplog.at_level(logging.INFO):
        run(scenario, api_keys=["k"])
    # A client's malformed HTTP is one log line, never a traceback.
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    assert any("Invalid header value char" in r.getMessage() for r in caplog.records)


def test_the_access_log_escapes_what_the_client_sent(caplog):
    async def scenario(h):
        await h.raw(b"GET /v1/x%0Aforged%20200 HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        await h.post("/v1/completions", {**COMPLETION, "model": "a\nb 200"})

    with caplog.at_level(logging.INFO, logger="api_gateway.access"):
        run(scenario)
    lines = [r.getMessage() for r in caplog.records if r.name == "api_gateway.access"]
    assert len(lines) == 2 and all("\n" not in line for line in lines), lines
    assert lines[0].startswith("GET /v1/x\\x0aforged\\x20200 404")
    assert "model=a\\x0ab\\x20200" in lines[1]


def test_a_large_batch_is_sent_without_stalling_the_event_loop():
    """While a 256-prompt request is submitted, the event loop gets a turn at least every
    YIELD_EVERY sends: counted in loop turns (a ticker task's iterations), not timed, so a
    loaded machine or a garbage collection cannot make it fail."""
    async def scenario(h):
        await h.ready()
        turns, stop = [0], asyncio.Event()
        sends_in_turn: dict[int, int] = {}
        send = h.link._send

        async def counted_send(*args, **kwargs):
            sends_in_turn[turns[0]] = sends_in_turn.get(turns[0], 0) + 1
            return await send(*args, **kwargs)

        async def ticker():
            while not stop.is_set():
                await asyncio.sleep(0)
                turns[0] += 1

        h.link._send = counted_send
        tick = asyncio.ensure_future(ticker())
        client = asyncio.ensure_future(h.post("/v1/completions", {**COMPLETION, "prompt": ["p"] * 256}))
        for _ in range(256):
            await h.engine.recv()
        stop.set()
        await tick
        client.cancel()
        assert sum(sends_in_turn.values()) == 256
        assert len(sends_in_turn) >= 256 // YIELD_EVERY, sends_in_turn
        assert max(sends_in_turn.values()) <= YIELD_EVERY, sends_in_turn

    run(scenario)


def test_usage_counts_a_stream_failed_after_its_headers_and_an_empty_answer_as_errors():
    """The key's usage (the manager's ``Finished``) says error for a stream whose engine failed
    after the 200 went out (the access line keeps the 200 the client got) and for a non-streaming
    answer the engine left empty (a 500), never success first."""
    from servectl.wire import control as MP

    async def scenario(h):
        sent = []
        h.gw.manager.report_now = sent.append
        await h.ready()
        client = asyncio.ensure_future(h.post("/v1/completions", {**COMPLETION, "stream": True}))
        gen = await h.engine.recv()
        await h.engine.step(EP.Delta(request_id=gen.request_id, index=0, text="a", token_ids=[7],
                                     prompt=EP.PromptInfo(tokens=1)))
        await h.engine.send(EP.RequestError(incarnation=h.engine.incarnation, request_id=gen.request_id,
                                            message="the engine failed", status=500))
        status, body = await client
        assert status == 200 and "the engine failed" in body, body
        (streamed,) = [m for m in sent if isinstance(m, MP.Finished)]
        assert streamed.error and (streamed.prompt_tokens, streamed.completion_tokens) == (1, 1)

        client = asyncio.ensure_future(h.post("/v1/responses", {"model": "m", "input": "x"}))
        gen = await h.engine.recv()
        await h.engine.step(EP.Delta(request_id=gen.request_id, index=0, token_ids=[7], finish_reason="stop",
                                     prompt=EP.PromptInfo(tokens=1)))  # no api_output: nothing to answer
        status, body = await client
        assert status == 500 and "no answer" in error_shape(body)["message"], body
        empty = [m for m in sent if isinstance(m, MP.Finished)][1:]
        assert [m.error for m in empty] == [True], empty

    run(scenario)
