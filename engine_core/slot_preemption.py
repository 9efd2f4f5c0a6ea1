"""A waiting request of better priority takes a running one's slot when every slot is taken.

vLLM's priority scheduling (``scheduling_policy = "priority"``, servectl's default) orders the
waiting queue, and preempts the worst running request only when the KV cache is short. When
the batch is full by ``max_num_seqs`` instead, a waiting request of better priority waits for
a running one to end: under a flood of long streams that is their whole length, and the fair
share between keys (api_gateway/fair_share.py) could only say who goes *next*. So before each
``schedule()`` the engine preempts the running request of worst priority (among equals the
one preempted least, then the latest) when the best waiting request's priority is strictly
better (lower): that request takes the slot, in the same step unless vLLM's waiting pass
cannot take it then (no token budget or KV left). The preempted one goes back to the waiting
queue (vLLM's ``_preempt_request``: its KV blocks freed, its full blocks kept in the prefix
cache where that is on, its in-flight output of an async step delivered) and resumes once it
is the best waiting.

Strictly better only: equal priorities keep first come first served, and a key's own later
requests in one gateway (never a lower tag, fair_share.py) never preempt its earlier ones. One
preemption per step: a burst of better requests takes a slot a step; and none for a request that
vLLM skipped after a slot was freed for it (it waits for the next free one, as without this).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any


def victim_for(running: Iterable[Any], best: Any, loras_full: set[int] | None = None) -> Any | None:
    """The running request ``best`` (the best waiting one) should take the slot of, or None.

    Pure: requests are read for ``priority``, ``arrival_time``, ``num_preemptions`` (and
    ``lora_request``). The victim has the worst priority, as vLLM's preemption picks; among
    equals, the one preempted least, then the latest to arrive, so that one request does not
    pay for every better one that comes. ``loras_full``: the running requests' LoRA ids when
    ``max_loras`` are all in use — ``best`` with another adapter could not run even with a
    slot, so nobody is preempted for it."""
    running = list(running)
    if not running:
        return None
    worst = max(r.priority for r in running)
    if best.priority >= worst:
        return None
    victim = max((r for r in running if r.priority == worst),
                 key=lambda r: (-r.num_preemptions, r.arrival_time))
    if loras_full is not None:
        lora = _lora_id(best)
        left = {_lora_id(r) for r in running if r is not victim} - {0}
        if lora and lora not in left and len(left) >= len(loras_full):
            return None
    return victim


def _lora_id(request: Any) -> int:
    lora = getattr(request, "lora_request", None)
    return lora.lora_int_id if lora is not None else 0


class SlotPreemption:
    """Wraps one vLLM ``Scheduler``'s ``schedule`` (see the module's docstring)."""

    def __init__(self, scheduler: Any):
        from vllm.v1.core.sched.interface import PauseState
        from vllm.v1.request import RequestStatus

        self.scheduler = scheduler
        self.unpaused = PauseState.UNPAUSED
        self.runnable = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        self.grammar_wait = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        self.preempted = 0  # how many times a better request took a slot (logged at the engine's exit)
        # (request id, its preemptions) of the last request a slot was freed for: while it still
        # waits at the head (vLLM skipped it that step), no second slot is freed for it.
        self.freed_for: tuple[str, int] | None = None
        self.inner = scheduler.schedule
        scheduler.schedule = self.schedule

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self.make_room()
        return self.inner(*args, **kwargs)

    def ready(self, request: Any) -> bool:
        """Whether vLLM's waiting pass would take ``request`` now, as far as its state says (its
        ``_handle_blocked_waiting_request`` and stale-output rule): one it would skip would leave
        the freed slot to another, even the one preempted for it."""
        status = request.status
        if status == self.grammar_wait:
            sor = request.structured_output_request
            grammar = sor.grammar if sor is not None else None  # None until compiled
            if grammar is None or isinstance(grammar, Exception):
                return False
        elif status not in self.runnable:
            return False
        return not (request.num_stale_output_tokens and not request.drop_stale_output)

    def make_room(self) -> None:
        s = self.scheduler
        if (not s.waiting or s.kv_holding_waiting or s.pause_state != self.unpaused
                or len(s.running) + s.num_waiting_for_streaming_input < s.max_num_active_reqs):
            return
        best = s.waiting.peek_request()
        if not self.ready(best) or self.freed_for == (best.request_id, best.num_preemptions):
            return
        lora_config = getattr(s, "lora_config", None)
        loras = None
        if lora_config is not None:
            in_use = {_lora_id(r) for r in s.running} - {0}
            loras = in_use if len(in_use) >= lora_config.max_loras else None
        victim = victim_for(s.running, best, loras)
        if victim is None or not s._request_blocks_can_be_freed(victim):
            return
        s.running.remove(victim)
        # As vLLM's own preemption in schedule(): a connector that needs KV delivery drops the
        # victim's in-flight output, whose blocks this frees.
        s._preempt_request(victim, time.monotonic(), drop_stale_output=s.requires_kv_delivery)
        # Should it run again this very step (vLLM skipped the better one), the model runner must
        # be sent its whole token ids, as reset_prefix_cache arranges for its same-step resumes.
        s.prev_step_scheduled_req_ids.discard(victim.request_id)
        self.freed_for = (best.request_id, best.num_preemptions)
        self.preempted += 1


# "0" leaves vLLM's scheduler as it is: a switch for comparing the two (bench.fair_share's
# "fair, no preemption" side), as step_halves.py's OVERLAP_ENV is.
PREEMPTION_ENV = "SERVECTL_SLOT_PREEMPTION"


def preempt_for_priority(engine: Any) -> SlotPreemption | None:
    """Install on a vLLM ``LLMEngine`` whose scheduler runs the priority policy; None otherwise."""
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    if os.environ.get(PREEMPTION_ENV, "1") == "0":
        return None

    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if getattr(scheduler, "policy", None) != SchedulingPolicy.PRIORITY:
        return None
    return SlotPreemption(scheduler)
