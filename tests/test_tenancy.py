"""Many teams on one server (issue 58), against a real daemon at --gateways 2 and real clients.

Named keys with limits that hold for the whole server (a concurrency limit of 1: the second
concurrent request is a 429 whichever gateway takes it; a tokens-per-minute limit with
OpenAI's headers, as the `openai` SDK reads them), a key's models enforced on every API
route, the fair share of a saturated model (asserted on the order requests started, not on
times), and usage per key equal to the sum of what the responses reported, through a
gateway SIGKILL and a daemon restart (the module's last test: it restarts the daemon).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from conftest import DEFAULT_MODEL_DIR, DaemonFactory, http, wait_for

ADMIN = "sk-admin-tenancy"
# Each named key's settings beyond its name and key.
SETTINGS = {"usage": 'models = ["default"]', "ledger": 'models = ["default"]', "alpha": "max_concurrent_requests = 1",
            "beta": "tokens_per_minute = 40", "gamma": 'models = ["second"]', "flood": "", "solo": ""}
KEYS = {name: f"sk-{name}-0123456789" for name in SETTINGS}
USAGE = "/servectl/v1/usage"
CONFIG = f"""[manager]
warm_standby = false
backoff_initial_s = 0.3
[gateway]
admin_keys = ["{ADMIN}"]
""" + "".join(f'[[gateway.keys]]\nname = "{name}"\nkey = "{KEYS[name]}"\n{extra}\n' for name, extra in SETTINGS.items()) + f"""[[models]]
name = "default"
model = "{DEFAULT_MODEL_DIR}"
[models.engine_args]
max_num_seqs = 4
[[models]]
name = "second"
model = "{DEFAULT_MODEL_DIR}"
autostart = false
"""


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    with DaemonFactory(tmp_path_factory, "tenancy") as make:
        yield make(CONFIG, args=["--gateways", "2"])


def completion(d, key: str, max_tokens: int = 4, **extra):
    return http(d, "POST", "/v1/completions", {"model": "default", "prompt": "def ", "max_tokens": max_tokens,
                                                "temperature": 0, **extra}, key=KEYS[key])


def usage(d, since: float | None = None) -> dict[tuple[str, str], dict]:
    r = http(d, "GET", USAGE + (f"?since={since}" if since is not None else ""), key=ADMIN)
    assert r.status == 200, r.text
    return {(row["key"], row["model"]): row for row in r.json()["data"]}


def access_lines(d, gateway: int, key: str) -> list[str]:
    return [line for line in d.log(f"gateway:{gateway}").splitlines() if line.endswith(f" key={key}")]


class Stream(threading.Thread):
    """A streaming completion read chunk by chunk; ``started`` once its first token came."""

    def __init__(self, d, key: str, max_tokens: int, order: list | None = None, lock=None, n: int = 1):
        super().__init__(daemon=True)
        body = json.dumps({"model": "default", "prompt": "def ", "max_tokens": max_tokens, "stream": True,
                           "ignore_eos": True, "temperature": 0 if n == 1 else 1.0, "n": n}).encode()
        self.req = urllib.request.Request(f"{d.base_url}/v1/completions", data=body, method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {KEYS[key]}"})
        self.key, self.order, self.lock = key, order, lock
        self.started = threading.Event()
        self.stop = threading.Event()
        self.status: int | None = None
        self.chunks = 0

    def run(self) -> None:
        try:
            with urllib.request.urlopen(self.req, timeout=300) as resp:
                self.status = resp.status
                for line in resp:
                    if line.startswith(b"data: {"):
                        self.chunks += 1
                        if not self.started.is_set():
                            if self.order is not None:
                                with self.lock:
                                    self.order.append(self.key)
                            self.started.set()
                    if self.stop.is_set():
                        return  # the client goes away mid-stream
                if self.order is not None:
                    with self.lock:
                        self.order.append(f"{self.key}:end")
        except urllib.error.HTTPError as exc:
            self.status = exc.code
        finally:
            self.started.set()


def test_a_concurrency_limit_of_one_holds_across_both_gateways(d):
    import openai

    held: Stream | None = None
    refused = []

    # Each request on a new connection: the kernel hands it to either gateway. Until both have
    # refused one (the limit is the server's, not a gateway's), with a stream of alpha's always
    # holding its one slot (a new one once the last ends).
    def both_refused() -> bool:
        nonlocal held
        if held is None or not held.is_alive():
            held = Stream(d, "alpha", 480, n=4)
            held.start()
            assert held.started.wait(120) and held.status == 200, held.status
        r = completion(d, "alpha")
        if held.is_alive():  # it held the slot all along
            refused.append(r)
        return all(any(" 429 " in line for line in access_lines(d, gw, "alpha")) for gw in (0, 1))

    wait_for(both_refused, 180, interval=0.02, what="an alpha 429 from each gateway",
             diagnose=lambda: f"{[r.status for r in refused]}")
    assert refused and {r.status for r in refused} == {429}
    err = refused[0].json()["error"]
    assert err["code"] == "rate_limit_exceeded" and "max_concurrent_requests = 1" in err["message"]
    assert int(refused[0].headers["Retry-After"]) >= 1
    if held.is_alive():
        with pytest.raises(openai.RateLimitError):
            d.openai(api_key=KEYS["alpha"]).completions.create(model="default", prompt="x", max_tokens=2)
    held.stop.set()  # the client goes away: its slot is given back
    held.join(120)
    wait_for(lambda: completion(d, "alpha").status == 200, 60, interval=0.2, what="alpha's slot back")
    # Another key is not held to alpha's limit.
    assert completion(d, "usage").status == 200


def test_a_tokens_per_minute_limit_answers_as_openai_does(d):
    import openai

    client = d.openai(api_key=KEYS["beta"])
    first = client.completions.with_raw_response.create(model="default", prompt="def ", max_tokens=20,
                                                        temperature=0, extra_body={"ignore_eos": True})
    assert first.headers["x-ratelimit-limit-tokens"] == "40"
    assert first.headers["x-ratelimit-remaining-tokens"] == "40"
    used = first.parse().usage.total_tokens
    second = client.completions.with_raw_response.create(model="default", prompt="def ", max_tokens=20,
                                                         temperature=0, extra_body={"ignore_eos": True})
    assert second.headers["x-ratelimit-remaining-tokens"] == str(40 - used)
    with pytest.raises(openai.RateLimitError) as info:  # the window now holds more than 40
        client.completions.create(model="default", prompt="def ", max_tokens=2)
    headers = info.value.response.headers
    assert headers["x-ratelimit-remaining-tokens"] == "0" and 1 <= int(headers["retry-after"]) <= 60
    assert info.value.body["code"] == "rate_limit_exceeded" and "tokens per minute" in info.value.body["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ("/v1/responses", {"input": "x", "max_output_tokens": 2}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "x"}]}),
    ("/v1/embeddings", {"input": "x"}),
    ("/pooling", {"input": "x"}),
    ("/tokenize", {"prompt": "x"}),
    ("/detokenize", {"tokens": [1, 2]}),
])
def test_a_keys_models_are_enforced_on_every_route(d, path, body):
    r = http(d, "POST", path, {"model": "default", **body}, key=KEYS["gamma"])
    assert r.status == 403, r.text
    error = r.json()["error"]
    assert "may not use model 'default'" in error["message"]
    if path.startswith("/v1/messages"):
        assert error["type"] == "permission_error"  # Anthropic's shape
    else:
        assert error["code"] == "model_not_allowed"
    # The same request with a key that may use it is not refused for its model.
    assert http(d, "POST", path, {"model": "default", **body}, key=KEYS["usage"]).status != 403


def test_a_key_lists_only_its_models(d):
    listed = [m["id"] for m in http(d, "GET", "/v1/models", key=KEYS["gamma"]).json()["data"]]
    assert listed == ["second"]
    assert sorted(m["id"] for m in http(d, "GET", "/v1/models", key=KEYS["usage"]).json()["data"]) == ["default"]
    assert sorted(m["id"] for m in http(d, "GET", "/v1/models", key=KEYS["flood"]).json()["data"]) == \
        ["default", "second"]


def waiting(d) -> float:
    for line in http(d, "GET", "/metrics", key=None).text.splitlines():
        if line.startswith("vllm:num_requests_waiting{") and 'model_name="default"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_saturated_model_is_shared_between_keys_not_first_come_first_served(d):
    """The model runs 4 sequences at once; key "flood" sends 12 long streams, then key "solo" one:
    solo's starts before any of flood's ends (its better priority takes a running one's slot,
    engine_core/slot_preemption.py) and before at least 6 of flood's (first come first served
    would start it last). With two gateways each counting its own, flood's first request on each
    has solo's priority 0, and its second on one gateway can take a slot from its fourth on the
    other: at most 6 of flood's ever start before solo, and four running hold one worse than 0."""
    order: list[str] = []
    lock = threading.Lock()
    flood = [Stream(d, "flood", 256, order, lock) for _ in range(12)]
    for s in flood:
        s.start()
    wait_for(lambda: len(order) >= 4 and waiting(d) >= 8, 120, interval=0.05,
             what="4 of flood's requests started, 8 waiting in the engine",
             diagnose=lambda: f"waiting {waiting(d)}, started {order}")
    solo = Stream(d, "solo", 8, order, lock)
    solo.start()
    for s in (*flood, solo):
        s.join(300)
    assert [s.status for s in (*flood, solo)] == [200] * 13
    assert sorted(order) == ["flood"] * 12 + ["flood:end"] * 12 + ["solo"] + ["solo:end"]
    assert "flood:end" not in order[:order.index("solo")], order
    assert order[order.index("solo"):].count("flood") >= 6, order


def test_a_reload_changes_a_keys_limit_without_dropping_a_request(d):
    """alpha's limit raised to 2 by `servectl reload` while one of its streams runs: the stream
    finishes whole, and a second concurrent one is admitted, a third refused. An API key on an
    admin route is audited by its name."""
    running = Stream(d, "alpha", 400)
    running.start()
    assert running.started.wait(120) and running.status == 200
    d.config_path.write_text(CONFIG.replace("max_concurrent_requests = 1", "max_concurrent_requests = 2"))
    d.cli("reload", check=True, timeout=120)
    second = Stream(d, "alpha", 400)
    second.start()
    assert second.started.wait(120) and second.status == 200, "the raised limit admits a second"
    if running.is_alive() and second.is_alive():
        assert completion(d, "alpha").status == 429
    for s in (running, second):
        s.join(120)
    assert (running.status, running.chunks, second.chunks) == (200, 400, 400)
    assert http(d, "GET", "/servectl/v1/models", key=KEYS["alpha"]).status == 403
    denied = d.runtime_dir / "state" / "audit-denied.log"
    wait_for(lambda: denied.exists() and '"alpha"' in denied.read_text(), 30, what="the refusal audited by name")
    assert KEYS["alpha"] not in denied.read_text()


def test_usage_per_key_equals_the_responses_and_survives_a_gateway_kill_and_a_restart(d):
    import anthropic

    since = time.time()
    client = d.openai(api_key=KEYS["ledger"])
    prompt = completion_tokens = requests = 0

    def add(usage_prompt: int, usage_completion: int) -> None:
        nonlocal prompt, completion_tokens, requests
        prompt, completion_tokens, requests = prompt + usage_prompt, completion_tokens + usage_completion, requests + 1

    def some_requests() -> None:
        u = client.completions.create(model="default", prompt="def add(a, b):", max_tokens=6, temperature=0).usage
        add(u.prompt_tokens, u.completion_tokens)
        u = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=5, temperature=0).usage
        add(u.prompt_tokens, u.completion_tokens)
        chunks = list(client.chat.completions.create(model="default", messages=[{"role": "user", "content": "yo"}],
                                                     max_tokens=7, stream=True, stream_options={"include_usage": True}))
        add(chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens)
        u = client.responses.create(model="default", input="hello", max_output_tokens=5, temperature=0).usage
        add(u.input_tokens, u.output_tokens)
        claude = anthropic.Anthropic(base_url=d.base_url, api_key=KEYS["ledger"], max_retries=0)
        u = claude.messages.create(model="default", max_tokens=4, messages=[{"role": "user", "content": "hey"}]).usage
        add(u.input_tokens, u.output_tokens)

    def matches() -> bool:
        row = usage(d, since).get(("ledger", "default"))
        return row is not None and (row["requests"], row["prompt_tokens"], row["completion_tokens"],
                                    row["errors"]) == (requests, prompt, completion_tokens, 0)

    some_requests()
    wait_for(matches, 30, interval=0.1, what="usage equal to the responses'", diagnose=lambda: str(usage(d, since)))
    # A refused model is counted as an error of that key and model; the key's other counts stand.
    assert http(d, "POST", "/v1/completions", {"model": "second", "prompt": "x"}, key=KEYS["ledger"]).status == 403
    wait_for(lambda: usage(d, since).get(("ledger", "second"), {}).get("errors") == 1, 30, what="the 403 counted")

    # A gateway SIGKILLed: what it had counted stays, and its successor counts on.
    gw = d.child("gateway:0")
    os.kill(gw.pid, signal.SIGKILL)
    wait_for(lambda: d.child("gateway:0").state == "ready" and d.child("gateway:0").pid != gw.pid, 60,
             what="gateway:0 replaced")
    some_requests()
    wait_for(matches, 30, interval=0.1, what="usage after the gateway kill", diagnose=lambda: str(usage(d, since)))

    # The whole daemon restarted: the counts are read back from the state directory.
    d.cli("stop", check=True, timeout=120)
    d.start()
    assert matches(), usage(d, since)
    metrics = http(d, "GET", "/metrics", key=None).text
    assert f'servectl_key_completion_tokens_total{{key="ledger",model="default"}} {completion_tokens}' in metrics
    assert 'servectl_key_errors_total{key="ledger",model="second"} 1' in metrics
    # The CLI says the same.
    out = json.loads(d.cli("usage", "--since", str(since), "--json", check=True).stdout)
    row = next(r for r in out["data"] if (r["key"], r["model"]) == ("ledger", "default"))
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (requests, prompt, completion_tokens)
