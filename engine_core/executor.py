"""vLLM Executor that drives manager-started worker processes over ZeroMQ.

``LLMEngine`` runs in the engine process with
``distributed_executor_backend=ZmqExecutor``. Every ``collective_rpc`` sends
the call to all workers first (``init_device`` is a rendezvous between ranks),
then gathers the replies. The wait for replies is the one deadline in this
process, armed only while a call is in flight: a worker that does not answer
in time is hung, and the engine exits so the manager restarts the group.

Idle workers are frozen (SIGSTOP through pidfds the manager passed in) and
thawed (SIGCONT) before the next call; see DESIGN.md "Frozen when idle".
"""

from __future__ import annotations

import itertools
import logging
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq

from engine_core.signing import BadSignature, Signer
from engine_core.worker import EXECUTE_AND_SAMPLE
from vllm.v1.executor.abstract import Executor

log = logging.getLogger("engine_core.executor")


class WorkerHung(RuntimeError):
    pass


@dataclass
class WorkerGroup:
    """The engine's handle on its workers; set before LLMEngine is built."""

    worker_paths: list[str]
    pidfds: list[int]
    signer: Signer
    reply_timeout_s: float
    distributed_init_method: str
    on_freeze_change: Callable[[bool], None] = lambda frozen: None
    frozen: bool = False
    sockets: list[zmq.Socket] = field(default_factory=list)
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    def connect(self, ctx: zmq.Context) -> None:
        for path in self.worker_paths:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"ipc://{path}")
            self.sockets.append(sock)
        self.poller = zmq.Poller()
        for sock in self.sockets:
            self.poller.register(sock, zmq.POLLIN)

    # ---- freezing ----------------------------------------------------------
    def _signal_all(self, sig: int) -> None:
        for fd in self.pidfds:
            try:
                signal.pidfd_send_signal(fd, sig)
            except ProcessLookupError:
                pass  # it died; the manager restarts the group

    def freeze(self) -> None:
        if not self.frozen and self.pidfds:
            self._signal_all(signal.SIGSTOP)
            self.frozen = True
            self.on_freeze_change(True)

    def thaw(self) -> None:
        if self.frozen:
            self._signal_all(signal.SIGCONT)
            self.frozen = False
            self.on_freeze_change(False)

    # ---- calls ----------------------------------------------------------------
    def call(self, method: str | bytes, args: tuple, kwargs: dict | None,
             per_rank_args: list[tuple] | None = None, output_rank: int | None = None,
             timeout: float | None = None) -> list[Any]:
        call_id = self.send(method, args, kwargs, per_rank_args, output_rank)
        return self._gather(call_id, method, timeout if timeout is not None else self.reply_timeout_s)

    def send(self, method: str | bytes, args: tuple, kwargs: dict | None,
             per_rank_args: list[tuple] | None = None, output_rank: int | None = None) -> int:
        """Send a call to every worker (all before any reply: TP calls are rendezvous)."""
        self.thaw()
        call_id = next(self._ids)
        for rank, sock in enumerate(self.sockets):
            rank_args = per_rank_args[rank] if per_rank_args is not None else args
            sock.send_multipart(self.signer.dumps((call_id, method, rank_args, kwargs, output_rank)), copy=False)
        return call_id

    def gather(self, call_id: int, method: str) -> list[Any]:
        return self._gather(call_id, method, self.reply_timeout_s)

    def _gather(self, call_id: int, method: Any, timeout_s: float) -> list[Any]:
        results: list[Any] = [None] * len(self.sockets)
        pending = set(range(len(self.sockets)))
        index = {sock: rank for rank, sock in enumerate(self.sockets)}
        errors = []
        end = time.monotonic() + timeout_s
        while pending:
            # The deadline exists only while a call is in flight.
            remaining = max(0, int((end - time.monotonic()) * 1000))
            ready = dict(self.poller.poll(remaining))
            if not ready:
                name = method if isinstance(method, str) else "<callable>"
                raise WorkerHung(f"worker rank(s) {sorted(pending)} gave no reply to {name} within {timeout_s:g}s")
            for sock in ready:
                rank = index[sock]
                try:
                    reply_id, ok, value = self.signer.loads(sock.recv_multipart())
                except BadSignature as exc:
                    log.warning("rejected reply from rank %d: %s", rank, exc)
                    continue
                if reply_id != call_id:
                    continue  # a late reply to an earlier call
                pending.discard(rank)
                if ok:
                    results[rank] = value
                else:
                    errors.append(f"rank {rank}: {value}")
        if errors:
            raise RuntimeError("worker call failed: " + "\n".join(errors))
        return results


GROUP: WorkerGroup | None = None


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class ZmqExecutor(Executor):
    supports_pp = False

    def _init_executor(self) -> None:
        if GROUP is None:
            raise RuntimeError("ZmqExecutor needs engine_core to set executor.GROUP first")
        self.group = GROUP
        world = self.parallel_config.world_size
        if world != len(self.group.sockets):
            raise RuntimeError(f"engine expects {world} workers, the manager started {len(self.group.sockets)}")
        tp = self.parallel_config.tensor_parallel_size
        per_rank = []
        for rank in range(world):
            kwargs = [{} for _ in range(world)]
            kwargs[rank] = dict(
                vllm_config=self.vllm_config,
                local_rank=rank,
                rank=rank,
                distributed_init_method=self.group.distributed_init_method,
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
        self._fused_call: int | None = None

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False,
                       single_value=False, output_rank=None):
        if not isinstance(method, str):
            import cloudpickle

            method = cloudpickle.dumps(method)
        results = self.group.call(method, tuple(args), kwargs, output_rank=output_rank, timeout=timeout)
        value = results[output_rank] if single_value else results
        return _done(value) if non_block else value

    def execute_model(self, scheduler_output, non_block=False):
        if not getattr(scheduler_output, "has_structured_output_requests", True):
            # No grammar: sample_tokens will get None, so the worker can sample
            # right after executing. The engine core then calls
            # sample_tokens(None), which collects the fused call's reply.
            self._fused_call = self.group.send(EXECUTE_AND_SAMPLE, (scheduler_output,), None,
                                               output_rank=self.output_rank)
            return _done(None) if non_block else None
        return self.collective_rpc("execute_model", args=(scheduler_output,), non_block=non_block,
                                   single_value=True, output_rank=self.output_rank)

    def sample_tokens(self, grammar_output, non_block=False):
        fused, self._fused_call = self._fused_call, None
        if fused is not None:
            if grammar_output is not None:  # cannot happen without structured requests; be loud
                raise RuntimeError("grammar output for a step that was sampled without one")
            value = self.group.gather(fused, EXECUTE_AND_SAMPLE)[self.output_rank]
            return _done(value) if non_block else value
        return self.collective_rpc("sample_tokens", args=(grammar_output,), non_block=non_block,
                                   single_value=True, output_rank=self.output_rank)

    def take_draft_token_ids(self):
        return self.collective_rpc("take_draft_token_ids", single_value=True, output_rank=self.output_rank)

    def check_health(self) -> None:
        # Liveness is the manager's job (pidfds); hangs are caught by the reply deadline.
        return

    def shutdown(self) -> None:
        # Workers are the manager's children: it stops them.
        return
