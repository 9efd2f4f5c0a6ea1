"""Watching the manager's children: each one's pidfd and output pipe on the event loop, its exit.

A child is learned dead through its pidfd (``loop.add_reader``) and reaped with
``waitid(P_PIDFD)``; its owner (engine group, standby pool, gateway pool) then decides what
the exit means (``Child.on_exit``). Orphans reparented to the manager (a subreaper) are reaped
here too (the manager kills the rest when it stops). A stop's grace is the only wait.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable

from manager.children import Child
from servectl.proc import all_pids, is_zombie, ppid_of

log = logging.getLogger("manager")


class ChildWatch:
    def __init__(self, instance: str, ours: Callable[[], set[int]], after_exit: Callable[[], None]):
        self.instance = instance
        self.ours = ours  # the pids of our own children (reaped through their pidfds, not here)
        self.after_exit = after_exit  # a child's exit was handled: the manager may have settled

    def watch(self, child: Child) -> None:
        loop = asyncio.get_running_loop()
        if child.stale_output_fd is not None:
            loop.remove_reader(child.stale_output_fd)
            os.close(child.stale_output_fd)
            child.stale_output_fd = None
        loop.add_reader(child.pidfd, self._on_exit, child)
        fd = child.output_fd
        if fd is not None:
            loop.add_reader(fd, self._on_output, child, fd)

    def unwatch(self, child: Child) -> None:
        loop = asyncio.get_running_loop()
        if child.pidfd is not None:
            loop.remove_reader(child.pidfd)
        if child.output_fd is not None:
            loop.remove_reader(child.output_fd)

    def _on_output(self, child: Child, fd: int) -> None:
        if child.output_fd != fd or not child.read_output():
            asyncio.get_running_loop().remove_reader(fd)

    def _on_exit(self, child: Child) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(child.pidfd)
        fd = child.output_fd
        if not child.read_output() and fd is not None:  # its last words first
            loop.remove_reader(fd)
        how = child.reap()
        # Orphans reparented to us (we are a subreaper) are reaped here: their
        # parent's exit is the event that made them ours. (uvloop owns SIGCHLD.)
        self.reap_strays()
        log.info("%s (pid %s) exited: %s", child.component, child.popen.pid, how)
        child.on_exit(child)
        self.after_exit()

    async def wait_exit(self, children: list[Child], grace_s: float) -> None:
        """Wait for children to exit; SIGKILL whoever outlives the grace."""
        loop = asyncio.get_running_loop()
        futs = []
        for c in children:
            if c.alive:
                fut = loop.create_future()
                c.exited_waiters.append(fut)
                futs.append(fut)
        if not futs:
            return
        # event-proof: the stop grace, once per stop; each child's exit settles its future at once.
        _, pending = await asyncio.wait(futs, timeout=grace_s)
        if pending:
            for c in children:
                if c.alive:
                    log.warning("%s did not stop within %.0fs: SIGKILL", c.component, grace_s)
                    c.signal(signal.SIGCONT)
                    c.signal(signal.SIGKILL)
            await asyncio.wait(pending)

    def reap_strays(self) -> None:
        """Reap exited orphans reparented to us; our own children are reaped through pidfds."""
        ours = self.ours()
        me = os.getpid()
        for pid in all_pids():
            if pid not in ours and ppid_of(pid) == me and is_zombie(pid):
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
