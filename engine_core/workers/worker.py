"""One tensor-parallel rank of an engine group: ``python -m engine_core.workers.worker``.

Started by the manager (never by the engine). Listens on a Unix stream socket
(link.py: signed pickles, no ZeroMQ on this hop), blocks
until its engine's executor sends a signed call, runs the call on vLLM's
``WorkerWrapperBase`` and replies on the connection the call came on. Each
connection has its own stream: a peer that sends garbage loses its own
connection, never the engine's.

Call frames (after the signature check): ``(call_id, method, args, kwargs,
output_rank)``. Reply: ``(call_id, ok, result_or_error_text)``, in the order
the calls came. Ranks other than ``output_rank`` reply with None to keep step
outputs single-copy. A step's ``ModelRunnerOutput`` that holds only sampled
tokens goes as an unsigned ``TokensReply`` instead of a signed pickle
(tokens_reply.py; ``SERVECTL_TOKENS_REPLY=0`` turns that off,
for A/Bs).

Replies go out in call order on the connection their call came on
(replies.py: ``Connections``, ``Replies``); under async scheduling an output
still being copied to the host is resolved on an output thread, on a CPU on
this loop.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from engine_core.load_errors import RemoteFailure, permanent_reason
from engine_core.workers.link import FrameError, listen_private, read_available
from engine_core.workers.remote import dial_engine
from engine_core.workers.replies import Connections, Replies
from engine_core.workers.signing import BadSignature, Signer, read_key
from engine_core.workers.spin import WORKER_SPIN_ENV, spin_seconds
from engine_core.workers import warm_rows
from engine_core.workers.tokens_reply import TokensReplyCodec
from servectl.paths import RuntimePaths
from servectl.proc import die_with_parent, setup_child_logging
from servectl.wire.spawn import model_of, worker_component
from servectl.wire.worker import EXECUTE_AND_SAMPLE, STATS_METHOD

TOKENS_REPLY_ENV = "SERVECTL_TOKENS_REPLY"  # "0": every reply a signed pickle (an A/B of the encoding)
# "1": async outputs go to the output thread on CPU too (a GPU's path, for tests and A/Bs)
OUTPUT_THREAD_ENV = "SERVECTL_ASYNC_OUTPUT_THREAD"


class _NoAsync:  # stands in for AsyncModelRunnerOutput where none can occur
    pass


def serve(listener: socket.socket | None, ctx: zmq.Context, signer: Signer, rank: int, log, wrapper: Any = None,
          run_method: Callable[..., Any] | None = None, async_type: type | None = None,
          thread_init: Callable[[], None] | None = None, tokens_codec: TokensReplyCodec | None = None,
          resolve_inline: bool | None = None, engine: socket.socket | None = None) -> None:
    """The worker loop on a listening socket. Returns when ``ctx`` (the output thread's) is terminated.

    A rank on another host has no listener: it is given its one ``engine`` connection
    (remote.py) and returns when that closes (its engine is gone; its host's manager or the
    head starts a new group).

    ``wrapper``, ``run_method`` and ``async_type`` default to vLLM's
    ``WorkerWrapperBase``, ``run_method`` and ``AsyncModelRunnerOutput``, and
    ``tokens_codec`` to a codec of vLLM's ``ModelRunnerOutput``; tests pass stand-ins
    so this loop runs without vLLM. ``resolve_inline`` (async outputs resolved on the
    loop, not the output thread) defaults to whether vLLM's platform is the CPU.
    """
    if wrapper is None:
        # vLLM is imported after the socket is bound so the engine can connect
        # while this process is still paying for `import vllm`.
        from vllm.v1.outputs import AsyncModelRunnerOutput
        from vllm.v1.serial_utils import run_method as vllm_run_method
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        import torch
        import tqdm

        # vLLM's weight-loading progress bar would start tqdm's monitor thread, which then
        # wakes every 10 s for the worker's whole life (a timer firing while idle). The bars
        # still print; only the watchdog for stalled bars is off.
        tqdm.tqdm.monitor_interval = 0

        # Linux lends AMX tile registers only to a process that asks (arch_prctl);
        # oneDNN asks when it JITs an AMX kernel, but vLLM's own AMX attention
        # kernel does not, and dies of SIGILL if it runs first. Ask up front.
        if torch.cpu._is_amx_tile_supported():
            torch.cpu._init_amx()
        wrapper = WorkerWrapperBase(rpc_rank=rank, global_rank=rank)
        run_method = vllm_run_method
        async_type = AsyncModelRunnerOutput
        if tokens_codec is None and os.environ.get(TOKENS_REPLY_ENV, "1") != "0":
            from vllm.v1.outputs import ModelRunnerOutput

            tokens_codec = TokensReplyCodec(ModelRunnerOutput)

        if resolve_inline is None:
            from vllm.platforms import current_platform

            resolve_inline = current_platform.is_cpu() and os.environ.get(OUTPUT_THREAD_ENV) != "1"

        def thread_init() -> None:
            # As vLLM's WorkerProc.async_output_busy_loop: a thread does not
            # inherit the device, and a CUDA call on it would otherwise create
            # a second context on device 0.
            from vllm.platforms import current_platform

            device = getattr(getattr(wrapper, "worker", None), "device", None)
            if device is not None:
                current_platform.set_device(device)

    assert run_method is not None
    poller = zmq.Poller()
    conns = Connections(log, poller)
    replies = Replies(ctx, conns, signer, log, async_type or _NoAsync, thread_init or (lambda: None), tokens_codec,
                      bool(resolve_inline))
    listen_fd = -1
    if listener is not None:
        listener.setblocking(False)
        listen_fd = listener.fileno()
        poller.register(listen_fd, zmq.POLLIN)
    if engine is not None:
        conns.add(engine)
    poller.register(replies.pair, zmq.POLLIN)
    spin_s = spin_seconds(WORKER_SPIN_ENV)
    spin_until = 0.0
    try:
        while True:
            if spin_s and time.perf_counter() < spin_until:
                # event-proof: a bounded spin right after a call came and went
                # (work is flowing); once spin_s passes without a call, the
                # next poll blocks, so an idle worker never spins.
                events = dict(poller.poll(0))
                if not events:
                    os.sched_yield()  # whatever else is runnable gets the core (as vLLM's shm ring reader)
                    continue
            else:
                events = dict(poller.poll())  # idle: blocks in the kernel
            if replies.pair in events:
                replies.forward()
            if listen_fd in events:
                _accept(listener, conns)
            for fd in [fd for fd in events if fd in conns.socks]:
                peer = conns.peer_of[fd]
                frames_list = _read(fd, conns, signer, log)
                for frames in frames_list:
                    _handle(peer, frames, replies, signer, rank, log, wrapper, run_method, async_type or _NoAsync)
                    # A reply the output thread finished meanwhile goes out before the next call runs.
                    replies.forward()
                if frames_list:
                    spin_until = time.perf_counter() + spin_s
            if engine is not None and not conns.socks:
                log.warning("the engine's connection closed: exiting")
                return
    except zmq.ContextTerminated:
        pass
    finally:
        replies.close()
        conns.close_all()
        if listener is not None:
            listener.close()


def _accept(listener: socket.socket, conns: Connections) -> None:
    while True:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # e.g. the peer gave up before the accept (ECONNABORTED)
            return
        sock.setblocking(True)
        conns.add(sock)


def _read(fd: int, conns: Connections, signer: Signer, log) -> list[list[bytes]]:
    """The complete messages a connection holds; a hung-up or garbled connection is closed."""
    try:
        frames, eof = read_available(conns.socks[fd], conns.readers[fd])
    except FrameError as exc:
        signer.rejected += 1
        log.warning("rejected frame: %s; closing that connection (%d rejected so far)", exc, signer.rejected)
        frames, eof = [], True
    if eof:
        conns.close(fd)
    return frames


def _handle(peer: int, frames: list[bytes], replies: Replies, signer: Signer, rank: int, log, wrapper: Any,
            run_method: Callable[..., Any], async_type: type) -> None:
    try:
        call = signer.loads(frames)
        call_id, method, args, kwargs, output_rank = call
    except BadSignature as exc:
        log.warning("rejected frame: %s (%d rejected so far)", exc, signer.rejected)
        return
    except (TypeError, ValueError) as exc:
        # Signed but not a call tuple: a bug in the signer's peer, still no crash.
        signer.rejected += 1
        log.warning("rejected frame: malformed call (%s) (%d rejected so far)", exc, signer.rejected)
        return
    if method == STATS_METHOD:
        replies.send(peer, call_id, True, {"rejected": signer.rejected, "rank": rank, "pid": os.getpid()})
        return
    try:
        if method == EXECUTE_AND_SAMPLE:
            result = wrapper.execute_model(*args)
            if result is None:
                result = wrapper.sample_tokens(None)
        else:
            result = run_method(wrapper, method, args, kwargs or {})
            if method == warm_rows.AFTER_METHOD:
                warm_rows.warm_worker(wrapper, log)
        if output_rank is not None and output_rank != rank:
            result = None  # as vLLM's own workers, other ranks never resolve an async output
    except Exception as exc:  # the executor re-raises it in the engine
        log.exception("call %s failed", method if isinstance(method, str) else "<callable>")
        replies.send(peer, call_id, False, RemoteFailure(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                                                         permanent_reason(exc)))
        return
    replies.send(peer, call_id, True, result)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine_core.workers.worker")
    ap.add_argument("--model", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--runtime-dir", required=True)
    ap.add_argument("--key-fd", type=int, required=True)
    ap.add_argument("--dial", help="ADDR:PORT: a rank on another host dials its engine there (remote.py)")
    ap.add_argument("--dial-timeout-s", type=float, default=60.0)
    ap.add_argument("--dead-after-s", type=float, default=6.0)
    ap.add_argument("--source-addr", help="with --dial: this host's cluster address, the connection's source")
    args = ap.parse_args(argv)
    die_with_parent()
    log = setup_child_logging(f"worker[{args.model}:{args.rank}]", worker_component(args.model, args.rank),
                              model_of(args.model))
    signer = Signer(read_key(args.key_fd))
    if args.dial:
        addr, _, port = args.dial.rpartition(":")
        try:
            engine = dial_engine(addr, int(port), signer, args.rank, time.monotonic() + args.dial_timeout_s,
                                 args.dead_after_s, args.source_addr)
        except OSError as exc:
            log.error("cannot reach the engine at %s: %s", args.dial, exc)
            return 1
        log.info("connected to the engine at %s", args.dial)
        # No peer check is possible across hosts: every reply is a signed pickle (the engine
        # refuses an unsigned one from a remote rank).
        os.environ[TOKENS_REPLY_ENV] = "0"
        serve(None, zmq.Context(), signer, args.rank, log, engine=engine)
        return 0
    path = RuntimePaths(Path(args.runtime_dir)).worker(args.model, args.rank)
    listener = listen_private(path)
    log.info("listening on %s", path)
    serve(listener, zmq.Context(), signer, args.rank, log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
