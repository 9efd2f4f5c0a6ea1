"""What every process of a servectl tree does first, and how to find a tree.

Children die with their parent (``PR_SET_PDEATHSIG``) and carry the tree's
instance tag in their environment so a leak can be found from /proc even after
the manager is gone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
INSTANCE_ENV = "SERVECTL_INSTANCE"
PARENT_ENV = "SERVECTL_PARENT_PID"

_libc = ctypes.CDLL(None, use_errno=True)


def prctl(option: int, arg: int) -> None:
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def die_with_parent() -> None:
    """SIGKILL this process when the thread that forked it exits.

    The race is closed by comparing getppid() with the pid the parent wrote
    into our environment: if it already died, we were reparented before prctl.
    """
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    expected = os.environ.get(PARENT_ENV)
    if expected and os.getppid() != int(expected):
        os._exit(1)


def become_subreaper() -> None:
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def setup_child_logging(name: str) -> logging.Logger:
    # Under systemd the journal timestamps every line: no second timestamp.
    stamp = "" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s "
    logging.basicConfig(
        level=os.environ.get("SERVECTL_LOG_LEVEL", "INFO"),
        format=f"{stamp}{name} %(levelname)s %(message)s",
        stream=sys.stderr,
        force=True,  # a warm standby configured logging before it knew its role
    )
    return logging.getLogger(name)


def processes_of_instance(instance: str) -> list[int]:
    """Pids of every live process whose environment carries this instance tag."""
    needle = f"{INSTANCE_ENV}={instance}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # A zombie has already released everything; it is not a live process.
        state = stat.rsplit(")", 1)[1].split()[0]
        if state == "Z":
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry.name))
    return found
