"""The engine process of one served model: ``python -m engine_core``.

Hosts vLLM's ``LLMEngine`` in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
with ``ZmqExecutor`` driving the group's manager-started workers. The loop is
vLLM's own core-loop shape: when nothing is unfinished, block on the sockets;
otherwise drain every pending message without blocking, ``step()`` once, and
send each gateway all of the step's deltas in one message.

Tokenisation, chat templates and detokenisation happen here, so gateways never
import torch or vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import zmq

from servectl.wire import engine as P
from engine_core.signing import Signer, read_key
from engine_core.worker_group import engine_batch_queue
from servectl.wire import control as MP
from servectl.wire.spawn import EngineSpec, engine_component, engine_identity, read_spec_fd
from servectl.paths import RuntimePaths, bind_private
from servectl.proc import die_with_parent, setup_child_logging

log = logging.getLogger("engine_core")
# "module:function" building the engine from the EngineSpec instead of vLLM's
# LLMEngine (for bench/'s zero-cost token source). Unset in production.
ENGINE_FACTORY_ENV = "SERVECTL_ENGINE_FACTORY"


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineServer:
    """Owns the LLMEngine, the gateway-facing ROUTER and the control DEALER."""

    def __init__(self, spec: EngineSpec, engine, group, frontend: zmq.Socket, control: zmq.Socket):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        self._SamplingParams = SamplingParams
        self._Structured = StructuredOutputsParams
        self._DELTA = RequestOutputKind.DELTA
        self.spec = spec
        self.engine = engine
        self.group = group
        self.frontend = frontend
        self.control = control
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.model_config.max_model_len
        sched = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
        self.max_num_seqs = getattr(sched, "max_num_seqs", 0) or 0
        self.freeze_grace_ms = int(spec.freeze_grace_s * 1000) if spec.freezing and spec.freeze_grace_s > 0 else None
        self.owner: dict[str, bytes] = {}  # request id -> gateway identity
        self.by_peer: dict[bytes, set[str]] = defaultdict(set)
        self.prompt_sent: set[str] = set()
        self.rejected = 0
        self.draining = False
        self.drain_reported = False
        self.on_gateway = {P.Hello: self._on_hello, P.Generate: self._add, P.Abort: self._on_abort,
                           P.Stats: self._on_stats}
        self.on_control = {MP.AbortPeer: self._on_abort_peer, MP.Drain: self._on_drain,
                           MP.FreezingControl: self._on_freezing}
        self.poller = zmq.Poller()
        self.poller.register(frontend, zmq.POLLIN)
        self.poller.register(control, zmq.POLLIN)

    # ---- the loop ------------------------------------------------------------
    def run(self) -> None:
        idle_since = time.monotonic()
        # Async scheduling: steps still in vLLM's batch queue are work in flight
        # even when no request is unfinished (one may have finished meanwhile);
        # keep stepping until it is empty, so workers never freeze under a batch.
        in_flight = engine_batch_queue(self.engine)
        while True:
            busy = self.engine.has_unfinished_requests() or bool(in_flight)
            if busy:
                timeout = 0
            elif self.group.frozen or self.freeze_grace_ms is None:
                timeout = None  # idle: sleep in the kernel until a message comes
            else:
                # One-shot deadline armed on the busy→idle transition.
                timeout = max(0, self.freeze_grace_ms - int((time.monotonic() - idle_since) * 1000))
            events = dict(self.poller.poll(timeout))
            if not events and not busy and timeout is not None:
                self.group.freeze()
                continue
            if self.frontend in events:
                self._drain_frontend()
            if self.control in events:
                self._drain_control()
            if self.engine.has_unfinished_requests() or in_flight:
                self._step()
                idle_since = time.monotonic()
                self._check_drained()

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

    # ---- one handler per gateway message ---------------------------------------
    def _on_hello(self, peer: bytes, msg: P.Hello) -> None:
        self._send(peer, P.HelloReply(version=P.PROTOCOL_VERSION, incarnation=self.spec.incarnation,
                                      model=self.spec.model.name, max_model_len=self.max_model_len,
                                      max_num_seqs=self.max_num_seqs, rejected_frames=self.rejected))

    def _on_abort(self, peer: bytes, msg: P.Abort) -> None:
        self._abort(msg.request_ids)

    def _on_stats(self, peer: bytes, msg: P.Stats) -> None:
        self._send(peer, P.StatsReply(incarnation=self.spec.incarnation,
                                      unfinished=self.engine.get_num_unfinished_requests(),
                                      overlapped_steps=self.group.overlapped_steps,
                                      rejected_frames=self.rejected))

    def _check_drained(self) -> None:
        if self.draining and not self.drain_reported and not self.engine.has_unfinished_requests():
            self.drain_reported = True
            self.control.send(MP.encoder.encode(MP.GroupDrained(model=self.spec.model.name,
                                                                incarnation=self.spec.incarnation)))

    def _reject(self, peer: bytes, why: str) -> None:
        self.rejected += 1
        log.warning("rejected frame from %r: %s (%d rejected so far)", peer[:32], why[:200], self.rejected)

    def _drain_control(self) -> None:
        while True:
            try:
                body = self.control.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = MP.to_engine_decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("rejected control frame: %s", exc)
                continue
            self.on_control[type(msg)](msg)

    # ---- one handler per manager message ----------------------------------------
    def _on_abort_peer(self, msg: MP.AbortPeer) -> None:
        ids = list(self.by_peer.pop(msg.peer.encode(), ()))
        if ids:
            log.info("aborting %d request(s) of dead gateway %s", len(ids), msg.peer)
            self._abort(ids)

    def _on_drain(self, msg: MP.Drain) -> None:
        self.draining = True
        log.info("draining: %d request(s) unfinished", self.engine.get_num_unfinished_requests())
        self._check_drained()

    def _on_freezing(self, msg: MP.FreezingControl) -> None:
        if msg.enabled:
            self.freeze_grace_ms = int(msg.grace_s * 1000)
        else:
            self.freeze_grace_ms = None
            self.group.thaw()
        log.info("freezing %s", "enabled" if msg.enabled else "disabled")

    def _send(self, peer: bytes, msg) -> None:
        try:
            self.frontend.send_multipart([peer, P.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY is off: rare)
            log.warning("cannot send to %r: %s", peer, exc)

    # ---- requests --------------------------------------------------------------
    def _add(self, peer: bytes, msg: P.Generate) -> None:
        rid = msg.request_id
        if self.draining:
            self._send(peer, P.RequestError(incarnation=self.spec.incarnation, request_id=rid,
                                            message=f"model {self.spec.model.name!r} is being stopped", status=503))
            return
        if rid in self.owner:
            self._send(peer, P.RequestError(incarnation=self.spec.incarnation, request_id=rid,
                                            message=f"duplicate request id {rid}", status=400))
            return
        try:
            prompt, params = self._build(msg)
            self.engine.add_request(rid, prompt, params)
        except BadRequest as exc:
            self._send(peer, P.RequestError(incarnation=self.spec.incarnation, request_id=rid,
                                            message=str(exc), status=400, param=exc.param))
            return
        except (ValueError, TypeError) as exc:
            self._send(peer, P.RequestError(incarnation=self.spec.incarnation, request_id=rid,
                                            message=str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                                            status=400))
            return
        except Exception as exc:  # one request's failure never takes the engine down
            # Admission only looks at the request itself, so whatever it rejects is bad input.
            log.warning("request %s rejected at admission: %r", rid, exc)
            self._send(peer, P.RequestError(incarnation=self.spec.incarnation, request_id=rid,
                                            message=f"invalid request: {exc}", status=400))
            return
        self.owner[rid] = peer
        self.by_peer[peer].add(rid)

    def _build(self, msg: P.Generate):
        from vllm.inputs import TokensPrompt

        if msg.messages is not None:
            try:
                text = self.tokenizer.apply_chat_template(msg.messages, tokenize=False, add_generation_prompt=True)
            except Exception as exc:
                raise BadRequest(f"cannot apply the chat template: {exc}", "messages") from None
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif msg.prompt_token_ids is not None:
            ids = list(msg.prompt_token_ids)
            vocab = len(self.tokenizer)
            bad = [t for t in ids if t < 0 or t >= vocab]
            if bad:
                raise BadRequest(f"token id(s) {bad[:5]} outside the vocabulary (0..{vocab - 1})", "prompt")
        elif msg.prompt is not None:
            ids = self.tokenizer.encode(msg.prompt)
        else:
            raise BadRequest("no prompt given", "prompt")
        if not ids:
            raise BadRequest("the prompt is empty", "prompt")
        sampling = dict(msg.sampling)
        max_tokens = sampling.get("max_tokens")
        limit = self.max_model_len
        if len(ids) >= limit or (max_tokens is not None and len(ids) + max_tokens > limit):
            asked = len(ids) + (max_tokens or 0)
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{asked} tokens ({len(ids)} in the prompt, {max_tokens or 0} for the completion). "
                "Please reduce the length of the prompt or the completion.",
                "max_tokens" if max_tokens else "prompt",
            )
        if msg.echo:
            sampling["prompt_logprobs"] = max(sampling.get("prompt_logprobs") or 0, sampling.get("logprobs") or 0)
        structured = None
        if msg.structured:
            structured = self._Structured(**msg.structured)
        params = self._SamplingParams(**sampling, output_kind=self._DELTA, structured_outputs=structured)
        return TokensPrompt(prompt_token_ids=ids), params

    def _abort(self, ids: list[str]) -> None:
        live = [i for i in ids if i in self.owner]
        if live:
            self.engine.abort_request(live)
            log.info("aborted %d request(s): %s", len(live), " ".join(live[:8]))
        for rid in live:
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        peer = self.owner.pop(rid, None)
        if peer is not None:
            self.by_peer[peer].discard(rid)
            if not self.by_peer[peer]:
                del self.by_peer[peer]
        self.prompt_sent.discard(rid)

    # ---- one step ----------------------------------------------------------------
    def _step(self) -> None:
        outputs = self.engine.step()
        batches: dict[bytes, list[P.Delta]] = defaultdict(list)
        for ro in outputs:
            rid = ro.request_id
            peer = self.owner.get(rid)
            if peer is None:
                continue  # aborted meanwhile
            first = rid not in self.prompt_sent
            if first:
                self.prompt_sent.add(rid)
            for comp in ro.outputs:
                delta = P.Delta(request_id=rid, index=comp.index, text=comp.text,
                                token_ids=list(comp.token_ids), finish_reason=comp.finish_reason,
                                stop_reason=comp.stop_reason)
                if first:
                    delta.prompt_tokens = len(ro.prompt_token_ids or ())
                    if ro.prompt_logprobs is not None:
                        delta.prompt_logprobs = self._prompt_logprobs(ro)
                        # Echo returns the prompt as text, without BOS and other specials.
                        delta.prompt_text = self.tokenizer.decode(ro.prompt_token_ids, skip_special_tokens=True)
                if comp.logprobs:
                    delta.logprobs = self._logprobs(comp.token_ids, comp.logprobs)
                batches[peer].append(delta)
            if ro.finished:
                self._forget(rid)
        for peer, deltas in batches.items():
            self._send(peer, P.StepOutput(incarnation=self.spec.incarnation, deltas=deltas))

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _logprobs(self, token_ids, logprobs) -> list[Any]:
        out = []
        for tid, alts in zip(token_ids, logprobs):
            chosen = alts.get(tid)
            top = sorted(alts.items(), key=lambda kv: kv[1].rank or 0)
            out.append([
                self._token_text(tid),
                chosen.logprob if chosen else None,
                [[self._token_text(t), lp.logprob] for t, lp in top if t != tid or lp.rank is not None],
            ])
        return out

    def _prompt_logprobs(self, ro) -> list[Any]:
        out = []
        for tid, alts in zip(ro.prompt_token_ids, ro.prompt_logprobs):
            chosen = alts.get(tid) if alts else None
            top = sorted(alts.items(), key=lambda kv: kv[1].rank or 0) if alts else []
            out.append([self._token_text(tid), chosen.logprob if chosen else None,
                        [[self._token_text(t), lp.logprob] for t, lp in top]])
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine_core")
    ap.add_argument("--spec-fd", type=int, help="a memfd holding the EngineSpec as JSON (from the manager)")
    ap.add_argument("--key-fd", type=int)
    ap.add_argument("--worker-pidfds", default="")
    ap.add_argument("--check", action="store_true", help="validate engine arguments and exit")
    ap.add_argument("--engine-args", help="with --check: engine arguments as JSON")
    args = ap.parse_args(argv)
    if args.check:
        return check_engine_args(json.loads(args.engine_args or "{}"))
    spec = read_spec_fd(args.spec_fd, EngineSpec)
    die_with_parent()
    setup_child_logging(f"engine_core[{spec.model.name}]")
    key = read_key(args.key_fd)
    pidfds = [int(x) for x in args.worker_pidfds.split(",") if x]
    paths = RuntimePaths(Path(spec.runtime_dir))
    ctx = zmq.Context()
    control = ctx.socket(zmq.DEALER)
    control.setsockopt(zmq.IDENTITY, engine_identity(spec.model.name))
    control.setsockopt(zmq.LINGER, 1000)
    control.connect(RuntimePaths.ipc(paths.control))
    frontend = ctx.socket(zmq.ROUTER)
    frontend.setsockopt(zmq.LINGER, 0)
    # A gateway that reconnects keeps its identity (gw-<index>-<pid>). Without
    # handover a ROUTER that still holds the old connection takes the new one
    # for a duplicate and silently eats its first message (the Hello): that
    # gateway would wait for this engine forever.
    frontend.setsockopt(zmq.ROUTER_HANDOVER, 1)
    bind_private(frontend, paths.engine(spec.model.name))

    def report_freeze(frozen: bool) -> None:
        control.send(MP.encoder.encode(MP.GroupFrozen(model=spec.model.name, frozen=frozen)))

    from engine_core import executor as ex

    tp = spec.model.tensor_parallel_size
    group = ex.WorkerGroup(
        worker_paths=[str(paths.worker(spec.model.name, r)) for r in range(tp)],
        pidfds=pidfds,
        signer=Signer(key),
        reply_timeout_s=spec.worker_reply_timeout_s,
        distributed_init_method=f"file://{paths.root}/dist-{spec.model.name}-{spec.incarnation}",
        on_freeze_change=report_freeze,
    )
    group.connect(ctx)
    ex.GROUP = group
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    factory = os.environ.get(ENGINE_FACTORY_ENV)
    try:
        if factory:
            # The documented hook for benchmarks (bench/zero_cost.py): anything
            # with LLMEngine's add_request/step/abort_request surface.
            module, _, name = factory.partition(":")
            engine = getattr(importlib.import_module(module), name)(spec)
            log.warning("engine built by %s, not vLLM's LLMEngine", factory)
        else:
            if spec.model.engine_args.get("async_scheduling") is True:
                ex.honour_async_scheduling_on_cpu()
            engine = LLMEngine.from_engine_args(EngineArgs(
                model=spec.model.model,
                tensor_parallel_size=tp,
                distributed_executor_backend=ex.ZmqExecutor,
                **spec.model.engine_args,
            ))
    except ex.WorkerHung as exc:
        log.error("engine start failed: %s", exc)
        return 75
    server = EngineServer(spec, engine, group, frontend, control)
    control.send(MP.encoder.encode(MP.ChildReady(
        component=engine_component(spec.model.name), pid=os.getpid(), incarnation=spec.incarnation,
        detail=json.dumps({"max_model_len": server.max_model_len}))))
    log.info("ready: %s (max_model_len %d, %d worker(s))", spec.model.model, server.max_model_len, tp)
    # The executor's counters (async scheduling overlap) go to the log at shutdown,
    # which is a SIGTERM from the manager: log, then die of it as before.
    def log_counters_and_die(signum, frame) -> None:
        log.info("stopping: %s", group.counters())
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, log_counters_and_die)
    try:
        server.run()
    except ex.WorkerHung as exc:
        log.error("%s: the group is hung; exiting so the manager restarts it", exc)
        return 75
    finally:
        log.info("executor: %s", group.counters())
    return 0


def check_engine_args(engine_args: dict[str, Any]) -> int:
    """`python -m engine_core --check`: let vLLM itself judge engine arguments."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        EngineArgs(model="x", **engine_args)
    except TypeError as exc:
        print(f"invalid engine argument: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"invalid engine arguments: {exc}", file=sys.stderr)
        return 2
    return 0

