"""A worker's connections and its replies, in call order, each on the connection its call came on.

``Connections``: the worker's peers (a stream and a frame reader per accepted
connection). ``Replies``: a reply signed, or sent as an unsigned ``TokensReply``
(tokens_reply.py), and written to its connection; the worker's loop
(worker.py) calls ``send`` after each call and ``forward`` between calls.

Async scheduling. With it vLLM's model runner returns an
``AsyncModelRunnerOutput`` from ``sample_tokens`` (the device-to-host copy of
the sampled tokens still running); ``get_output()`` blocks until it is done.
As vLLM's own multiproc worker does (``WorkerProc.async_output_busy_loop``),
that wait, and the reply's pickling and signing, happen on an output thread,
so the worker's loop is already receiving and launching step N+1 while step N's
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

import itertools
import os
import queue
import socket
import threading
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from engine_core.workers.link import UNSIGNED, FrameReader, send_frames
from engine_core.workers.signing import Signer
from engine_core.workers.tokens_reply import TokensReplyCodec

_pair_ids = itertools.count()


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
