"""vLLM's ``LLMEngine.step`` in its two halves, so the second can run beside the next model step.

``LLMEngine.step`` (vllm/v1/engine/llm_engine.py) first runs the engine
core's step — schedule, the model on the workers, ``update_from_output`` —
then processes what it returned: detokenising, stop strings, aborting the
requests a stop string finished, stats. servectl then builds each request's
deltas and sends them to its gateway. All of that is the engine's one thread
while the worker sits idle, so with synchronous scheduling every decode step
would wait for the previous step's outputs to be processed and sent. In
`vllm serve` the same output processing runs in the API-server process,
beside the engine core.

``core_step`` is the first half, ``process`` the second. The engine
(core.py) keeps a step's core outputs and processes them while the *next*
step's model runs: its worker group calls back before it blocks for a reply
(``WorkerGroup.while_waiting``). When no next model step follows (the
scheduler holds no request), they are processed at once.

What that changes, as in `vllm serve`: a request that a stop string finishes
is still in the scheduler when the next step is scheduled, so that step
computes one token more for it, which is dropped (``update_from_output``
skips a request finished meanwhile, the output processor one it no longer
tracks). Outputs are processed exactly once, in step order; a request
finished by its length or EOS is known to the scheduler at once and costs
nothing extra. The aborts that processing makes (stop strings, an output
that failed to build) reach the scheduler while the worker runs the next
step, where vLLM's engine core applies the aborts that came in meanwhile
between the model's return and ``update_from_output``
(``EngineCore._process_aborts_queue``): the scheduler sees the same state
either way, and the KV blocks a finished request frees are reused only by
the next ``schedule()``, after this step.
"""

from __future__ import annotations

import os
from typing import Any

from engine_core.batch_yield import batch_yield

# "0" processes every step's outputs at once, before the next step is scheduled:
# a switch for comparing the two (python -m bench.rounds --only servectl --env-b ...=0).
OVERLAP_ENV = "SERVECTL_OUTPUT_OVERLAP"


class StepHalves:
    """The two halves of ``LLMEngine.step`` on one in-process ``LLMEngine``."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.client = engine.engine_core  # the in-process client (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        self.core = self.client.engine_core  # vLLM's EngineCore
        self.overlap = os.environ.get(OVERLAP_ENV, "1") != "0"
        self.batches = batch_yield(self.core)  # a batch's lines, and a flood's, yield (batch_yield.py)

    def core_step(self) -> Any:
        """Schedule, run the model, update the scheduler: the step's ``EngineCoreOutputs`` (None: none)."""
        engine = self.engine
        if engine.should_execute_dummy_batch:  # data parallel only, as LLMEngine.step
            engine.should_execute_dummy_batch = False
            self.client.execute_dummy_batch()
            return None
        if self.batches is not None:
            return self.batches.step(self.client.get_output)
        return self.client.get_output()

    def more_to_run(self) -> bool:
        """Whether the next ``core_step`` runs the model (so that processing can hide behind it)."""
        return self.overlap and (self.core.scheduler.has_requests() or bool(getattr(self.core, "batch_queue", None)))

    def process(self, outputs: Any) -> list[Any]:
        """Detokenise, check stop strings, abort what they finished, record stats: the RequestOutputs.

        ``LLMEngine.step``'s steps 2 to 4, unchanged."""
        if outputs is None:
            return []
        from vllm.v1.metrics.stats import IterationStats

        engine = self.engine
        iteration_stats = IterationStats() if engine.log_stats and outputs.outputs else None
        processed = engine.output_processor.process_outputs(
            outputs.outputs, engine_core_timestamp=outputs.timestamp, iteration_stats=iteration_stats,
            weight_version=outputs.weight_version)
        mm_cache = engine.renderer.mm_processor_cache
        if mm_cache is not None:
            for core_output in outputs.outputs:
                for mm_hash in core_output.mm_cache_miss_hashes or ():
                    mm_cache.invalidate(mm_hash)
        engine.output_processor.update_scheduler_stats(outputs.scheduler_stats)
        self.client.abort_requests(processed.reqs_to_abort)
        if engine.logger_manager is not None and outputs.scheduler_stats is not None:
            engine.logger_manager.record(scheduler_stats=outputs.scheduler_stats, iteration_stats=iteration_stats,
                                         mm_cache_stats=engine.renderer.stat_mm_cache())
            if outputs.outputs:
                engine.do_log_stats_with_interval()
        return processed.request_outputs


class WholeStep:
    """An engine with only ``step()`` (one built by ``SERVECTL_ENGINE_FACTORY``): nothing to split."""

    def __init__(self, engine: Any):
        self.engine = engine

    def core_step(self) -> Any:
        return self.engine.step()

    def more_to_run(self) -> bool:
        return False  # processed at once: its step() did it already

    def process(self, outputs: Any) -> list[Any]:
        return outputs


def step_halves(engine: Any) -> StepHalves | WholeStep:
    """The halves of vLLM's ``LLMEngine.step``; the whole step of an engine that is not one."""
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    return StepHalves(engine) if hasattr(core, "scheduler") else WholeStep(engine)
