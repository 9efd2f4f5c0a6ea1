"""The executor's step protocol over a ``WorkerGroup``: one round trip per step (vLLM-free).

Also where the engine finds vLLM's batch queue (the steps in flight under async
scheduling). Tested with the group against a worker double
(tests/test_executor_unit.py).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from engine_core.workers.group import WorkerGroup
from engine_core.workers.pending_call import PendingCall
from engine_core.workers.step_deadline import StepKinds
from servectl.wire.worker import EXECUTE_AND_SAMPLE


class StepCalls:
    """The executor's step protocol over a WorkerGroup, vLLM-free.

    ``execute_model`` with no grammar in the step sends the fused call
    (execute, then sample if execute returned None) and returns its future;
    the ``sample_tokens`` that vLLM's engine core then asks for is that same
    future. One round trip per step, synchronous or not:

    - ``EngineCore.step`` (synchronous): ``execute_model(non_block=True)``
      resolves to the sampled output, so it never calls ``sample_tokens``.
    - ``EngineCore.step_with_batch_queue`` (async scheduling): it calls
      ``sample_tokens(None, non_block=True)`` right after and queues that
      future; two steps are then in flight at once.

    With a grammar, ``execute_model`` and ``sample_tokens`` are two calls (the
    bitmask is computed between them), each a future in the group's FIFO.
    """

    def __init__(self, group: WorkerGroup, output_rank: int):
        self.group = group
        self.output_rank = output_rank
        self._fused: PendingCall | None = None
        self._tokens = 0  # the current step's scheduled tokens (sample_tokens belongs to it)
        self._kinds: frozenset[str] = frozenset()  # and what its batch needs of the sampler
        self.step_kinds = StepKinds()

    def _value(self, fut: Future, non_block: bool) -> Any:
        return fut if non_block else fut.result()

    def rpc(self, method: str | bytes, args: tuple = (), kwargs: dict | None = None, non_block: bool = False,
            single_value: bool = False, output_rank: int | None = None, timeout: float | None = None,
            tokens: int | None = None, kinds: frozenset[str] = frozenset()) -> Any:
        fut = self.group.send(method, tuple(args), kwargs, output_rank=output_rank, timeout=timeout,
                              pick=output_rank if single_value else None, tokens=tokens, kinds=kinds)
        return self._value(fut, non_block)

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        # The step's size sizes its deadline (step_deadline.py).
        self._tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        self._kinds = self.step_kinds.of(scheduler_output)
        if not getattr(scheduler_output, "has_structured_output_requests", True):
            self._fused = self.group.send(EXECUTE_AND_SAMPLE, (scheduler_output,), None,
                                          output_rank=self.output_rank, pick=self.output_rank, tokens=self._tokens,
                                          kinds=self._kinds)
            return self._value(self._fused, non_block)
        self._fused = None
        return self.rpc("execute_model", (scheduler_output,), non_block=non_block, single_value=True,
                        output_rank=self.output_rank, tokens=self._tokens, kinds=self._kinds)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        fused, self._fused = self._fused, None
        if fused is not None:
            if grammar_output is not None:  # cannot happen without structured requests; be loud
                raise RuntimeError("grammar output for a step that was sampled without one")
            return self._value(fused, non_block)
        return self.rpc("sample_tokens", (grammar_output,), non_block=non_block, single_value=True,
                        output_rank=self.output_rank, tokens=self._tokens, kinds=self._kinds)


def engine_batch_queue(engine: Any) -> Any:
    """vLLM's engine-core batch queue (steps in flight under async scheduling), or ``()``.

    ``LLMEngine.engine_core`` is the in-process client, whose ``engine_core``
    is the ``EngineCore``; its ``batch_queue`` is None without a batch queue.
    Engines built by ``SERVECTL_ENGINE_FACTORY`` may have none at all.
    """
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    queue = getattr(core, "batch_queue", None)
    return queue if queue is not None else ()
