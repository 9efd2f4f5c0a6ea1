"""A batch's lines yield the engine to interactive requests, and a flood's requests to a newcomer:
no step queued ahead of them, the step of their prompt their own, the others' prefills in small
portions.

A batch's line has the lowest priority (``BATCH_PRIORITY``, api_gateway/batch_runner.py): it
yields to every other request. A newcomer is a request that arrives with a better priority than
every running one but batch lines — another key's first request while one key floods (the fair
share's tags, api_gateway/fair_share.py, only rise while a key has requests in flight through a
gateway, so one key's through one gateway never are; through several, each counting its own,
they can be, so a request whose key, ``Generate.tenant``, already runs is not one either), or a
client's own better ``priority``; for ``YIELD_WINDOW_S`` after one ran, the requests
of a worse priority than the newcomers' yield too (``BatchYield.boundary``). When a request
yielded to arrives while only yielding ones run, three things would make it wait beyond the
step running:

- vLLM's async scheduling (``EngineCore.step_with_batch_queue``, two batches in its queue)
  schedules step k+1 while step k runs, so the request waits for k, then for k+1 (scheduled
  without it), before the step that holds its prompt. So while only yielding requests run, and
  one yielded to ran within ``YIELD_WINDOW_S``, the queue is one batch deep: each step is
  scheduled once the last has returned, as vLLM's synchronous path does. The switch waits for the
  batch queued ahead to return first (a call that only waits: vLLM's own path when nothing is to
  be scheduled), so no step is lost or run twice; a request yielded to running, or the window
  passed, puts it back to two. After the window the others run at full speed again: the request
  that comes back after it pays one step more, once.
- The step that takes its prompt would also run every running request's next token (vLLM's
  running pass goes first): a step as long as a full decode step plus the prompt. So that step
  is its own: the running requests that yield sit it out, by vLLM's own per-request skip
  (``Request.next_decode_eligible_step``, which vLLM's diffusion scheduler sets the same way),
  once per request reaching the head of the queue (one vLLM cannot admit yet costs the others
  one step, not a step each time it is tried), and never two steps running: however many
  arrive, the others run at least every other step.
- Requests that started together end together when their lengths match, and the next ones
  would be admitted together: one step holding all their prompts (16 prompts of 32 tokens: four
  decode steps long here). So within the window a step gives waiting requests that yield at most
  ``PREFILL_TOKENS`` tokens, and none while one yielded to waits.

Only under the ``priority`` policy (servectl's default), where the lines' priority means
something to vLLM. ``SERVECTL_BATCH_YIELD=0`` leaves vLLM's engine as it is (bench.batch's
control). Measured in bench.batch (docs/batch.md) and bench.fair_share (docs/tenancy.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from servectl.wire.engine import BATCH_PRIORITY

YIELD_ENV = "SERVECTL_BATCH_YIELD"
YIELD_WINDOW_S = 5.0  # how long after a request yielded to ran the others' steps stay one deep
PREFILL_TOKENS = 64  # the prompt tokens of waiting requests that yield one step takes, at most
BASE = BATCH_PRIORITY - 1  # with no newcomer lately, only a batch's lines yield
TENANT = "servectl_tenant"  # the attribute a vLLM Request carries its key in (Generate.tenant)


def need(request: Any) -> int:
    """The tokens a running request asks of the next step (vLLM's running pass: its prompt's rest
    mid-prefill, else its next token and drafts, async placeholders counted), at least 1."""
    return max(1, request.num_tokens_with_spec + request.num_output_placeholders - request.num_computed_tokens)


def newcomer(priority: int, running: list[Any], tenant: str = "") -> bool:
    """Pure: better than every running request that is not a batch line, one at least running
    (batch lines yield to every other request already: one arriving over them only is not new),
    and none of them its own key's (``tenant``: through several gateways a key's tags can be
    better than its own running ones; through one they never are)."""
    seen = False
    for r in running:
        if r.priority >= BATCH_PRIORITY:
            continue
        if priority >= r.priority or (tenant and getattr(r, TENANT, "") == tenant):
            return False
        seen = True
    return seen


def step_budget(running: list[Any], waiting: list[Any], full: int, step: int, above: int) -> int:
    """Pure: the step's token budget when ``waiting`` is not empty — all the running requests
    scheduled in step ``step`` ask (vLLM's running pass goes first, in admission order: less would
    starve the ones behind a prompt mid-prefill), then the prompts waiting whole of the requests
    yielded to (priority ``above`` or better), or ``PREFILL_TOKENS`` of the others' when none waits."""
    base = sum(need(r) for r in running if r.next_decode_eligible_step <= step)
    asked = [r for r in waiting if r.priority <= above]
    extra = sum(r.num_tokens - r.num_computed_tokens for r in asked) if asked else PREFILL_TOKENS
    return max(1, min(full, base + extra))


class BatchYield:
    """On one vLLM ``EngineCore`` whose scheduler runs the priority policy."""

    def __init__(self, core: Any, clock: Callable[[], float] = time.monotonic, budget: bool = True):
        self.core = core
        self.scheduler = core.scheduler
        self.clock = clock
        self.depth = getattr(core, "batch_queue_size", 1)  # vLLM's (2 with async scheduling)
        # Async scheduling's two, not pipeline parallelism's stages; and not with drafts on vLLM's
        # V1 model runner, which counts a step's drafts as accepted until the next step's update
        # (one deep, the scheduler would have rolled them back already).
        self.pipelined = (getattr(core, "batch_queue", None) is not None and self.depth == 2
                          and not self.scheduler.use_pp
                          and (not self.scheduler.num_spec_tokens or self.scheduler.use_v2_model_runner))
        self.last_favored = float("-inf")  # when a request yielded to last ran or waited
        self.above = BASE  # the requests of a worse priority than this yield (see boundary)
        self.shallow_steps = 0  # steps run one deep (the engine logs it at exit)
        self.solo_for: str | None = None  # the request the others last sat a step out for
        self.sat_out = 0  # steps the others sat out (the engine logs it at exit)
        self.sat_step = -2  # the last step they sat out: they run at least every other step
        # Whether a batch line or a newcomer ever came: until one does, each step costs one test
        # of it (an engine serving neither is vLLM's, and its per-step path stays as it was).
        self.engaged = False
        # The key of the request vLLM is adding now (its every Request: vLLM renames the id, and
        # n > 1 adds a child each), set by the engine's intake around the add only
        # (engine_core/intake.py ``_adding``): it goes onto each Request, and dies with it.
        self.arriving = ""
        self.add = self.scheduler.add_request
        self.scheduler.add_request = self.add_request
        self.inner = self.scheduler.schedule
        self.scheduler.schedule = self.schedule
        self.budget = budget  # whether the step's token budget may be set (see batch_yield)

    def boundary(self, now: float) -> int:
        """The worst priority yielded to: a batch line's better, or within a newcomer's window the
        newcomers' worst (the requests of a worse priority yield)."""
        if self.above != BASE and now - self.last_favored >= YIELD_WINDOW_S:
            self.above = BASE  # the newcomers went quiet: only a batch's lines yield
        return self.above

    def add_request(self, request: Any) -> None:
        """A batch line engages the yield; so does a newcomer — a request arriving with a better
        priority than every running one but batch lines (another key's first under a flood: the
        fair share's tags; a client's own better ``priority``), which the worse ones then yield to."""
        p, tenant = request.priority, self.arriving
        if tenant:
            setattr(request, TENANT, tenant)
        if p >= BATCH_PRIORITY:
            self.engaged = True
        elif newcomer(p, self.scheduler.running, tenant):
            self.engaged = True
            now = self.clock()
            recent = now - self.last_favored < YIELD_WINDOW_S and self.above != BASE
            self.above = max(self.above, p) if recent else p  # every newcomer of the window yielded to
            self.last_favored = now
        self.add(request)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        s = self.scheduler
        if not self.engaged or not s.waiting:
            return self.inner(*args, **kwargs)
        head = s.waiting.peek_request()
        now = self.clock()
        above = self.boundary(now)
        if head.priority <= above:
            self.last_favored = now
            # (schedule() numbers the step it schedules current_step + 1)
            if head.request_id != self.solo_for and s.current_step + 1 >= self.sat_step + 2:
                self.sit_out(head.request_id, above)
            if not self.budget:
                return self.inner(*args, **kwargs)
            waiting = list(getattr(s.waiting, "_heap", s.waiting))  # (the heap as it is: no order needed)
            if all(r.priority <= above for r in waiting):  # none that yields waits: vLLM's own budget
                return self.inner(*args, **kwargs)
        elif self.budget and now - self.last_favored < YIELD_WINDOW_S:
            waiting = [head]
        else:  # nothing yielded to lately: the others' prompts at vLLM's own pace
            return self.inner(*args, **kwargs)
        full = s.max_num_scheduled_tokens
        s.max_num_scheduled_tokens = step_budget(s.running, waiting, full, s.current_step + 1, above)
        try:
            return self.inner(*args, **kwargs)
        finally:
            s.max_num_scheduled_tokens = full

    def sit_out(self, request_id: str, above: int) -> None:
        """The running requests that yield skip the step being scheduled (schedule() counts it as
        ``current_step + 1`` and skips a request while ``current_step`` is below its mark; max
        keeps a longer wait vLLM set itself)."""
        self.solo_for = request_id
        mark = self.scheduler.current_step + 2
        yielding = [r for r in self.scheduler.running if r.priority > above]
        for r in yielding:
            r.next_decode_eligible_step = max(r.next_decode_eligible_step, mark)
        if yielding:
            self.sat_out += 1
            self.sat_step = mark - 1

    def shallow(self) -> bool:
        """Only requests that yield run, and one yielded to ran within the window."""
        running, waiting = self.scheduler.running, self.scheduler.waiting
        now = self.clock()
        above = self.boundary(now)
        if any(r.priority <= above for r in running) or (waiting and waiting.peek_request().priority <= above):
            self.last_favored = now
            return False
        return bool(running) and now - self.last_favored < YIELD_WINDOW_S

    def step(self, get_output: Callable[[], Any]) -> Any:
        """``get_output`` (the in-process client's step) at the depth the running requests call for."""
        core = self.core
        if not self.pipelined or not self.engaged:
            return get_output()
        if not self.shallow():
            if core.batch_queue_size != self.depth and not core.batch_queue:
                core.batch_queue_size = self.depth
            return get_output()
        if core.batch_queue_size != 1:
            if core.batch_queue:
                return self.wait_only(get_output)  # the step queued ahead returns first
            core.batch_queue_size = 1
        self.shallow_steps += 1
        return get_output()

    def wait_only(self, get_output: Callable[[], Any]) -> Any:
        """One vLLM step that schedules nothing: the oldest queued batch's outputs."""
        scheduler = self.scheduler
        scheduler.has_requests = lambda: False  # step_with_batch_queue's "no new batch" path
        try:
            return get_output()
        finally:
            del scheduler.has_requests


def batch_yield(core: Any) -> BatchYield | None:
    """Installed where the scheduler runs the priority policy; None elsewhere."""
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    if os.environ.get(YIELD_ENV, "1") == "0":
        return None
    scheduler = getattr(core, "scheduler", None)
    if getattr(scheduler, "policy", None) != SchedulingPolicy.PRIORITY:
        return None
    # Without chunked prefill a prompt larger than the step's budget is never scheduled, and
    # vLLM's waiting pass stops at it: the budget is left to vLLM (the step queue and the sit-out
    # still yield).
    return BatchYield(core, budget=scheduler.scheduler_config.enable_chunked_prefill)
