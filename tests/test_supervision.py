"""Issue 3: supervision that heals, tested by killing and stopping real processes.

One daemon serves two models (a, b) through two gateway processes and carries
a third model whose engine crashes at every start (a crash loop; not a load
failure judged permanent, which fails at once: test_operator_errors.py). Every test ends with
the tree accounted for: the module's teardown scans /proc for the instance tag.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from http.client import HTTPConnection

import pytest

from conftest import ROOT, Daemon, DaemonFactory, EventStream, Response, http, json_lines, wait_for
from servectl.config import DEFAULT_MODEL_DIR
from servectl.priority import IOPRIO_CLASS_IDLE, IOPRIO_CLASS_SHIFT, ioprio_of

CONFIG = f"""
[gateway]
processes = 2
hold_timeout_s = 180
output_timeout_s = 10
max_waiting_per_model = 2

[manager]
backoff_initial_s = 0.3
backoff_max_s = 2
crash_loop_count = 10
crash_loop_window_s = 600
worker_reply_timeout_s = 10
freeze_grace_s = 1
stop_grace_s = 5

[[models]]
name = "a"
model = "{DEFAULT_MODEL_DIR}"

[[models]]
name = "b"
model = "{DEFAULT_MODEL_DIR}"
[models.engine_args]
max_num_seqs = 2

[[models]]
name = "broken"
model = "{DEFAULT_MODEL_DIR}"
crash_loop_count = 2
# A restart answers once its crash loop has ended (within the model's hold timeout): two cold
# starts on a loaded machine take longer than the default 60 s.
hold_timeout_s = 600
[models.env]
SERVECTL_ENGINE_FACTORY = "test_supervision:crash_at_load"
PYTHONPATH = "{ROOT / 'tests'}"
"""


def crash_at_load(spec):
    """Model `broken`'s engine (SERVECTL_ENGINE_FACTORY): a crash at every start, as a
    restart might fix (a RuntimeError is not judged permanent)."""
    raise RuntimeError(f"simulated crash while loading {spec.model.name}")


@pytest.fixture(scope="module")
def sup(tmp_path_factory):
    with DaemonFactory(tmp_path_factory, "sup") as make:
        yield make(CONFIG, expect_ok=False)  # `broken` fails: start says so (exit 1), the rest serves


def post(d: Daemon, path: str, body: dict, timeout: float = 300) -> Response:
    return http(d, "POST", path, body, timeout=timeout)


class FirstTokenStream:
    """A streamed completion whose first token has arrived: cut it now, read the rest later."""

    def __init__(self, d: Daemon, body: dict):
        self.conn = HTTPConnection("127.0.0.1", d.port, timeout=300)
        self.conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                          {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.status
        self.first = self.resp.readline()
        assert self.first.startswith(b"data: {") and b'"error"' not in self.first, self.first

    def rest(self) -> str:
        try:
            return (self.first + self.resp.read()).decode()
        finally:
            self.conn.close()


def pids(d: Daemon) -> dict[str, int]:
    return {c.component: c.pid for c in d.status().children}


def priorities(pid: int) -> set[tuple[int, int, int]]:
    """(scheduling policy, nice, I/O class) of each thread of a process (/proc's stat, ioprio_get)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            rest = open(f"/proc/{pid}/task/{tid}/stat").read().rpartition(")")[2].split()
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
        out.add((int(rest[38]), int(rest[16]), ioprio_of(int(tid)) >> IOPRIO_CLASS_SHIFT))  # fields 41 and 19
    return out


def proc_state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]


WARMING = {(os.SCHED_IDLE, 0, IOPRIO_CLASS_IDLE)}  # issue 57: a standby takes only cores nobody wants


def model_state(d: Daemon, name: str) -> str:
    return next(m.state for m in d.status().models if m.name == name)


def test_start_reports_the_crash_looping_model(sup):
    out = sup.start_output
    assert out.returncode != 0
    assert "broken" in out.stderr and "failed" in out.stderr
    st = sup.status()
    states = {m.name: m.state for m in st.models}
    assert states == {"a": "ready", "b": "ready", "broken": "failed"}


def test_crash_loop_is_failed_with_reason_and_503(sup):
    st = sup.status()
    engine = next(c for c in st.children if c.component == "engine_core:broken")
    assert engine.state == "failed"
    assert engine.last_exit and engine.last_exit.startswith("exit code")
    assert engine.restarts == 1  # crash_loop_count = 2 starts, then no more
    # Its last words say why it could not start.
    assert any("simulated crash while loading broken" in line for line in engine.last_log), engine.last_log
    r = post(sup, "/v1/completions", {"model": "broken", "prompt": "x"})
    assert r.status == 503
    err = r.json()["error"]
    assert "failed" in err["message"] and "servectl restart broken" in err["message"]
    # Failed means no more restarts: the count stays put. Nothing signals a
    # restart that does not happen: wait longer than the longest backoff (2 s).
    time.sleep(3)
    assert next(c for c in sup.status().children if c.component == "engine_core:broken").restarts == 1
    cli = sup.cli("status")
    assert cli.returncode == 1 and "broken failed" in cli.stdout


def test_restart_clears_failed(sup):
    engine = sup.child("engine_core:broken")
    assert (model_state(sup, "broken"), engine.state) == ("failed", "failed")
    proc = sup.cli("restart", "broken")
    # It fails again (the path is still wrong), through the whole crash loop
    # again: crash_loop_count = 2 more starts, so 2 more restarts of its engine.
    # The restart answers once that is over, and says it failed (issue 51).
    assert proc.returncode == 1 and "restarted broken, but it failed" in proc.stderr, proc.stdout + proc.stderr
    wait_for(lambda: (lambda c: (c.restarts, c.state))(sup.child("engine_core:broken")) == (engine.restarts + 2, "failed"),
             360, interval=0.5, what="the second crash loop to end",  # two cold starts; slow on a loaded machine
             diagnose=lambda: str(sup.child("engine_core:broken")))
    assert model_state(sup, "broken") == "failed"


def test_worker_sigkill_restarts_the_group_only(sup):
    warm = sup.wait_standbys_warm(4)  # a and b: an engine and a worker each
    for standby in warm.values():
        assert priorities(standby.pid) == WARMING, standby
    before = pids(sup)
    restarts = {c.component: c.restarts for c in sup.status().children}
    client = sup.openai(timeout=300)
    # An in-flight stream of model a, cut after its first token: it goes on on the
    # restarted group (issue 14; tests/test_resume.py has the thorough version).
    stream = FirstTokenStream(sup, {"model": "a", "prompt": "def ", "max_tokens": 200, "ignore_eos": True,
                                    "stream_options": {"include_usage": True}})
    os.kill(before["worker:a:0"], signal.SIGKILL)
    events = json_lines(stream.rest())
    assert not any("error" in e for e in events), events[-2:]
    assert events[-1]["usage"]["completion_tokens"] == 200

    # A request sent while the group restarts is held, then served.
    r = client.completions.create(model="a", prompt="import ", max_tokens=5, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    after = pids(sup)
    assert after["worker:a:0"] != before["worker:a:0"]
    assert after["engine_core:a"] != before["engine_core:a"]
    for keep in ("engine_core:b", "worker:b:0", "gateway:0", "gateway:1"):
        assert after[keep] == before[keep], keep
    assert sup.child("engine_core:a").restarts == restarts["engine_core:a"] + 1
    assert sup.child("worker:a:0").restarts == restarts["worker:a:0"] + 1
    # The restart took the warm standbys (no import paid) ...
    assert after["engine_core:a"] == warm["engine_core:a"].pid
    assert after["worker:a:0"] == warm["worker:a:0"].pid
    assert "handed to its warm standby" in sup.log("manager")
    serving = priorities(sup.manager_pid)
    assert len(serving) == 1 and serving != WARMING
    for member in ("engine_core:a", "worker:a:0"):  # every thread (torch's and OpenMP's too) serves at the manager's
        assert priorities(after[member]) == serving, member
    # ... and new ones stand by once a serves again; b's are untouched.
    again = sup.wait_standbys_warm(4)
    assert again["engine_core:a"].pid != after["engine_core:a"]  # a fresh standby, not the one now serving
    assert again["worker:b:0"].pid == warm["worker:b:0"].pid


def test_a_second_crash_takes_the_standbys_while_they_still_import(sup):
    warm = {c.pid for c in sup.wait_standbys_warm(4).values()}
    os.kill(sup.child("worker:a:0").pid, signal.SIGKILL)

    def back_with_fresh_standbys():
        if model_state(sup, "a") != "ready":
            return None
        fresh = {k: v for k, v in sup.standbys().items() if k in ("engine_core:a", "worker:a:0") and v.pid not in warm}
        return fresh if len(fresh) == 2 else None

    fresh = wait_for(back_with_fresh_standbys, 180, interval=0.1, what="a ready with new standbys")
    # (lowered as its main begins, a few milliseconds after the exec)
    wait_for(lambda: all(priorities(c.pid) == WARMING for c in fresh.values()), 10, interval=0.01,
             what="the new standbys at idle priority")
    now = sup.standbys()
    assert all(now[k].pid == c.pid and now[k].state == "starting" for k, c in fresh.items()), now  # importing
    os.kill(sup.child("worker:a:0").pid, signal.SIGKILL)
    # The role waits in the socket until the import is done; nothing crashes on the way.
    wait_for(lambda: model_state(sup, "a") == "ready" and sup.child("engine_core:a").pid == fresh["engine_core:a"].pid,
             180, interval=0.5, what="a back on the standbys that were still importing",
             diagnose=lambda: sup.log_tails("manager", "engine_core:a", "worker:a:0"))
    assert sup.child("worker:a:0").pid == fresh["worker:a:0"].pid
    # Taken while importing: it finished the import at serving priority, threads born since included.
    for c in fresh.values():
        assert priorities(c.pid) == priorities(sup.manager_pid), c
    r = sup.openai().completions.create(model="a", prompt="x", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_a_killed_standby_is_replaced_and_nothing_else_moves(sup):
    warm = sup.wait_standbys_warm(4)
    before = pids(sup)
    # b serves throughout: its new standby waits, stopped, until every model is idle (issue 57).
    stop, served = threading.Event(), []

    def load() -> None:
        while not stop.is_set():
            served.append(post(sup, "/v1/completions", {"model": "b", "prompt": "x", "max_tokens": 64,
                                                        "ignore_eos": True}).status)

    t = threading.Thread(target=load)
    t.start()
    try:
        wait_for(lambda: served, 120, what="b serving")
        os.kill(warm["worker:b:0"].pid, signal.SIGKILL)
        new = wait_for(lambda: (lambda s: s.get("worker:b:0") if "worker:b:0" in s and
                                s["worker:b:0"].pid != warm["worker:b:0"].pid else None)(sup.standbys()),
                       60, what="a new standby for worker:b:0")
        wait_for(lambda: proc_state(new.pid) == "T", 30, interval=0.05, what="the new standby stopped while b serves")
        count = len(served)
        wait_for(lambda: len(served) > count + 2, 120, what="b serving on")
        assert proc_state(new.pid) == "T" and sup.standbys()["worker:b:0"].state == "starting"
    finally:
        stop.set()
        t.join(300)
    assert set(served) == {200}
    again = sup.wait_standbys_warm(4)  # b idle, frozen: it imports
    assert again["worker:b:0"].pid == new.pid
    assert again["engine_core:b"].pid == warm["engine_core:b"].pid
    def serving(p: dict[str, int]) -> dict[str, int]:
        return {k: v for k, v in p.items() if not k.startswith("standby:")}

    assert serving(pids(sup)) == serving(before)
    assert post(sup, "/v1/completions", {"model": "b", "prompt": "x", "max_tokens": 2}).status == 200


def engine_unfinished(d: Daemon, model: str) -> int:
    """Ask the engine itself (its gateway socket) how many requests it runs."""
    import zmq

    from servectl.wire import engine as EP

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"ipc://{d.runtime_dir / f'engine-{model}'}")
        sock.send(EP.encoder.encode(EP.Stats()))
        assert sock.poll(10000), "the engine did not answer Stats"
        return EP.to_gateway_decoder.decode(sock.recv()).unfinished
    finally:
        sock.close()


def test_engine_sigkill_mid_requests_they_complete_on_the_restarted_group(sup):
    before = pids(sup)
    result = {}

    def call():
        result["r"] = post(sup, "/v1/completions", {"model": "b", "prompt": "x", "max_tokens": 200,
                                                    "ignore_eos": True})

    t = threading.Thread(target=call)
    t.start()
    # Cut it once it has produced output (a request with none yet would be
    # re-sent, not failed): it is in the engine, and a stream admitted after
    # it has its first token, so at least one step ran with it.
    wait_for(lambda: engine_unfinished(sup, "b") >= 1, 30, interval=0.05, what="the request to reach the engine")
    companion = FirstTokenStream(sup, {"model": "b", "prompt": "x", "max_tokens": 200, "ignore_eos": True})
    os.kill(before["engine_core:b"], signal.SIGKILL)
    assert not any("error" in e for e in json_lines(companion.rest()))
    t.join(300)
    r = result["r"]
    assert r.status == 200, r.body
    assert r.json()["usage"]["completion_tokens"] == 200
    wait_for(lambda: model_state(sup, "b") == "ready", 180, interval=0.5, what="b to come back")
    after = pids(sup)
    assert after["worker:b:0"] != before["worker:b:0"]  # the group restarted as a unit


def test_gateway_sigkill_is_restarted_and_the_other_serves(sup):
    before = pids(sup)
    os.kill(before["gateway:0"], signal.SIGKILL)
    # The sibling keeps accepting on the shared socket meanwhile.
    for _ in range(4):
        assert post(sup, "/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 2}).status == 200
    wait_for(lambda: sup.child("gateway:0").state == "ready" and sup.child("gateway:0").pid != before["gateway:0"],
             60, what="gateway 0 restarted")
    after = pids(sup)
    for keep in ("engine_core:a", "worker:a:0", "engine_core:b", "worker:b:0", "gateway:1"):
        assert after[keep] == before[keep], keep


def test_an_operator_restart_takes_the_standbys_too(sup):
    warm = sup.wait_standbys_warm(4)
    assert sup.cli("restart", "b").returncode == 0
    wait_for(lambda: model_state(sup, "b") == "ready" and sup.child("engine_core:b").pid == warm["engine_core:b"].pid,
             180, interval=0.5, what="b restarted on its standbys",
             diagnose=lambda: sup.log_tails("manager"))
    assert sup.child("worker:b:0").pid == warm["worker:b:0"].pid
    assert post(sup, "/v1/completions", {"model": "b", "prompt": "x", "max_tokens": 2}).status == 200


def test_dead_gateways_requests_are_aborted_in_the_engine(sup):
    import socket

    gw = sup.status()
    body = json.dumps({"model": "a", "prompt": "def ", "max_tokens": 480, "ignore_eos": True,
                       "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", sup.port))
    s.settimeout(120)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    received = b""
    while b"data:" not in received:
        chunk = s.recv(4096)
        assert chunk
        received += chunk
    assert b'"error"' not in received, received  # a token, not an error event
    # The gateway holding the stream is the one with an established connection to our port.
    holder = None
    for c in gw.children:
        if c.kind == "gateway":
            fds = os.listdir(f"/proc/{c.pid}/fd")
            inodes = {os.readlink(f"/proc/{c.pid}/fd/{fd}") for fd in fds}
            local = s.getsockname()[1]
            for line in open(f"/proc/{c.pid}/net/tcp").read().splitlines()[1:]:
                parts = line.split()
                if int(parts[2].split(":")[1], 16) == local and f"socket:[{parts[9]}]" in inodes:
                    holder = c
    assert holder is not None
    os.kill(holder.pid, signal.SIGKILL)
    s.close()
    # The engine names the gateway by its identity, gw-<index>-<pid>.
    peer = f"gw-{holder.component.split(':')[1]}-{holder.pid}"
    wait_for(lambda: f"aborting 1 request(s) of dead gateway {peer}" in sup.log("engine_core:a"), 30,
             what="the engine to drop the dead gateway's request",
             diagnose=lambda: sup.log_tails("engine_core:a", "manager", holder.component))


def test_hung_worker_is_detected_and_the_group_restarted(sup):
    wait_for(lambda: model_state(sup, "a") == "ready", 120, what="a ready")
    before = pids(sup)
    stream = FirstTokenStream(sup, {"model": "a", "prompt": "def ", "max_tokens": 200, "ignore_eos": True})
    os.kill(before["worker:a:0"], signal.SIGSTOP)  # hung, not dead: only a deadline can tell
    body = stream.rest()
    assert body.rstrip().endswith("data: [DONE]")
    assert not any("error" in c for c in json_lines(body))  # it went on on the restarted group
    wait_for(lambda: model_state(sup, "a") == "ready" and sup.child("worker:a:0").pid != before["worker:a:0"],
             180, interval=0.5, what="a restarted")
    assert not os.path.exists(f"/proc/{before['worker:a:0']}")
    r = sup.openai().completions.create(model="a", prompt="x", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_engine_freeze_is_not_a_hang(sup):
    wait_for(lambda: sup.child("worker:b:0").state == "idle (frozen)", 60, what="b frozen")
    pid = sup.child("worker:b:0").pid
    time.sleep(12)  # the point: no hang is declared over longer than both hang deadlines of this daemon
    assert sup.child("worker:b:0").pid == pid
    r = sup.openai().completions.create(model="b", prompt="x", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_events_stream_reports_state_changes(sup):
    wait_for(lambda: model_state(sup, "b") == "ready", 180, what="b ready")
    with EventStream(sup, probe_model="b") as events:
        os.kill(sup.child("worker:b:0").pid, signal.SIGKILL)

        def states(seen) -> list[str]:
            return [e.state for e in seen if e.component == "model:b"]

        def back_ready(seen) -> bool:
            # A freeze or thaw also announces "ready": only one after the exit counts.
            s = states(seen)
            return "exited" in s and "ready" in s[s.index("exited"):]

        seen = events.until(back_ready, 180, what="model b exited and back ready")
    after_exit = states(seen)[states(seen).index("exited"):]
    assert after_exit.index("backoff") < after_exit.index("starting") < after_exit.index("ready"), after_exit
    assert any((e.component, e.state) == ("worker:b:0", "exited") for e in seen), seen


def test_admission_control_429_past_the_waiting_cap(sup):
    """Model b runs 2 sequences at once and each gateway queues at most 2 more."""
    from concurrent.futures import ThreadPoolExecutor

    wait_for(lambda: model_state(sup, "b") == "ready", 180, what="b ready")
    body = {"model": "b", "prompt": "def ", "max_tokens": 300, "ignore_eos": True}
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: post(sup, "/v1/completions", body), range(16)))
    codes = [r.status for r in results]
    assert codes.count(200) >= 4, codes
    assert 429 in codes, codes
    refused = next(r for r in results if r.status == 429)
    assert refused.headers.get("Retry-After") and refused.json()["error"]["type"] == "rate_limit_error"
    assert post(sup, "/v1/completions", {"model": "b", "prompt": "x", "max_tokens": 2}).status == 200


def test_stop_drains_in_flight_requests(daemon_factory):
    d = daemon_factory("[manager]\ndrain_timeout_s = 60\nwarm_standby = false\n")
    # Standbys are exec'd the moment a group is ready, unless switched off.
    assert not d.standbys()

    # A long streamed request (4 choices × 480 tokens) is in flight when the stop begins.
    conn = HTTPConnection("127.0.0.1", d.port, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "default", "prompt": "def ", "max_tokens": 480, "n": 4, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = resp.readline()
    assert first.startswith(b"data: ")
    stopper = threading.Thread(target=lambda: d.cli("stop"))
    stopper.start()

    def draining():
        r = http(d, "GET", "/health", timeout=5)
        return r.status == 503 and r.json()["status"] == "draining"

    wait_for(draining, 20, interval=0.05, what="the gateway to drain")
    late = post(d, "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert late.status == 503 and "shutting down" in late.text
    body = (first + resp.read()).decode()
    stopper.join(120)
    events = json_lines(body)
    assert body.rstrip().endswith("data: [DONE]")
    assert not any("error" in e for e in events), "the in-flight request was cut"
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events) > 100
    wait_for(lambda: not d.tree(), 60, what="the tree to exit")


def test_a_request_queued_past_the_output_timeout_is_not_a_hang(daemon_factory):
    """One sequence at a time and a 1 s output deadline: the third request waits
    seconds for its first token, while its engine answers between steps."""
    from concurrent.futures import ThreadPoolExecutor

    d = daemon_factory(f"""
[gateway]
output_timeout_s = 1
[manager]
warm_standby = false
[[models]]
name = "one"
model = "{DEFAULT_MODEL_DIR}"
[models.engine_args]
max_num_seqs = 1
""")
    engine = d.child("engine_core:one").pid
    body = {"model": "one", "prompt": "def ", "max_tokens": 400, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: post(d, "/v1/completions", body), range(3)))
    assert [r.status for r in results] == [200, 200, 200], [r.body[:200] for r in results]
    assert d.child("engine_core:one").pid == engine
    assert "hung" not in d.log("manager")
