"""What a transport costs per round trip between two processes, as the engine ⇄ worker hop uses it.

    python -m bench.hop_rtt                  # 3 alternating rounds of each, 3,000 round trips each
    python -m bench.hop_rtt --load 2         # with two processes that compute 3 ms, sleep 1 ms

One process sends a message (``--size`` bytes, a step call's order of
magnitude), the other sends it back. Four ways:

- ``zmq``: DEALER → ROUTER over ``ipc://``, both ends blocking (servectl's hop);
- ``zmq+spin``: the same, each end polling with ``sched_yield`` for a reply
  before blocking (servectl's default since the yielding spins);
- ``unix``: a Unix stream socket, length-prefixed, both ends blocking;
- ``unix+spin``: the same, each end reading without blocking (``MSG_DONTWAIT``)
  and yielding before it blocks.

A ZeroMQ message between processes passes the sender's and the receiver's
I/O threads, each woken in the kernel; a socket wakes the receiver alone, and
a spinning receiver not even that. The gap between these figures is what a
hop without ZeroMQ's I/O threads (a shared-memory ring, or a plain socket)
would save per step. Writes ``bench/results/<date>-hop-rtt.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import struct
import tempfile
import time
from pathlib import Path

import zmq

from bench.spread import alternate, cell, spreads

SPIN_S = 0.002
RESULTS = Path(__file__).resolve().parent / "results"


def _timed(n: int, send, receive) -> list[float]:
    """Seconds per round trip, ``n`` times: send, then receive the echo."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        send()
        receive()
        times.append(time.perf_counter() - t)
    return times


def _zmq_echo(path: str, spin: bool) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"ipc://{path}")
    while True:
        frames = _zmq_recv(sock, spin)
        if frames[1] == b"q":
            break
        sock.send_multipart(frames)
    sock.close(0)
    ctx.term()


def _zmq_recv(sock: zmq.Socket, spin: bool) -> list[bytes]:
    if spin:
        end = time.perf_counter() + SPIN_S
        # event-proof: a benchmark's bounded spin, as the engine's and the worker's
        while time.perf_counter() < end:
            try:
                return sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                os.sched_yield()
    return sock.recv_multipart()


def _zmq_client(path: str, spin: bool, n: int, payload: bytes) -> list[float]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"ipc://{path}")
    times = _timed(n, lambda: sock.send(payload), lambda: _zmq_recv(sock, spin))
    sock.send(b"q")
    sock.close(1000)
    ctx.term()
    return times


def _recv_exact(conn: socket.socket, n: int, spin: bool) -> bytes:
    buf = bytearray()
    end = time.perf_counter() + SPIN_S if spin else 0.0
    while len(buf) < n:
        if spin and time.perf_counter() < end:
            try:
                chunk = conn.recv(n - len(buf), socket.MSG_DONTWAIT)
            except BlockingIOError:
                os.sched_yield()  # event-proof: a benchmark's bounded spin
                continue
        else:
            chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _unix_recv(conn: socket.socket, spin: bool) -> bytes:
    (size,) = struct.unpack("<I", _recv_exact(conn, 4, spin))
    return _recv_exact(conn, size, spin)


def _unix_echo(path: str, spin: bool) -> None:
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    conn, _ = listener.accept()
    while (msg := _unix_recv(conn, spin)) != b"q":
        conn.sendall(struct.pack("<I", len(msg)) + msg)
    conn.close()
    listener.close()


def _unix_client(path: str, spin: bool, n: int, payload: bytes) -> list[float]:
    conn = socket.socket(socket.AF_UNIX)
    for _ in range(200):  # event-proof: a benchmark waiting (≤ 2 s) for its echo process to listen
        try:
            conn.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.01)
    frame = struct.pack("<I", len(payload)) + payload
    times = _timed(n, lambda: conn.sendall(frame), lambda: _unix_recv(conn, spin))
    conn.sendall(struct.pack("<I", 1) + b"q")
    conn.close()
    return times


def _load() -> None:
    while True:  # event-proof: a benchmark's background load, killed at the end
        end = time.perf_counter() + 0.003
        while time.perf_counter() < end:
            pass
        time.sleep(0.001)


WAYS = {"zmq": (_zmq_echo, _zmq_client, False), "zmq+spin": (_zmq_echo, _zmq_client, True),
        "unix": (_unix_echo, _unix_client, False), "unix+spin": (_unix_echo, _unix_client, True)}


def one_run(way: str, n: int, payload: bytes, workdir: str) -> list[float]:
    echo, client, spin = WAYS[way]
    path = os.path.join(workdir, f"{way.replace('+', '-')}-{time.monotonic_ns()}")
    proc = mp.get_context("spawn").Process(target=echo, args=(path, spin), daemon=True)
    proc.start()
    if way.startswith("zmq"):
        time.sleep(0.5)  # event-proof: once, the echo process's start (ZeroMQ reconnects anyway)
    try:
        return client(path, spin, n, payload)
    finally:
        proc.join(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=3000, help="round trips per run")
    ap.add_argument("--size", type=int, default=4096, help="message bytes")
    ap.add_argument("--load", type=int, default=0, help="background processes (3 ms busy, 1 ms asleep)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    payload = os.urandom(args.size)
    loads = [mp.get_context("spawn").Process(target=_load, daemon=True) for _ in range(args.load)]
    for p in loads:
        p.start()
    try:
        with tempfile.TemporaryDirectory(prefix="hop-rtt-") as workdir:
            def run(r: int, way: str) -> dict[str, float]:
                times = sorted(one_run(way, args.n, payload, workdir))
                cell = {"p50_us": times[len(times) // 2] * 1e6, "p90_us": times[int(len(times) * 0.9)] * 1e6}
                print(f"round {r + 1} {way:10s} p50 {cell['p50_us']:8.1f} µs  p90 {cell['p90_us']:8.1f} µs",
                      flush=True)
                return cell

            runs = alternate(args.rounds, tuple(WAYS), run)
    finally:
        for p in loads:
            p.kill()
    date = time.strftime("%Y-%m-%d")
    out = Path(args.out) if args.out else RESULTS / f"{date}-hop-rtt"
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "size": args.size, "n": args.n, "load": args.load,
              "loadavg": os.getloadavg(), "runs": runs}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"# A round trip between two processes — {result['date']}", "",
             f"{args.n} round trips of {args.size} bytes per run, {args.rounds} alternating rounds, "
             f"{args.load} background load process(es); load average at the end "
             f"{' '.join(f'{x:.1f}' for x in result['loadavg'])}. Median of the runs, [min – max].", "",
             "| transport | round trip p50 µs | p90 µs |", "|---|---|---|"]
    for way, cells in runs.items():
        figures = spreads(cells, ("p50_us", "p90_us"), lambda c, f: c[f])
        lines.append(f"| {way} | {cell(figures['p50_us'], ' – ')} | {cell(figures['p90_us'], ' – ')} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
