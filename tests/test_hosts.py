"""Several hosts behind vllm-router, in miniature (issue 37; docs/operations.md, "Several hosts").

Network namespaces stand in for hosts (tests/netns.py): one servectl daemon in each of two
(the bundled model, CPU, no standbys), `vllm-router` (the PyPI package, `cache_aware`, checking
each host's `/ready?model=default` every second) and the clients in a third. Host 1 also serves
`broken`, a model whose engine dies at every start: it fails, and the router, asking about
`default` only, sends there all the same. Traffic stays inside the namespaces; they, their
links and every process in them are removed whatever the outcome.

Needs root (CI runs as root: there a skip is a failure).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import DEFAULT_MODEL_DIR, NamespaceDaemon, http, wait_for
from netns import Load, Router, Topology, stream

TESTS = os.path.dirname(os.path.abspath(__file__))
PORT = 8000

pytestmark = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="network namespaces need root")


def host_config(ip: str, broken: bool) -> str:
    config = f"""[gateway]
host = "{ip}"
port = {PORT}
hold_timeout_s = 120
[manager]
warm_standby = false
unready_grace_s = 2
backoff_initial_s = 0.3
backoff_max_s = 1
step_deadline_floor_s = 120  # a worker stopped on purpose (SIGSTOP) is not hung
[[models]]
name = "default"
model = "{DEFAULT_MODEL_DIR}"
"""
    if broken:  # its engine dies of SIGSEGV at every start (tests/crash_engine.py): failed at once
        config += f"""[[models]]
name = "broken"
model = "{DEFAULT_MODEL_DIR}"
crash_loop_count = 1
env = {{ SERVECTL_ENGINE_FACTORY = "crash_engine:build", PYTHONPATH = "{TESTS}" }}
"""
    return config


class HostDaemon(NamespaceDaemon):
    def __init__(self, tmp, topo: Topology, index: int, **kw):
        super().__init__(tmp, topo, index, host_config(topo.host_ip[index], broken=index == 0), **kw)


class Hosts:
    def __init__(self, topo: Topology, daemons: list[HostDaemon], router: Router):
        self.topo = topo
        self.daemons = daemons
        self.router = router
        self.prefixes: dict[str, int] = {}  # a gateway's request-id prefix -> host index

    @property
    def url(self) -> str:
        return self.router.url

    def healthy(self) -> set[str]:
        return self.router.healthy()

    def workers(self) -> list[dict]:
        return self.router.workers()

    def host_of(self, response_id: str) -> int:
        return self.prefixes[response_id.split("-", 1)[1].rsplit("-", 1)[0]]

    def learn_prefixes(self) -> None:
        """Which host answered a response: its gateway's request-id prefix, learnt directly."""
        for i, d in enumerate(self.daemons):
            r = http(d.base_url, "POST", "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 1},
                     key=None)
            assert r.status == 200, r.text
            self.prefixes[r.json()["id"].split("-", 1)[1].rsplit("-", 1)[0]] = i


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    if shutil.which("vllm-router") is None:
        pytest.fail("vllm-router is not installed (pip install -e '.[test]')")
    topo = Topology(f"sct{os.getpid() % 10000}", 2).up()
    daemons: list[HostDaemon] = []
    router = None
    try:
        for i in range(2):
            d = HostDaemon(tmp_path_factory.mktemp(f"host{i + 1}"), topo, i)
            daemons.append(d)
            d.start(expect_ok=i != 0)  # host 1: `broken` fails, and `servectl start` says so
        # The router asks each host about `default` alone: host 1's failed `broken` does not
        # take it out of the rotation (its /ready, for every model, is 503).
        router = Router(topo, [d.base_url for d in daemons], tmp_path_factory.mktemp("router") / "router.log",
                        health_path="/ready?model=default")
        router.start()
        h = Hosts(topo, daemons, router)
        with topo.inside():
            h.learn_prefixes()
            wait_for(lambda: len(h.healthy()) == 2, 30, what="both hosts healthy in the router",
                     diagnose=lambda: f"{h.workers()}\n{router.tail()}")
        yield h
    finally:
        problems = [] if router is None or router.stop() else ["vllm-router did not exit on SIGTERM"]
        for d in daemons:
            try:
                d.stop()
            except Exception as exc:  # noqa: BLE001 - still remove everything and report
                problems.append(f"{d.ns}: stop failed: {exc}")
            left = d.kill_all()
            if left:
                problems.append(f"{d.ns}: processes left after stop (SIGKILLed): {left}")
        left = topo.down()
        assert not topo.exists() and not any(os.path.exists(f"/run/netns/{ns}") for ns in topo.namespaces())
        assert not left, f"processes left in the namespaces: {left}"
        assert not problems, "\n".join(problems)


def complete(h: Hosts, prompt: str, max_tokens: int = 4, **kw) -> dict:
    r = http(h.url, "POST", "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0, **kw}, key=None, timeout=120)
    assert r.status == 200, r.text
    return r.json()


def test_answers_per_state(hosts):
    h1, h2 = hosts.daemons
    with hosts.topo.inside():
        wait_for(lambda: http(h1.base_url, "GET", "/ready?model=broken", key=None).json()["models"]["broken"]
                 ["state"] == "failed", 120, what="broken failed")
        assert http(h1.base_url, "GET", "/live", key=None).status == 200  # a failed model: the host lives
        broken = http(h1.base_url, "GET", "/ready?model=broken", key=None)
        assert broken.status == 503 and broken.json()["models"]["broken"]["ready"] is False, broken.text
        assert http(h1.base_url, "GET", "/ready?model=default", key=None).status == 200  # the other serves
        assert http(h1.base_url, "GET", "/ready", key=None).status == 503  # not every model
        assert http(h1.base_url, "GET", "/health", key=None).status == 503  # /health keeps its meaning
        worker = h2.child("worker:default:0").pid
        os.kill(worker, signal.SIGSTOP)
        try:
            assert http(h2.base_url, "GET", "/live", key=None).status == 200  # a stopped worker: alive
        finally:
            os.kill(worker, signal.SIGCONT)
        # The router asks about `default` only: both hosts are in its rotation.
        assert len(hosts.healthy()) == 2, hosts.workers()


def test_requests_spread_and_follow_their_prefix(hosts):
    with hosts.topo.inside():
        # Four groups of prompts, each sharing a long start (several KV blocks), each request its own end.
        groups = [f"# group {g}: " + " ".join(f"def f{g}_{i}(x): return x * {i}" for i in range(20))
                  for g in range(4)]
        with ThreadPoolExecutor(4) as pool:  # each group's first request at once: spread by load
            firsts = list(pool.map(lambda p: hosts.host_of(complete(hosts, p + " # first", 16)["id"]), groups))
        assert set(firsts) == {0, 1}, f"concurrent distinct prompts all went to host {firsts[0] + 1}"
        followed = 0
        for g, prompt in enumerate(groups):
            for tail in range(4):
                followed += hosts.host_of(complete(hosts, f"{prompt} # tail {tail}")["id"]) == firsts[g]
        assert followed == 16, f"{followed} of 16 requests went where their prefix had gone"
        # A chat through the router (which adds fields of its own to the body) is answered too.
        r = http(hosts.url, "POST", "/v1/chat/completions", {"model": "default", "max_tokens": 4,
                 "messages": [{"role": "user", "content": "hello"}]}, key=None)
        assert r.status == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text


def test_a_stopping_host_finishes_what_reached_it(hosts):
    """Streams in flight on host 2 when its drain begins finish whole. However fast the machine,
    they are: host 2's worker is stopped (SIGSTOP) once both have their first token and resumed
    only once the drain has begun."""
    h1, h2 = hosts.daemons
    tokens = 400  # the bundled model's context is 512
    with hosts.topo.inside():
        with ThreadPoolExecutor(3) as pool, Load(hosts.url, n=2) as load:
            time.sleep(1.0)  # load flowing through the router to both hosts
            outs: list[dict] = [{}, {}]
            direct = [pool.submit(stream, h2.base_url, f"def direct_{i}(x):", tokens, out=outs[i]) for i in range(2)]
            wait_for(lambda: all(o.get("times") for o in outs), 60, interval=0.005,
                     what="the direct streams' first tokens from host 2")
            worker = h2.child("worker:default:0").pid
            os.kill(worker, signal.SIGSTOP)
            try:
                assert not any(o["done"] for o in outs), "a direct stream finished before its worker was stopped"
                stopper = threading.Thread(target=h2.stop)
                stopper.start()
                # /ready fails first (unready_grace_s), then the drain: the router stops sending there.
                wait_for(lambda: len(hosts.healthy()) == 1, 10, what="host 2 out of the router's rotation",
                         diagnose=lambda: str(hosts.workers()))
                wait_for(lambda: "stopping: draining gateways" in h2.log("manager"), 30,
                         what="host 2's drain to begin", diagnose=lambda: h2.log_tails("manager"))
                in_flight = [not o["done"] for o in outs]
            finally:
                os.kill(worker, signal.SIGCONT)
            finished = [f.result(180) for f in direct]
            stopper.join(180)
            time.sleep(1.0)
        assert all(in_flight), "the direct streams were not in flight when the drain began"
        assert all(r["done"] and not r["error"] and len(r["times"]) >= tokens for r in finished), finished
        assert len(load.results) >= 4, load.results
        errors = [r for r in load.results if r["error"] or not r["done"]]
        assert not errors, f"{len(errors)} of {len(load.results)} requests through the router failed: {errors[:3]}"
        # Not even refused and retried by the router: /ready failed before the drain refused anything.
        refused = [line for line in h2.log("gateway:0").splitlines() if re.search(r" POST \S+ 503 ", line)]
        assert not refused, refused
    h2.start()  # back for the next test
    with hosts.topo.inside():
        hosts.learn_prefixes()
        wait_for(lambda: len(hosts.healthy()) == 2, 30, what="host 2 back in the router's rotation")


def test_a_host_killed_under_load_loses_only_its_started_streams(hosts):
    h1, h2 = hosts.daemons
    with hosts.topo.inside():
        with Load(hosts.url, n=4) as load:
            time.sleep(2.0)
            killed_at = time.monotonic()
            os.kill(h1.manager_pid, signal.SIGKILL)  # the host's tree goes with it (PDEATHSIG)
            wait_for(lambda: hosts.healthy() == {h2.base_url}, 10, what="the router to drop host 1",
                     diagnose=lambda: str(hosts.workers()))
            time.sleep(3.0)
        after = [r for r in load.results if r["times"] and r["times"][0] > killed_at + 1.0]
    started_there = [r for r in load.results if r["error"] and r["times"]]
    lost_unstarted = [r for r in load.results if (r["error"] or not r["done"]) and not r["times"]]
    assert not lost_unstarted, f"{len(lost_unstarted)} request(s) that had not started failed: {lost_unstarted[:3]}"
    assert all(r["times"][0] < killed_at + 1.0 for r in started_there), started_there
    assert after and all(hosts.host_of(r["id"]) == 1 for r in after), "requests still went to the dead host"
    wait_for(lambda: not h1.tree(), 30, what="host 1's tree gone with its manager")
