"""vLLM Executor that drives manager-started worker processes (over link.py).

``LLMEngine`` runs in the engine process with
``distributed_executor_backend=executor_for(group)``: vLLM instantiates the
executor class itself, so the group it drives is bound to a subclass made per
group (no module global: two executors with different groups live in one
process). The calls, their futures, the reply deadline and freezing live in
``group.py`` (no vLLM there); this module is the thin vLLM side.

Async scheduling. ``supports_async_scheduling()`` is true, so vLLM turns it on
by default (on CPU too: ``honour_async_scheduling_on_cpu`` keeps vLLM's
decision there; ``engine_args.async_scheduling = false`` turns it off
anywhere). Then vLLM's ``VllmConfig.max_concurrent_batches`` is 2 and the
engine core runs ``step_with_batch_queue``: it sends step N+1 before it
collects step N. Each ``execute_model`` / ``sample_tokens`` with
``non_block=True`` returns the group's future for that call; futures settle
first in, first out, under the deadline of the oldest call in flight.
"""

from __future__ import annotations

import copyreg
import logging

from engine_core.workers.group import WorkerGroup
from engine_core.workers.step_calls import StepCalls
from engine_core.workers.tokens_reply import TokensReplyCodec
from vllm.v1.executor.abstract import Executor

log = logging.getLogger("engine_core.executor")


def executor_for(group: WorkerGroup) -> type["WorkerGroupExecutor"]:
    """The executor class to give vLLM (``distributed_executor_backend``) for ``group``."""
    return _GroupBound("WorkerGroupExecutor", (WorkerGroupExecutor,), {"group": group, "__module__": __name__})


class _GroupBound(type(Executor)):
    """The metaclass of a group-bound executor class. vLLM pickles its config, which names the
    executor class, into every worker's ``init_worker``; a bound class is not importable by name
    and its group (sockets) cannot travel, so it pickles as ``WorkerGroupExecutor`` (workers
    never instantiate it)."""


def _unbound() -> type["WorkerGroupExecutor"]:
    return WorkerGroupExecutor


def _pickle_as_unbound(cls: type) -> tuple:
    return _unbound, ()


copyreg.pickle(_GroupBound, _pickle_as_unbound)


class WorkerGroupExecutor(Executor):
    """vLLM's executor over a ``WorkerGroup``; vLLM gets a subclass bound to one (``executor_for``)."""

    supports_pp = False
    group: WorkerGroup | None = None  # bound per group by executor_for

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        # The group keeps several calls in flight and settles them in order;
        # the worker resolves vLLM's async model-runner outputs off its loop.
        return True

    @property
    def max_concurrent_batches(self) -> int:
        """As vLLM computes it (2 with async scheduling, else the pipeline depth)."""
        return self.vllm_config.max_concurrent_batches

    def _init_executor(self) -> None:
        if self.group is None:
            raise RuntimeError("WorkerGroupExecutor has no group: give vLLM executor_for(group)")
        from vllm.v1.outputs import ModelRunnerOutput

        # A step's reply of sampled tokens only comes unsigned (tokens_reply.py).
        self.group.tokens_codec = TokensReplyCodec(ModelRunnerOutput)
        world = self.parallel_config.world_size
        if world != self.group.ranks:
            raise RuntimeError(f"engine expects {world} workers, the manager started {self.group.ranks}")
        tp = self.parallel_config.tensor_parallel_size
        per_rank = []
        for rank in range(world):
            kwargs = [{} for _ in range(world)]
            kwargs[rank] = dict(
                vllm_config=self.vllm_config,
                local_rank=rank if self.group.local_ranks is None else self.group.local_ranks[rank],
                rank=rank,
                distributed_init_method=(self.group.distributed_init_method if self.group.init_methods is None
                                         else self.group.init_methods[rank]),
                is_driver_worker=rank % tp == 0,
                shared_worker_lock=None,
            )
            per_rank.append((kwargs,))
        self.group.call("init_worker", (), None, per_rank_args=per_rank)
        self.group.call("init_device", (), None)
        self.group.call("load_model", (), None)
        from vllm.platforms import current_platform

        current_platform.update_block_size_for_backend(self.vllm_config)
        self.output_rank = world - tp
        self.steps = StepCalls(self.group, self.output_rank)
        async_on = bool(self.scheduler_config.async_scheduling)
        log.info("async scheduling %s (max_concurrent_batches %d, platform %s)", "on" if async_on else "off",
                 self.max_concurrent_batches, current_platform.device_type or "?")

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False,
                       single_value=False, output_rank=None):
        if not isinstance(method, str):
            import cloudpickle

            method = cloudpickle.dumps(method)
        return self.steps.rpc(method, tuple(args), kwargs, non_block=non_block, single_value=single_value,
                              output_rank=output_rank, timeout=timeout)

    def execute_model(self, scheduler_output, non_block=False):
        return self.steps.execute_model(scheduler_output, non_block)

    def sample_tokens(self, grammar_output, non_block=False):
        return self.steps.sample_tokens(grammar_output, non_block)

    def take_draft_token_ids(self):
        return self.collective_rpc("take_draft_token_ids", single_value=True, output_rank=self.output_rank)

    def check_health(self) -> None:
        # Liveness is the manager's job (pidfds); hangs are caught by the reply deadline.
        return

    def shutdown(self) -> None:
        # Workers are the manager's children: it stops them.
        return


def honour_async_scheduling_on_cpu() -> None:
    """Keep vLLM's own async-scheduling decision on a CPU host, as a GPU host keeps it.

    vLLM decides first (``VllmConfig.__post_init__``: on unless the operator
    says ``async_scheduling = false``, the model pools, or its speculative
    method cannot), then its CPU platform turns it off for every engine ("not
    required on CPU": vllm serve's CPU worker spreads its OpenMP team over all
    cores, so an engine scheduling beside it would take a core from the step).
    servectl's worker leaves a core to the engine (docs/decisions.md), and its
    hop costs a pickle, two MACs and two wake-ups a step, which the batch queue
    overlaps with the worker's step (docs/performance.md has the rounds against
    `vllm serve`). The outputs equal the synchronous path's
    (tests/test_async_scheduling.py), so the decision stands on CPU.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    platform = type(current_platform)
    forced = platform.check_and_update_config.__func__

    def keep_the_decision(cls, vllm_config) -> None:
        decided = vllm_config.scheduler_config.async_scheduling
        forced(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = decided

    platform.check_and_update_config = classmethod(keep_the_decision)
