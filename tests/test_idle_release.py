"""Issue 18 end to end (CPU, the real engine): idle release, wake on demand, start on first use,
vLLM's metrics on /metrics.

One daemon serves one model, ``lazy``: ``autostart = false`` (started by its
first request), released after 2.5 s idle, configured ``idle_release =
"sleep"`` (on CPU vLLM has no sleep mode: it falls back to unload), and its
own ``hold_timeout_s`` (the gateway's is 5 s: a cold start here takes far
longer). The tests run in order and share it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import DaemonFactory, EventStream, context_switches, http, wait_for
from servectl.config import DEFAULT_MODEL_DIR
from servectl.proc import rss_bytes

MODEL = "lazy"
RELEASE_S = 2.5
CONFIG = f"""
[gateway]
hold_timeout_s = 5           # the model's own is long: a cold start here takes minutes
[manager]
freeze_grace_s = 0.5
[[models]]
name = "{MODEL}"
model = "{DEFAULT_MODEL_DIR}"
autostart = false
idle_release_s = {RELEASE_S}
idle_release = "sleep"        # CPU: no sleep mode in vLLM, so unload (warned at load)
hold_timeout_s = 600
"""
PROMPT = {"model": MODEL, "prompt": "def ", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
seen: dict[str, object] = {}  # what one test leaves the next (they run in order)


@pytest.fixture(scope="module")
def lazy(tmp_path_factory):
    with DaemonFactory(tmp_path_factory, "idle") as make:
        yield make(CONFIG)


def model_status(d):
    return next(m for m in d.status().models if m.name == MODEL)


def members(d) -> dict[str, object]:
    return {c.component: c for c in d.status().children if c.model == MODEL}


def complete(d, body=PROMPT, timeout: float = 600):
    r = http(d, "POST", "/v1/completions", body, timeout=timeout)
    assert r.status == 200, r.text
    return r.json()


def tree_rss(d) -> int:
    return sum(rss_bytes(pid) for pid in d.tree())


def engine_families(d) -> dict:
    text = http(d, "GET", "/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(families: dict, name: str, suffix: str = "") -> float | None:
    fam = families.get(name)
    values = [s.value for s in fam.samples if s.name == name + suffix and s.labels.get("model_name") == MODEL] \
        if fam else []
    return sum(values) if values else None


def wait_released(d, timeout: float = 60) -> None:
    wait_for(lambda: model_status(d).state == "released", timeout, interval=0.2, what=f"{MODEL} released",
             diagnose=lambda: d.log_tails("manager", f"engine_core:{MODEL}"))


class KeepAlive:
    """One tiny request a second: the model never reaches its idle_release_s meanwhile."""

    def __init__(self, d):
        self.d = d
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop.wait(1.0):
            r = http(self.d, "POST", "/v1/completions", {**PROMPT, "max_tokens": 1}, timeout=120)
            if r.status != 200:
                self.errors.append(r.text)

    def __enter__(self) -> "KeepAlive":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(130)


def test_autostart_false_is_listed_and_started_by_its_first_request(lazy):
    st = model_status(lazy)
    assert st.state == "released" and "autostart" in st.reason
    assert all(c.pid is None for c in members(lazy).values())  # no engine, no worker, no standby yet
    models = http(lazy, "GET", "/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["state"]) for m in models] == [(MODEL, "released")]
    assert http(lazy, "GET", "/health", timeout=10).status == 200  # released is available: it will be served
    assert "vllm:" not in http(lazy, "GET", "/metrics", timeout=10).text
    # The first request is held (well past the gateway's 5 s) while the model starts, then answered.
    out = complete(lazy)
    assert out["usage"]["completion_tokens"] == 8
    seen["text"] = out["choices"][0]["text"]
    # A configured sleep on CPU: unload, said at load.
    assert model_status(lazy).release_mode == "unload"
    assert "vLLM has no sleep mode on this platform" in lazy.log(f"engine_core:{MODEL}")


def stream_with_a_scrape(d, n: int) -> tuple[int, float | None]:
    """One streaming request of n tokens; /metrics is read once its first token has come (mid-request).

    Returns the tokens streamed and vllm:num_requests_running as that scrape saw it."""
    import json
    import urllib.request

    body = json.dumps({**PROMPT, "max_tokens": n, "stream": True, "stream_options": {"include_usage": True}})
    req = urllib.request.Request(f"{d.base_url}/v1/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    running = None
    tokens = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif running is None:
                running = sample(engine_families(d), "vllm:num_requests_running")
    return tokens, running


def test_engine_metrics_under_vllms_names(lazy):
    n = 128
    for attempt in range(3):
        with KeepAlive(lazy):  # (it also wakes the model if it was released meanwhile)
            wait_for(lambda: model_status(lazy).state == "ready", 600, what="ready")
        # Within idle_release_s of the last keep-alive: the counter before, then one request of n tokens.
        fams = engine_families(lazy)
        engine = members(lazy)[f"engine_core:{MODEL}"].pid
        before = sample(fams, "vllm:generation_tokens", "_total")
        tokens, running = stream_with_a_scrape(lazy, n)
        after = sample(engine_families(lazy), "vllm:generation_tokens", "_total")
        if members(lazy)[f"engine_core:{MODEL}"].pid == engine and before is not None:
            break  # (else it was released in between, and the counters restarted with the engine: again)
    else:
        pytest.fail("the model was released between the measurements three times")
    assert tokens == n
    assert running is not None and running >= 1, f"vllm:num_requests_running mid-request: {running}"
    assert after - before == n
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:num_preemptions",
                 "vllm:request_queue_time_seconds", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:engine_sleep_state", "vllm:generation_tokens", "servectl_requests"):
        assert name in fams, name
    assert {s.labels["model_name"] for s in fams["vllm:num_requests_running"].samples} == {MODEL}
    # Released: the model's vLLM figures are gone (no stale gauges); servectl's own stay.
    wait_released(lazy)
    text = http(lazy, "GET", "/metrics", timeout=10).text
    assert "vllm:" not in text and "servectl_requests_total" in text


def test_idle_model_is_released_and_woken_on_demand(lazy):
    with KeepAlive(lazy) as alive:
        wait_for(lambda: model_status(lazy).state == "ready", 600, what="ready")
        warm = lazy.wait_standbys_warm(2, timeout=600)
        events = EventStream(lazy, MODEL)
        serving = members(lazy)
        rss_serving = tree_rss(lazy)
        st = model_status(lazy)
        assert st.memory_bytes > 0 and st.release_after_s == RELEASE_S
    assert not alive.errors
    try:
        # Idle past idle_release_s: the engine says so, the manager stops the group, the standbys stay.
        events.until(lambda ev: any(e.component == f"model:{MODEL}" and e.state == "released" for e in ev), 60,
                     what="the release's events")
    finally:
        events.close()
    states = [e.state for e in events.seen if e.component == f"model:{MODEL}"]
    assert states[-3:] == ["releasing", "stopping", "released"]
    st = model_status(lazy)
    assert st.state == "released" and st.memory_bytes == 0 and st.released_since is not None
    for component in (f"engine_core:{MODEL}", f"worker:{MODEL}:0"):
        assert members(lazy)[component].pid is None
        assert rss_bytes(serving[component].pid) == 0, component  # gone
    standbys = lazy.standbys()
    assert {k: v.pid for k, v in standbys.items()} == {k: v.pid for k, v in warm.items()}
    rss_released = tree_rss(lazy)
    assert rss_released < rss_serving - 200 * 2**20, (rss_serving, rss_released)
    assert "released" in lazy.cli("status").stdout
    # The next request is held, the model woken on its standbys (no `import vllm`), the same answer.
    out = complete(lazy)
    assert out["choices"][0]["text"] == seen["text"]
    assert members(lazy)[f"engine_core:{MODEL}"].pid == warm[f"engine_core:{MODEL}"].pid
    # And released again.
    wait_released(lazy)


def test_requests_arriving_during_the_release_are_served(lazy):
    """A request is sent on each step of a release: it is served by the engine (the release is
    refused), or bounced and held, or held by the gateway, and answered after the wake."""
    with KeepAlive(lazy):
        wait_for(lambda: model_status(lazy).state == "ready", 600, what="ready")
        events = EventStream(lazy, MODEL)
    pool = ThreadPoolExecutor(2)
    sent: dict[str, object] = {}
    try:
        def on_release_steps(ev) -> bool:
            for state in ("releasing", "stopping"):
                if state not in sent and any(e.component == f"model:{MODEL}" and e.state == state for e in ev):
                    sent[state] = pool.submit(complete, lazy)
            return len(sent) == 2

        events.until(on_release_steps, 300, what="a release to send requests into")
    finally:
        events.close()
    answers = [f.result(timeout=600) for f in sent.values()]
    pool.shutdown()
    assert [a["choices"][0]["text"] for a in answers] == [seen["text"]] * 2
    wait_released(lazy)
    # No request of this module failed (the keep-alives included).
    text = http(lazy, "GET", "/metrics", timeout=10).text
    failed = [s for f in text_string_to_metric_families(text) if f.name == "servectl_requests"
              for s in f.samples if s.name == "servectl_requests_total" and s.labels["endpoint"] == "/v1/completions"
              and s.labels["status"] != "200" and s.value > 0]
    assert failed == []


def test_a_released_model_makes_no_wake_ups(lazy):
    wait_released(lazy)
    lazy.wait_standbys_warm(2, timeout=600)
    pids = [lazy.manager_pid] + [c.pid for c in lazy.status().children if c.pid]
    before = context_switches(pids)
    time.sleep(5)  # the measurement: what the idle tree does over a fixed window
    quiet = context_switches(pids) - before
    assert quiet <= 25, f"{quiet} context switches in 5 s with {MODEL} released"
