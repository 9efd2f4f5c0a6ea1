"""vLLM's KV-cache events through servectl's engine (issue 37): each engine publishes on an
endpoint of its own on the gateway's host, /kv_event_sources says where as `vllm serve`
does, a subscriber decodes vLLM's KVEventBatch, and an idle engine with events on sleeps.

The `tools_daemon` (conftest.TOOLS_CONFIG) has events on for both its models: `tools` on the
default endpoint (the gateway's host, port 5557), `default-hermes` on an explicit port.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import msgspec
import pytest
import zmq

from conftest import TOOLS_KV_EVENTS_PORT, context_switches, http, wait_for



def sources(d, model: str | None = None) -> dict:
    r = http(d, "GET", "/kv_event_sources" + (f"?model={model}" if model else ""), key=None, timeout=30)
    assert r.status == 200, r.text
    return r.json()


def test_each_model_publishes_on_its_own_endpoint_on_the_gateways_host(tools_daemon):
    from vllm.config.kv_events import KVEventsConfig

    every = sources(tools_daemon)
    assert set(every) == {"tools", "default-hermes"}, every
    tools, hermes = every["tools"]["0"], every["default-hermes"]["0"]
    # vLLM's own shape: KVEventsConfig's fields, publisher "zmq" (what a subscriber speaks).
    assert set(tools) == set(asdict(KVEventsConfig())), tools
    assert tools["publisher"] == "zmq" and tools["enable_kv_cache_events"] is True
    # Not every interface (vLLM's default tcp://*:5557): the gateway's host, each on its own port.
    assert tools["endpoint"] == "tcp://127.0.0.1:5557", tools
    assert hermes["endpoint"] == f"tcp://127.0.0.1:{TOOLS_KV_EVENTS_PORT}", hermes
    # One model asked for: `vllm serve`'s answer (replica -> config).
    assert sources(tools_daemon, "tools") == {"0": tools}
    assert http(tools_daemon, "GET", "/kv_event_sources?model=nope", key=None).status == 404


def test_a_subscriber_sees_its_prompts_first_block_stored(tools_daemon):
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    endpoint = sources(tools_daemon, "tools")["0"]["endpoint"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        stored: list = []
        ids: list[int] = []

        def block_of_prompt() -> bool:
            # A SUB socket joins asynchronously: prompts go on until one's events are seen, each
            # new from its first token (a block already cached is not stored again).
            prompt = f"{time.time_ns()} The quick brown fox jumps over the lazy dog " * 16
            ids[:] = http(tools_daemon, "POST", "/tokenize", {"model": "tools", "prompt": prompt}).json()["tokens"]
            r = http(tools_daemon, "POST", "/v1/completions", {"model": "tools", "prompt": prompt,
                                                                 "max_tokens": 1})
            assert r.status == 200, r.text
            while sub.poll(500):
                topic, seq, payload = sub.recv_multipart()
                assert len(seq) == 8
                batch = decoder.decode(payload)
                stored.extend(e for e in batch.events if isinstance(e, BlockStored))
            return any(e.token_ids[:e.block_size] == ids[:e.block_size] for e in stored)

        wait_for(block_of_prompt, 60, interval=0.5, what="BlockStored with the prompt's first block",
                 diagnose=lambda: f"{len(stored)} BlockStored; first: {stored[:1]}")
        first = next(e for e in stored if e.token_ids[:e.block_size] == ids[:e.block_size])
        # A full block of the prompt (vLLM's block on CPU is 128 tokens, on GPU 16).
        assert len(ids) > first.block_size and len(first.token_ids) == first.block_size * len(first.block_hashes)
    finally:
        sub.close(linger=0)
        ctx.term()


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
