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

Async scheduling. With it vLLM's model runner returns an
``AsyncModelRunnerOutput`` from ``sample_tokens`` (the device-to-host copy of
the sampled tokens still running); ``get_output()`` blocks until it is done.
As vLLM's own multiproc worker does (``WorkerProc.async_output_busy_loop``),
that wait, and the reply's pickling and signing, happen on an output thread,
so this loop is already receiving and launching step N+1 while step N's
output is copied. The loop owns the connections; the output thread hands
finished replies back through one end of an inproc ZeroMQ PAIR (the loop
writes them to the connection as soon as it is not inside a call). While
anything is with the output thread, every later reply queues behind it
there, so replies stay first in, first out. A worker that never sees an
async output (async scheduling off) never starts the thread.

On a CPU device there is no copy to wait for: vLLM's CPU runner makes the
copy's event a no-op, so ``get_output()`` returns at once. There the output
is resolved and its reply written on the loop (``resolve_inline``), before
the loop takes step N+1: handed to the thread, it would be written only
after step N+1 ran (the loop writes between calls), so the engine would get
step N's tokens a whole step late and the batch queue would not overlap
anything. ``SERVECTL_ASYNC_OUTPUT_THREAD=1`` keeps the thread on CPU (the
GPU's path, for tests and A/Bs).
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from engine_core.load_errors import RemoteFailure, permanent_reason
from engine_core.workers.link import UNSIGNED, FrameError, FrameReader, listen_private, read_available, send_frames
from engine_core.workers.signing import BadSignature, Signer, read_key
from engine_core.workers.spin import WORKER_SPIN_ENV, spin_seconds
from engine_core.workers.tokens_reply import TokensReplyCodec
from servectl.paths import RuntimePaths
from servectl.proc import die_with_parent, setup_child_logging
from servectl.wire.worker import EXECUTE_AND_SAMPLE, STATS_METHOD

TOKENS_REPLY_ENV = "SERVECTL_TOKENS_REPLY"  # "0": every reply a signed pickle (an A/B of the encoding)
# "1": async outputs go to the output thread on CPU too (a GPU's path, for tests and A/Bs)
OUTPUT_THREAD_ENV = "SERVECTL_ASYNC_OUTPUT_THREAD"
_pair_ids = itertools.count()


class _NoAsync:  # stands in for AsyncModelRunnerOutput where none can occur
    pass


class Connections:
    """The worker's peers: a stream and a frame reader per accepted connection, and their polling.

    The loop polls them by fd; replies name their connection by a peer number
    that is never reused (an fd is, once its connection closes). Whoever
    closes a connection (a hang-up, garbage, a failed reply) closes it here,
    so the poller never holds a closed fd."""

    def __init__(self, log, poller: zmq.Poller):
        self.log = log
        self.poller = poller
        self.socks: dict[int, socket.socket] = {}  # fd -> its connection
        self.readers: dict[int, FrameReader] = {}  # fd -> its stream's reader
        self.peer_of: dict[int, int] = {}  # fd -> peer number
        self.fd_of: dict[int, int] = {}  # peer number -> fd
        self._peers = itertools.count(1)

    def add(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        self.socks[fd] = sock
        self.readers[fd] = FrameReader()
        self.peer_of[fd] = peer = next(self._peers)
        self.fd_of[peer] = fd
        self.poller.register(fd, zmq.POLLIN)

    def close(self, fd: int) -> None:
        sock = self.socks.pop(fd, None)
        if sock is None:
            return
        self.poller.unregister(fd)
        self.readers.pop(fd)
        self.fd_of.pop(self.peer_of.pop(fd))
        sock.close()

    def deliver(self, peer: int, frames: list[bytes]) -> None:
        """Write a reply to the connection its call came on (gone: the reply is dropped)."""
        fd = self.fd_of.get(peer)
        if fd is None:
            self.log.warning("dropped a reply: its caller's connection is closed")
            return
        try:
            send_frames(self.socks[fd], frames)  # blocking: the engine reads its replies while it waits for them
        except OSError as exc:
            self.log.warning("dropped a reply: %s", exc)
            self.close(fd)

    def close_all(self) -> None:
        for fd in list(self.socks):
            self.close(fd)


class Replies:
    """Sends replies in call order; async outputs are resolved on an output thread, or on the
    loop where they are already on the host (``resolve_inline``)."""

    def __init__(self, ctx: zmq.Context, conns: Connections, signer: Signer, log, async_type: type,
                 thread_init: Callable[[], None] = lambda: None, tokens_codec: TokensReplyCodec | None = None,
                 resolve_inline: bool = False):
        self.ctx = ctx
        self.resolve_inline = resolve_inline  # outputs already on the host (CPU): no thread, no wait
        self.inline_logged = False
        self.tokens_codec = tokens_codec
        self.conns = conns
        self.signer = signer
        self.log = log
        self.async_type = async_type
        self.thread_init = thread_init
        self.in_thread = 0  # replies handed to the output thread and not yet forwarded (loop thread only)
        self.thread: threading.Thread | None = None
        self.work: queue.SimpleQueue = queue.SimpleQueue()
        self.address = f"inproc://servectl-worker-replies-{os.getpid()}-{next(_pair_ids)}"
        self.pair = ctx.socket(zmq.PAIR)
        self.pair.setsockopt(zmq.LINGER, 0)
        self.pair.bind(self.address)

    # ---- the loop's side ----------------------------------------------------------
    def send(self, peer: int, call_id: Any, ok: bool, value: Any) -> None:
        if self.resolve_inline and not self.in_thread and isinstance(value, self.async_type):
            if not self.inline_logged:
                self.inline_logged = True
                self.log.info("async scheduling: async model outputs are resolved on the loop (already on the host)")
            ok, value = self._resolve(ok, value)
        if isinstance(value, self.async_type) or self.in_thread:
            if self.thread is None:
                self.log.info("async scheduling: async model outputs are resolved on an output thread")
                self.thread = threading.Thread(target=self._output_loop, name="servectl-async-output", daemon=True)
                self.thread.start()
            self.in_thread += 1
            self.work.put((peer, call_id, ok, value))
            return
        self.conns.deliver(peer, self._frames(call_id, ok, value))

    def forward(self) -> None:
        """Write every reply the output thread has finished to its connection (never waits for one)."""
        while self.in_thread:  # none handed over: nothing to ask the pair for
            try:
                peer, mac, payload = self.pair.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.in_thread -= 1
            self.conns.deliver(int(peer), [mac, payload])

    def close(self) -> None:
        if self.thread is not None:
            self.work.put(None)  # the output thread closes its socket and ends
            self.thread.join()
        self.pair.close()

    # ---- both sides -------------------------------------------------------------------
    def _resolve(self, ok: bool, value: Any) -> tuple[bool, Any]:
        try:
            return ok, value.get_output()
        except Exception as exc:
            self.log.exception("async model output failed")
            return False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"

    def _frames(self, call_id: Any, ok: bool, value: Any) -> list[bytes]:
        if ok and self.tokens_codec is not None:
            payload = self.tokens_codec.encode(call_id, value)
            if payload is not None:
                return [UNSIGNED, payload]
        try:
            return self.signer.dumps((call_id, ok, value))
        except Exception as exc:  # e.g. an unpicklable result: report it instead
            return self.signer.dumps((call_id, False, f"reply not sendable: {exc!r}"))

    # ---- the output thread -----------------------------------------------------------
    def _output_loop(self) -> None:
        out = self.ctx.socket(zmq.PAIR)
        out.setsockopt(zmq.LINGER, 0)
        out.connect(self.address)
        try:
            self.thread_init()
        except Exception:
            self.log.exception("output thread setup failed")
        try:
            while True:
                item = self.work.get()  # idle: blocks on the queue's lock
                if item is None:
                    return
                peer, call_id, ok, value = item
                if isinstance(value, self.async_type):
                    ok, value = self._resolve(ok, value)
                out.send_multipart([str(peer).encode(), *self._frames(call_id, ok, value)], copy=False)
        except zmq.ContextTerminated:
            return
        finally:
            out.close()


def serve(listener: socket.socket, ctx: zmq.Context, signer: Signer, rank: int, log, wrapper: Any = None,
          run_method: Callable[..., Any] | None = None, async_type: type | None = None,
          thread_init: Callable[[], None] | None = None, tokens_codec: TokensReplyCodec | None = None,
          resolve_inline: bool | None = None) -> None:
    """The worker loop on a listening socket. Returns when ``ctx`` (the output thread's) is terminated.

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
    listener.setblocking(False)
    listen_fd = listener.fileno()
    poller.register(listen_fd, zmq.POLLIN)
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
    except zmq.ContextTerminated:
        pass
    finally:
        replies.close()
        conns.close_all()
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
    args = ap.parse_args(argv)
    die_with_parent()
    log = setup_child_logging(f"worker[{args.model}:{args.rank}]")
    signer = Signer(read_key(args.key_fd))
    path = RuntimePaths(Path(args.runtime_dir)).worker(args.model, args.rank)
    listener = listen_private(path)
    log.info("listening on %s", path)
    serve(listener, zmq.Context(), signer, args.rank, log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
