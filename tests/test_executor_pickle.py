"""A group-bound executor class travels in vLLM's pickled config as the plain class: vLLM
pickles ``VllmConfig`` (which names ``distributed_executor_backend``) into every worker's
``init_worker``, and a bound class is neither importable by name nor may its group travel."""

from __future__ import annotations

import pickle

import pytest

pytestmark = pytest.mark.vllm_unit


def test_a_bound_executor_pickles_as_the_unbound_class_and_keeps_its_group():
    from engine_core.workers.executor import WorkerGroupExecutor, executor_for

    group_a, group_b = object(), object()
    a, b = executor_for(group_a), executor_for(group_b)
    assert a.group is group_a and b.group is group_b and a is not b
    assert pickle.loads(pickle.dumps(a)) is WorkerGroupExecutor
    assert pickle.loads(pickle.dumps({"backend": b})) == {"backend": WorkerGroupExecutor}
    assert WorkerGroupExecutor.group is None  # binding one never binds the base
