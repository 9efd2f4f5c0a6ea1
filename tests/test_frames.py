"""Garbage and forged frames on every socket are rejected; nothing dies of them."""

from __future__ import annotations

import os
import subprocess
import sys

import socket

import msgspec
import zmq

from conftest import ROOT, wait_for
from servectl.wire import engine as EP
from engine_core.workers.link import FrameReader, read_available, send_frames
from engine_core.workers.signing import Signer
from servectl.wire.worker import STATS_METHOD
from servectl.wire import control as MP

GARBAGE = [b"\x00\xff garbage", msgspec.msgpack.encode({"type": "generate", "request_id": 5})]


def dealer(path, identity: bytes | None = None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(f"ipc://{path}")
    return sock


def test_engine_socket_rejects_garbage_and_keeps_serving(daemon):
    sock = dealer(daemon.runtime_dir / "engine-default")
    try:
        sock.send(EP.encoder.encode(EP.Hello(version=EP.PROTOCOL_VERSION)))
        assert sock.poll(10000), "no hello reply"
        before = EP.to_gateway_decoder.decode(sock.recv()).rejected_frames
        for frame in GARBAGE:
            sock.send(frame)
        sock.send_multipart([b"two", b"frames"])
        # Positive control: a well-formed hello on the same socket is answered,
        # and it reports the three rejections.
        sock.send(EP.encoder.encode(EP.Hello(version=EP.PROTOCOL_VERSION)))
        assert sock.poll(10000)
        reply = EP.to_gateway_decoder.decode(sock.recv())
        assert reply.rejected_frames == before + 3
    finally:
        sock.close()
    # The log reaches its file through the manager: it may come a moment after the reply.
    wait_for(lambda: "rejected frame" in daemon.log("engine_core:default"), 20, what="the engine to log it")
    r = daemon.openai().completions.create(model="default", prompt="x", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_a_peer_that_reconnects_under_its_identity_is_answered_on_the_new_connection(daemon):
    """Gateways keep their identity across reconnects, engines across restarts.

    The old connection is still open when the new one arrives (the worst case):
    without ROUTER_HANDOVER the new connection's first message is eaten and it
    is never answered.
    """
    cases = [(daemon.runtime_dir / "engine-default", EP.encoder.encode(EP.Hello(version=EP.PROTOCOL_VERSION)),
              EP.to_gateway_decoder, EP.HelloReply),
             (daemon.runtime_dir / "control", MP.encoder.encode(MP.StatusRequest()), MP.control_out_decoder,
              MP.StatusReply)]
    for path, hello, decoder, reply_type in cases:
        old, new = dealer(path, b"test-reconnect"), None
        try:
            old.send(hello)
            assert old.poll(10000), f"{path.name}: no reply on the first connection"
            assert isinstance(decoder.decode(old.recv()), reply_type)
            new = dealer(path, b"test-reconnect")
            new.send(hello)
            assert new.poll(10000), f"{path.name}: the reconnected peer was not answered"
            assert isinstance(decoder.decode(new.recv()), reply_type)
        finally:
            old.close()
            if new is not None:
                new.close()


def test_gateway_link_does_not_reconnect_for_a_repeated_ready(daemon):
    """Every freeze/thaw re-announces "ready" for the same engine lifetime."""
    import asyncio

    import zmq.asyncio

    from api_gateway.engines import EngineLink

    incarnation = next(m.incarnation for m in daemon.status().models if m.name == "default")

    async def scenario():
        ctx = zmq.asyncio.Context()
        link = EngineLink("default", str(daemon.runtime_dir / "engine-default"), ctx, b"test-link")
        try:
            link.on_model_state("ready", incarnation, None)
            first = link.sock
            link.on_model_state("ready", incarnation, None)  # before the Hello is answered
            await asyncio.wait_for(link.ready.wait(), 30)
            assert link.sock is first and link.incarnation == incarnation
            link.on_model_state("ready", incarnation, None)  # after
            assert link.sock is first and link.ready.is_set()
        finally:
            link.remove()
            ctx.term()

    asyncio.run(scenario())


def test_control_socket_rejects_garbage(daemon):
    sock = dealer(daemon.runtime_dir / "control")
    try:
        sock.send(b"\x93nonsense")
        assert sock.poll(10000)
        reply = MP.control_out_decoder.decode(sock.recv())
        assert isinstance(reply, MP.Ack) and not reply.ok and "bad request" in reply.message
        sock.send(MP.encoder.encode(MP.StatusRequest()))
        assert sock.poll(10000)
        assert isinstance(MP.control_out_decoder.decode(sock.recv()), MP.StatusReply)
    finally:
        sock.close()


def worker_conn(path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    return sock


def test_worker_socket_rejects_unsigned_and_forged_frames_in_the_daemon(daemon):
    worker = daemon.child("worker:default:0")
    path = daemon.runtime_dir / "worker-default-0"
    garbage, forger = worker_conn(path), worker_conn(path)
    try:
        garbage.sendall(b"\xff garbage, not a length " * 4)
        send_frames(forger, Signer(os.urandom(32)).dumps((1, "shutdown", (), {}, None)))
        # A worker never answers a rejected frame; a stream it cannot read is closed.
        garbage.settimeout(20)
        assert garbage.recv(1) == b""
        forger.settimeout(1.5)
        try:
            assert forger.recv(1) == b"", "a forged call was answered"
        except TimeoutError:
            pass
    finally:
        garbage.close()
        forger.close()
    wait_for(lambda: daemon.log("worker:default:0").count("rejected frame") >= 2, 20,
             what="the worker to log both rejections")
    assert "HMAC mismatch" in daemon.log("worker:default:0")
    r = daemon.openai().completions.create(model="default", prompt="y", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    assert daemon.child("worker:default:0").pid == worker.pid  # it did not die of it


def test_standalone_worker_accepts_only_correctly_signed_frames(tmp_path):
    """Positive control: the same call signed with the group key is answered."""
    key = os.urandom(32)
    r, w = os.pipe()
    os.write(w, key)
    os.close(w)
    proc = subprocess.Popen([sys.executable, "-m", "engine_core.workers.worker", "--model", "solo", "--rank", "0",
                             "--runtime-dir", str(tmp_path), "--key-fd", str(r)], pass_fds=(r,), cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    os.close(r)
    try:
        wait_for(lambda: (tmp_path / "worker-solo-0").exists(), 60, what="the worker socket")
        garbage = worker_conn(tmp_path / "worker-solo-0")
        garbage.sendall(b"\xff" * 64)  # a length no call can have: that connection is closed
        sock = worker_conn(tmp_path / "worker-solo-0")
        signer = Signer(key)
        call = (7, STATS_METHOD, (), {}, None)
        send_frames(sock, Signer(os.urandom(32)).dumps(call))  # same call, wrong key
        mac, payload = signer.dumps(call)
        send_frames(sock, [mac, payload + b"x"])  # right key, tampered payload
        send_frames(sock, signer.dumps(call))
        reader, replies = FrameReader(), []
        while not replies:
            assert zmq.select([sock], [], [], 120)[0], "the correctly signed call got no reply"
            got, hung_up = read_available(sock, reader)
            replies.extend(got)
            assert not hung_up
        call_id, ok, stats = signer.loads(replies[0])
        assert (call_id, ok) == (7, True)
        assert stats["rejected"] == 3
        assert not zmq.select([sock], [], [], 0.5)[0]  # and exactly one reply
        assert len(replies) == 1
        sock.close()
        garbage.close()
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
