"""The engine ⇄ worker hop on a Unix stream socket (engine_core/workers/link.py), without vLLM.

Framing at every split, garbage and oversized lengths on one connection not
touching another, a signature still checked before anything is unpickled,
and the engine side finding a worker that is gone, not listening yet, or not
reading — each at once or within its deadline, never by waiting forever.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time

import pytest
import zmq

from engine_core.workers.group import WorkerGroup, WorkerHung
from engine_core.workers.link import (
    HEADER,
    FrameError,
    FrameReader,
    listen_private,
    read_available,
    send_frames,
)
from engine_core.workers.signing import Signer
from servectl.wire.worker import STATS_METHOD

pytestmark = pytest.mark.unit

KEY = b"k" * 32


def encoded(frames: list[bytes]) -> bytes:
    mac, payload = frames
    return HEADER.pack(len(payload), mac) + payload


def test_frames_come_out_whole_and_in_order_at_every_split():
    signer = Signer(KEY)
    messages = [signer.dumps((i, "m", (b"x" * n,), None, None)) for i, n in enumerate((0, 1, 700, 70_000))]
    stream = b"".join(encoded(m) for m in messages)
    for cut in (1, 2, 39, 40, 41, 1000, len(stream)):
        reader, out = FrameReader(), []
        for i in range(0, len(stream), cut):
            out.extend(reader.feed(stream[i:i + cut]))
        assert out == messages, cut
        assert reader.buf == b"" and reader.wanted() == HEADER.size
    assert [signer.loads(f)[0] for f in out] == [0, 1, 2, 3]


def test_a_length_no_call_can_have_is_a_frame_error():
    reader = FrameReader(max_payload=1000)
    assert reader.feed(struct.pack("!Q", 1000) + b"m" * 32) == []
    assert reader.wanted() == 1000
    with pytest.raises(FrameError, match="1001 bytes"):
        FrameReader(max_payload=1000).feed(struct.pack("!Q", 1001) + b"m" * 32)
    with pytest.raises(FrameError):  # garbage read as a length: 0xffff... bytes
        FrameReader().feed(b"\xff" * 40)


def test_a_big_message_crosses_a_socket_pair_and_a_hang_up_is_seen():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    signer = Signer(KEY)
    frames = signer.dumps(("big", os.urandom(5 << 20)))
    t = threading.Thread(target=send_frames, args=(a, frames))
    t.start()
    reader, got = FrameReader(), []
    while not got:
        ready, hung_up = read_available(b, reader)
        got.extend(ready)
        assert not hung_up
    t.join()
    assert got == [frames] and signer.loads(got[0])[0] == "big"
    a.close()
    assert read_available(b, reader) == ([], True)
    b.close()


def test_the_listening_socket_is_private(tmp_path):
    sock = listen_private(tmp_path / "w")
    try:
        assert (tmp_path / "w").stat().st_mode & 0o777 == 0o600
    finally:
        sock.close()


# ---- the real worker loop -------------------------------------------------------------------

class Echo:
    def echo(self, value):
        return value


def run_method(wrapper, method, args, kwargs):
    return getattr(wrapper, method)(*args, **kwargs)


@pytest.fixture
def worker(tmp_path):
    from engine_core.workers.worker import serve

    ctx = zmq.Context()
    path = tmp_path / "w0"
    t = threading.Thread(target=serve, args=(listen_private(path), ctx, Signer(KEY), 0, logging.getLogger("w")),
                         kwargs=dict(wrapper=Echo(), run_method=run_method), daemon=True)
    t.start()
    yield path
    ctx.term()  # ends the loop
    t.join(10)
    assert not t.is_alive()


def group(paths, timeout: float = 5.0) -> WorkerGroup:
    g = WorkerGroup(worker_paths=[str(p) for p in paths], pidfds=[], signer=Signer(KEY), reply_timeout_s=timeout,
                    distributed_init_method="unused")
    g.connect()
    return g


def stats(g: WorkerGroup) -> dict:
    return g.call(STATS_METHOD, (), None, output_rank=0)[0]


def test_garbage_and_forgeries_on_other_connections_leave_the_engines_alone(worker):
    g = group([worker])
    try:
        assert g.call("echo", (1,), None) == [1]
        garbage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        garbage.connect(str(worker))
        garbage.sendall(b"\xff" * 64)  # a length no call can have: that connection is closed
        forger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        forger.connect(str(worker))
        send_frames(forger, Signer(os.urandom(32)).dumps((9, "echo", ("forged",), None, None)))
        mac, payload = Signer(KEY).dumps((10, "echo", ("tampered",), None, None))
        send_frames(forger, [mac, payload + b"x"])
        garbage.settimeout(10)
        assert garbage.recv(1) == b""  # closed by the worker
        # Positive control on the engine's own connection: answered, and the three counted.
        assert g.call("echo", (2,), None) == [2]
        deadline = time.monotonic() + 10
        while stats(g)["rejected"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stats(g)["rejected"] == 3
        forger.settimeout(0.3)
        with pytest.raises(TimeoutError):
            forger.recv(1)  # never answered
        forger.close()
        garbage.close()
    finally:
        g.close()


def test_the_first_call_waits_for_a_worker_that_is_not_listening_yet(tmp_path):
    from engine_core.workers.worker import serve

    path = tmp_path / "late"
    ctx = zmq.Context()

    def start_later():
        time.sleep(0.3)
        serve(listen_private(path), ctx, Signer(KEY), 0, logging.getLogger("w"), wrapper=Echo(),
              run_method=run_method)

    t = threading.Thread(target=start_later, daemon=True)
    t.start()
    g = group([path])
    try:
        assert g.call("echo", ("late",), None) == ["late"]
    finally:
        g.close()
        ctx.term()
        t.join(10)


def test_no_worker_at_all_is_hung_at_the_calls_deadline(tmp_path):
    g = group([tmp_path / "nobody"], timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(WorkerHung, match="not listening"):
        g.call("echo", (1,), None)
    assert time.monotonic() - t0 < 5


def test_a_worker_that_hangs_up_with_a_call_in_flight_fails_it_at_once(tmp_path):
    listener = listen_private(tmp_path / "w")
    g = group([tmp_path / "w"], timeout=60)
    call = g.send("echo", (1,), None)
    conn, _ = listener.accept()
    conn.close()  # the worker dies holding the call
    t0 = time.monotonic()
    with pytest.raises(WorkerHung, match="closed its connection"):
        call.result()
    assert time.monotonic() - t0 < 5  # not the 60 s deadline
    assert not g.outstanding
    listener.close()


def test_a_worker_that_reads_nothing_cannot_block_a_big_send_past_the_deadline(tmp_path):
    listener = listen_private(tmp_path / "w")  # connections queue in the backlog, nothing is ever read
    g = group([tmp_path / "w"], timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(WorkerHung, match="took no call"):
        g.send("echo", (b"x" * (8 << 20),), None)
    assert time.monotonic() - t0 < 5
    listener.close()
