"""The engine ⇄ worker hop: signed pickles on a plain Unix stream socket.

Every other hop in servectl is ZeroMQ. This one is not because it is on the
path of every decode step, twice: a ZeroMQ message passes the sender's I/O
thread and the receiver's, each woken in the kernel and each needing a core,
before the receiving thread sees it. On a Unix socket the receiving thread
reads what the sending thread wrote (`python -m bench.hop_rtt`: round trip
p50 105 against 17 µs with both ends spinning, p90 154 against 19 µs;
bench/results/2026-11-30-hop-rtt.md).

A message on the stream is an 8-byte big-endian payload length, the payload's
32-byte HMAC-SHA256 and the payload: exactly the ``[mac, payload]`` frames of
``Signer.dumps``, so ``Signer.loads`` checks the signature before a byte is
unpickled, as on every other transport. One kind of message is not signed:
a step's reply that holds only sampled tokens, msgpack-encoded
(servectl/wire/worker.py), which nothing unpickles. Its length carries
``UNSIGNED_FLAG`` and its MAC field is zeros; the reader hands it on as
``[UNSIGNED, payload]``, whose empty MAC no ``Signer.loads`` accepts: an
unsigned frame is decoded as that struct by the engine, refused by a worker,
and unpickled by neither. A length over ``MAX_PAYLOAD`` cannot
be a call (garbage, or a peer speaking something else): the reader raises
``FrameError`` and the owner closes that connection; nothing else on the
stream can be trusted to be aligned after it. Other connections are not
affected: each peer has its own stream.

The engine connects to each worker's socket by its path; ``peer_credentials`` and
``pidfd_pid`` let it check that the process listening there is the worker it was
handed (by pidfd), not another process of the same uid at that path (group.py).

No vLLM, no ZeroMQ here (tests/test_worker_link_unit.py).
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

from servectl.paths import bind_private

HEADER = struct.Struct("!Q32s")  # payload length, HMAC-SHA256 of the payload
UNSIGNED_FLAG = 1 << 63  # in the length: a TokensReply, msgpack, no MAC (zeros in its place)
UNSIGNED = b""  # the MAC frame of an unsigned message, as the reader hands it on
MAX_PAYLOAD = 1 << 31  # a step's pickled SchedulerOutput is KiB to a few MiB; 2 GiB is not a call
READ_CHUNK = 1 << 16
MAX_READ = 1 << 24  # one recv's buffer is allocated up front: never the whole of a claimed length
JOIN_BELOW = 1 << 16  # smaller messages go out as one joined buffer (header + payload)


class FrameError(Exception):
    """The stream is not this protocol (a length no call can have): close the connection."""


class FrameReader:
    """Splits one stream's bytes into ``[mac, payload]`` frames, whatever the reads' sizes."""

    def __init__(self, max_payload: int = MAX_PAYLOAD):
        self.max_payload = max_payload
        self.buf = bytearray()

    def wanted(self) -> int:
        """Bytes still missing for the message being read (at least a header's worth)."""
        if len(self.buf) < HEADER.size:
            return HEADER.size - len(self.buf)
        length, _ = HEADER.unpack_from(self.buf)
        return max(0, HEADER.size + (length & ~UNSIGNED_FLAG) - len(self.buf))

    def feed(self, data: bytes) -> list[list[bytes]]:
        """The frames ``data`` completes, in stream order; FrameError on a length past the limit.

        A read that starts on a message boundary (every step's call and reply, as a rule)
        is sliced from ``data`` itself; only a partial message's bytes are kept and copied."""
        out: list[list[bytes]] = []
        if self.buf:
            self.buf += data
            consumed = self._split(self.buf, out)
            del self.buf[:consumed]
        else:
            consumed = self._split(data, out)
            self.buf += data[consumed:]
        return out

    def _split(self, data: bytes | bytearray, out: list[list[bytes]]) -> int:
        """Append the whole messages at the start of ``data`` to ``out``: the bytes they took."""
        pos = 0
        while len(data) - pos >= HEADER.size:
            length, mac = HEADER.unpack_from(data, pos)
            if length & UNSIGNED_FLAG:
                length &= ~UNSIGNED_FLAG
                mac = UNSIGNED
            if length > self.max_payload:
                raise FrameError(f"a message of {length} bytes (the limit is {self.max_payload})")
            end = pos + HEADER.size + length
            if len(data) < end:
                break
            out.append([mac, bytes(data[pos + HEADER.size:end])])
            pos = end
        return pos


def read_available(sock: socket.socket, reader: FrameReader) -> tuple[list[list[bytes]], bool]:
    """Read what the socket holds now, without blocking: (complete frames, the peer hung up).

    A read shorter than asked for took everything the socket held (a stream
    socket's recv returns what is queued, up to the size), so reading stops
    there: no second recv only to be told EAGAIN, with its exception, on every
    step's call and reply. Whatever arrives later, a hang-up included, makes the
    socket readable again for the owner's next poll.

    The socket must be in blocking mode (no timeout): Python waits out a socket's
    timeout before each recv, whatever the flags."""
    frames: list[list[bytes]] = []
    while True:
        want = min(MAX_READ, max(READ_CHUNK, reader.wanted()))
        try:
            data = sock.recv(want, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return frames, False
        except (ConnectionError, TimeoutError):  # reset, or a TCP peer's keepalive gave up (ETIMEDOUT)
            return frames, True
        if not data:
            return frames, True
        frames.extend(reader.feed(data))
        if len(data) < want:
            return frames, False


def send_frames(sock: socket.socket, frames: list[bytes], timeout: float | None = None) -> None:
    """Write one message, ``[mac, payload]`` (``[UNSIGNED, payload]``: unsigned); ``timeout``: raise
    ``TimeoutError`` if the peer does not read it in time.

    The message goes out in one non-blocking call: ``send`` of the joined
    buffer below ``JOIN_BELOW`` (a step's call or reply), ``sendmsg`` gathering
    header and payload uncopied above it. That fits the socket buffer as a
    rule, so it is one syscall on the step's path. Only what the buffer cannot
    take (a big prefill's call while the worker still runs the step before
    it) waits for the peer to read, bounded by ``timeout`` where the caller
    has a deadline; the sockets stay in blocking mode throughout."""
    mac, payload = frames
    header = HEADER.pack(len(payload) if mac else len(payload) | UNSIGNED_FLAG, mac)
    small = len(payload) < JOIN_BELOW
    data = header + payload if small else None
    try:  # send of one joined buffer is the cheaper call; sendmsg gathers a big payload uncopied
        if small:
            sent = sock.send(data, socket.MSG_DONTWAIT)
        else:
            sent = sock.sendmsg((header, payload), (), socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        sent = 0
    if sent == len(header) + len(payload):
        return
    rest = [memoryview(data)[sent:]] if small else [memoryview(header)[sent:],
                                                    memoryview(payload)[max(0, sent - len(header)):]]
    if timeout is not None:
        sock.settimeout(max(timeout, 1e-3))
    try:
        for part in rest:
            if len(part):
                sock.sendall(part)
    finally:
        if timeout is not None:
            sock.settimeout(None)


PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket
    (``SO_PEERCRED``: for a connecting end, the process that called ``listen``)."""
    return PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))


def pidfd_pid(fd: int) -> int | None:
    """The pid of the process a pidfd refers to (the ``Pid:`` line of its fdinfo), or None
    when it has exited (-1 there) or ``fd`` is not a pidfd."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"Pid:"):
                    pid = int(line.split()[1])
                    return pid if pid > 0 else None
    except (OSError, ValueError, IndexError):
        return None
    return None


def listen_private(path: Path, backlog: int = 16) -> socket.socket:
    """A listening Unix stream socket at ``path``, the socket file created mode 0600."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bind_private(sock, path)
    sock.listen(backlog)
    return sock
