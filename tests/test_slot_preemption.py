"""engine_core/slot_preemption.py on vLLM's real ``Scheduler`` (no model: its outputs are made here).

A full batch (``max_num_seqs = 2``) and a waiting request of strictly better priority: the worst
running one (priority, then arrival, as vLLM's own preemption picks) is preempted before the
step is scheduled and the better one runs in that step; equal priorities stay first come first
served; the preempted one resumes, its output whole, once it is the best waiting. The pure
choice (``victim_for``) has unit tests of its own (test_slot_preemption_unit.py).
"""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.vllm_unit

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from engine_core.slot_preemption import SlotPreemption  # noqa: E402
from servectl.config import DEFAULT_MODEL_DIR  # noqa: E402

BLOCK = 16
clock = itertools.count(1)


def block_hasher():
    """The prefix cache's block hasher, as vLLM's EngineCore makes it for each request."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return get_request_block_hasher(BLOCK, fn)


HASHER = block_hasher()


def scheduler(policy: str = "priority", max_num_seqs: int = 2, kind: type = Scheduler) -> Scheduler:
    cache = CacheConfig(block_size=BLOCK)
    cache.num_gpu_blocks = 200
    config = VllmConfig(model_config=ModelConfig(model=str(DEFAULT_MODEL_DIR), max_model_len=512),
                        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                                         max_model_len=512, policy=policy,
                                                         is_encoder_decoder=False),
                        cache_config=cache)
    kv = KVCacheConfig(num_blocks=200, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float32))])
    return kind(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                     block_size=BLOCK, log_stats=False)


def request(rid: str, priority: int, max_tokens: int = 8, params: SamplingParams | None = None) -> Request:
    return Request(rid, [1, 2, 3, 4, 5], params or SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                   arrival_time=float(next(clock)), priority=priority, block_hasher=HASHER)


def step(s: Scheduler, token: int = 7):
    """One step: scheduled, every scheduled request given one token. What ran, what it finished."""
    out = s.schedule()
    ran = list(out.num_scheduled_tokens)
    s.update_from_output(out, ModelRunnerOutput(req_ids=ran, req_id_to_index={r: i for i, r in enumerate(ran)},
                                                sampled_token_ids=[[token] for _ in ran]))
    return out, ran


def test_a_better_request_takes_the_worst_running_ones_slot_in_the_same_step():
    s = scheduler()
    slots = SlotPreemption(s)
    reqs = {rid: request(rid, prio) for rid, prio in (("a0", 0), ("a1", 1000), ("a2", 2000), ("b", 0))}
    for rid in ("a0", "a1", "a2"):
        s.add_request(reqs[rid])
    _, ran = step(s)
    assert sorted(ran) == ["a0", "a1"]
    s.add_request(reqs["b"])  # same priority as a0, better than a1 and a2
    out, ran = step(s)
    assert sorted(ran) == ["a0", "b"] and out.preempted_req_ids == {"a1"}
    assert slots.preempted == 1
    assert reqs["a1"].status is RequestStatus.PREEMPTED and reqs["a1"].num_preemptions == 1
    # b runs to its end beside a0; a1, the best waiting then, resumes before a2, its output whole.
    while not reqs["b"].is_finished():
        _, ran = step(s)
        assert "a2" not in ran
    while not reqs["a1"].is_finished():
        _, ran = step(s)
        assert "a2" not in ran or reqs["a0"].is_finished()
    assert len(reqs["a1"].output_token_ids) == 8 and reqs["a1"].num_preemptions == 1
    while s.has_requests():
        step(s)
    assert all(len(r.output_token_ids) == 8 for r in reqs.values())
    assert slots.preempted == 1  # a1 and a2 never took a slot from each other or from a0


def test_equal_or_worse_priorities_stay_first_come_first_served():
    s = scheduler()
    slots = SlotPreemption(s)
    s.add_request(request("a0", 5))
    s.add_request(request("a1", 5))
    step(s)
    s.add_request(request("c", 5))  # equal: waits its turn
    s.add_request(request("d", 9))  # worse
    out, ran = step(s)
    assert sorted(ran) == ["a0", "a1"] and not out.preempted_req_ids and slots.preempted == 0


def test_with_a_free_slot_nobody_is_preempted():
    s = scheduler(max_num_seqs=3)
    slots = SlotPreemption(s)
    s.add_request(request("a0", 1000))
    s.add_request(request("a1", 1000))
    step(s)
    s.add_request(request("b", 0))
    out, ran = step(s)
    assert sorted(ran) == ["a0", "a1", "b"] and not out.preempted_req_ids and slots.preempted == 0


def test_a_burst_of_better_requests_takes_a_slot_a_step():
    s = scheduler()
    slots = SlotPreemption(s)
    for rid in ("a0", "a1"):
        s.add_request(request(rid, 1000, max_tokens=50))
    step(s)
    s.add_request(request("b0", 0))
    s.add_request(request("b1", 0))
    _, first = step(s)
    _, second = step(s)
    assert sorted(first) == ["a0", "b0"] and sorted(second) == ["b0", "b1"]
    assert slots.preempted == 2


def test_the_first_come_first_served_policy_is_left_alone():
    from engine_core.slot_preemption import preempt_for_priority

    class Engine:  # LLMEngine's path to its scheduler (tools/vllm_pins.py pins each step)
        def __init__(self, sched):
            self.engine_core = type("Client", (), {"engine_core": type("Core", (), {"scheduler": sched})()})()

    fcfs = scheduler(policy="fcfs")
    inner = fcfs.schedule
    assert preempt_for_priority(Engine(fcfs)) is None and fcfs.schedule == inner
    assert isinstance(preempt_for_priority(Engine(scheduler())), SlotPreemption)


def test_with_async_scheduling_the_preempted_ones_step_in_flight_is_delivered_once():
    """vLLM's ``AsyncScheduler`` schedules a step while the last one runs: the preempted request
    has a token in flight, delivered when that step returns; it resumes once that has drained,
    and every request ends with exactly its tokens."""
    from collections import deque

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    s = scheduler(kind=AsyncScheduler)
    slots = SlotPreemption(s)
    reqs = {rid: request(rid, prio) for rid, prio in (("a0", 1000), ("a1", 1000), ("b", 0))}
    s.add_request(reqs["a0"])
    s.add_request(reqs["a1"])
    in_flight: deque = deque()
    tokens = {rid: 0 for rid in reqs}

    def schedule_one():
        out = s.schedule()
        in_flight.append(out)
        return out

    def finish_one():
        out = in_flight.popleft()
        ran = list(out.num_scheduled_tokens)
        engine_outputs = s.update_from_output(out, ModelRunnerOutput(
            req_ids=ran, req_id_to_index={r: i for i, r in enumerate(ran)}, sampled_token_ids=[[7] for _ in ran]))
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                tokens[o.request_id] += len(o.new_token_ids)

    schedule_one()
    schedule_one()  # a second step scheduled before the first returned
    s.add_request(reqs["b"])
    out = schedule_one()
    assert out.preempted_req_ids == {"a1"} and "b" in out.num_scheduled_tokens
    for _ in range(200):
        if not s.has_requests() and not in_flight:
            break
        if in_flight:
            finish_one()
        if s.has_requests():
            schedule_one()
    assert tokens == {"a0": 8, "a1": 8, "b": 8}
    assert all(len(r.output_token_ids) == 8 for r in reqs.values()) and slots.preempted == 1


def test_one_request_does_not_pay_for_every_better_one():
    """Better requests one after another: the running ones of the worst priority take turns at
    being preempted (the least preempted first), not the same one each time."""
    s = scheduler()
    slots = SlotPreemption(s)
    reqs = {rid: request(rid, 1000, max_tokens=60) for rid in ("a0", "a1")}
    for r in reqs.values():
        s.add_request(r)
    step(s)
    victims = []
    for i in range(4):
        b = request(f"b{i}", 0, max_tokens=2)
        s.add_request(b)
        out, _ = step(s)
        victims.extend(out.preempted_req_ids)
        while not b.is_finished():
            step(s)
        step(s)  # the preempted one resumes
    assert victims == ["a1", "a0", "a1", "a0"] and slots.preempted == 4
    while s.has_requests():
        step(s)
    assert [len(r.output_token_ids) for r in reqs.values()] == [60, 60]


def test_a_preempted_request_at_the_head_takes_a_slot_back_from_a_worse_one():
    """One preempted earlier (status PREEMPTED) that is the best waiting is as good as a new one:
    had a worse one taken the slot meanwhile (vLLM skipped it for a step: async output still in
    flight, say), it takes it back, and its key's order holds."""
    s = scheduler()
    slots = SlotPreemption(s)
    a, worse, b = request("a", 500, max_tokens=30), request("worse", 2000, max_tokens=30), request("b", 0, 2)
    s.add_request(request("x", 0, max_tokens=60))
    s.add_request(a)
    step(s)
    s.add_request(b)
    out, _ = step(s)
    assert out.preempted_req_ids == {"a"} and a.status is RequestStatus.PREEMPTED
    s.add_request(worse)
    skipped = {"a"}
    real = s._handle_blocked_waiting_request
    s._handle_blocked_waiting_request = lambda r: r.request_id not in skipped and real(r)
    while not b.is_finished():
        step(s)
    _, ran = step(s)
    assert "worse" in ran and "a" not in ran  # b's slot went to the worse one while a was skipped
    skipped.clear()
    out, ran = step(s)
    assert out.preempted_req_ids == {"worse"} and "a" in ran and slots.preempted == 2


def test_a_request_whose_grammar_is_compiled_preempts_and_one_still_compiling_does_not():
    """A JSON-constrained request waits as WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR until its grammar
    is compiled; vLLM promotes it only inside its waiting pass, which a full batch never reaches."""
    from concurrent.futures import Future

    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.request import StructuredOutputRequest

    s = scheduler()
    slots = SlotPreemption(s)
    for rid in ("a0", "a1"):
        s.add_request(request(rid, 1000, max_tokens=30))
    step(s)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json_object=True))
    constrained = request("json", 0, params=params)
    constrained.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    compiling: Future = Future()
    constrained.structured_output_request = StructuredOutputRequest(params.structured_outputs)
    constrained.structured_output_request.grammar = compiling
    s.waiting.add_request(constrained)
    s.requests[constrained.request_id] = constrained
    assert not slots.ready(constrained)
    slots.make_room()
    assert slots.preempted == 0 and len(s.running) == 2
    compiling.set_result(object())  # compiled
    assert slots.ready(constrained)
    slots.make_room()
    assert slots.preempted == 1 and len(s.running) == 1


def test_no_second_slot_is_freed_for_a_request_vllm_skipped():
    """A slot freed for the best waiting request that vLLM's waiting pass then skips (here: its
    LoRA budget, which the estimate cannot see) goes to another; no second preemption for it."""
    s = scheduler()
    slots = SlotPreemption(s)
    for rid in ("a0", "a1"):
        s.add_request(request(rid, 1000, max_tokens=30))
    step(s)
    best = request("b", 0)
    s.add_request(best)
    skipped = {"b"}
    real = s._handle_blocked_waiting_request
    s._handle_blocked_waiting_request = lambda r: r.request_id not in skipped and real(r)
    step(s)
    step(s)
    step(s)
    assert slots.preempted == 1 and best.status is RequestStatus.WAITING  # one slot freed, not three
    skipped.clear()
    _, ran = step(s)  # runnable again: it takes the next slot that frees, none is freed for it
    assert "b" not in ran and slots.preempted == 1
