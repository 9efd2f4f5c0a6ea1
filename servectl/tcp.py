"""A TCP connection between hosts watched by the kernel, not by a timer (the managers' cluster
link, manager/cluster_link.py, and a remote rank's link to its engine, engine_core/workers/remote.py)."""

from __future__ import annotations

import socket


def tune_socket(sock: socket.socket, dead_after_s: float) -> None:
    """The kernel notices a dead peer within ~dead_after_s: keepalive when idle, TCP_USER_TIMEOUT when not."""
    idle = max(1, int(dead_after_s / 3))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small control messages, sent now
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, int(dead_after_s - idle)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(dead_after_s * 1000))
