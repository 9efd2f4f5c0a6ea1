"""The engine ⇄ worker hop: the engine's side (vLLM's executor over a worker group) and the worker's.

Code outside this package uses only the names below (tests/test_boundaries_unit.py
checks it); the files inside are:

- ``executor.py``: ``WorkerGroupExecutor``, vLLM's executor interface, bound to one group
  (``executor_for``); the CPU platform's async-scheduling decision (``honour_async_scheduling_on_cpu``)
- ``group.py``: ``WorkerGroup``, the engine's handle on its workers (calls in flight, their
  deadline); ``processes.py``: its part that reaches the workers' processes (a connection per
  rank, its peer checked; freezing)
- ``pending_call.py``: ``PendingCall``, one call in flight; how calls fail (``WorkerCallFailed``,
  ``WorkerHung``)
- ``step_calls.py``: ``StepCalls``, the step protocol (execute and sample fused); vLLM's batch queue
- ``step_deadline.py``: ``StepDeadline``, a step's reply deadline from the step times seen
- ``spin.py``: how long the engine and a worker poll before blocking
- ``link.py``: the framing on a Unix stream (length, HMAC, payload), the private listening socket
- ``signing.py``: HMAC-signed pickles; ``tokens_reply.py``: a step's reply of sampled tokens only
- ``worker.py``: ``python -m engine_core.workers.worker``, one rank's loop around vLLM's ``WorkerWrapperBase``;
  ``replies.py``: its connections and replies (in call order; async outputs resolved off the loop)

The message names both ends share (``EXECUTE_AND_SAMPLE``, ``STATS_METHOD``, ``TokensReply``)
are in servectl/wire/worker.py. Importing this package imports no vLLM and no torch: what
needs vLLM (the executor, the worker's loop) is imported by the functions that need it.
"""

from __future__ import annotations

from typing import Any

from engine_core.workers.group import WorkerGroup
from engine_core.workers.pending_call import PendingCall, WorkerCallFailed, WorkerHung
from engine_core.workers.signing import Signer, read_key
from engine_core.workers.step_calls import engine_batch_queue

__all__ = [
    "PendingCall",
    "Signer",
    "WorkerCallFailed",
    "WorkerGroup",
    "WorkerHung",
    "engine_batch_queue",
    "executor_for",
    "honour_async_scheduling_on_cpu",
    "preload",
    "read_key",
    "worker_main",
]

def executor_for(group: WorkerGroup) -> type:
    """vLLM's executor class (``distributed_executor_backend``) driving ``group`` (imports vLLM)."""
    from engine_core.workers.executor import executor_for as bind

    return bind(group)


def honour_async_scheduling_on_cpu() -> None:
    """Keep vLLM's async-scheduling decision on a CPU host (executor.py; imports vLLM)."""
    from engine_core.workers.executor import honour_async_scheduling_on_cpu as honour

    honour()


def preload() -> None:
    """Import what an engine's executor and a worker import (a warm standby's preload)."""
    import engine_core.workers.executor  # noqa: F401
    import engine_core.workers.worker  # noqa: F401


def worker_main(argv: list[str] | None = None) -> Any:
    """A worker's ``main`` (a standby that becomes a worker runs it in place of the exec)."""
    from engine_core.workers.worker import main

    return main(argv)
