"""Two engines' executors in one process, each driving its own worker group (no module global).

vLLM instantiates the executor class it is given itself, so the group is bound
to the class: ``executor_for(group)`` makes a subclass per group. Imports
vLLM's ``Executor`` (the vllm_unit tier); the workers are doubles
(tests/worker_double.py), the config a stand-in with what the executor reads.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine_core.workers.signing import Signer
from hop_fixtures import KEY, ctx, make_group  # noqa: F401  (fixtures)
from worker_double import WorkerDouble

pytestmark = pytest.mark.vllm_unit


def config() -> SimpleNamespace:
    """The parts of a VllmConfig the executor reads (no model: vLLM's block-size check returns at once)."""
    return SimpleNamespace(model_config=None, cache_config=None, lora_config=None, load_config=None,
                           parallel_config=SimpleNamespace(world_size=1, tensor_parallel_size=1),
                           scheduler_config=SimpleNamespace(async_scheduling=False), device_config=None,
                           speculative_config=None, observability_config=None, max_concurrent_batches=1)


def test_two_executors_with_different_groups_work_in_one_process(ctx, tmp_path):
    from engine_core.workers import executor_for
    from engine_core.workers.executor import WorkerGroupExecutor

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    doubles = {m: WorkerDouble(tmp_path / m / "w0", Signer(KEY), handler=lambda method, args, m=m: (m, method))
               for m in ("a", "b")}
    try:
        groups = {m: make_group(ctx, tmp_path / m) for m in doubles}
        classes = {m: executor_for(g) for m, g in groups.items()}
        assert classes["a"] is not classes["b"] and issubclass(classes["a"], WorkerGroupExecutor)
        executors = {m: cls(config()) for m, cls in classes.items()}  # as vLLM makes them
        for m, ex in executors.items():
            assert ex.group is groups[m]
            assert ex.collective_rpc("ping") == [(m, "ping")]
            assert [method for _, method, _ in doubles[m].calls] == ["init_worker", "init_device", "load_model",
                                                                      "ping"]
        assert WorkerGroupExecutor.group is None  # binding a group never binds the base class
        with pytest.raises(RuntimeError, match="no group"):
            WorkerGroupExecutor(config())
    finally:
        for d in doubles.values():
            d.close()
