"""The engine ⇄ worker hop on a Unix stream socket (engine_core/workers/link.py), without vLLM.

Framing at every split, garbage and oversized lengths on one connection not
touching another, a signature still checked before anything is unpickled,
and the engine side finding a worker that is gone, not listening yet, or not
reading — each at once or within its deadline, never by waiting forever (read on
the group's own clock, a ``SimClock``: tests/hop_fixtures.py).
"""

from __future__ import annotations

import os
import socket
import struct
import threading

import pytest

from conftest import wait_for
from engine_core.workers.group import WorkerGroup
from engine_core.workers.pending_call import WorkerHung
from engine_core.workers.processes import CONNECT_RETRY_S
from engine_core.workers.link import (
    HEADER,
    FrameError,
    FrameReader,
    listen_private,
    read_available,
    send_frames,
)
from engine_core.workers.signing import Signer
from hop_fixtures import KEY, SimClock, ctx, make_group, start_worker  # noqa: F401  (fixtures)
from servectl.wire.worker import STATS_METHOD

pytestmark = pytest.mark.unit


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


@pytest.fixture
def worker(ctx, tmp_path):
    path = tmp_path / "w0"
    start_worker(ctx, path, Echo())
    return path


def stats(g: WorkerGroup) -> dict:
    return g.call(STATS_METHOD, (), None, output_rank=0)[0]


def test_garbage_and_forgeries_on_other_connections_leave_the_engines_alone(ctx, tmp_path, worker):
    g = make_group(ctx, tmp_path, paths=[worker])
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
    wait_for(lambda: stats(g)["rejected"] >= 3, 10, interval=0.02, what="the worker to count three rejects")
    assert stats(g)["rejected"] == 3
    forger.setblocking(False)
    with pytest.raises(BlockingIOError):
        forger.recv(1)  # never answered (the engine's call after the forgeries was)
    forger.close()
    garbage.close()


def test_the_first_call_waits_for_a_worker_that_is_not_listening_yet(ctx, tmp_path):
    path = tmp_path / "late"
    bound = threading.Event()
    start_worker(ctx, path, Echo(), before=lambda: bound.wait(10))
    g = make_group(ctx, tmp_path, paths=[path])
    retries: list[float] = []

    def retry(seconds: float) -> None:  # the group's start-up sleep: the worker starts at the third
        retries.append(seconds)
        if len(retries) == 3:
            bound.set()
            wait_for(path.exists, 10, interval=0.01, what="the worker's socket")

    g.sleep = retry
    assert g.call("echo", ("late",), None) == ["late"]
    assert len(retries) >= 3 and set(retries) == {CONNECT_RETRY_S}  # it retried until the worker listened


def test_no_worker_at_all_is_hung_at_the_calls_deadline(ctx, tmp_path):
    clock = SimClock()
    g = make_group(ctx, tmp_path, paths=[tmp_path / "nobody"], timeout=0.3, clock=clock)
    with pytest.raises(WorkerHung, match="not listening"):
        g.call("echo", (1,), None)
    assert clock.now == pytest.approx(0.3, abs=0.011)  # retried (10 ms apart) until the call's deadline
    assert abs(len(clock.sleeps) - 30) <= 1


def test_a_worker_that_hangs_up_with_a_call_in_flight_fails_it_at_once(ctx, tmp_path):
    listener = listen_private(tmp_path / "w")
    clock = SimClock()
    g = make_group(ctx, tmp_path, paths=[tmp_path / "w"], timeout=60, clock=clock)
    call = g.send("echo", (1,), None)
    conn, _ = listener.accept()
    conn.close()  # the worker dies holding the call
    with pytest.raises(WorkerHung, match="closed its connection"):
        call.result()
    assert clock.now == 0  # at once: not the 60 s deadline, not even a spin's turn
    assert not g.outstanding
    listener.close()


def test_a_worker_that_reads_nothing_cannot_block_a_big_send_past_the_deadline(ctx, tmp_path):
    listener = listen_private(tmp_path / "w")  # connections queue in the backlog, nothing is ever read
    g = make_group(ctx, tmp_path, paths=[tmp_path / "w"], timeout=0.3)
    # The send waits in the kernel (the socket's timeout, the call's deadline) and gives up.
    with pytest.raises(WorkerHung, match="took no call echo within 0.3s"):
        g.send("echo", (b"x" * (8 << 20),), None)
    listener.close()
