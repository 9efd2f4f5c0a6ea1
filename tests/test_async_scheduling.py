"""Issues 13 and 40: vLLM's async scheduling through servectl's executor, with the real engine on CPU.

On CPU vLLM turns async scheduling off for every executor
(``CpuPlatform.check_and_update_config``). servectl keeps vLLM's own decision
there (``engine_core.workers.executor.honour_async_scheduling_on_cpu``), as a GPU
platform would: on by default since issue 40. With ``WorkerGroupExecutor`` saying it supports async scheduling, vLLM builds its
``AsyncScheduler`` and a batch queue of ``max_concurrent_batches`` = 2, and the
CPU model runner returns vLLM's ``AsyncGPUModelRunnerOutput`` (the CPU worker
replaces CUDA streams and events with no-op placeholders, so it runs). So
this is the GPU code path end to end: engine core, executor futures, worker
output thread; only the device-side overlap is missing.

Two models of one daemon: "async" (the default: no ``async_scheduling`` key) and "sync"
(``engine_args.async_scheduling = false``: the synchronous path, as vLLM runs on
CPU). Every feature whose tokens the batch queue could change must give the
same output on both: greedy completions and chat, logprobs, penalties, stop
strings, structured outputs, seeded sampling with n > 1, and a stream resumed
after its worker was killed. The async engine must report overlapped steps;
after an abandoned stream its batch queue drains and the workers freeze.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal

import msgspec
import pytest
import zmq

from conftest import Daemon, http, wait_for
from servectl.config import DEFAULT_MODEL_DIR
from servectl.wire import engine as EP

ENGINE_ARGS = 'enforce_eager = true\nkv_cache_memory_bytes = 134217728\nmax_model_len = 512\ndtype = "float32"\n'


@pytest.fixture(scope="module")
def pair_daemon(tmp_path_factory):
    config = (f'[gateway]\nhold_timeout_s = 120\n[manager]\nwarm_standby = false\nfreeze_grace_s = 1.0\n'
              f'backoff_initial_s = 0.3\n'
              f'[[models]]\nname = "sync"\nmodel = "{DEFAULT_MODEL_DIR}"\n[models.engine_args]\n{ENGINE_ARGS}'
              f'async_scheduling = false\n'
              f'[[models]]\nname = "async"\nmodel = "{DEFAULT_MODEL_DIR}"\n[models.engine_args]\n{ENGINE_ARGS}'
              f'[[models]]\nname = "async-thread"\nmodel = "{DEFAULT_MODEL_DIR}"\n'
              f'env = {{ SERVECTL_ASYNC_OUTPUT_THREAD = "1" }}\n[models.engine_args]\n{ENGINE_ARGS}')
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
    # The worker got vLLM's async model-runner outputs and, on CPU, resolved them on its loop: the
    # reply goes before the next step runs, or the engine would get each step's tokens a step late.
    assert "async model outputs are resolved on the loop" in pair_daemon.log("worker:async:0")
    assert "output thread" not in pair_daemon.log("worker:async:0")
    assert "async model outputs" not in pair_daemon.log("worker:sync:0")


def test_async_outputs_come_back_as_sampled_tokens_from_the_output_thread(pair_daemon):
    """vLLM's async model output, resolved on the worker's output thread (the path a GPU takes on
    every step; ``SERVECTL_ASYNC_OUTPUT_THREAD=1`` keeps it on CPU), gives the synchronous tokens and
    still qualifies for the unsigned tokens reply (engine_core/workers/tokens_reply.py)."""
    before = engine_stats(pair_daemon, "async-thread")
    client = pair_daemon.openai()
    r = client.completions.create(model="async-thread", prompt="def ", max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 10
    after = engine_stats(pair_daemon, "async-thread")
    assert after.token_replies - before.token_replies >= 10
    assert after.overlapped_steps > before.overlapped_steps
    assert "async model outputs are resolved on an output thread" in pair_daemon.log("worker:async-thread:0")
    assert complete_all(pair_daemon, "async-thread") == complete_all(pair_daemon, "sync")


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


MESSAGES = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "size": {"type": "integer"}},
               "required": ["name", "size"], "additionalProperties": False}
# Each feature whose tokens the batch queue could change: (path, body). Run alone, one after another,
# so both engines see the same batches (one request; n sequences) and only the scheduling differs.
FEATURES = {
    "chat": ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 0, "max_tokens": 24}),
    "chat-logprobs": ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 0, "max_tokens": 12,
                                               "logprobs": True, "top_logprobs": 3}),
    "completion-logprobs": ("/v1/completions", {"prompt": "import numpy as np\n", "temperature": 0, "max_tokens": 12,
                                                "logprobs": 3, "echo": True}),
    "penalties": ("/v1/completions", {"prompt": "def f(x):\n    return x", "temperature": 0, "max_tokens": 32,
                                      "presence_penalty": 0.8, "frequency_penalty": 0.6, "repetition_penalty": 1.3,
                                      "ignore_eos": True}),
    "stop-strings": ("/v1/completions", {"prompt": "def main():\n", "temperature": 0, "max_tokens": 64,
                                         "stop": ["return", "\n\n\n"]}),
    "min-tokens-stop": ("/v1/completions", {"prompt": "x = 1\n", "temperature": 0, "max_tokens": 40,
                                            "min_tokens": 6, "stop": ["\n"], "include_stop_str_in_output": True}),
    "choice": ("/v1/completions", {"prompt": "My favourite dessert is ", "temperature": 0, "max_tokens": 8,
                                   "structured_outputs": {"choice": ["apple pie", "banana split", "cherry tart"]}}),
    "regex": ("/v1/completions", {"prompt": "name = ", "temperature": 0, "max_tokens": 20,
                                  "structured_outputs": {"regex": "[a-z]{3,8}_[0-9]{2}"}}),
    "json-schema": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "A thing, as JSON."}],
                                             "temperature": 0, "max_tokens": 60,
                                             "response_format": {"type": "json_schema", "json_schema": {
                                                 "name": "thing", "schema": JSON_SCHEMA}}}),
    "n3-seeded": ("/v1/completions", {"prompt": "for i in ", "n": 3, "temperature": 0.9, "seed": 1234,
                                      "max_tokens": 16, "ignore_eos": True}),
    "chat-n2-seeded-top-p": ("/v1/chat/completions", {"messages": MESSAGES, "n": 2, "temperature": 1.0,
                                                      "top_p": 0.9, "top_k": 20, "seed": 7, "max_tokens": 16}),
}
NOT_COMPARED = {"id", "created", "model", "system_fingerprint", "service_tier"}


def same(a, b, where: str = "") -> list[str]:
    """Where two responses differ (logprobs to 1e-4; ids, times and model names not compared)."""
    if isinstance(a, float) or isinstance(b, float):
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 1e-4
        return [] if ok else [f"{where}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        keys = (a.keys() | b.keys()) - NOT_COMPARED
        return [d for k in sorted(keys) for d in same(a.get(k), b.get(k), f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


@pytest.mark.parametrize("feature", list(FEATURES))
def test_every_feature_gives_the_synchronous_output(pair_daemon, feature):
    path, body = FEATURES[feature]
    before = engine_stats(pair_daemon, "async").overlapped_steps
    out = {}
    for model in ("async", "sync"):
        r = http(pair_daemon, "POST", path, {"model": model, **body}, timeout=120)
        assert r.status == 200, (model, r.text)
        out[model] = r.json()
    differences = same(out["async"], out["sync"])
    assert not differences, f"{feature}: async differs from sync:\n" + "\n".join(differences[:10])
    assert out["async"]["usage"]["completion_tokens"] > 0, out["async"]
    steps = out["async"]["usage"]["completion_tokens"] // len(out["async"]["choices"])
    if steps > 2:  # the batch queue was used: the next step went out before the last reply came
        assert engine_stats(pair_daemon, "async").overlapped_steps > before, feature


def test_a_stream_resumed_after_its_worker_died_gives_the_synchronous_tokens(pair_daemon):
    """The worker of the async model is SIGKILLed mid-stream, with steps in flight: the stream
    resumes on the restarted group and ends with the tokens of an undisturbed synchronous run."""
    # 480 tokens: the kill at the 20th chunk must come while the engine still generates, even
    # when this client is starved of the CPU and the server runs ahead of it.
    body = {"prompt": "def parse(line):\n", "temperature": 0, "max_tokens": 480, "ignore_eos": True}
    sync = http(pair_daemon, "POST", "/v1/completions", {"model": "sync", **body}, timeout=120).json()
    client = pair_daemon.openai()
    stream = client.completions.create(model="async", stream=True, **{k: v for k, v in body.items()
                                                                       if k != "ignore_eos"},
                                       extra_body={"ignore_eos": True})
    pieces: list[str] = []
    worker = pair_daemon.child("worker:async:0").pid
    engine = pair_daemon.child("engine_core:async").pid
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
        if len(pieces) == 20:
            os.kill(worker, signal.SIGKILL)
    assert pair_daemon.child("engine_core:async").pid != engine, "the group was not restarted"
    assert len(pieces) == 480, len(pieces)
    assert "".join(pieces) == sync["choices"][0]["text"]
    assert "going on with" in pair_daemon.log("gateway:0"), pair_daemon.log_tails("gateway:0")


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
