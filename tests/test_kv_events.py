"""vLLM's KV-cache events through servectl's engine (issue 37; issue 53's first finding): each
engine publishes on an endpoint of its own, by default a 0600 socket in the runtime directory,
/kv_event_sources says where as `vllm serve` does (behind the API keys), a subscriber decodes
vLLM's KVEventBatch, BlockStored carries no token ids unless the model opts in, and an idle
engine with events on sleeps.

The `tools_daemon` (conftest.TOOLS_CONFIG) has events on for both its models: `tools` on the
default endpoint with token ids (kv_events_token_ids), `default-hermes` on loopback TCP ports
with a replay endpoint, without them (the default).
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import asdict

import msgspec
import pytest
import zmq

from conftest import TOOLS_KV_EVENTS_PORT, TOOLS_KV_REPLAY_PORT, context_switches, http, wait_for

END = (-1).to_bytes(8, "big", signed=True)


def sources(d, model: str | None = None) -> dict:
    r = http(d, "GET", "/kv_event_sources" + (f"?model={model}" if model else ""), key=None, timeout=30)
    assert r.status == 200, r.text
    return r.json()


def test_each_model_publishes_on_its_own_endpoint_by_default_a_private_socket(tools_daemon):
    from vllm.config.kv_events import KVEventsConfig

    every = sources(tools_daemon)
    assert set(every) == {"tools", "default-hermes"}, every
    tools, hermes = every["tools"]["0"], every["default-hermes"]["0"]
    # vLLM's own shape: KVEventsConfig's fields, publisher "zmq" (what a subscriber speaks).
    assert set(tools) == set(asdict(KVEventsConfig())), tools
    assert tools["publisher"] == "zmq" and tools["enable_kv_cache_events"] is True
    # No TCP port by default: a socket in the runtime directory (0700), itself 0600 — what the
    # runtime directory's owner alone may connect to (issue 53: not uid nobody).
    path = os.path.join(tools_daemon.runtime_dir, "kv-events-tools@0")
    assert tools["endpoint"] == f"ipc://{path}", tools
    assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    # An endpoint given is taken as it is (loopback TCP needs no opt-in), each model its own.
    assert hermes["endpoint"] == f"tcp://127.0.0.1:{TOOLS_KV_EVENTS_PORT}", hermes
    assert hermes["replay_endpoint"] == f"tcp://127.0.0.1:{TOOLS_KV_REPLAY_PORT}", hermes
    # One model asked for: `vllm serve`'s answer (replica -> config).
    assert sources(tools_daemon, "tools") == {"0": tools}
    assert http(tools_daemon, "GET", "/kv_event_sources?model=nope", key=None).status == 404


def test_kv_event_sources_needs_a_key_where_keys_are_configured(daemon):
    """As /v1: where the events are is the API's (issue 53); /ready and /health stay open."""
    assert daemon.api_key
    r = http(daemon, "GET", "/kv_event_sources", key=None)
    assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert http(daemon, "GET", "/kv_event_sources", key="sk-wrong").status == 401
    r = http(daemon, "GET", "/kv_event_sources")  # the daemon's key
    assert r.status == 200 and r.json() == {}, r.text  # its model publishes no events
    assert http(daemon, "GET", "/health", key=None).status == 200
    assert http(daemon, "GET", "/ready", key=None).status == 200


def stored_events(d, model: str, endpoint: str, until, what: str) -> list:
    """Subscribe to ``endpoint`` and send ``model`` fresh prompts until ``until(stored, ids)``
    holds for the BlockStored events seen (``ids``: the last prompt's token ids)."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        stored: list = []
        ids: list[int] = []

        def seen() -> bool:
            # A SUB socket joins asynchronously: prompts go on until one's events are seen, each
            # new from its first token (a block already cached is not stored again).
            prompt = f"{time.time_ns()} The launch code is SECRET-42. " + "The quick brown fox jumps over a dog " * 16
            r = http(d, "POST", "/tokenize", {"model": model, "prompt": prompt})
            assert r.status == 200, r.text
            ids[:] = r.json()["tokens"]
            r = http(d, "POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1})
            assert r.status == 200, r.text
            while sub.poll(500):
                topic, seq, payload = sub.recv_multipart()
                assert len(seq) == 8
                stored.extend(e for e in decoder.decode(payload).events if isinstance(e, BlockStored))
            return until(stored, ids)

        wait_for(seen, 60, interval=0.5, what=what, diagnose=lambda: f"{len(stored)} BlockStored; first: {stored[:1]}")
        return stored
    finally:
        sub.close(linger=0)
        ctx.term()


def test_by_default_block_stored_carries_no_token_ids_live_or_replayed(tools_daemon):
    """Issue 53: a subscriber, then a replay from sequence 0 (what the audit did), decode every
    BlockStored: block hashes (what a router matches), no token ids, no extra keys, no session."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    endpoint = sources(tools_daemon, "default-hermes")["0"]["endpoint"]
    stored = stored_events(tools_daemon, "default-hermes", endpoint,
                           lambda stored, ids: any(len(e.block_hashes) and e.block_size for e in stored),
                           "BlockStored from default-hermes")
    assert all(e.token_ids == [] and e.extra_keys is None and e.session_id is None for e in stored), stored[:2]
    assert all(len(e.block_hashes) >= 1 and e.block_size > 0 for e in stored)
    # The replay buffer holds what was sent: the same, stripped.
    ctx = zmq.Context()
    replay = ctx.socket(zmq.DEALER)
    replay.connect(sources(tools_daemon, "default-hermes")["0"]["replay_endpoint"])
    try:
        replay.send_multipart((b"", (0).to_bytes(8, "big")))
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        replayed: list = []
        while True:
            assert replay.poll(10_000), "no end marker from the replay endpoint"
            _, topic, seq, payload = replay.recv_multipart()
            if seq == END:
                break
            replayed.extend(e for e in decoder.decode(payload).events if isinstance(e, BlockStored))
        assert replayed and all(e.token_ids == [] and e.extra_keys is None for e in replayed), replayed[:2]
    finally:
        replay.close(linger=0)
        ctx.term()


def test_with_the_opt_in_a_subscriber_on_the_socket_sees_its_prompts_first_block(tools_daemon):
    """`kv_events_token_ids = true` (only over ipc://): vLLM's BlockStored whole, for a router on
    this host that hashes token ids itself (vllm-router's kv_aware)."""
    endpoint = sources(tools_daemon, "tools")["0"]["endpoint"]
    assert endpoint.startswith("ipc://")
    ids: list[int] = []

    def prompts_block(stored, prompt_ids) -> bool:
        ids[:] = prompt_ids
        return any(e.token_ids[:e.block_size] == prompt_ids[:e.block_size] for e in stored)

    stored = stored_events(tools_daemon, "tools", endpoint, prompts_block, "BlockStored with the prompt's first block")
    first = next(e for e in stored if e.token_ids[:e.block_size] == ids[:e.block_size])
    # A full block of the prompt (vLLM's block on CPU is 128 tokens, on GPU 16).
    assert len(ids) > first.block_size and len(first.token_ids) == first.block_size * len(first.block_hashes)


def test_the_publisher_strips_prompts_unless_told_and_leaves_vllms_events_alone(tmp_path):
    """engine_core/kv_events.py alone (no daemon): what goes out, live and replayed, and the
    socket file's mode; vLLM's own event objects are not changed."""
    from engine_core.kv_events import SleepingZmqPublisher
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    def batch() -> KVEventBatch:
        return KVEventBatch(ts=1.0, events=[
            BlockStored(block_hashes=[b"h1", b"h2"], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                        lora_id=None, medium="GPU", lora_name=None, extra_keys=[("salt-a",), None],
                        session_id="s-1"),
            BlockRemoved(block_hashes=[b"h0"], medium="GPU")])

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    for token_ids in (False, True):
        ctx = zmq.Context.instance()
        endpoint = f"ipc://{tmp_path}/ev-{token_ids}"
        publisher = SleepingZmqPublisher(endpoint=endpoint, replay_endpoint=f"{endpoint}-replay", token_ids=token_ids)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"{endpoint}-replay")
        try:
            assert stat.S_IMODE(os.stat(f"{tmp_path}/ev-{token_ids}").st_mode) == 0o600
            sent = batch()

            def received() -> bool:
                publisher.publish(batch())
                return bool(sub.poll(100))
            wait_for(received, 10, interval=0.05, what="a batch through the SUB socket")
            live = decoder.decode(sub.recv_multipart()[2])
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            assert dealer.poll(5000)
            replayed = decoder.decode(dealer.recv_multipart()[3])
            for got in (live, replayed):
                stored, removed = got.events
                assert stored.block_hashes == [b"h1", b"h2"] and stored.block_size == 4 and stored.medium == "GPU"
                assert removed == BlockRemoved(block_hashes=[b"h0"], medium="GPU")
                if token_ids:
                    assert stored == batch().events[0]  # vLLM's event whole
                else:
                    assert stored.token_ids == [] and stored.extra_keys is None and stored.session_id is None
            publisher.publish(sent)
            assert sent.events[0].token_ids == list(range(8)) and sent.events[0].session_id == "s-1"
        finally:
            sub.close(linger=0)
            dealer.close(linger=0)
            publisher.shutdown()


def test_an_idle_engine_with_events_on_sleeps(tools_daemon):
    """vLLM's publisher thread wakes ten times a second; servectl's blocks until there is work."""
    tools_daemon.openai().completions.create(model="tools", prompt="warm", max_tokens=2)
    engine = tools_daemon.child("engine_core:tools").pid
    # Past the freeze grace (the engine's one-shot deadline after its last request): it froze its worker.
    wait_for(lambda: tools_daemon.child("worker:tools:0").state == "idle (frozen)", 60, what="the worker frozen")
    time.sleep(0.5)
    before = context_switches([engine])
    time.sleep(3.0)  # the measurement itself: what the idle engine does over a fixed window
    woke = context_switches([engine]) - before
    assert woke <= 3, f"the idle engine (events on) switched {woke} times in 3 s"
