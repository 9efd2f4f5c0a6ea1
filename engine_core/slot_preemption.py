"""A waiting request of better priority takes a running one's slot when every slot is taken.

vLLM's priority scheduling (``scheduling_policy = "priority"``, servectl's default) orders the
waiting queue, and preempts the worst running request only when the KV cache is short. When
the batch is full by ``max_num_seqs`` instead, a waiting request of better priority waits for
a running one to end: under a flood of long streams that is their whole length, and the fair
share between keys (api_gateway/fair_share.py) could only say who goes *next*. So before each
``schedule()`` the engine preempts the running request of worst (priority, arrival), as
vLLM's own preemption picks it, when the best waiting request's priority is strictly better
(lower): that request takes the slot in the same step. The preempted one goes back to the
waiting queue (vLLM's ``_preempt_request``: its KV blocks freed, still in the prefix cache,
its in-flight output of an async step delivered) and resumes once it is the best waiting.

Strictly better only: equal priorities keep first come first served, and a key's own later
requests (never a lower tag, fair_share.py) never preempt its earlier ones. One preemption
per step: a burst of better requests takes a slot a step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any


def victim_for(running: Iterable[Any], best: Any, loras_full: set[int] | None = None) -> Any | None:
    """The running request ``best`` (the best waiting one) should take the slot of, or None.

    Pure: requests are read for ``priority`` and ``arrival_time`` (and ``lora_request``).
    ``loras_full``: the running requests' LoRA ids when ``max_loras`` are all in use — ``best``
    with another adapter could not run even with a slot, so nobody is preempted for it."""
    running = list(running)
    if not running:
        return None
    victim = max(running, key=lambda r: (r.priority, r.arrival_time))
    if best.priority >= victim.priority:
        return None
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
        self.waiting_status = RequestStatus.WAITING
        self.preempted = 0  # how many times a better request took a slot (the engine's log at exit)
        self.inner = scheduler.schedule
        scheduler.schedule = self.schedule

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self.make_room()
        return self.inner(*args, **kwargs)

    def make_room(self) -> None:
        s = self.scheduler
        if (not s.waiting or s.kv_holding_waiting or s._pause_state != self.unpaused
                or len(s.running) + s.num_waiting_for_streaming_input < s.max_num_active_reqs):
            return
        best = s.waiting.peek_request()
        # One that vLLM would skip this step (a grammar still compiling, output still in flight)
        # would leave the freed slot to the one preempted for it.
        if best.status != self.waiting_status or best.num_stale_output_tokens:
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
        s._preempt_request(victim, time.monotonic())
        self.preempted += 1


def preempt_for_priority(engine: Any) -> SlotPreemption | None:
    """Install on a vLLM ``LLMEngine`` whose scheduler runs the priority policy; None otherwise."""
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if getattr(scheduler, "policy", None) != SchedulingPolicy.PRIORITY:
        return None
    return SlotPreemption(scheduler)
