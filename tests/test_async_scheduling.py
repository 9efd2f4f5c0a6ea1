"""Issue 13: vLLM's async scheduling through the ZeroMQ executor, with the real engine on CPU.

On CPU vLLM turns async scheduling off for every executor
(``CpuPlatform.check_and_update_config``). An explicit
``engine_args.async_scheduling = true`` is honoured there by servectl
(``engine_core.workers.executor.honour_async_scheduling_on_cpu``), as a GPU platform
would decide: with ``WorkerGroupExecutor`` saying it supports async scheduling, vLLM builds its
``AsyncScheduler`` and a batch queue of ``max_concurrent_batches`` = 2, and the
CPU model runner returns vLLM's ``AsyncGPUModelRunnerOutput`` (the CPU worker
replaces CUDA streams and events with no-op placeholders, so it runs). So
this is the GPU code path end to end: engine core, executor futures, worker
output thread; only the device-side overlap is missing.

Two models of one daemon: "async" (``async_scheduling = true``) and "sync" (``engine_args.async_scheduling = false``: off, the
synchronous path). The same prompts at temperature 0 must give the same
tokens; the async engine must report overlapped steps; after an abandoned
stream its batch queue drains and the workers freeze.
"""

from __future__ import annotations

import concurrent.futures as cf

import msgspec
import pytest
import zmq

from conftest import Daemon, http, wait_for
from servectl.config import DEFAULT_MODEL_DIR
from servectl.wire import engine as EP

ENGINE_ARGS = 'enforce_eager = true\nkv_cache_memory_bytes = 134217728\nmax_model_len = 512\ndtype = "float32"\n'
# An explicit `async_scheduling = true` is honoured on CPU too (vLLM's CPU platform forces it off).
ASYNC_ON = "async_scheduling = true\n"


@pytest.fixture(scope="module")
def pair_daemon(tmp_path_factory):
    config = (f'[manager]\nwarm_standby = false\nfreeze_grace_s = 1.0\n'
              f'[[models]]\nname = "sync"\nmodel = "{DEFAULT_MODEL_DIR}"\n[models.engine_args]\n{ENGINE_ARGS}'
              f'async_scheduling = false\n'
              f'[[models]]\nname = "async"\nmodel = "{DEFAULT_MODEL_DIR}"\n[models.engine_args]\n{ENGINE_ARGS}'
              f'{ASYNC_ON}')
    d = Daemon(tmp_path_factory.mktemp("async"), config=config)
    try:
        d.start()
        yield d
    finally:
        d.stop()
        leftover = d.tree()
        d.kill_all()
        assert not leftover


def engine_stats(d: Daemon, model: str) -> EP.StatsReply:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{d.runtime_dir / f'engine-{model}'}")
    try:
        sock.send(EP.encoder.encode(EP.Stats()))
        while True:
            assert sock.poll(20000), "no stats reply"
            msg = EP.to_gateway_decoder.decode(sock.recv())
            if isinstance(msg, EP.StatsReply):
                return msg
    finally:
        sock.close()


PROMPTS = ["def main():\n", "import os\n", "class Foo:\n", "for i in range(", "x = ", "# a comment\n"]


def complete_all(d: Daemon, model: str) -> list[tuple[str, list[int]]]:
    client = d.openai()

    def one(i):
        r = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=8 + 4 * i, temperature=0,
                                      logprobs=0, extra_body={"ignore_eos": True})
        return r.choices[0].text, r.usage.completion_tokens

    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


def test_async_scheduling_gives_the_synchronous_tokens_and_overlaps_steps(pair_daemon):
    async_log, sync_log = pair_daemon.log("engine_core:async"), pair_daemon.log("engine_core:sync")
    assert "async scheduling on (max_concurrent_batches 2, platform cpu)" in async_log
    assert "async scheduling off (max_concurrent_batches 1" in sync_log
    assert "Async scheduling will be disabled" not in async_log
    before = engine_stats(pair_daemon, "async").overlapped_steps
    overlapped = complete_all(pair_daemon, "async")
    sync = complete_all(pair_daemon, "sync")
    assert overlapped == sync
    assert [n for _, n in overlapped] == [8 + 4 * i for i in range(len(PROMPTS))]
    assert engine_stats(pair_daemon, "async").overlapped_steps > before
    assert engine_stats(pair_daemon, "sync").overlapped_steps == 0
    # The same counter on the gateway's /metrics.
    metrics = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
               for line in http(pair_daemon, "GET", "/metrics").text.splitlines()
               if line.startswith("servectl_engine_overlapped_steps{")}
    assert metrics['model="async"'] > 0
    assert metrics['model="sync"'] == 0
    # The worker got vLLM's async model-runner outputs and resolved them on its output thread.
    assert "async model outputs are resolved on an output thread" in pair_daemon.log("worker:async:0")
    assert "output thread" not in pair_daemon.log("worker:sync:0")


def test_async_outputs_come_back_as_sampled_tokens_from_the_output_thread(pair_daemon):
    """vLLM's async model output, resolved on the worker's output thread, still qualifies for the
    unsigned tokens reply (engine_core/workers/tokens_reply.py): the path a GPU takes on every step."""
    before = engine_stats(pair_daemon, "async")
    client = pair_daemon.openai()
    r = client.completions.create(model="async", prompt="def ", max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 10
    after = engine_stats(pair_daemon, "async")
    assert after.token_replies - before.token_replies >= 10
    assert "async model outputs are resolved on an output thread" in pair_daemon.log("worker:async:0")


def test_an_abandoned_stream_drains_the_queue_and_the_workers_freeze(pair_daemon):
    client = pair_daemon.openai()
    stream = client.completions.create(model="async", prompt="def ", max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # the gateway aborts it with steps in flight
    wait_for(lambda: pair_daemon.child("worker:async:0").state == "idle (frozen)", 60,
             what="the async model's worker frozen", diagnose=lambda: pair_daemon.log_tails("engine_core:async"))
    assert engine_stats(pair_daemon, "async").unfinished == 0
    r = client.completions.create(model="async", prompt="def main():\n", max_tokens=8, temperature=0)
    s = client.completions.create(model="sync", prompt="def main():\n", max_tokens=8, temperature=0)
    assert r.choices[0].text == s.choices[0].text


def test_the_counters_are_in_the_engine_log_at_shutdown(pair_daemon):
    """Last in this module: it stops the daemon."""
    overlapped = engine_stats(pair_daemon, "async").overlapped_steps
    assert overlapped > 0
    pair_daemon.stop()
    assert f"step(s) sent, {overlapped} sent before the previous reply arrived" in pair_daemon.log("engine_core:async")
    assert "step(s) sent, 0 sent before the previous reply arrived" in pair_daemon.log("engine_core:sync")


def test_stats_reply_decodes_without_the_new_field():
    """A StatsReply from an engine older than the counter still decodes (default 0)."""
    old = msgspec.msgpack.encode({"type": "stats_reply", "incarnation": "x", "unfinished": 0, "rejected_frames": 0})
    assert EP.to_gateway_decoder.decode(old).overlapped_steps == 0
