"""Issue 13: two calls in flight through the executor, without vLLM or a GPU.

``WorkerGroup`` (engine_core/workers/group.py) against a worker double
(tests/worker_double.py: a thread on a Unix socket speaking the signed-pickle protocol):
FIFO settling, a late reply, a dead worker, the deadline of the oldest call,
the overlap counter, no freezing with a call in flight. Waits are read on the
group's own clock (a ``SimClock``, tests/hop_fixtures.py), never the wall clock's. Then the real worker
loop (``engine_core.workers.worker.serve``) with a stand-in model runner whose
``sample_tokens`` returns an async output, driven by ``StepCalls`` the way
vLLM's ``EngineCore.step_with_batch_queue`` drives the executor: the worker
takes step N+1 while step N's output is still being resolved, and replies
stay in order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import zmq

from engine_core.workers.group import WorkerGroup
from engine_core.workers.pending_call import WorkerHung
from engine_core.workers.step_calls import StepCalls
from hop_fixtures import SimClock, ctx, doubles, make_group, start_worker  # noqa: F401  (fixtures)
from servectl.wire.worker import EXECUTE_AND_SAMPLE

pytestmark = pytest.mark.unit


def test_modules_import_no_vllm_or_torch():
    code = ("import sys, engine_core.workers, engine_core.workers.group, engine_core.workers.step_calls, "
            "engine_core.workers.worker, engine_core.workers.signing, engine_core.workers.link; "
            "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; assert not bad, bad")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_two_calls_in_flight_settle_first_in_first_out(ctx, tmp_path, doubles):
    d = doubles("manual")
    g = make_group(ctx, tmp_path)
    order = []
    a = g.send("execute_model", (1,), None)
    b = g.send("execute_model", (2,), None)
    a.add_done_callback(lambda f: order.append("a"))
    b.add_done_callback(lambda f: order.append("b"))
    (ida, _, _), (idb, _, _) = d.wait_calls(2)
    # The worker answers the younger call first (a misbehaving worker): it is kept, not dropped,
    # and settles only after the older one.
    d.reply(idb, "B")
    d.reply(ida, "A")
    assert b.result() == ["B"]
    assert a.done() and a.result() == ["A"]
    assert order == ["a", "b"]
    assert not g.outstanding and g.dropped_replies == 0


def test_waiting_on_the_younger_call_settles_the_older_one_first(ctx, tmp_path, doubles):
    doubles("auto", handler=lambda method, args: args[0] * 10)
    g = make_group(ctx, tmp_path)
    order = []
    calls = [g.send("execute_model", (i,), None) for i in range(3)]
    for i, c in enumerate(calls):
        c.add_done_callback(lambda f, i=i: order.append(i))
    assert calls[2].result() == [20]
    assert order == [0, 1, 2]
    assert [c.result() for c in calls] == [[0], [10], [20]]


def test_a_late_reply_to_an_older_call_is_kept(ctx, tmp_path, doubles):
    d = doubles("manual")
    clock = SimClock()
    g = make_group(ctx, tmp_path, clock=clock)
    a = g.send("sample_tokens", (None,), None, pick=0)
    b = g.send("execute_model", ("n+1",), None, pick=0)
    (ida, _, _), (idb, _, _) = d.wait_calls(2)
    clock.after(0.2, d.reply_now, ida, "late A")
    clock.after(0.3, d.reply_now, idb, "B")
    assert b.result() == "B"
    assert clock.now == pytest.approx(0.3)  # it waited for both
    assert a.result() == "late A"


def test_a_reply_to_a_call_not_in_flight_is_dropped(ctx, tmp_path, doubles):
    d = doubles("manual")
    g = make_group(ctx, tmp_path)
    a = g.send("execute_model", (), None, pick=0)
    (ida, _, _), = d.wait_calls(1)
    d.reply(ida + 1000, "stray")
    d.reply(ida, "A")
    assert a.result() == "A"
    assert g.dropped_replies == 1


def test_a_dead_worker_is_hung_at_the_deadline(ctx, tmp_path, doubles):
    doubles("dead")
    clock = SimClock()
    g = make_group(ctx, tmp_path, timeout=0.5, clock=clock)
    a = g.send("execute_model", (), None)
    b = g.send("sample_tokens", (), None)
    with pytest.raises(WorkerHung, match=r"rank\(s\) \[0\] gave no reply to execute_model within 0.5s"):
        b.result()
    assert clock.now == pytest.approx(0.5, abs=clock.turn_s)  # the whole deadline, no longer
    # Every call in flight fails with it; nothing is left outstanding to wait on.
    with pytest.raises(WorkerHung):
        a.result()
    assert not g.outstanding


def test_the_deadline_is_the_oldest_calls(ctx, tmp_path, doubles):
    doubles("dead")
    clock = SimClock()
    g = make_group(ctx, tmp_path, clock=clock)
    g.send("execute_model", (), None, timeout=0.4)
    young = g.send("sample_tokens", (), None, timeout=60)
    with pytest.raises(WorkerHung, match="execute_model within 0.4s"):
        young.result()  # waiting on the young call still hangs at the old call's deadline
    assert clock.now == pytest.approx(0.4, abs=clock.turn_s)


def test_a_calls_clock_starts_when_it_becomes_the_oldest(ctx, tmp_path, doubles):
    """The worker starts call B only after A: B's deadline runs from A's reply, not from B's send."""
    d = doubles("manual")
    clock = SimClock()
    g = make_group(ctx, tmp_path, clock=clock)
    a = g.send("execute_model", (), None, timeout=30, pick=0)
    b = g.send("execute_model", (), None, timeout=1.0, pick=0)
    (ida, _, _), (idb, _, _) = d.wait_calls(2)
    clock.after(0.7, d.reply_now, ida, "A")
    clock.after(1.4, d.reply_now, idb, "B")  # 1.4 s after B was sent, 0.7 s after A settled
    assert a.result() == "A"
    assert b.result() == "B"
    assert clock.now == pytest.approx(1.4)


def test_a_failed_call_raises_and_the_next_call_still_settles(ctx, tmp_path, doubles):
    d = doubles("manual")
    g = make_group(ctx, tmp_path)
    a = g.send("execute_model", (), None)
    b = g.send("execute_model", (), None, pick=0)
    (ida, _, _), (idb, _, _) = d.wait_calls(2)
    d.reply(ida, "boom", ok=False)
    d.reply(idb, "fine")
    with pytest.raises(RuntimeError, match="rank 0: boom"):
        a.result()
    assert b.result() == "fine"


def test_tensor_parallel_call_waits_for_every_rank_and_names_the_silent_one(ctx, tmp_path, doubles):
    doubles("auto", rank=0, handler=lambda m, a: "r0")
    doubles("dead", rank=1)
    g = make_group(ctx, tmp_path, ranks=2, timeout=0.4)
    with pytest.raises(WorkerHung, match=r"rank\(s\) \[1\]"):
        g.call("init_device", (), None)


def test_overlap_counter_counts_steps_sent_before_the_previous_reply(ctx, tmp_path, doubles):
    d = doubles("manual")
    g = make_group(ctx, tmp_path)
    first = g.send("execute_model", (), None)
    g.send("sample_tokens", (), None)
    assert (g.steps, g.overlapped_steps) == (1, 0)
    # Two batches queued: step N+1 goes out while step N is unanswered.
    g.send(EXECUTE_AND_SAMPLE, (), None)
    assert (g.steps, g.overlapped_steps) == (2, 1)
    for call_id, _, _ in d.wait_calls(3):
        d.reply(call_id, None)
    first.result()
    while g.outstanding:
        next(iter(g.outstanding.values())).result()
    g.send("execute_model", (), None)  # nothing in flight: not an overlap
    assert (g.steps, g.overlapped_steps) == (3, 1)
    assert "1 sent before the previous reply arrived" in g.counters()


def test_a_group_with_a_call_in_flight_is_never_frozen(ctx, tmp_path, doubles):
    d = doubles("manual")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pidfd = os.pidfd_open(proc.pid)
    events = []
    try:
        # The double is a thread of this process, not the sleeper the pidfd names: no peer check.
        g = make_group(ctx, tmp_path, pidfds=[pidfd], check_peers=False)
        g.on_freeze_change = events.append
        a = g.send("execute_model", (), None)
        assert g.freeze() is False and not g.frozen
        (ida, _, _), = d.wait_calls(1)
        d.reply(ida, None)
        a.result()
        assert g.freeze() is True
        stopped = os.waitid(os.P_PIDFD, pidfd, os.WSTOPPED)  # returns once the SIGSTOP has landed
        assert stopped.si_code == os.CLD_STOPPED
        g.send("execute_model", (), None)  # a call thaws first
        assert events == [True, False]
    finally:
        os.close(pidfd)
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


# ---- the peer of each worker connection is the worker the engine was handed (issue 39) -----------

STRANGER = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1]); s.listen(64)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.close()
"""


def start_stranger(path) -> subprocess.Popen:
    """Another process of this uid listening at a worker's path (a relay would): not the worker."""
    proc = subprocess.Popen([sys.executable, "-c", STRANGER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "listening"
    return proc


def test_a_connection_whose_peer_is_not_the_workers_process_is_refused_and_counted(ctx, tmp_path, caplog):
    stranger = start_stranger(tmp_path / "w0")
    me = os.pidfd_open(os.getpid())  # the worker the engine was handed: this process, not the stranger
    try:
        g = make_group(ctx, tmp_path, timeout=0.3, pidfds=[me])
        with caplog.at_level("WARNING", logger="engine_core.executor"):
            with pytest.raises(WorkerHung, match=rf"peer is pid {stranger.pid} .*not the worker's pid {os.getpid()}"):
                g.send("execute_model", (), None)
        assert g.refused_peers >= 2  # tried again until the call's deadline, each refusal counted
        assert g.sockets == [None] and not g.outstanding  # nothing was sent to the stranger
        refusals = [r for r in caplog.records if "refused the connection" in r.getMessage()]
        assert len(refusals) == 1, "logged once per rank and pid, not per retry"
        assert str(stranger.pid) in refusals[0].getMessage() and str(os.getpid()) in refusals[0].getMessage()
        assert f"{g.refused_peers} connection(s) refused" in g.counters()
    finally:
        os.close(me)
        stranger.kill()
        stranger.wait()


def test_the_worker_is_connected_once_the_stranger_at_its_path_is_gone(ctx, tmp_path, doubles):
    path = tmp_path / "w0"
    stranger = start_stranger(path)
    me = os.pidfd_open(os.getpid())  # the double's thread is this process: the real worker here
    workers = []

    def retry_sleep(seconds: float) -> None:  # between two tries: the stranger goes, the worker comes
        if g.refused_peers and not workers:
            stranger.kill()
            stranger.wait()
            path.unlink()
            workers.append(doubles("auto"))
        time.sleep(seconds)

    try:
        g = make_group(ctx, tmp_path, timeout=10, pidfds=[me], sleep=retry_sleep)
        assert g.send("execute_model", (7,), None).result() == [("done", "execute_model", (7,))]
        assert g.refused_peers == 1 and workers
    finally:
        os.close(me)
        stranger.kill()
        stranger.wait()


def test_the_workers_own_process_is_accepted(ctx, tmp_path, doubles):
    doubles("auto")
    me = os.pidfd_open(os.getpid())
    try:
        g = make_group(ctx, tmp_path, pidfds=[me])
        assert g.call("execute_model", (1,), None) == [("done", "execute_model", (1,))]
        assert g.refused_peers == 0
    finally:
        os.close(me)


def test_a_pidfds_pid_is_read_from_its_fdinfo():
    from engine_core.workers.link import pidfd_pid

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    fd = os.pidfd_open(proc.pid)
    try:
        assert pidfd_pid(fd) == proc.pid
        proc.kill()
        proc.wait()
        assert pidfd_pid(fd) is None  # exited: no pid to match a peer with
        r, w = os.pipe()
        assert pidfd_pid(r) is None  # not a pidfd
        os.close(r), os.close(w)
    finally:
        os.close(fd)


# ---- the real worker loop, with a stand-in model runner -----------------------------------------

class FakeAsyncOutput:
    """Stands in for vLLM's AsyncModelRunnerOutput: get_output blocks until the 'device' is done."""

    def __init__(self, step: int, release: threading.Event, log: list):
        self.step, self.release, self.log = step, release, log

    def get_output(self):
        assert self.release.wait(10), f"step {self.step} never released"
        self.log.append(("output", self.step, threading.current_thread().name))
        return {"step": self.step, "tokens": [self.step]}


class FakeRunner:
    """execute_model defers sampling (returns None); sample_tokens returns an async output."""

    def __init__(self):
        self.log: list = []
        self.releases: dict[int, threading.Event] = {}
        self.executed = threading.Condition()
        self.pending = None

    def execute_model(self, scheduler_output):
        with self.executed:
            self.log.append(("execute", scheduler_output.step))
            self.executed.notify_all()
        self.pending = scheduler_output.step
        return None

    def sample_tokens(self, grammar_output):
        step = self.pending
        self.releases[step] = threading.Event()
        return FakeAsyncOutput(step, self.releases[step], self.log)

    def wait_executed(self, step: int, timeout: float = 10) -> None:
        with self.executed:
            assert self.executed.wait_for(lambda: ("execute", step) in self.log, timeout), self.log


@pytest.fixture
def real_worker(ctx, tmp_path):
    runner = FakeRunner()
    start_worker(ctx, tmp_path / "w0", runner, async_type=FakeAsyncOutput)
    yield runner
    # ContextTerminated ends serve(); release anything still pending so its output thread can finish.
    for ev in runner.releases.values():
        ev.set()


def step(n: int, structured: bool = False):
    return SimpleNamespace(step=n, has_structured_output_requests=structured)


def test_worker_takes_step_n_plus_1_while_step_n_output_is_pending(ctx, tmp_path, real_worker):
    """As step_with_batch_queue: execute+sample N, then N+1, then collect N, then N+1."""
    g = make_group(ctx, tmp_path, timeout=10)
    calls = StepCalls(g, output_rank=0)
    exec_n = calls.execute_model(step(1), non_block=True)
    out_n = calls.sample_tokens(None, non_block=True)
    assert out_n is exec_n  # fused: one call, one future
    exec_n1 = calls.execute_model(step(2), non_block=True)
    out_n1 = calls.sample_tokens(None, non_block=True)
    assert g.overlapped_steps == 1
    # The worker has run step 2's execute while step 1's output is still unresolved.
    real_worker.wait_executed(2)
    assert not out_n.done()
    real_worker.releases[1].set()
    assert out_n.result() == {"step": 1, "tokens": [1]}
    real_worker.releases[2].set()
    assert out_n1.result() == {"step": 2, "tokens": [2]}
    assert exec_n1 is out_n1
    outputs = [e for e in real_worker.log if e[0] == "output"]
    assert [e[1] for e in outputs] == [1, 2]
    assert all(e[2] == "servectl-async-output" for e in outputs)  # off the worker's loop


def test_on_a_cpu_the_worker_answers_step_n_before_it_runs_step_n_plus_1(ctx, tmp_path):
    """Where the output is already on the host (vLLM's CPU runner), the loop resolves it and writes
    the reply before it takes the next call: on the output thread the reply would go out only after
    step N+1 ran, and the engine would get every step's tokens a step late."""
    runner = FakeRunner()
    runner.sample_tokens = lambda grammar_output, _sample=runner.sample_tokens: ready(_sample(grammar_output))
    start_worker(ctx, tmp_path / "w0", runner, async_type=FakeAsyncOutput, resolve_inline=True)
    g = make_group(ctx, tmp_path, timeout=10)
    calls = StepCalls(g, output_rank=0)
    out_n = calls.execute_model(step(1), non_block=True)
    out_n1 = calls.execute_model(step(2), non_block=True)
    assert g.overlapped_steps == 1
    assert out_n.result() == {"step": 1, "tokens": [1]} and out_n1.result() == {"step": 2, "tokens": [2]}
    assert runner.log == [("execute", 1), ("output", 1, "worker-main"), ("execute", 2), ("output", 2, "worker-main")]


def ready(output: FakeAsyncOutput) -> FakeAsyncOutput:
    output.release.set()  # a CPU's copy: done when the step returns
    return output


def test_synchronous_step_gets_the_sampled_output_from_execute_model(ctx, tmp_path, real_worker):
    """As EngineCore.step: execute_model(non_block=True).result() is the sampled output."""
    g = make_group(ctx, tmp_path, timeout=10)
    calls = StepCalls(g, output_rank=0)
    for n in (1, 2, 3):
        fut = calls.execute_model(step(n), non_block=True)
        real_worker.wait_executed(n)
        real_worker.releases[n].set()
        assert fut.result() == {"step": n, "tokens": [n]}
    assert g.overlapped_steps == 0 and g.steps == 3


def test_replies_after_an_async_output_keep_their_order(ctx, tmp_path, real_worker):
    """A plain call behind a pending async output is answered after it, not before."""
    g = make_group(ctx, tmp_path, timeout=10)
    calls = StepCalls(g, output_rank=0)
    out = calls.execute_model(step(1), non_block=True)
    pend = calls.rpc("wait_executed", (1,), non_block=True, single_value=True, output_rank=0)
    real_worker.wait_executed(1)
    time.sleep(0.1)  # let the plain call run on the worker; its reply must queue behind step 1's
    assert not pend.done()
    real_worker.releases[1].set()
    assert pend.result() is None and out.done()


def test_structured_steps_are_two_calls_in_the_same_fifo(ctx, tmp_path, doubles):
    d = doubles("auto", handler=lambda m, a: m)
    g = make_group(ctx, tmp_path)
    calls = StepCalls(g, output_rank=0)
    e = calls.execute_model(step(1, structured=True), non_block=True)
    s = calls.sample_tokens("bitmask", non_block=True)
    assert s.result() == "sample_tokens" and e.result() == "execute_model"
    assert [m for _, m, _ in d.calls] == ["execute_model", "sample_tokens"]
    with pytest.raises(RuntimeError, match="grammar output for a step that was sampled without one"):
        calls.execute_model(step(2), non_block=True)
        calls.sample_tokens("bitmask", non_block=True)


# ---- the step deadline: derived from the steps seen ---------------------------------------

def test_step_deadline_is_generous_until_warm_and_for_what_it_has_not_seen():
    from engine_core.workers.step_deadline import StepDeadline

    d = StepDeadline(generous_s=120, floor_s=5, multiple=20, warmup=4)
    assert d.timeout_for(8) == 120 and not d.warm
    for _ in range(8):
        d.observe(0.01, 8)  # decode steps of 8 tokens, 10 ms
    assert d.warm and d.timeout_for(8) == 5  # 20 x 10 ms is under the floor
    assert d.timeout_for(1) == 5  # a size seen too rarely borrows the next larger one's times
    assert d.timeout_for(64) == 5  # a larger one scales the largest seen by the tokens: 8 x 10 ms x 20
    assert d.timeout_for(512) == 12.8  # 2^6 x 10 ms x 20
    assert d.timeout_for(4096) == 102.4  # a long prefill: long (2^9 x 10 ms x 20)
    assert d.timeout_for(1 << 15) == 120  # beyond the generous deadline: that one
    assert d.timeout_for(None) == 120  # not a step (loading, sleep/wake)
    for _ in range(8):
        d.observe(1.0, 4000)  # a long prefill, once seen often enough, has its own times ...
    assert d.timeout_for(3000) == 20
    assert d.timeout_for(8) == 5  # ... and does not stretch the small steps'
    for _ in range(100):
        d.observe(0.5, 8)
    # Queries answer from the last refresh: the group refreshes while it waits for a reply, so
    # neither the reply's settling nor the next call sorts on the step's path.
    assert d.timeout_for(8) == 5
    d.refresh()
    assert d.timeout_for(8) == 10  # decode got slower (a loaded machine): its deadline follows
    slow = StepDeadline(generous_s=30, floor_s=5, multiple=20, warmup=1)
    for _ in range(8):
        slow.observe(10.0, 8)
    assert slow.timeout_for(8) == 30  # never beyond the generous deadline


def test_a_warm_group_finds_a_hung_worker_at_the_derived_deadline_and_publishes_it(ctx, tmp_path, doubles):
    d = doubles("auto")
    published = []
    g = make_group(ctx, tmp_path, timeout=60, on_deadline=published.append, step_floor_s=0.3)
    steps = StepCalls(g, 0)
    for _ in range(16):  # warm-up: served at the generous deadline (on the real clock: the double answers)
        steps.execute_model(SimpleNamespace(total_num_scheduled_tokens=4, has_structured_output_requests=False))
    assert g.deadlines.warm and published == []
    d.mode = "manual"  # the worker stops answering
    clock = SimClock().install(g)
    with pytest.raises(WorkerHung, match="within 0.3s"):
        steps.execute_model(SimpleNamespace(total_num_scheduled_tokens=4, has_structured_output_requests=False))
    assert clock.now == pytest.approx(0.3, abs=clock.turn_s)  # not the generous 60 s
    assert published == [0.3]


def test_a_step_whose_reply_came_with_its_elders_is_not_timed_from_zero(ctx, tmp_path, doubles):
    """Under async scheduling two steps are in flight and both replies are often read at once; the
    younger was never the oldest call, so it has no start to time it from. Timed from nothing, its
    sample was the clock's whole reading and kept the step deadline at the generous one for good."""
    d = doubles("manual")
    clock = SimClock()
    clock.now = 5000.0  # a monotonic clock's reading is far from 0
    g = make_group(ctx, tmp_path, timeout=60, step_floor_s=0.3, clock=clock)
    for i in range(20):  # two steps in flight, answered together: as step_with_batch_queue sees it
        a = g.send(EXECUTE_AND_SAMPLE, (), None, pick=0, tokens=1)
        b = g.send(EXECUTE_AND_SAMPLE, (), None, pick=0, tokens=1)
        (ida, _, _), (idb, _, _) = d.wait_calls(2 * i + 2)[-2:]
        clock.after(0.008, lambda: (d.reply_now(ida, "A"), d.reply_now(idb, "B")))
        assert b.result() == "B" and a.result() == "A"
    assert g.deadlines.warm
    assert g.deadlines.timeout_for(1) == pytest.approx(0.3)  # 20 × ~8 ms, at the floor
    assert max(g.deadlines.buckets[g.deadlines.bucket(1)]) < 1.0


def test_spin_settings_are_microseconds_in_bounds_with_short_defaults():
    from engine_core.workers.spin import ENGINE_SPIN_ENV, MAX_US, WORKER_SPIN_ENV, spin_seconds

    assert spin_seconds(ENGINE_SPIN_ENV, {}) == pytest.approx(5e-3)
    assert spin_seconds(WORKER_SPIN_ENV, {}) == pytest.approx(2e-3)
    assert spin_seconds(WORKER_SPIN_ENV, {WORKER_SPIN_ENV: "0"}) == 0.0
    assert spin_seconds(WORKER_SPIN_ENV, {WORKER_SPIN_ENV: "250"}) == pytest.approx(250e-6)
    assert spin_seconds(ENGINE_SPIN_ENV, {ENGINE_SPIN_ENV: " "}) == pytest.approx(5e-3)  # blank: the default
    for bad in ("-1", "abc", "nan", str(MAX_US * 2), "inf"):
        assert spin_seconds(ENGINE_SPIN_ENV, {ENGINE_SPIN_ENV: bad}) == 0.0, bad


def test_a_spinning_engine_takes_a_reply_that_comes_during_its_spin_and_blocks_after_it(ctx, tmp_path, doubles):
    d = doubles("manual")
    clock = SimClock()
    g = make_group(ctx, tmp_path, clock=clock)
    polls = clock.polls
    g.spin_s = 0.5
    a = g.send("execute_model", (1,), None)
    (ida, _, _), = d.wait_calls(1)
    clock.after(0.05, d.reply_now, ida, "A")  # comes while the engine spins
    assert a.result() == ["A"]
    # Caught by non-blocking polls (a turn each, 50 ms of them): no blocking wait was needed.
    assert all(t == 0 for t in polls) and abs(len(polls) - 50) <= 1
    # A reply later than the spin: the spin ends within its bound and the wait blocks (with the deadline).
    polls.clear()
    g.spin_s = 0.05
    b = g.send("execute_model", (2,), None)
    idb = d.wait_calls(2)[1][0]
    clock.after(0.3, d.reply_now, idb, "B")
    assert b.result() == ["B"]
    spin, blocking = [t for t in polls if t == 0], [t for t in polls if t != 0]
    assert abs(len(spin) - 50) <= 1 and polls[:len(spin)] == spin  # the spin first: 50 ms of turns
    assert len(blocking) == 1 and abs(blocking[0] - 4950) <= 1  # then one wait for the deadline, not a spin
    assert not g.outstanding


def test_a_step_that_needs_a_sampler_path_no_step_needed_yet_gets_the_generous_deadline():
    """vLLM compiles parts of its sampler on first use (logprob ranks, top-k/top-p): seconds for
    one step, which is not a hang (it was one, at the 5 s floor, before)."""
    from engine_core.workers.step_deadline import StepDeadline, StepKinds

    def params(**kw):
        base = dict(logprobs=None, prompt_logprobs=None, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                    presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None,
                    allowed_token_ids=None, bad_words=[], min_tokens=0, structured_outputs=None, seed=None)
        return SimpleNamespace(**{**base, **kw})

    def step(new=(), running=(), finished=()):
        reqs = [SimpleNamespace(req_id=rid, sampling_params=p) for rid, p in new]
        ids = [rid for rid, _ in new] + list(running)
        return SimpleNamespace(scheduled_new_reqs=reqs, finished_req_ids=set(finished),
                               num_scheduled_tokens=dict.fromkeys(ids, 1), total_num_scheduled_tokens=len(ids))

    d = StepDeadline(generous_s=120, floor_s=5, multiple=20, warmup=4)
    kinds = StepKinds()
    k = kinds.of(step(new=[("a", params())]))
    assert k == frozenset()  # greedy: nothing beyond the plain path
    for _ in range(8):
        d.observe(0.01, 1, k)
    assert d.timeout_for(1, k) == 5
    k = kinds.of(step(new=[("b", params(logprobs=1))], finished=["a"]))
    assert k == {"logprobs@1"} and d.timeout_for(1, k) == 120  # its first time: may compile
    d.observe(2.8, 1, k)
    assert d.timeout_for(1, kinds.of(step(running=["b"]))) == 5  # seen now, and its 2.8 s is not a sample
    # Another request joins the logprobs one: a batch of two has not needed logprobs yet (a graph
    # compiled for one request specialises on it), even though the new request is greedy.
    k = kinds.of(step(new=[("c", params())], running=["b"]))
    assert k == {"logprobs@n"} and d.timeout_for(2, k) == 120
    d.observe(1.0, 2, k)
    k = kinds.of(step(running=["b", "c"]))
    assert d.timeout_for(2, k) == 5
    # Finished requests stop counting; every sampling option is a kind of its own.
    assert kinds.of(step(running=["c"], finished=["b"])) == frozenset()
    k = kinds.of(step(new=[("d", params(temperature=0.7, top_p=0.9, seed=3, presence_penalty=1.0,
                                        logit_bias={"5": 1.0}, prompt_logprobs=0, min_p=0.1))], running=["c"]))
    assert k == {f"{x}@n" for x in ("random", "top_k_top_p", "seed", "penalties", "logit_bias", "prompt_logprobs",
                                    "min_p")}
    assert d.timeout_for(2, k) == 120
    assert kinds.of(SimpleNamespace()) == {f"{x}@n" for x in ("random", "top_k_top_p", "seed", "penalties",
                                                               "logit_bias", "prompt_logprobs", "min_p")}


def test_the_engine_works_while_the_group_waits_for_a_reply_and_never_while_idle(ctx, tmp_path, doubles):
    d = doubles("manual")
    g = make_group(ctx, tmp_path)
    seen = []
    g.while_waiting = lambda: seen.append(("waiting", len(g.outstanding), call.done()))
    call = g.send("execute_model", (1,), None)
    (cid, _, _), = d.wait_calls(1)
    d.reply_later(0.05, cid, "A")
    assert call.result() == ["A"]
    # Called before the group blocked for the reply, with the call sent: the work overlaps the worker's.
    assert seen and seen[0] == ("waiting", 1, False)
    n = len(seen)
    assert not g.outstanding and len(seen) == n  # nothing in flight: never called


def test_a_message_on_the_waker_ends_the_wait_early_and_the_engine_works_again(ctx, tmp_path, doubles):
    """During a step the engine's gateway socket wakes its wait for the workers: a request that
    arrives while the model runs is taken in then (while_waiting), not after the step."""
    d = doubles("manual")
    clock = SimClock()
    g = make_group(ctx, tmp_path, clock=clock)
    g.spin_s = 0  # block at once: only the waker or the reply can end the wait
    front, gateway = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    front.bind("inproc://waker-test")
    gateway.connect("inproc://waker-test")
    taken: list[bytes] = []

    def while_waiting():
        while front.poll(0):
            taken.append(front.recv())

    g.while_waiting = while_waiting
    g.wake_on(front)
    call = g.send("execute_model", (1,), None, tokens=1)
    (cid, _, _), = d.wait_calls(1)
    clock.after(0.05, gateway.send, b"request")
    clock.after(0.3, d.reply_now, cid, "A")
    g.wait_once()  # woken by the waker, the reply not in yet: returns having read nothing
    assert clock.now == pytest.approx(0.05) and not call.done() and g.waker is front
    assert not g.reply_waiting()
    clock.advance(0.3 - clock.now)
    assert g.reply_waiting() and not call.done()  # in, not read yet
    assert call.result() == ["A"] and taken == [b"request"]  # while_waiting ran again and took it
    # Unset, the waker's messages wait: a call outside a step is not woken by them.
    g.wake_on(None)
    call = g.send("load_model", (), None)
    cid, _, _ = d.wait_calls(2)[1]
    sent_at = clock.now
    clock.after(0.05, gateway.send, b"later")
    clock.after(0.2, d.reply_now, cid, "B")
    g.wait_once()  # one wait, ended by the reply alone
    assert call.done() and call.result() == ["B"] and taken == [b"request"]
    assert clock.now == pytest.approx(sent_at + 0.2)
    assert front.poll(0)  # "later" is still there for the engine's own loop
    front.close(0)
    gateway.close(0)


def test_a_waker_that_never_falls_silent_does_not_postpone_the_deadline(ctx, tmp_path, doubles):
    d = doubles("manual")
    g = make_group(ctx, tmp_path, timeout=0.3)
    g.spin_s = 0
    front, gateway = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    front.bind("inproc://waker-flood")
    gateway.connect("inproc://waker-flood")
    gateway.send(b"never read")  # while_waiting leaves it there: every wait wakes at once
    g.wake_on(front)
    call = g.send("execute_model", (1,), None, tokens=1)
    d.wait_calls(1)
    with pytest.raises(WorkerHung):
        call.result()
    g.wake_on(None)
    front.close(0)
    gateway.close(0)


def test_a_long_step_is_spun_for_only_around_its_usual_end(ctx, tmp_path, doubles):
    """A step whose size usually takes 0.3 s: the engine sleeps in the kernel until shortly before
    that, then spins (a spin from the start would burn the whole step on a core)."""
    d = doubles("manual")
    clock = SimClock()
    g = make_group(ctx, tmp_path, clock=clock)
    polls = clock.polls
    g.spin_s = 0.3  # from 0.15 s to 0.45 s
    for _ in range(20):
        g.deadlines.observe(0.3, tokens=64)
    assert g.deadlines.earliest(64) == pytest.approx(0.3) and g.deadlines.earliest(1) is None
    call = g.send("execute_model", (1,), None, tokens=64)
    (cid, _, _), = d.wait_calls(1)
    clock.after(0.28, d.reply_now, cid, "A")
    assert call.result() == ["A"]
    # One sleep until 0.15 s (the usual end less half the spin), then non-blocking polls only,
    # one a turn, until the reply at 0.28 s.
    assert polls[0] in (149, 150) and all(t == 0 for t in polls[1:]) and abs(len(polls[1:]) - 130) <= 1
    # A size not seen yet is spun for from its start, as any other call.
    polls.clear()
    call = g.send("execute_model", (2,), None, tokens=1)
    cid = d.wait_calls(2)[1][0]
    clock.after(0.02, d.reply_now, cid, "B")
    assert call.result() == ["B"] and all(t == 0 for t in polls) and abs(len(polls) - 20) <= 1


def test_with_the_next_step_queued_the_spin_starts_just_ahead_of_the_usual_end(ctx, tmp_path, doubles):
    """Async scheduling: the next step is already with the worker while the engine waits for
    this one's reply. Nothing idles until the engine answers, so it sleeps in the kernel until
    just before the step's usual end (QUEUED_SPIN_LEAD_S), not half a spin ahead of it; the
    step behind, alone in flight once the first is in, is spun for half a spin ahead again."""
    from engine_core.workers.spin import QUEUED_SPIN_LEAD_S

    d = doubles("manual")
    clock = SimClock()
    g = make_group(ctx, tmp_path, clock=clock)
    polls = clock.polls
    g.spin_s = 0.3
    for _ in range(20):
        g.deadlines.observe(0.3, tokens=64)
    first = g.send("execute_model", (1,), None, tokens=64)
    behind = g.send("execute_model", (2,), None, tokens=64)
    (c1, _, _), (c2, _, _) = d.wait_calls(2)
    clock.after(0.305, d.reply_now, c1, "A")
    assert first.result() == ["A"]
    asleep_ms = (0.3 - QUEUED_SPIN_LEAD_S) * 1000
    assert asleep_ms - 1 <= polls[0] <= asleep_ms and all(t == 0 for t in polls[1:])
    assert 4 <= len(polls[1:]) <= 7  # from 0.29975 s to the reply at 0.305 s, a turn a ms
    polls.clear()
    clock.after(0.28, d.reply_now, c2, "B")
    assert behind.result() == ["B"]
    assert polls[0] in (149, 150) and all(t == 0 for t in polls[1:])  # alone: half the spin ahead


# ---- PendingCall: the Future surface vLLM's engine core uses, without a Future's locks -----

def test_a_pending_call_answers_as_a_future_does(caplog):
    from engine_core.workers.pending_call import PendingCall, WorkerCallFailed

    waits = []
    group = SimpleNamespace(wait_once=lambda: (waits.append(1), call.set_result(["v"])))
    call = PendingCall(group, 1, "execute_model", 1, 5.0, pick=None)
    seen = []
    call.add_done_callback(lambda f: seen.append(("early", f.done())))
    assert not call.done() and call.running() and not call.cancelled() and not call.cancel()
    assert call.result() == ["v"] and waits == [1]  # result() waits through the group
    assert call.done() and not call.running() and call.exception() is None
    call.add_done_callback(lambda f: seen.append(("late", f.result())))  # done: called at once
    assert seen == [("early", True), ("late", ["v"])]
    with pytest.raises(RuntimeError, match="settled twice"):
        call.set_result(["again"])
    with pytest.raises(RuntimeError, match="not a timeout"):
        call.result(timeout=1)

    failed = PendingCall(SimpleNamespace(wait_once=lambda: None), 2, "load_model", 2, 5.0, pick=0)
    failed.errors.append("rank 1: boom")
    failed.waiting.clear()
    failed.add_done_callback(lambda f: 1 / 0)  # a callback's failure is logged, never raised
    failed._settle()
    assert isinstance(failed.exception(), WorkerCallFailed)
    with pytest.raises(WorkerCallFailed, match="load_model failed: rank 1: boom"):
        failed.result()
    assert "a callback of" in caplog.text

    picked = PendingCall(SimpleNamespace(wait_once=lambda: None), 3, "m", 2, 5.0, pick=1)
    picked.values[:] = ["rank 0", "rank 1"]
    picked.waiting.clear()
    picked._settle()
    assert picked.result() == "rank 1"
