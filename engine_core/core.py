"""The engine process of one served model: ``python -m engine_core``.

Hosts vLLM's ``LLMEngine`` in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
with ``WorkerGroupExecutor`` driving the group's manager-started workers. The loop is
vLLM's own core-loop shape: when nothing is unfinished, block on the sockets;
otherwise drain every pending message without blocking, step once, and send
each gateway all of the step's deltas in one message (a non-streaming
request's after its first are held and merged: coalesce.py). A step's outputs are
processed (detokenised, turned into deltas, sent) while the next step's model
runs on the workers, as `vllm serve` does them beside its engine core
(step_halves.py).

Tokenisation, chat templates and detokenisation happen here, so gateways never
import torch or vLLM. The process's start (sockets, the worker group, vLLM's
engine) is ``engine_core/main.py``; requests queued and added are intake.py's,
the gateways' other messages gateway_handlers.py's, the manager's
control_handlers.py's.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict, deque
from typing import Any

import msgspec
import zmq

from engine_core.coalesce import HeldOutput
from engine_core.control_handlers import ManagerMessages
from engine_core.gateway_handlers import GatewayMessages
from engine_core.idle import IdleClock, IdleRelease
from engine_core.intake import InFlight, Intake
from engine_core.outputs import OutputFormatter
from engine_core.request_types import BadRequest, is_request_error
from engine_core.slices import Slicing
from engine_core.step_halves import StepHalves, WholeStep, step_halves
from engine_core.workers import WorkerHung, engine_batch_queue
from servectl.wire import control as MP
from servectl.wire import engine as P
from servectl.wire.spawn import EngineSpec
from servectl.wire.vocab import IdleMode

log = logging.getLogger("engine_core")


class StepFailed(RuntimeError):
    """``LLMEngine.step`` raised: which request, if any, caused it is unknown."""


class EngineServer(ManagerMessages, GatewayMessages, Intake):
    """Owns the LLMEngine, the gateway-facing ROUTER and the control DEALER; runs the loop.

    Its parts in other files share its state: the manager's messages (control_handlers.py),
    the gateways' other than Generate (gateway_handlers.py), requests queued, added and
    forgotten (intake.py). A method found on a part costs the loop no extra call."""

    # Requests are built, and tokenizer questions answered, the way vLLM's OpenAI server does
    # (requests.py, tokenizing.py); both import vLLM when first used, so the loop itself is
    # tested without it (tests/test_engine_loop_unit.py).
    @functools.cached_property
    def builder(self):
        from engine_core.requests import request_builder

        return request_builder(self.engine.vllm_config, self.engine.renderer, self.spec.model,
                               getattr(self.engine, "input_processor", None), self.tasks, self.adapters)

    @functools.cached_property
    def adapters(self):
        """The model's LoRA adapters: vLLM's OpenAIServingModels over this engine (loras.py)."""
        from engine_core.loras import Adapters
        from servectl.config import lora_enabled

        return Adapters(self.engine, self.spec.model.name, self.spec.model.model, lora_enabled(self.spec.model))

    @functools.cached_property
    def tokenizer_endpoints(self):
        from engine_core.tokenizing import TokenizerEndpoints

        return TokenizerEndpoints(self.builder)

    def __init__(self, spec: EngineSpec, engine, group, frontend: zmq.Socket, control: zmq.Socket,
                 release_mode: IdleMode = IdleMode.UNLOAD, device_memory=lambda: None,
                 halves: StepHalves | WholeStep | None = None):
        self.spec = spec
        self.engine = engine
        self.group = group
        self.frontend = frontend
        self.control = control
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.model_config.max_model_len
        sched = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
        self.max_num_seqs = getattr(sched, "max_num_seqs", 0) or 0
        self.requests: dict[str, InFlight] = {}  # request id -> what the engine keeps for it
        self.tracing = None  # EngineTracing with tracing on (engine_core/tracing.py)
        self.trace_parent = ""  # its start span's traceparent, in the HelloReply (tracing on)
        # A pooling request's engine requests (one per prompt, vLLM's ids) -> its request id.
        self.pooled: dict[str, str] = {}
        getter = getattr(engine, "get_supported_tasks", None)
        self.tasks = tuple(getter()) if getter is not None else ("generate",)
        self.by_peer: dict[bytes, set[str]] = defaultdict(set)  # gateway -> its requests (an index of requests)
        # Generates received and not yet added (intake.py, ADD_BUDGET_S), in arrival order.
        self.pending: dict[str, tuple[bytes, P.Generate]] = {}
        # Pooling requests added by slices, the rest of their inputs to render and add (slices.py).
        self.slices = Slicing(engine, self._slice_added, self._slice_failed)
        # Tokenizer questions received and not answered yet, in arrival order (_answer_tokenizing).
        self.tokenizing: deque[tuple[bytes, P.Tokenizer]] = deque()
        self.tokenizer_answers = 0  # answered while requests ran: at most one per gap or model run
        self.outputs = OutputFormatter(self.tokenizer)
        self.held = HeldOutput()  # non-streaming requests' output, sent in a few messages (coalesce.py)
        self.rejected = 0
        self.draining = False
        self.drain_reported = False
        self.idle = IdleRelease(engine, spec.idle_release_s, release_mode, spec.sleep_level, device_memory)
        # (bytes per device, how measured) once loaded (engine_core/footprint.py); sent at ready.
        self.footprint: tuple[int, str] | None = None
        # When the engine last worked, and the deadlines armed when it goes idle (freeze, GroupIdle).
        self.clock = IdleClock(group, self.idle, int(spec.freeze_grace_s * 1000)
                               if spec.freezing and spec.freeze_grace_s > 0 else None)
        # Async scheduling: steps still in vLLM's batch queue are work in flight
        # even when no request is unfinished (one may have finished meanwhile).
        self.in_flight = engine_batch_queue(engine)
        group.on_freeze_change = self._report_freeze
        # A step's core outputs, kept until the next step's model runs (step_halves.py):
        # the group processes them while it waits for the workers' reply.
        self.halves = halves if halves is not None else step_halves(engine)
        self.kept: Any = None
        self.steps = 0
        self.overlapped_outputs = 0  # steps whose outputs were processed while a model step ran
        self.intake_while_waiting = 0  # waits during which arrived requests were taken in
        self.in_step = False  # inside _step: gateway messages are taken in while its model runs
        self.intake_error: Exception | None = None  # a gateway handler's failure mid-step, raised after it
        group.while_waiting = self._while_waiting
        self.on_gateway = {P.Hello: self._on_hello, P.Generate: self._on_generate, P.Abort: self._on_abort,
                           P.Stats: self._on_stats, P.Tokenizer: self._on_tokenizer,
                           P.MetricsRequest: self._on_metrics}
        self.on_control = {MP.AbortPeer: self._on_abort_peer, MP.Drain: self._on_drain,
                           MP.FreezingControl: self._on_freezing, MP.Release: self._on_release,
                           MP.Wake: self._on_wake, MP.AddLora: self._on_lora_change,
                           MP.RemoveLora: self._on_lora_change}
        self.poller = zmq.Poller()
        self.poller.register(frontend, zmq.POLLIN)
        self.poller.register(control, zmq.POLLIN)

    # ---- the loop ------------------------------------------------------------
    def run(self) -> None:
        # Keep stepping until vLLM's batch queue is empty, so workers never freeze under a batch.
        in_flight = self.in_flight
        while True:
            busy = (self.engine.has_unfinished_requests() or bool(in_flight) or bool(self.pending)
                    or self.kept is not None or bool(self.tokenizing) or bool(self.slices))
            # event-proof: idle, the timeout is one of two one-shot deadlines armed on the busy→idle
            # transition (freeze, GroupIdle), or none at all once both have fired.
            timeout = 0 if busy else self.clock.timeout_ms()
            events = dict(self.poller.poll(timeout))  # event-proof: 0 (no wait) while busy, else the deadlines above
            if not events and not busy and timeout is not None:
                self.clock.fire(self._say_idle)
                continue
            if self.frontend in events:
                self._drain_frontend()
            if self.control in events:
                self._drain_control()
            if self.pending or self.slices:
                self._add_pending()
            if self.tokenizing:
                self._answer_tokenizing()
            if self.engine.has_unfinished_requests() or in_flight or self.kept is not None:
                self._step()
                self.clock.worked()
                if self.draining:
                    self._check_drained()

    def _say_idle(self, idle_ms: int) -> None:
        log.info("idle for %.1fs: telling the manager", idle_ms / 1000)
        self.control.send(MP.encoder.encode(MP.GroupIdle(model=self.spec.group_name, incarnation=self.spec.incarnation,
                                                         idle_s=idle_ms / 1000)))

    def _report_freeze(self, frozen: bool) -> None:
        self.control.send(MP.encoder.encode(MP.GroupFrozen(
            model=self.spec.group_name, frozen=frozen, idle_since=self.clock.since_wall if frozen else None)))

    def _drain_frontend(self) -> None:
        while True:
            try:
                frames = self.frontend.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._reject(frames[0] if frames else b"?", f"{len(frames)} frames")
                continue
            peer, body = frames
            try:
                msg = P.from_gateway_decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._reject(peer, str(exc))
                continue
            self.on_gateway[type(msg)](peer, msg)

    def _check_drained(self) -> None:
        if (self.draining and not self.drain_reported and not self.engine.has_unfinished_requests()
                and not self.pending and not self.slices):
            self.drain_reported = True
            self.control.send(MP.encoder.encode(MP.GroupDrained(model=self.spec.group_name,
                                                                incarnation=self.spec.incarnation)))

    def _reject(self, peer: bytes, why: str) -> None:
        self.rejected += 1
        log.warning("rejected frame from %r: %s (%d rejected so far)", peer[:32], why[:200], self.rejected)

    def _send(self, peer: bytes, msg) -> None:
        try:
            self.frontend.send_multipart([peer, P.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY is off: rare)
            log.warning("cannot send to %r: %s", peer, exc)

    # ---- one step ----------------------------------------------------------------
    def _step(self) -> None:
        """One engine-core step; the previous step's outputs are processed, and requests that
        arrive are taken in, while its model runs."""
        try:
            self.in_step = True
            self.group.wake_on(self.frontend)  # a request arriving wakes the wait (_while_waiting)
            try:
                outputs = self.halves.core_step()  # waiting for the workers, the group calls _while_waiting
            finally:
                self.group.wake_on(None)
                self.in_step = False
            self._process_kept()  # the step did not wait for the workers: nothing was scheduled
            self.kept = outputs
            self.steps += 1
            if not self.halves.more_to_run():  # no model step follows to hide the processing behind
                self._process_kept()
        except WorkerHung:
            raise
        except Exception as exc:  # a worker's error, or vLLM's: its state is unknown now
            raise StepFailed(f"{type(exc).__name__}: {exc}") from exc
        if self.intake_error is not None:  # a gateway message's handler failed mid-step: not the model's
            exc, self.intake_error = self.intake_error, None
            raise exc

    def _while_waiting(self) -> None:
        """The workers run a step's model: the last step's outputs go out, then the requests
        that came meanwhile are taken in (tokenised, added to the scheduler's waiting queue),
        both off the step's path. In `vllm serve` its API-server process does both beside the
        engine core. A request added now is scheduled from the next step on, as in vLLM's own
        engine core, which takes in what its input thread prepared between two steps.

        Called again each time the wait wakes early (a gateway message: ``wake_on``). Only
        during a step (``in_step``): the workers' other calls (loading, a release to sleep) take
        no requests in. A handler that fails here is raised after the step, not as the model's
        failure."""
        if self.kept is not None:
            self.overlapped_outputs += 1
            self._process_kept()
        if not self.in_step or self.intake_error is not None:
            return  # a call that is not a step (loading, the calls of a release to sleep): requests wait
        try:
            self._drain_frontend()
            if self.pending or self.slices:
                self.intake_while_waiting += 1
                self._add_pending_until_reply()
            # A tokenizer question at a time while the reply is not in (each wake of the wait), off
            # the step's path; the rest between steps, one per gap.
            if self.tokenizing and not self.group.reply_waiting():
                self.tokenizer_answers += 1
                self._answer_tokenizer(*self.tokenizing.popleft())
        except Exception as exc:  # raised once the step is through, as the loop's own would be
            self.intake_error = exc
            self.group.wake_on(None)  # the rest of the step's wait is woken by its reply alone

    def counters(self) -> str:
        return (f"{self.steps} step(s), the outputs of {self.overlapped_outputs} processed while the next one ran, "
                f"requests taken in during {self.intake_while_waiting} model run(s), "
                f"{self.tokenizer_answers} tokenizer question(s) answered while requests ran")

    def _process_kept(self) -> None:
        """Process the kept core outputs (once: the group may call back again) and send the deltas."""
        kept, self.kept = self.kept, None
        if kept is None:
            return
        batches: dict[bytes, list[P.Delta]] = defaultdict(list)
        now = time.monotonic()
        for ro in self.halves.process(kept):
            rid = self.pooled.get(ro.request_id, ro.request_id)
            req = self.requests.get(rid)
            if req is None:
                continue  # aborted meanwhile
            peer, spec = req.peer, req.spec
            try:
                first = not spec.started
                deltas = self.outputs.deltas(ro, spec, first=first)
                spec.started = True
                if req.resumed is not None:  # the choice it continues; the client had its prompt already
                    for d in deltas:
                        d.index, d.prompt = req.resumed, None
                if spec.whole and not first:  # the first goes at once: it times the first token
                    deltas = self.held.take(rid, deltas, ro.finished, now)
                batches[peer].extend(deltas)
            except BadRequest as bad:  # vLLM's serving code answered with its error (serving_apis.py)
                self._fail(peer, rid, str(bad), bad.status, bad.param)
                continue
            except BaseException as exc:  # this request's output only: it fails, the others go on
                if not is_request_error(exc):
                    raise
                log.exception("building the output of request %s", rid)
                self._fail(peer, rid, f"internal error building this request's output: {type(exc).__name__}")
                continue
            if ro.finished and self.tracing is not None:
                self.tracing.finished(rid, ro)
            if ro.finished and spec.api is not None and (follow := spec.api.take_next()) is not None:
                self._add_next(peer, rid, follow)  # the request asks the engine again (speech_apis.py)
            elif ro.finished and getattr(getattr(spec, "pooling", None), "done", True):
                self._forget(rid)
        for peer, deltas in batches.items():
            if deltas:  # (all of a gateway's may be held)
                self._send(peer, P.StepOutput(incarnation=self.spec.incarnation, deltas=deltas))

    def _fail(self, peer: bytes, rid: str, message: str, status: int = 500, param: str | None = None) -> None:
        self._drop(rid)
        self._forget(rid)
        self._refuse(peer, rid, message, status, param)
