"""Issue 54: a rank on another host reaches its engine over TCP and proves the group key.

``WorkerGroup`` with a remote rank (engine_core/workers/remote.py: the rank dials the engine's
listening socket and answers a fresh challenge signed with the key) against the real worker
loop (``serve`` with its one engine connection) on loopback, without vLLM: calls go through;
a rank without the key, a hello replayed from another connection and an unsigned reply from a
remote rank are refused; the worker loop ends when its engine's connection closes.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
import zmq

from engine_core.workers.group import WorkerGroup
from engine_core.workers.link import HEADER, UNSIGNED_FLAG, FrameReader, send_frames
from engine_core.workers.pending_call import WorkerHung
from engine_core.workers.remote import CHALLENGE, HELLO, dial_engine
from engine_core.workers.signing import Signer
from hop_fixtures import KEY, call_method

pytestmark = pytest.mark.unit


class Echo:
    def echo(self, x):
        return ("echo", x)


def listener() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(4)
    return s


def remote_group(lsock: socket.socket, timeout: float = 5.0) -> WorkerGroup:
    g = WorkerGroup(worker_paths=["(remote)"], pidfds=[], signer=Signer(KEY), reply_timeout_s=timeout,
                    distributed_init_method="unused", remote_ranks=frozenset({0}), remote_listener=lsock,
                    dead_after_s=3.0)
    g.connect()
    return g


def run_rank(port: int, key: bytes = KEY, ctx: zmq.Context | None = None) -> tuple[threading.Thread, dict]:
    """The real worker loop as a remote rank: dial, prove, serve; ``out`` says how it ended."""
    from engine_core.workers.worker import serve

    out: dict = {}
    ctx = ctx or zmq.Context()

    def run() -> None:
        try:
            sock = dial_engine("127.0.0.1", port, Signer(key), 0, time.monotonic() + 5, 3.0)
        except OSError as exc:
            out["error"] = exc
            return
        serve(None, ctx, Signer(key), 0, logging.getLogger("test-remote"), wrapper=Echo(), run_method=call_method,
              engine=sock)
        out["returned"] = True

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_remote_rank_serves_calls_and_its_loop_ends_with_the_engine_connection():
    lsock = listener()
    g = remote_group(lsock)
    t, out = run_rank(lsock.getsockname()[1])
    assert g.call("echo", (7,), None) == [("echo", 7)]
    assert g.call("echo", ("x",), None) == [("echo", "x")]
    assert g.signer.rejected == 0
    g.close()  # the engine goes: the rank's loop returns (the process exits)
    t.join(10)
    assert out.get("returned") is True
    lsock.close()


def test_a_rank_without_the_key_is_refused_and_the_call_fails_at_its_deadline():
    lsock = listener()
    g = remote_group(lsock, timeout=1.5)
    t, out = run_rank(lsock.getsockname()[1], key=b"w" * 32)
    with pytest.raises(WorkerHung, match="did not connect"):
        g.call("echo", (1,), None)
    t.join(10)
    assert isinstance(out.get("error"), ConnectionError)  # the rank saw a challenge it cannot verify
    assert g.signer.rejected >= 1
    g.close()
    lsock.close()


def read_frame(sock: socket.socket) -> list[bytes]:
    reader = FrameReader()
    while True:
        frames = reader.feed(sock.recv(65536))
        if frames:
            return frames[0]


def test_a_replayed_hello_does_not_prove_a_rank():
    """An on-path observer records a genuine hello and replays it on its own connection: the
    engine's challenge there is a new nonce, so the recorded answer does not verify."""
    lsock = listener()
    port = lsock.getsockname()[1]
    signer = Signer(KEY)
    recorded: dict = {}

    def genuine_then_replay() -> None:
        s = socket.create_connection(("127.0.0.1", port))
        kind, nonce = signer.loads(read_frame(s))
        hello = signer.dumps((HELLO, 0, nonce))
        recorded["hello"] = hello
        send_frames(s, hello)
        recorded["first"] = s  # kept open: the engine keeps it as rank 0
        s2 = socket.create_connection(("127.0.0.1", port))
        read_frame(s2)  # its challenge
        send_frames(s2, hello)  # the recorded answer
        recorded["second"] = s2

    g = WorkerGroup(worker_paths=["(remote)", "(remote)"], pidfds=[], signer=Signer(KEY), reply_timeout_s=1.5,
                    distributed_init_method="unused", remote_ranks=frozenset({0, 1}), remote_listener=lsock)
    g.connect()
    t = threading.Thread(target=genuine_then_replay, daemon=True)
    t.start()
    with pytest.raises(WorkerHung, match="rank 1"):
        g.send("echo", (1,), None)  # rank 0 is the genuine connection; the replay never becomes rank 1
    t.join(5)
    assert g.sockets[1] is None
    assert g.signer.rejected >= 1
    for s in (recorded.get("first"), recorded.get("second")):
        if s is not None:
            s.close()
    g.close()
    lsock.close()


def test_an_unsigned_reply_from_a_remote_rank_is_refused():
    """Locally the peer is checked (SO_PEERCRED), so a step's tokens may come unsigned; from
    another host no peer check exists, so an unsigned frame is dropped like a forged one."""
    lsock = listener()
    port = lsock.getsockname()[1]
    signer = Signer(KEY)
    g = remote_group(lsock, timeout=1.5)
    g.tokens_codec = object()  # a codec is set (the executor's): unsigned replies would be decoded locally

    def impostor_reply() -> None:
        s = socket.create_connection(("127.0.0.1", port))
        kind, nonce = signer.loads(read_frame(s))
        assert kind == CHALLENGE
        send_frames(s, signer.dumps((HELLO, 0, nonce)))
        read_frame(s)  # the call
        payload = b"\x93\x01\xc3\xc0"  # msgpack [1, true, nil]: a TokensReply-shaped answer to call 1
        s.sendall(HEADER.pack(len(payload) | UNSIGNED_FLAG, b"\0" * 32) + payload)
        time.sleep(3)  # keep the connection while the engine waits
        s.close()

    t = threading.Thread(target=impostor_reply, daemon=True)
    t.start()
    with pytest.raises(WorkerHung):
        g.call("echo", (1,), None)
    assert g.signer.rejected >= 1 and g.token_replies == 0
    t.join(5)
    g.close()
    lsock.close()
