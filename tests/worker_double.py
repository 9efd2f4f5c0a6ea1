"""A worker test double: a thread listening on a Unix socket that speaks the worker protocol.

Messages are engine_core/workers/link.py's signed pickles on a stream: calls
``(call_id, method, args, kwargs, output_rank)``, replies ``(call_id, ok,
value)``. No vLLM, no torch. The double's thread owns its sockets; the test
talks to the thread through a queue and a socketpair doorbell.

Modes:
- ``"auto"``: answer each call at once with ``handler(method, args)`` (by
  default ``("done", method, args)``);
- ``"manual"``: record calls; the test answers with ``reply(call_id, ...)``,
  in any order, whenever it likes;
- ``"dead"``: record calls, never answer (a hung worker).
"""

from __future__ import annotations

import queue
import selectors
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine_core.workers.link import FrameReader, listen_private, read_available, send_frames
from engine_core.workers.signing import Signer


class WorkerDouble:
    def __init__(self, path: Path, signer: Signer, mode: str = "auto",
                 handler: Callable[[str, tuple], Any] | None = None):
        self.path = path
        self.signer = signer
        self.mode = mode
        self.handler = handler or (lambda method, args: ("done", method, args))
        self.calls: list[tuple[int, str, tuple]] = []  # (call_id, method, args) in arrival order
        self.sent: list[int] = []  # call ids answered, in order
        self._peers: dict[int, socket.socket] = {}
        self._cond = threading.Condition()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._bell_r, self._bell_w = socket.socketpair()
        self._listener = listen_private(path)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"worker-double-{path.name}")
        self._thread.start()

    # ---- the test's side (any thread) ----------------------------------------------------
    def wait_calls(self, n: int, timeout: float = 10) -> list[tuple[int, str, tuple]]:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.calls) >= n, timeout):
                raise AssertionError(f"the double got {len(self.calls)} call(s), expected {n}")
            return list(self.calls)

    def reply(self, call_id: int, value: Any = None, ok: bool = True, raw: list[bytes] | None = None) -> None:
        """Answer a call (or send ``raw`` frames to the last peer) from the double's thread."""
        self._commands.put(("reply", call_id, ok, value, raw))
        self._bell_w.send(b"!")

    def reply_now(self, call_id: int, value: Any = None, ok: bool = True) -> None:
        """Answer a call from the caller's thread: the reply is in the engine's socket when this
        returns (for a test on a simulated clock, tests/hop_fixtures.py). Manual mode only (the
        double's thread then never writes)."""
        assert self.mode != "auto"
        with self._cond:
            peer = self._peers[call_id]
        self._send(peer, call_id, ok, value)

    def reply_later(self, delay_s: float, call_id: int, value: Any = None, ok: bool = True) -> threading.Timer:
        timer = threading.Timer(delay_s, self.reply, args=(call_id, value, ok))
        timer.daemon = True
        timer.start()
        return timer

    def close(self) -> None:
        self._commands.put(("stop",))
        self._bell_w.send(b"!")
        self._thread.join(10)
        self._bell_w.close()

    # ---- the double's thread --------------------------------------------------------------
    def _send(self, peer: socket.socket, call_id: int, ok: bool, value: Any) -> None:
        send_frames(peer, self.signer.dumps((call_id, ok, value)))
        with self._cond:
            self.sent.append(call_id)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, "listen")
        sel.register(self._bell_r, selectors.EVENT_READ, "bell")
        readers: dict[socket.socket, FrameReader] = {}
        last_peer: socket.socket | None = None
        try:
            while True:
                for key, _ in sel.select():
                    if key.data == "listen":
                        conn, _ = self._listener.accept()
                        readers[conn] = FrameReader()
                        sel.register(conn, selectors.EVENT_READ, "conn")
                    elif key.data == "bell":
                        self._bell_r.recv(4096)
                        while True:
                            try:
                                cmd = self._commands.get_nowait()
                            except queue.Empty:
                                break
                            if cmd[0] == "stop":
                                return
                            _, call_id, ok, value, raw = cmd
                            peer = self._peers.get(call_id, last_peer)
                            if raw is not None:
                                send_frames(last_peer, raw)
                                continue
                            self._send(peer, call_id, ok, value)
                    else:
                        conn = key.fileobj
                        messages, hung_up = read_available(conn, readers[conn])
                        for frames in messages:
                            last_peer = conn
                            call_id, method, args, kwargs, output_rank = self.signer.loads(frames)
                            with self._cond:
                                self.calls.append((call_id, method, args))
                                self._peers[call_id] = conn
                                self._cond.notify_all()
                            if self.mode == "auto":
                                self._send(conn, call_id, True, self.handler(method, args))
                        if hung_up:
                            sel.unregister(conn)
                            conn.close()
                            readers.pop(conn)
        finally:
            for conn in readers:
                conn.close()
            self._listener.close()
            self._bell_r.close()
            sel.close()
