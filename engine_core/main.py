"""``python -m engine_core``: start one served model's engine process.

Connects the control socket, binds the gateway-facing ROUTER, builds the
worker group and vLLM's ``LLMEngine`` with ``WorkerGroupExecutor`` (or what
``SERVECTL_ENGINE_FACTORY`` names, for benchmarks), says ready, and runs
``EngineServer``'s loop (core.py). Exits 75 when the group is hung and 70 when
a step failed (the engine's state is unknown): the manager restarts the group.
A start that fails for a reason a restart cannot fix (load_errors.py) is
reported (``EngineFailed``) and exits 78: the manager fails the model at once.
``--check`` lets vLLM judge engine arguments for ``servectl config check``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from engine_core.core import EngineServer, StepFailed
from engine_core.footprint import footprint_in_worker, group_footprint, rss_bytes
from engine_core.idle import build_choice, device_memory_in_use
from engine_core.kv_events import vllm_config
from engine_core.load_errors import describe, permanent_reason
from engine_core.media import close_media_fetching
from engine_core.slot_preemption import preempt_for_priority
from engine_core.tracing import EngineTracing
from engine_core.workers import (Signer, WorkerGroup, WorkerHung, executor_for, honour_async_scheduling_on_cpu,
                                 read_key)
from servectl.messages import one_line
from servectl.paths import RuntimePaths, bind_private
from servectl.proc import die_with_parent, setup_child_logging
from servectl.wire import control as MP
from servectl.wire.spawn import (EngineSpec, engine_component, engine_identity, engine_max_message_bytes, model_of,
                                  read_spec_fd)
from servectl.wire.vocab import ExitCode

log = logging.getLogger("engine_core")
# "module:function" building the engine from the EngineSpec instead of vLLM's
# LLMEngine (for bench/'s zero-cost token source). Unset in production.
ENGINE_FACTORY_ENV = "SERVECTL_ENGINE_FACTORY"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine_core")
    ap.add_argument("--spec-fd", type=int, help="a memfd holding the EngineSpec as JSON (from the manager)")
    ap.add_argument("--key-fd", type=int)
    ap.add_argument("--worker-pidfds", default="")
    ap.add_argument("--remote-listen-fd", type=int, help="ranks on other hosts dial this (TCP) socket")
    ap.add_argument("--check", action="store_true", help="validate engine arguments and exit")
    ap.add_argument("--engine-args", help="with --check: engine arguments as JSON")
    ap.add_argument("--chat", help="with --check: the model's tool_call_parser and tool_parser_plugin as JSON")
    args = ap.parse_args(argv)
    if args.check:
        return check_engine_args(json.loads(args.engine_args or "{}"), json.loads(args.chat or "{}"))
    spec = read_spec_fd(args.spec_fd, EngineSpec)
    die_with_parent()
    setup_child_logging(f"engine_core[{spec.group_name}]", engine_component(spec.group_name), model_of(spec.group_name))
    # Tracing on: the start span times the load (None, and nothing imported, when off).
    traced = EngineTracing.start(spec.model.name, spec.incarnation, spec.group_name)
    key = read_key(args.key_fd)
    pidfds = [int(x) for x in args.worker_pidfds.split(",") if x]
    paths = RuntimePaths(Path(spec.runtime_dir))
    ctx = zmq.Context()
    control = ctx.socket(zmq.DEALER)
    control.setsockopt(zmq.IDENTITY, engine_identity(spec.group_name))
    control.setsockopt(zmq.LINGER, 1000)
    # The manager sends an engine only small messages (Drain, Release, AbortPeer, ...).
    control.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
    control.connect(RuntimePaths.ipc(paths.control))
    frontend = ctx.socket(zmq.ROUTER)
    frontend.setsockopt(zmq.LINGER, 0)
    # A gateway that reconnects keeps its identity (gw-<index>-<pid>). Without
    # handover a ROUTER that still holds the old connection takes the new one
    # for a duplicate and silently eats its first message (the Hello): that
    # gateway would wait for this engine forever.
    frontend.setsockopt(zmq.ROUTER_HANDOVER, 1)
    # A message no gateway's Generate can be (derived from gateway.max_body_bytes) closes that
    # connection before the engine holds it.
    frontend.setsockopt(zmq.MAXMSGSIZE, engine_max_message_bytes(spec.max_body_bytes))
    bind_private(frontend, paths.engine(spec.group_name))

    def report_deadline(seconds: float) -> None:
        why = ("the generous one: a step that may be slow, e.g. the first to need a sampler path"
               if seconds >= spec.worker_reply_timeout_s else "derived from the steps seen")
        log.info("step deadline now %.3gs (%s)", seconds, why)
        control.send(MP.encoder.encode(MP.StepDeadlineChanged(model=spec.group_name, incarnation=spec.incarnation,
                                                              seconds=seconds)))

    tp = spec.model.tensor_parallel_size
    group = WorkerGroup(
        worker_paths=[str(paths.worker(spec.group_name, r)) for r in range(tp)],
        pidfds=pidfds,
        signer=Signer(key),
        reply_timeout_s=spec.worker_reply_timeout_s,
        distributed_init_method=f"file://{paths.root}/dist-{spec.group_name}-{spec.incarnation}",
        init_methods=spec.init_methods or None,
        on_deadline=report_deadline,
        step_floor_s=spec.step_deadline_floor_s,
        step_multiple=spec.step_deadline_multiple,
        remote_ranks=frozenset(spec.remote_ranks),
        remote_listener=(socket.socket(fileno=args.remote_listen_fd) if args.remote_listen_fd is not None
                         else None),
        dead_after_s=spec.dead_after_s,
        local_ranks=spec.local_ranks,
    )
    group.connect()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine

    close_media_fetching()  # before vLLM reads its environment: no media URL fetched unless allowed
    idle = build_choice(spec.idle_release, current_platform.is_sleep_mode_available(), spec.idle_release_s,
                        spec.model.name)
    if idle.warning:
        log.warning("%s", idle.warning)
    factory = os.environ.get(ENGINE_FACTORY_ENV)
    slots = None  # the slot preemption on the priority policy (slot_preemption.py), for the log at exit
    try:
        if factory:
            # The documented hook for benchmarks (bench/zero_cost.py): anything
            # with LLMEngine's add_request/step/abort_request surface.
            module, _, name = factory.partition(":")
            engine = getattr(importlib.import_module(module), name)(spec)
            log.warning("engine built by %s, not vLLM's LLMEngine", factory)
        else:
            honour_async_scheduling_on_cpu()
            engine = LLMEngine.from_engine_args(EngineArgs(
                model=spec.model.model,
                tensor_parallel_size=tp,
                distributed_executor_backend=executor_for(group),
                **{**vllm_config(engine_args(spec.model), spec.runtime_dir, spec.model.name, spec.events_slot,
                                 spec.model.kv_events_token_ids), **idle.engine_args,
                   # vLLM's metrics carry model_name = this; the gateway shows them as they are.
                   "served_model_name": spec.model.name},
            ))
            slots = preempt_for_priority(engine)  # a better waiting request takes a full batch's slot
    except WorkerHung as exc:
        log.error("engine start failed: %s", exc)
        return ExitCode.HUNG
    except Exception as exc:
        reason = permanent_reason(exc)
        if reason is None:
            raise  # a crash like any other: its traceback in the log, restarted with backoff
        log.exception("engine start failed; a restart cannot fix this: %s", reason)
        report_permanent_failure(control, spec, reason)
        return ExitCode.PERMANENT

    def device_memory() -> int | None:
        """Accelerator memory in use on the workers' devices (None on CPU: no call, no thaw)."""
        if not current_platform.is_cuda_alike():
            return None
        used = [n for n in engine.collective_rpc(device_memory_in_use) if n is not None]
        return sum(used) if used else None

    server = EngineServer(spec, engine, group, frontend, control, release_mode=idle.mode,
                          device_memory=device_memory)
    server.tracing = traced
    # vLLM's OpenAI request classes are imported, the model's generation config read and its chat
    # parsers made now, before ready, not by the first request. A parser vLLM does not register,
    # or one that does not fit the tokenizer, is the configuration's fault: no restart fixes it.
    try:
        server.builder  # noqa: B018
        if server.adapters.enabled:  # its LoRA adapters: configured, and loaded at run time before
            server.adapters.load_at_start(spec.loras, list(spec.model.lora_modules))
    except WorkerHung as exc:
        log.error("engine start failed: %s", exc)
        return ExitCode.HUNG
    except Exception as exc:
        reason = permanent_reason(exc) or describe(exc)
        log.exception("the model's chat settings or LoRA adapters cannot be used; a restart cannot fix this: %s",
                      reason)
        report_permanent_failure(control, spec, reason)
        return ExitCode.PERMANENT
    try:  # what the model holds now it is loaded (the manager's memory budget): measured once
        server.footprint = group_footprint(list(engine.collective_rpc(footprint_in_worker)), rss_bytes())
    except WorkerHung as exc:
        log.error("engine start failed: %s", exc)
        return ExitCode.HUNG
    if traced is not None:
        server.trace_parent = traced.loaded(engine)
    server.say_ready()
    log.info("ready: %s (max_model_len %d, %d worker(s))", spec.model.model, server.max_model_len, tp)
    # The executor's counters (async scheduling overlap) go to the log at shutdown,
    # which is a SIGTERM from the manager: log, then die of the signal (the manager reads that exit).
    def log_counters_and_die(signum, frame) -> None:
        batches = getattr(server.halves, "batches", None)
        log.info("stopping: %s; %s%s%s", group.counters(), server.counters(),
                 f"; slots taken by a better priority {slots.preempted}" if slots is not None else "",
                 f"; yielding: steps one deep {batches.shallow_steps}, steps sat out {batches.sat_out}"
                 if batches is not None else "")
        if traced is not None:
            traced.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, log_counters_and_die)
    try:
        server.run()
    except WorkerHung as exc:
        log.error("%s: the group is hung; exiting so the manager restarts it", exc)
        exit_now(ExitCode.HUNG, group)
    except StepFailed as exc:
        log.exception("a step failed (%s): the engine's state is unknown; exiting so the manager restarts "
                      "the group", exc)
        exit_now(ExitCode.STEP_FAILED, group)
    log.info("executor: %s", group.counters())
    return 0


def engine_args(model) -> dict[str, Any]:
    """The model's vLLM engine arguments; its ``override_generation_config`` goes to vLLM's
    argument of that name (the server's default sampling parameters), over any given there."""
    args = dict(model.engine_args)
    # The gateways' fair share between keys is each request's priority (api_gateway/fair_share.py);
    # with every priority 0 this orders as "fcfs" does. A model's own setting wins.
    args.setdefault("scheduling_policy", "priority")
    if model.override_generation_config:
        args["override_generation_config"] = {**(args.get("override_generation_config") or {}),
                                              **model.override_generation_config}
    return args


def report_permanent_failure(control: zmq.Socket, spec: EngineSpec, reason: str, wait_s: float = 10.0) -> None:
    """Tell the manager why the group must not be restarted, and wait (bounded) for
    its Ack, so it knows before it sees this process exit."""
    control.send(MP.encoder.encode(MP.EngineFailed(model=spec.group_name, incarnation=spec.incarnation,
                                                   reason=reason)))
    deadline = time.monotonic() + wait_s
    # event-proof: a bounded wait for one reply, once, on the way out of a failed start.
    while (left := deadline - time.monotonic()) > 0 and control.poll(int(left * 1000) + 1):
        try:
            if isinstance(MP.control_out_decoder.decode(control.recv()), MP.Ack):
                return
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue  # a message for a serving engine (AbortPeer, ...): not ours now
    log.warning("the manager did not acknowledge the failure report; exiting %d anyway", ExitCode.PERMANENT)


def exit_now(code: int, group) -> None:
    """Leave at once: every second here is a second clients wait for the restart. The
    interpreter's teardown (vLLM's and torch's exit handlers, their threads) took seconds on
    a loaded machine, and the engine's state is unknown anyway; only the log is flushed."""
    log.info("executor: %s", group.counters())
    logging.shutdown()
    os._exit(code)


def check_engine_args(engine_args: dict[str, Any], chat: dict[str, Any] | None = None) -> int:
    """`python -m engine_core --check`: let vLLM itself judge engine arguments, and whether it
    registers the parsers named (``chat``: the model's tool_call_parser and tool_parser_plugin).
    A parser it does not know is named with the ones it does; the parsers in use are printed."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        EngineArgs(model="x", **engine_args)
    except TypeError as exc:  # one line, printed last: `servectl config check` shows the last line
        print(f"invalid engine argument: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"invalid engine arguments: {one_line(str(exc))}", file=sys.stderr)
        return 2
    chat = chat or {}
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    for key, path, load in (("tool_parser_plugin", chat.get("tool_parser_plugin"), ToolParserManager.import_tool_parser),
                            ("engine_args.reasoning_parser_plugin", engine_args.get("reasoning_parser_plugin"),
                             ReasoningParserManager.import_reasoning_parser)):
        try:
            if path:
                load(path)
        except Exception as exc:  # noqa: BLE001 - the plugin's own error, in one line
            print(f"{key} {path!r} cannot be imported: {one_line(str(exc))}", file=sys.stderr)
            return 2
    for key, name, known in (("tool_call_parser", chat.get("tool_call_parser"), ToolParserManager.list_registered()),
                             ("engine_args.reasoning_parser", engine_args.get("reasoning_parser"),
                              ReasoningParserManager.list_registered())):
        if name and name not in known:
            print(f"{key} {name!r} is not registered in vLLM; it registers: {', '.join(known)}", file=sys.stderr)
            return 2
        if name:
            print(f"{key}: {name}")
    return 0

