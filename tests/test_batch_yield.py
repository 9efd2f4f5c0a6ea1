"""engine_core/batch_yield.py: a batch's prefills in small portions and none while an interactive
request waits (on vLLM's real ``Scheduler``, outputs made here), and the step queue one deep
while only batch lines run (on a stand-in for vLLM's batch queue)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.vllm_unit

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from engine_core import batch_yield as Y  # noqa: E402
from servectl.wire.engine import BATCH_PRIORITY  # noqa: E402
from test_slot_preemption import HASHER, clock, scheduler, step  # noqa: E402


def request(rid: str, priority: int, prompt: int = 40, max_tokens: int = 8) -> Request:
    first = 1 + 1000 * next(clock)  # a prompt of its own: nothing from the prefix cache
    return Request(rid, list(range(first, first + prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                   arrival_time=float(next(clock)), priority=priority, block_hasher=HASHER)


def core_of(s):
    return SimpleNamespace(scheduler=s, batch_queue=None, batch_queue_size=1)


def test_a_batch_prompt_mid_prefill_never_takes_an_interactive_prompts_step():
    """A long batch prompt admitted in a portion, then a chat prompt: the chat's prompt runs whole
    in the next step, alone; the batch lines (the one mid-prefill too) go on in the step after."""
    s = scheduler(max_num_seqs=16)
    Y.BatchYield(core_of(s), clock=lambda: 0.0).last_favored = 0.0
    for i in range(4):
        s.add_request(request(f"line{i}", BATCH_PRIORITY, prompt=16))
    while s.waiting or not s.running:
        step(s)
    long = request("long", BATCH_PRIORITY, prompt=300)
    s.add_request(long)
    step(s)
    assert 0 < long.num_computed_tokens < 300  # a portion
    s.add_request(request("chat", 0, prompt=100))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"chat": 100}
    out, _ = step(s)
    assert out.num_scheduled_tokens["long"] > 0 and all(out.num_scheduled_tokens[f"line{i}"] == 1 for i in range(4))
    while s.has_requests():
        step(s)
    assert long.num_computed_tokens >= 300 and len(long.output_token_ids) == 8


def test_without_chunked_prefill_the_budget_is_vllms_and_the_batch_still_sits_out():
    from unittest import mock

    s = scheduler(max_num_seqs=16)
    with mock.patch.object(s.scheduler_config, "enable_chunked_prefill", False):
        y = Y.batch_yield(core_of(s))
    assert y is not None and not y.budget  # a prompt past a small budget would never run
    seen = []
    real = y.inner

    def recording(*a, **k):
        seen.append(s.max_num_scheduled_tokens)
        return real(*a, **k)

    y.inner = recording
    for i in range(4):
        s.add_request(request(f"line{i}", BATCH_PRIORITY, prompt=16))
    step(s)
    for i in range(4, 8):
        s.add_request(request(f"line{i}", BATCH_PRIORITY))
    s.add_request(request("chat", 0, prompt=100))
    out, _ = step(s)
    assert "chat" in out.num_scheduled_tokens and not any(f"line{i}" in out.num_scheduled_tokens for i in range(4))
    assert set(seen) == {512}


def test_waiting_batch_lines_get_a_small_portion_of_a_step_and_the_running_their_tokens():
    s = scheduler(max_num_seqs=16)
    Y.BatchYield(core_of(s), clock=lambda: 0.0).last_favored = 0.0  # one ran just now
    lines = [request(f"line{i}", BATCH_PRIORITY) for i in range(16)]
    for r in lines:
        s.add_request(r)
    out, _ = step(s)
    assert sum(out.num_scheduled_tokens.values()) == Y.PREFILL_TOKENS  # not 16 prompts at once
    for _ in range(20):
        before = sum(Y.need(r) for r in s.running)  # what the running ask, then a portion for the waiting
        out, ran = step(s)
        assert sum(out.num_scheduled_tokens.values()) <= before + Y.PREFILL_TOKENS
    while s.has_requests():
        step(s)
    assert all(len(r.output_token_ids) == 8 for r in lines)


@pytest.mark.parametrize("installed", [False, True])
def test_without_it_or_long_after_an_interactive_request_a_step_takes_every_waiting_prompt(installed):
    s = scheduler(max_num_seqs=16)
    if installed:
        Y.BatchYield(core_of(s), clock=lambda: Y.YIELD_WINDOW_S + 100.0).last_favored = 0.0
    for i in range(16):
        s.add_request(request(f"line{i}", BATCH_PRIORITY))
    out, _ = step(s)
    assert sum(out.num_scheduled_tokens.values()) == 512  # vLLM's whole budget (max_num_batched_tokens)


def test_an_interactive_prompt_waiting_takes_a_step_of_its_own_and_the_batch_goes_on_after():
    s = scheduler(max_num_seqs=16)
    Y.BatchYield(core_of(s))
    for i in range(4):
        s.add_request(request(f"line{i}", BATCH_PRIORITY, prompt=16))
    step(s)
    while s.waiting:
        step(s)
    for i in range(4, 8):
        s.add_request(request(f"line{i}", BATCH_PRIORITY))  # waiting behind it
    s.add_request(request("chat", 0, prompt=100))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"chat": 100}  # the running lines sit this one out, the waiting too
    out, _ = step(s)
    assert out.num_scheduled_tokens["chat"] == 1 and all(out.num_scheduled_tokens[f"line{i}"] == 1 for i in range(4))


def test_the_batch_sits_out_one_step_per_interactive_request_even_one_vllm_cannot_admit():
    """A chat request vLLM cannot admit (every slot taken by a better one): the batch lines lose
    one step for it, not every step it waits."""
    s = scheduler(max_num_seqs=4)
    y = Y.BatchYield(core_of(s))
    for i in range(2):
        s.add_request(request(f"line{i}", BATCH_PRIORITY, prompt=16, max_tokens=40))
    for i in range(2):
        s.add_request(request(f"chat{i}", 0, prompt=16, max_tokens=40))
    while s.waiting:
        step(s)
    blocked = request("blocked", 5, prompt=16)  # no slot (no slot preemption on this scheduler): it waits
    s.add_request(blocked)
    skipped = 0
    for _ in range(6):
        out, _ = step(s)
        skipped += not any(rid.startswith("line") for rid in out.num_scheduled_tokens)
    assert y.solo_for == "blocked" and skipped <= 1


def test_the_budget_is_pure():
    chat = SimpleNamespace(priority=0, num_tokens=30, num_computed_tokens=10)
    line = SimpleNamespace(priority=BATCH_PRIORITY, num_tokens=50, num_computed_tokens=0)
    def running(n, **kw):
        return [SimpleNamespace(next_decode_eligible_step=0, **kw) for _ in range(n)]

    decoding = running(4, num_tokens_with_spec=20, num_output_placeholders=0, num_computed_tokens=19)
    drafting = running(4, num_tokens_with_spec=22, num_output_placeholders=1, num_computed_tokens=20)
    prefilling = running(1, num_tokens_with_spec=450, num_output_placeholders=0, num_computed_tokens=64)
    sitting = running(3, num_tokens_with_spec=20, num_output_placeholders=0, num_computed_tokens=19)
    for r in sitting:
        r.next_decode_eligible_step = 8
    assert Y.step_budget(decoding, [line], 2048, 7, Y.BASE) == 4 + Y.PREFILL_TOKENS
    assert Y.step_budget(drafting, [chat, line], 2048, 7, Y.BASE) == 12 + 20
    assert Y.step_budget([*decoding, *prefilling], [chat], 2048, 7, Y.BASE) == 4 + 386 + 20  # its whole rest first
    assert Y.step_budget(decoding, [chat], 10, 7, Y.BASE) == 10  # never past vLLM's own
    assert Y.step_budget([*decoding, *sitting], [chat, line], 2048, 7, Y.BASE) == 4 + 20  # those sitting the step out ask nothing
    assert Y.step_budget([*decoding, *sitting], [chat, line], 2048, 8, Y.BASE) == 7 + 20
    flood = SimpleNamespace(priority=3000, num_tokens=50, num_computed_tokens=0)
    assert Y.step_budget(decoding, [chat, flood], 2048, 7, 0) == 4 + 20  # a newcomer's window: the flood's waits
    assert Y.step_budget(decoding, [flood], 2048, 7, 0) == 4 + Y.PREFILL_TOKENS


class Scheduler:
    def __init__(self, running):
        self.running = running
        self.waiting: list = []
        self.use_pp = False

    def add_request(self, request) -> None:
        self.running.append(request)

    def has_requests(self) -> bool:
        return True


class Core:
    """vLLM's ``step_with_batch_queue`` as far as the queue goes: schedule when there is work and
    room, return without waiting while the queue has room, else the oldest batch's outputs."""

    def __init__(self, running):
        self.scheduler = Scheduler(running)
        self.batch_queue: deque = deque()
        self.batch_queue_size = 2
        self.scheduled = 0
        self.returned: list[int] = []

    def get_output(self):
        assert len(self.batch_queue) < self.batch_queue_size
        if self.scheduler.has_requests():
            self.scheduled += 1
            self.batch_queue.appendleft(self.scheduled)
            if len(self.batch_queue) < self.batch_queue_size:
                return None
        out = self.batch_queue.pop()
        self.returned.append(out)
        return out


def test_one_deep_while_only_batch_lines_run_after_an_interactive_one_no_step_lost():
    now = [0.0]
    batch = SimpleNamespace(priority=BATCH_PRIORITY)
    chat = SimpleNamespace(priority=0)
    core = Core([batch, chat])
    yield_ = Y.BatchYield.__new__(Y.BatchYield)
    yield_.__dict__.update(core=core, scheduler=core.scheduler, clock=lambda: now[0], depth=2, pipelined=True,
                           last_favored=float("-inf"), above=Y.BASE, shallow_steps=0, engaged=True)
    for _ in range(4):
        yield_.step(core.get_output)
    assert core.batch_queue_size == 2 and len(core.batch_queue) == 1  # an interactive one runs: two deep
    core.scheduler.running = [batch]
    yield_.step(core.get_output)  # the step queued ahead returns, nothing scheduled with it
    assert core.batch_queue_size == 2 and not core.batch_queue
    for _ in range(3):
        out = yield_.step(core.get_output)
        assert out == core.scheduled and not core.batch_queue  # scheduled and returned in one call
    assert core.batch_queue_size == 1 and yield_.shallow_steps == 3
    now[0] = Y.YIELD_WINDOW_S + 1  # no interactive request for the window: two deep again
    yield_.step(core.get_output)
    assert core.batch_queue_size == 2 and len(core.batch_queue) == 1
    assert core.returned == sorted(core.returned) and len(set(core.returned)) == len(core.returned)
    assert core.returned == list(range(1, core.scheduled))  # every step but the one queued, once, in order


def budgets(s) -> list[int]:
    """The token budget of each schedule() call on ``s`` from now on (what the yield set or left)."""
    seen: list[int] = []
    real = s.schedule

    def recording(*a, **k):
        seen.append(s.max_num_scheduled_tokens)
        return real(*a, **k)

    s.schedule = recording
    return seen


def test_with_no_batch_line_waiting_the_step_keeps_vllms_budget():
    s = scheduler(max_num_seqs=16)
    seen = budgets(s)
    Y.BatchYield(core_of(s))
    for i in range(3):
        s.add_request(request(f"chat{i}", 0))
    step(s)
    s.add_request(request("line", BATCH_PRIORITY))
    s.add_request(request("chat3", 0))
    step(s)
    assert seen[0] == 512 and seen[1] == 3 + 40  # the second: a batch line waits behind chat3


@pytest.mark.parametrize("spec, v2, depth, pp, switches", [(0, False, 2, False, True), (3, False, 2, False, False),
                                                           (3, True, 2, False, True), (0, False, 3, False, False),
                                                           (0, False, 2, True, False)])
def test_the_queue_switches_only_for_async_schedulings_two_and_not_with_v1_drafts(spec, v2, depth, pp, switches):
    """Not for pipeline parallelism's two stages either (vLLM's queue is as deep as its stages)."""
    core = Core([])
    core.scheduler.num_spec_tokens, core.scheduler.use_v2_model_runner, core.scheduler.use_pp = spec, v2, pp
    core.scheduler.schedule = lambda: None
    core.batch_queue_size = depth
    assert Y.BatchYield(core).pipelined is switches


def flood_running(s, n: int = 8):
    """A key's ``n`` requests running, as the fair share tags them (its k-th in flight: k * 1000)."""
    reqs = [request(f"a{i}", i * 1000, prompt=16, max_tokens=60) for i in range(n)]
    for r in reqs:
        s.add_request(r)
    while s.waiting:
        step(s)
    return reqs


def test_a_flooding_keys_requests_yield_to_another_keys_first():
    """Key A's 8 requests run (priorities 0 ... 7000); key B's first (0) arrives once A's first
    ended: A's running requests sit out B's prompt's step, and while only A's run after B's
    ended, ``shallow`` (the steps one deep) holds within the window and not after it."""
    now = [0.0]
    s = scheduler(max_num_seqs=16)
    y = Y.BatchYield(core_of(s), clock=lambda: now[0])
    flood = flood_running(s)
    assert not y.engaged  # one key's requests, each as good as the worst running or worse: nothing to yield to
    first = flood[0]
    s.finish_requests(first.request_id, RequestStatus.FINISHED_ABORTED)
    s.add_request(request("b", 0, prompt=24, max_tokens=2))
    assert y.engaged and y.above == 0
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"b": 24} and y.sat_out == 1
    out, _ = step(s)  # b's second token, its last
    assert set(out.num_scheduled_tokens) == {"b"} | {r.request_id for r in flood[1:]}
    assert "b" not in s.requests and len(s.running) == 7
    assert y.shallow()  # only A's run, B's ran just now
    now[0] = Y.YIELD_WINDOW_S + 1
    assert not y.shallow() and y.above == Y.BASE  # B quiet for the window: A's run as vLLM would


@pytest.mark.parametrize("priorities", [[0] * 6, [0, 1000, 2000, 3000, 3000, 4000]])
def test_one_keys_requests_or_equal_priorities_never_engage_it(priorities):
    """No keys (every priority 0), or one key's requests (the fair share's tags only rise while it
    has any in flight): no request is better than every running one, so vLLM schedules as it would."""
    s = scheduler(max_num_seqs=16)
    seen = budgets(s)
    y = Y.BatchYield(core_of(s))
    for i, p in enumerate(priorities):
        s.add_request(request(f"r{i}", p, prompt=16))
        step(s)
    assert not y.engaged and set(seen) == {512}


def test_a_newcomer_is_better_than_every_running_request_but_batch_lines():
    def running(*priorities):
        return [SimpleNamespace(priority=p) for p in priorities]

    assert Y.newcomer(0, running(1000, 2000)) and Y.newcomer(-1, running(0, BATCH_PRIORITY))
    assert not Y.newcomer(0, running(0, 1000)) and not Y.newcomer(1000, running(0))
    assert not Y.newcomer(0, running()) and not Y.newcomer(0, running(BATCH_PRIORITY, BATCH_PRIORITY))


def test_a_keys_own_request_is_no_newcomer_whatever_its_priority():
    def running(*pairs):
        return [SimpleNamespace(priority=p, **({Y.TENANT: t} if t else {})) for p, t in pairs]

    assert not Y.newcomer(0, running((1000, "a"), (2000, "b")), "a")  # a's own runs: not a's first
    assert Y.newcomer(0, running((1000, "a"), (2000, "b")), "c")
    assert Y.newcomer(0, running((1000, ""), (2000, "")), "a")  # untagged (no fair share) runners
    assert Y.newcomer(0, running((1000, "a")))  # an untagged arrival: priorities alone, as before


def test_one_key_through_two_gateways_never_engages_it():
    """Each gateway counts its own: the key's requests through gateway 2 start again at 0 while its
    requests through gateway 1 run at 1000 and up. The key is on each (Generate.tenant, on every
    vLLM Request made while the engine's intake adds it: vLLM renames the id, ``rid-xxxxxxxx``, and
    n > 1 adds a child ``i_rid-xxxxxxxx`` each): vLLM schedules as it would."""
    s = scheduler(max_num_seqs=16)
    seen = budgets(s)
    y = Y.BatchYield(core_of(s))

    def add(tenant: str, *rids_and_priority) -> None:
        *rids, priority = rids_and_priority
        y.arriving = tenant  # as Intake._adding does around vLLM's add_request
        try:
            for rid in rids:
                s.add_request(request(rid, priority, prompt=16))
        finally:
            y.arriving = ""

    for i, p in enumerate([0, 1000, 2000, 3000]):  # gateway 1
        add("team-a", f"g1-{i}-0a1b2c3d", p)
        step(s)
    s.finish_requests("g1-0-0a1b2c3d", RequestStatus.FINISHED_ABORTED)
    step(s)
    add("team-a", "0_g2-0-81557a02", "1_g2-0-81557a02", 0)  # gateway 2's first, n = 2: its own key runs
    step(s)
    assert all(getattr(s.requests[r], Y.TENANT) == "team-a" for r in ("0_g2-0-81557a02", "1_g2-0-81557a02"))
    assert not y.engaged and set(seen) == {512}
    s.finish_requests(["0_g2-0-81557a02", "1_g2-0-81557a02"], RequestStatus.FINISHED_ABORTED)
    step(s)
    add("team-b", "b-0-5e6f7a8b", 0)  # another key's first, over team-a's 1000 and up: a newcomer
    assert y.engaged and y.above == 0 and getattr(s.requests["b-0-5e6f7a8b"], Y.TENANT) == "team-b"
    s.add_request(request("after", 5000, prompt=16))  # added outside an intake's add: no key
    assert not hasattr(s.requests["after"], Y.TENANT)


def test_over_a_batch_interactive_requests_never_yield_to_each_other():
    """chat0 (0) arrives over batch lines only, chat1 (a key's second in flight: 1000) after it:
    chat1 is no newcomer, and both are yielded to by the batch alone."""
    s = scheduler(max_num_seqs=16)
    y = Y.BatchYield(core_of(s))
    for i in range(4):
        s.add_request(request(f"line{i}", BATCH_PRIORITY, prompt=16, max_tokens=30))
    while s.waiting:
        step(s)
    s.add_request(request("chat0", 0, prompt=16, max_tokens=30))
    assert y.above == Y.BASE  # over batch lines only: every interactive request stays yielded to
    step(s)
    step(s)
    s.add_request(request("chat1", 1000, prompt=40, max_tokens=30))
    for i in range(4, 8):
        s.add_request(request(f"line{i}", BATCH_PRIORITY))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"chat0": 1, "chat1": 40}  # the batch sat out, chat0 did not


def test_however_many_arrive_the_others_run_every_other_step_at_least():
    s = scheduler(max_num_seqs=64)
    Y.BatchYield(core_of(s))
    for i in range(4):
        s.add_request(request(f"line{i}", BATCH_PRIORITY, prompt=16, max_tokens=60))
    while s.waiting:
        step(s)
    ran = []
    for i in range(12):
        s.add_request(request(f"chat{i}", 0, prompt=8, max_tokens=2))  # one a step
        out, _ = step(s)
        ran.append("line0" in out.num_scheduled_tokens)
    assert not any(a == b == False for a, b in zip(ran, ran[1:]))  # noqa: E712 - never two steps without
    assert ran.count(False) >= 5  # and they did sit out
