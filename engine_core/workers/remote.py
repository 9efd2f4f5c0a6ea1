"""Ranks on another host: their TCP connection to the engine and how each end proves itself.

A rank on the engine's host is reached on a Unix socket whose peer is checked against its
pidfd (processes.py). A rank on another host cannot be checked that way, so it dials the
engine instead (the engine's host's manager bound the listening socket and passed it in; the
rank's host's manager told it where) and proves that it holds the group's key: the engine
sends a fresh nonce, the rank answers ``(HELLO, rank, nonce)`` signed with the key. The key
is derived on each host from the cluster secret and the incarnation (manager/cluster_link.py),
so it never crosses the network, and a hello recorded from another incarnation or another
connection does not verify. Every later frame from such a rank must be signed: an unsigned
``TokensReply`` is refused from it (group.py), and the rank sends none.

The kernel watches the link (TCP keepalive and ``TCP_USER_TIMEOUT``, set on both ends): a host
that vanishes or a cable pulled closes the connection within ``dead_after_s``, with no timer in
either process; the rank exits when its engine's connection closes (worker.py).
"""

from __future__ import annotations

import os
import socket
import time

from engine_core.workers.link import FrameReader, send_frames
from engine_core.workers.signing import BadSignature, Signer
from servectl.tcp import tune_socket

CHALLENGE = "servectl-challenge"
HELLO = "servectl-hello"


def _read_one(sock: socket.socket, deadline: float) -> list[bytes] | None:
    """One frame from ``sock`` before ``deadline`` (monotonic), or None (timeout, hang-up, garbage)."""
    reader = FrameReader(max_payload=4096)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            data = sock.recv(4096)
        except (TimeoutError, OSError):
            return None
        finally:
            sock.settimeout(None)
        if not data:
            return None
        try:
            frames = reader.feed(data)
        except Exception:  # noqa: BLE001 - a length no hello has: not a rank
            return None
        if frames:
            return frames[0]


def accept_rank(listener: socket.socket, signer: Signer, wanted: set[int], deadline: float,
                dead_after_s: float) -> tuple[int, socket.socket] | None:
    """The next connection on ``listener`` that proves to be one of the ``wanted`` ranks,
    before ``deadline``; None when the deadline passed first. Others are closed (counted)."""
    while (left := deadline - time.monotonic()) > 0:
        listener.settimeout(left)
        try:
            sock, _ = listener.accept()
        except (TimeoutError, OSError):
            continue
        finally:
            listener.settimeout(None)
        sock.setblocking(True)
        nonce = os.urandom(32)
        try:
            send_frames(sock, signer.dumps((CHALLENGE, nonce)), timeout=5.0)
        except OSError:
            sock.close()
            continue
        frames = _read_one(sock, min(deadline, time.monotonic() + 5.0))
        try:
            kind, rank, echoed = signer.loads(frames) if frames and frames[0] else (None, None, None)
        except (BadSignature, TypeError, ValueError):
            kind = None
        if kind == HELLO and echoed == nonce and rank in wanted:
            tune_socket(sock, dead_after_s)
            return rank, sock
        signer.rejected += 1
        sock.close()
    return None


def dial_engine(addr: str, port: int, signer: Signer, rank: int, deadline: float,
                dead_after_s: float, source: str | None = None) -> socket.socket:
    """Connect to the engine and answer its challenge (a rank's side); OSError when it cannot.
    ``source``: this host's cluster address, the connection's (else routing picks one)."""
    sock = socket.create_connection((addr, port), timeout=max(0.1, deadline - time.monotonic()),
                                    source_address=(source, 0) if source else None)
    sock.settimeout(None)
    try:
        frames = _read_one(sock, deadline)
        kind, nonce = signer.loads(frames) if frames and frames[0] else (None, None)
        if kind != CHALLENGE or not isinstance(nonce, bytes):
            raise ConnectionError(f"the engine at {addr}:{port} sent no valid challenge")
        send_frames(sock, signer.dumps((HELLO, rank, nonce)), timeout=5.0)
    except (BadSignature, TypeError, ValueError) as exc:
        sock.close()
        raise ConnectionError(f"the engine at {addr}:{port} does not hold this group's key: {exc}") from None
    except BaseException:
        sock.close()
        raise
    tune_socket(sock, dead_after_s)
    return sock

