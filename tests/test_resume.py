"""Issue 14: a crash costs clients latency, not errors (real engine, real kills).

One daemon serves the bundled model. Each scenario warms the engine up, starts
8 concurrent requests (chat and completions, streaming and not, n=2,
logprobs, a stop string, ignore_eos), waits until at least 4 tokens of every
choice reached every streaming client, then kills: the worker (SIGKILL), the
engine (SIGKILL), the worker again (SIGSTOP: a hang, found at the deadline
the engine derived from its step times). Every request must then finish as if
nothing happened: no error, exactly max_tokens tokens per choice, one
logprobs entry per token, and each stream's text before the kill a prefix of
its final text.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from http.client import HTTPConnection

import pytest

from bench.run import sse_events
from conftest import DaemonFactory, assert_nothing_running, http, wait_for

MAX = 150
MESSAGES = [{"role": "user", "content": "Write a Python function."}]
REQUESTS = {
    "c-stream": ("/v1/completions", {"prompt": "def ", "temperature": 0, "stream": True}),
    "c-stream-n2-logprobs": ("/v1/completions", {"prompt": "import ", "n": 2, "temperature": 0.8, "logprobs": 2,
                                                 "stream": True}),
    "c-stream-stop": ("/v1/completions", {"prompt": "class ", "temperature": 0, "stream": True,
                                          "stop": ["never in this text, 20+ characters long"]}),
    "c-whole-n2": ("/v1/completions", {"prompt": "for ", "n": 2, "temperature": 0.7}),
    "c-whole-echo-logprobs": ("/v1/completions", {"prompt": "x = ", "temperature": 0, "logprobs": 1,
                                                  "echo": True}),
    "chat-stream-logprobs": ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 0, "logprobs": True,
                                                      "top_logprobs": 2, "stream": True}),
    "chat-stream-n2": ("/v1/chat/completions", {"messages": MESSAGES, "n": 2, "temperature": 1.0,
                                                "stream": True}),
    "chat-whole": ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 0}),
}


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    with DaemonFactory(tmp_path_factory, "resume") as make:
        yield make("[gateway]\nhold_timeout_s = 120\n[manager]\nfreeze_grace_s = 1\nbackoff_initial_s = 0.3\n")


class Client(threading.Thread):
    """One request, run to its end; a stream records per choice what arrived and when."""

    def __init__(self, d, name: str):
        super().__init__(daemon=True, name=name)
        path, body = REQUESTS[name]
        self.d, self.name, self.path = d, name, path
        self.stream = bool(body.get("stream"))
        self.body = {"model": "default", "max_tokens": MAX, "ignore_eos": True, **body}
        if self.stream:
            self.body["stream_options"] = {"include_usage": True}
        self.n = self.body.get("n", 1)
        self.texts = {i: [] for i in range(self.n)}  # per choice, in order
        self.tokens = dict.fromkeys(range(self.n), 0)  # chunks carrying a choice's tokens
        self.logprobs = dict.fromkeys(range(self.n), 0)
        self.finish: dict[int, str] = {}
        self.usage = None
        self.errors: list = []
        self.result = None
        self.started = threading.Event()  # every choice has 4 tokens (streams only)

    def run(self) -> None:
        try:
            if self.stream:
                self._stream()
            else:
                self.result = http(self.d, "POST", self.path, self.body, timeout=600)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(repr(exc))
        finally:
            self.started.set()

    def _stream(self) -> None:
        conn = HTTPConnection("127.0.0.1", self.d.port, timeout=600)
        headers = {"Content-Type": "application/json"}
        if self.d.api_key:
            headers["Authorization"] = f"Bearer {self.d.api_key}"
        conn.request("POST", self.path, json.dumps(self.body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            self.errors.append((resp.status, resp.read()[:300]))
            return
        for event in sse_events(resp):
            if "error" in event:
                self.errors.append(event["error"])
                continue
            if event.get("usage"):
                self.usage = event["usage"]
            for c in event["choices"]:
                i = c["index"]
                if "delta" in c:
                    if "role" in c["delta"]:
                        continue  # a chat stream's opening chunk (the role), no token
                    text = c["delta"].get("content") or ""
                    entries = (c.get("logprobs") or {}).get("content") or []
                else:
                    text = c["text"]
                    entries = (c.get("logprobs") or {}).get("tokens") or []
                self.texts[i].append(text)
                self.tokens[i] += 1
                self.logprobs[i] += len(entries)
                if c.get("finish_reason"):
                    self.finish[i] = c["finish_reason"]
            if all(t >= 4 for t in self.tokens.values()):
                self.started.set()
        conn.close()

    def text(self, i: int) -> str:
        return "".join(self.texts[i])


def warm_up(d) -> float:
    """Enough steps for the engine to derive its deadline; returns it (as /metrics publishes it)."""
    r = http(d, "POST", "/v1/completions", {"model": "default", "prompt": "def ", "max_tokens": 40,
                                            "ignore_eos": True})
    assert r.status == 200, r.body

    def deadline():
        for line in http(d, "GET", "/metrics", key=None).text.splitlines():
            if line.startswith('servectl_engine_step_deadline_seconds{model="default"}'):
                return float(line.rsplit(" ", 1)[1])
        return None

    return wait_for(deadline, 60, interval=0.2, what="the engine's step deadline published")


def check(clients: list[Client], before: dict[str, dict[int, str]]) -> None:
    for c in clients:
        assert not c.errors, (c.name, c.errors)
        if c.stream:
            assert c.usage and c.usage["completion_tokens"] == MAX * c.n, (c.name, c.usage)
            for i in range(c.n):
                assert c.tokens[i] == MAX, (c.name, i, c.tokens[i])  # one chunk per token: none repeated or lost
                assert c.finish[i] == "length", (c.name, c.finish)
                assert c.text(i).startswith(before[c.name][i]), (c.name, i, before[c.name][i], c.text(i))
                if c.body.get("logprobs"):
                    assert c.logprobs[i] == MAX, (c.name, i, c.logprobs[i])
        else:
            assert c.result.status == 200, (c.name, c.result.status, c.result.body[:300])
            body = c.result.json()
            assert body["usage"]["completion_tokens"] == MAX * c.n, (c.name, body["usage"])
            assert [ch["finish_reason"] for ch in body["choices"]] == ["length"] * c.n, c.name
            for ch in body["choices"]:
                lp = ch.get("logprobs")
                if lp and "tokens" in lp:  # completions, echo: the prompt's entries come first
                    assert len(lp["tokens"]) == body["usage"]["prompt_tokens"] + MAX, c.name
                elif lp:
                    assert len(lp["content"]) == MAX, c.name


def run_killing(d, component: str, sig: int) -> tuple[dict, float]:
    """8 requests; ``sig`` to ``component`` once every stream has 4 tokens per choice; all checked.
    Returns the pids before and the seconds from the signal until the model served again."""
    d.wait_standbys_warm(2)
    clients = [Client(d, name) for name in REQUESTS]
    for c in clients:
        c.start()
    for c in clients:
        if c.stream:
            assert c.started.wait(300), f"{c.name}: no 4 tokens"
    assert all(not c.errors for c in clients), [c.errors for c in clients]
    before = {c.name: {i: c.text(i) for i in range(c.n)} for c in clients if c.stream}
    unfinished = [c.name for c in clients if c.is_alive()]
    pids = {ch.component: ch.pid for ch in d.status().children}
    os.kill(pids[component], sig)
    killed_at = time.monotonic()
    wait_for(lambda: d.child("engine_core:default").pid != pids["engine_core:default"]
             and next(m.state for m in d.status().models if m.name == "default") == "ready", 300, interval=0.1,
             what="the group restarted", diagnose=lambda: d.log_tails("manager", "engine_core:default"))
    back_in = time.monotonic() - killed_at
    for c in clients:
        c.join(600)
        assert not c.is_alive(), c.name
    assert unfinished, "every request finished before the kill: nothing was tested"
    check(clients, before)
    assert "going on with" in d.log("gateway:0"), d.log_tails("gateway:0")
    assert_nothing_running(d)
    return pids, back_in


def test_worker_sigkill_mid_requests_costs_no_errors(d):
    warm_up(d)
    run_killing(d, "worker:default:0", signal.SIGKILL)


def test_engine_sigkill_mid_requests_costs_no_errors(d):
    warm_up(d)
    run_killing(d, "engine_core:default", signal.SIGKILL)


def test_a_hung_worker_is_found_at_the_derived_deadline_and_costs_no_errors(d):
    deadline = warm_up(d)
    assert deadline <= 30, f"the step deadline after warm-up is {deadline}s, not well below the generous 120 s"
    pids, back_in = run_killing(d, "worker:default:0", signal.SIGSTOP)
    log = d.log("engine_core:default")
    assert "gave no reply to" in log and "the group is hung" in log, d.log_tails("engine_core:default")
    assert back_in < deadline + 60, back_in  # found at the deadline, not at worker_reply_timeout_s
    assert not os.path.exists(f"/proc/{pids['worker:default:0']}")  # the stopped worker was killed
    print(f"\nSIGSTOP of the worker to serving again: {back_in:.1f}s (step deadline {deadline:g}s)")
