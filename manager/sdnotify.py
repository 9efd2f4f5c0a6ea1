"""systemd's notify protocol: one datagram to $NOTIFY_SOCKET, if it is set; its watchdog."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable


def notify(message: str) -> bool:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(message.encode(), addr)
        return True
    except OSError:
        return False


def start_watchdog(loop: asyncio.AbstractEventLoop, stopping: Callable[[], bool]) -> None:
    """systemd's watchdog: the one periodic wake-up, and only when systemd asks for it
    (``WATCHDOG_USEC``, for this process); it ends once ``stopping()``."""
    usec = os.environ.get("WATCHDOG_USEC")
    wpid = os.environ.get("WATCHDOG_PID")
    if not usec or (wpid and int(wpid) != os.getpid()):
        return
    interval = int(usec) / 1e6 / 2

    def ping() -> None:  # event-proof: systemd's watchdog protocol requires a periodic keep-alive
        notify("WATCHDOG=1")
        if not stopping():
            loop.call_later(interval, ping)  # event-proof: systemd's watchdog (above)

    ping()
