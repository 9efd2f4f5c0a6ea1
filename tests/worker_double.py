"""A worker test double: a thread with a ROUTER socket that speaks the worker protocol.

Frames are engine_core/signing.py's signed pickles: calls ``(call_id, method,
args, kwargs, output_rank)``, replies ``(call_id, ok, value)``. No vLLM, no
torch. The double's thread owns its ROUTER; the test talks to the thread
through a queue and an inproc doorbell, so every socket has one thread.

Modes:
- ``"auto"``: answer each call at once with ``handler(method, args)`` (by
  default ``("done", method, args)``);
- ``"manual"``: record calls; the test answers with ``reply(call_id, ...)``,
  in any order, whenever it likes;
- ``"dead"``: record calls, never answer (a hung worker).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from engine_core.signing import Signer

_ids = itertools.count()


class WorkerDouble:
    def __init__(self, ctx: zmq.Context, path: Path, signer: Signer, mode: str = "auto",
                 handler: Callable[[str, tuple], Any] | None = None):
        self.ctx = ctx
        self.path = path
        self.signer = signer
        self.mode = mode
        self.handler = handler or (lambda method, args: ("done", method, args))
        self.calls: list[tuple[int, str, tuple]] = []  # (call_id, method, args) in arrival order
        self.sent: list[int] = []  # call ids answered, in order
        self._peers: dict[int, bytes] = {}
        self._cond = threading.Condition()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._bell = f"inproc://worker-double-{next(_ids)}"
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"worker-double-{path.name}")
        self._thread.start()
        self._ready.wait(10)

    # ---- the test's side (any thread) ----------------------------------------------------
    def wait_calls(self, n: int, timeout: float = 10) -> list[tuple[int, str, tuple]]:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.calls) >= n, timeout):
                raise AssertionError(f"the double got {len(self.calls)} call(s), expected {n}")
            return list(self.calls)

    def reply(self, call_id: int, value: Any = None, ok: bool = True, raw: list[bytes] | None = None) -> None:
        """Answer a call (or send ``raw`` frames to the last peer) from the double's thread."""
        self._commands.put(("reply", call_id, ok, value, raw))
        self._ring()

    def reply_later(self, delay_s: float, call_id: int, value: Any = None, ok: bool = True) -> threading.Timer:
        timer = threading.Timer(delay_s, self.reply, args=(call_id, value, ok))
        timer.daemon = True
        timer.start()
        return timer

    def close(self) -> None:
        self._commands.put(("stop",))
        self._ring()
        self._thread.join(10)

    def _ring(self) -> None:
        # A socket of the calling thread's own, used once: one thread per socket.
        bell = self.ctx.socket(zmq.PUSH)
        bell.setsockopt(zmq.LINGER, 1000)
        bell.connect(self._bell)
        bell.send(b"!")
        bell.close()

    # ---- the double's thread --------------------------------------------------------------
    def _run(self) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"ipc://{self.path}")
        bell = self.ctx.socket(zmq.PULL)
        bell.setsockopt(zmq.LINGER, 0)
        bell.bind(self._bell)
        poller = zmq.Poller()
        for s in (sock, bell):
            poller.register(s, zmq.POLLIN)
        self._ready.set()
        last_peer = b""
        try:
            while True:
                events = dict(poller.poll())
                if bell in events:
                    while True:
                        try:
                            bell.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                    while True:
                        try:
                            cmd = self._commands.get_nowait()
                        except queue.Empty:
                            break
                        if cmd[0] == "stop":
                            return
                        _, call_id, ok, value, raw = cmd
                        if raw is not None:
                            sock.send_multipart([last_peer, *raw])
                            continue
                        peer = self._peers.get(call_id, last_peer)
                        sock.send_multipart([peer, *self.signer.dumps((call_id, ok, value))])
                        with self._cond:
                            self.sent.append(call_id)
                if sock in events:
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        peer, body = frames[0], frames[1:]
                        last_peer = peer
                        call_id, method, args, kwargs, output_rank = self.signer.loads(body)
                        with self._cond:
                            self.calls.append((call_id, method, args))
                            self._peers[call_id] = peer
                            self._cond.notify_all()
                        if self.mode == "auto":
                            sock.send_multipart([peer, *self.signer.dumps((call_id, True, self.handler(method, args)))])
                            with self._cond:
                                self.sent.append(call_id)
        finally:
            for s in (sock, bell):
                s.close()


def elapsed(t0: float) -> float:
    return time.monotonic() - t0
