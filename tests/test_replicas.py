"""Issue 36: replicas of one model under supervision (real engines, the bundled model, real kills).

One daemon serves `chat` as two replicas (two engine groups, one name) and `flaky`, whose second
replica crashes at every start (its replica_env has its engine fault at once): it fails alone
and its model goes on, `degraded`. The tests see which replica served what through vLLM's own
metrics (one `engine` label per replica) and the daemon's status, and drive it with the openai SDK.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from conftest import DEFAULT_MODEL_DIR, DaemonFactory, assert_nothing_running, http, wait_for

TESTS = os.path.dirname(os.path.abspath(__file__))
CONFIG = f"""[gateway]
hold_timeout_s = 120
[manager]
warm_standby = false
freeze_grace_s = 1
backoff_initial_s = 0.3
backoff_max_s = 1
[[models]]
name = "chat"
model = "{DEFAULT_MODEL_DIR}"
replicas = 2
# float32: greedy text that does not depend on the batch a request shares (the kill moves it)
engine_args = {{ dtype = "float32" }}
[[models]]
name = "flaky"
model = "{DEFAULT_MODEL_DIR}"
replicas = 2
crash_loop_count = 2
# The second replica's engine dies of SIGSEGV at every start (tests/crash_engine.py).
replica_env = [{{}}, {{SERVECTL_ENGINE_FACTORY = "crash_engine:build", PYTHONPATH = "{TESTS}"}}]
"""


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    with DaemonFactory(tmp_path_factory, "replicas") as make:
        # `servectl start` says a model's replica failed (exit 1); the daemon serves on.
        yield make(CONFIG, expect_ok=False)


def served_per_replica(d, model: str = "chat") -> dict[str, float]:
    """vLLM's finished-request count of each replica of ``model`` (its `engine` label)."""
    text = http(d, "GET", "/metrics").text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{") and f'model_name="{model}"' in line:
            engine = re.search(r'engine="(\d+)"', line).group(1)
            counts[engine] = counts.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def states(d) -> dict[str, str]:
    return {m.name: str(m.state) for m in d.status().models}


def test_each_replica_is_a_group_one_name_is_served_and_a_crash_looping_replica_fails_alone(d):
    assert d.start_output.returncode == 1 and "flaky@1 failed" in d.start_output.stderr, d.start_output
    wait_for(lambda: states(d).get("flaky@1") == "failed", 240, what="flaky@1 to fail",
             diagnose=lambda: str(states(d)))
    assert states(d) == {"chat@0": "ready", "chat@1": "ready", "flaky@0": "ready", "flaky@1": "failed"}
    status = d.status()
    assert {c.component for c in status.children if c.kind == "worker"} >= {"worker:chat@0:0", "worker:chat@1:0"}
    assert [m.id for m in d.openai().models.list().data] == ["chat", "flaky"]
    health = http(d, "GET", "/health").json()
    assert health["status"] == "ok"  # a degraded model serves
    assert health["models"]["chat"] == {"state": "ready"}
    assert health["models"]["flaky"]["state"] == "degraded"
    assert "1 of 2 replicas serve; flaky@1 failed" in health["models"]["flaky"]["reason"]
    # The failed replica's model goes on: its requests go to the replica that serves.
    out = d.openai().completions.create(model="flaky", prompt="def ", max_tokens=5, temperature=0)
    assert out.choices[0].text and out.model == "flaky"
    shown = d.cli("status").stdout
    assert "chat@0" in shown and "chat@1" in shown and "flaky@1" in shown


def test_both_replicas_serve_under_load_and_a_busy_one_gets_no_new_requests(d):
    client = d.openai()
    before = served_per_replica(d)
    threads = [threading.Thread(target=client.completions.create,
                                kwargs=dict(model="chat", prompt=f"{i} def ", max_tokens=24, temperature=0))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = served_per_replica(d)
    gained = {e: after.get(e, 0) - before.get(e, 0) for e in ("0", "1")}
    assert sum(gained.values()) == 8 and min(gained.values()) >= 2, gained  # both replicas served
    assert_nothing_running(d)

    # One long request keeps a replica busy; the short ones sent meanwhile all go to the other.
    before = served_per_replica(d)
    long = client.completions.create(model="chat", prompt="class ", max_tokens=400, temperature=0,
                                     extra_body={"ignore_eos": True}, stream=True)
    next(iter(long))  # it runs
    for i in range(3):
        client.completions.create(model="chat", prompt=f"short {i}", max_tokens=4, temperature=0)
    middle = served_per_replica(d)
    assert sorted(middle.get(e, 0) - before.get(e, 0) for e in ("0", "1")) == [0, 3], (before, middle)
    assert sum(1 for _ in long) > 0
    final = served_per_replica(d)
    assert sorted(final.get(e, 0) - before.get(e, 0) for e in ("0", "1")) == [1, 3]


MAX = 480  # tokens per stream (the model holds 512): in flight at the kill (a few ms per token here)


def stream_text(client, prompt: str, chunks: list[str] | None = None, started: threading.Event | None = None) -> str:
    parts = [] if chunks is None else chunks
    for chunk in client.completions.create(model="chat", prompt=prompt, max_tokens=MAX, temperature=0,
                                           extra_body={"ignore_eos": True}, stream=True):
        parts.append(chunk.choices[0].text if chunk.choices else "")
        if started is not None and len(parts) >= 8:
            started.set()
    return "".join(parts)


def test_a_replicas_worker_killed_under_load_costs_no_error_and_its_requests_finish_on_the_other(d):
    client = d.openai(timeout=300)
    prompts = [f"def f{i}(" for i in range(4)]
    expected = {p: stream_text(client, p) for p in prompts}  # unkilled runs (temperature 0)
    victim = d.child("worker:chat@0:0")
    restarts = {m.name: m.restarts for m in d.status().models}["chat@0"]
    results: dict[str, str] = {}
    chunks: dict[str, list[str]] = {p: [] for p in prompts}
    errors: list[BaseException] = []
    started = {p: threading.Event() for p in prompts}

    def run(p: str) -> None:
        try:
            results[p] = stream_text(client, p, chunks[p], started[p])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for p in prompts:
        assert started[p].wait(120), p
    os.kill(victim.pid, signal.SIGKILL)
    at_kill = {p: len(c) for p, c in chunks.items()}
    for t in threads:
        t.join(300)
    back = states(d)["chat@0"]
    assert all(n < MAX for n in at_kill.values()), at_kill  # every stream was in flight at the kill
    assert not errors, errors
    # Every stream finished with the text of an unkilled run, before the killed replica was back:
    # those it ran went on on the other replica at once, not on its restart.
    assert results == expected
    assert back != "ready", "the killed replica was back before its requests finished: they waited for it"
    assert "going on with" in d.log("gateway:0")
    wait_for(lambda: states(d)["chat@0"] == "ready", 180, what="chat@0 back")
    assert {m.name: m.restarts for m in d.status().models}["chat@0"] == restarts + 1
    assert states(d)["chat@1"] == "ready"
    assert_nothing_running(d)


def waiting_metric(d, model: str = "chat") -> float:
    for line in http(d, "GET", "/metrics").text.splitlines():
        if line.startswith(f'servectl_requests_waiting{{model="{model}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_rolling_reload_under_load_holds_nothing_fails_nothing_and_takes_effect(d):
    """Last in this module: it reconfigures the daemon."""
    client = d.openai(timeout=300)
    assert {m.id: m.max_model_len for m in client.models.list().data}["chat"] == 512
    stop = threading.Event()
    errors: list[BaseException] = []
    done = [0]
    waiting: list[float] = []

    def load(i: int) -> None:
        while not stop.is_set():
            try:
                if i % 2:
                    out = client.completions.create(model="chat", prompt=f"{i} def ", max_tokens=32,
                                                    temperature=0)
                    assert out.choices[0].finish_reason == "length"
                else:  # a long stream (that the new max_model_len admits too)
                    chunks = client.completions.create(model="chat", prompt=f"{i} class ", max_tokens=300,
                                                       temperature=0, extra_body={"ignore_eos": True}, stream=True)
                    assert "".join(c.choices[0].text for c in chunks if c.choices)
                done[0] += 1
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    text = d.config_path.read_text().replace('engine_args = { dtype = "float32" }',
                                              'engine_args = { dtype = "float32", max_model_len = 384 }')
    d.config_path.write_text(text)
    reload = threading.Thread(target=lambda: waiting.append(d.cli("reload")))
    reload.start()
    samples = []
    while reload.is_alive():
        samples.append(waiting_metric(d))
        reload.join(0.2)
    stop.set()
    for t in threads:
        t.join(300)
    out = waiting[0]
    assert out.returncode == 0, out
    assert "chat rolled" in out.stdout + out.stderr, out
    assert not errors, errors
    assert done[0] > 0 and samples and max(samples) == 0, samples  # nothing was held meanwhile
    assert {m.id: m.max_model_len for m in client.models.list().data}["chat"] == 384
    assert len([g for g in states(d) if g.startswith("chat@")]) == 2
    assert all(s == "ready" for g, s in states(d).items() if g.startswith("chat@")), states(d)
    assert_nothing_running(d)
