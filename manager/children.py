"""One supervised process and its state: the single owner of that state.

States (../shared/DESIGN.md): ``starting → ready → (stopping → stopped) | (exited →
backoff → starting) | failed``, plus ``idle (frozen)`` for a worker its
engine froze. Every change goes through ``Child.set``, which timestamps it and
reports it to the listener (the manager publishes it on the events socket).
The owner of a child (its engine group, the standby pool, the gateway pool)
decides its state and is told of its exit through ``on_exit``. Whether to
restart is decided by ``RestartPolicy``, a pure function of exit times,
unit-tested without processes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from manager.logs import LogSink, journal_mode
from servectl.wire.spawn import STANDBY, standby_component
from servectl.wire.vocab import ChildState, EventKind

__all__ = ["Child", "ChildState", "RestartPolicy", "Standby", "describe_exit"]


@dataclass
class RestartPolicy:
    """Exponential backoff, and `failed` after too many exits in a window."""

    initial_s: float = 1.0
    max_s: float = 30.0
    crash_loop_count: int = 5
    window_s: float = 120.0
    exits: deque = field(default_factory=deque)

    def record_exit(self, now: float) -> float | None:
        """Note an exit; return the delay before restarting, or None for `failed`."""
        self.exits.append(now)
        while self.exits and now - self.exits[0] > self.window_s:
            self.exits.popleft()
        recent = len(self.exits)
        if recent >= self.crash_loop_count:
            return None
        return min(self.max_s, self.initial_s * (2 ** (recent - 1)))

    def reset(self) -> None:
        self.exits.clear()


def describe_exit(status: int, code: int) -> str:
    """waitid's (si_code, si_status) in words: 'exit code 1' or 'signal SIGKILL'."""
    if code == os.CLD_EXITED:
        return f"exit code {status}"
    try:
        name = signal.Signals(status).name
    except ValueError:
        name = str(status)
    return f"signal {name}"


class Child:
    """A process the manager execs, watches through a pidfd and may restart."""

    def __init__(self, component: str, kind: EventKind, model: str | None, log_path: Path,
                 on_change: Callable[["Child", str], None], on_exit: Callable[["Child"], None] = lambda c: None):
        self.component = component
        self.kind = kind
        self.model = model
        self.log_path = log_path
        self.on_change = on_change
        self.on_exit = on_exit  # its owner's verdict on an exit (restart, fail, forget)
        self.state = ChildState.STOPPED
        self.since = time.time()
        self.started_at: float | None = None
        self.popen: subprocess.Popen | None = None
        self.pidfd: int | None = None
        self.restarts = 0
        self.starts = 0
        self.last_exit: str | None = None  # in words (describe_exit)
        # The last exit as the kernel said it: its status if it exited, its signal's number if killed.
        self.exit_code: int | None = None
        self.exit_signal: int | None = None
        self.exit_ok = False
        self.exited_waiters: list = []
        self.output_fd: int | None = None
        self.stale_output_fd: int | None = None
        self.sink = LogSink(component, log_path, journal=journal_mode())

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None and self.pidfd is not None else None

    @property
    def alive(self) -> bool:
        return self.pidfd is not None

    def set(self, state: ChildState, detail: str = "") -> None:
        state = ChildState(state)
        if state == self.state and not detail:
            return
        self.state = state
        self.since = time.time()
        self.on_change(self, detail)

    def spawn(self, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> None:
        """Exec the child. Must run on the event-loop thread (PDEATHSIG follows it)."""
        r, w = os.pipe()
        try:
            self.popen = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=w, stderr=subprocess.STDOUT,
                pass_fds=pass_fds, close_fds=True, start_new_session=False,
            )
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        os.set_blocking(r, False)
        self.sink.pid = self.popen.pid
        self._started(r, os.pidfd_open(self.popen.pid))

    def adopt(self, standby: "Child") -> None:
        """Become the process a warm standby runs (it has been sent our role)."""
        popen, pidfd, output_fd = standby.popen, standby.pidfd, standby.output_fd
        standby.popen, standby.pidfd, standby.output_fd = None, None, None
        self.popen = popen
        self.sink.pid = popen.pid if popen is not None else None
        self._started(output_fd, pidfd)

    def _started(self, output_fd: int | None, pidfd: int) -> None:
        # A previous incarnation's pipe may still be open (a grandchild holds
        # it): the manager stops watching and closes it (see ChildWatch.watch, manager/watch.py).
        self.stale_output_fd = self.output_fd
        self.output_fd = output_fd
        self.pidfd = pidfd
        self.started_at = time.time()
        if self.starts:
            self.restarts += 1
        self.starts += 1
        self.set(ChildState.STARTING)

    def reap(self) -> str:
        """Collect the exit status through the pidfd; return it in words."""
        assert self.pidfd is not None and self.popen is not None
        try:
            info = os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            info = None
        os.close(self.pidfd)
        self.pidfd = None
        if info is None:
            self.popen.returncode = -1
            self.last_exit = "exited (status unknown)"
            self.exit_code = self.exit_signal = None
            self.exit_ok = False
        else:
            exited = info.si_code == os.CLD_EXITED
            self.popen.returncode = info.si_status if exited else -info.si_status
            self.last_exit = describe_exit(info.si_status, info.si_code)
            self.exit_code, self.exit_signal = (info.si_status, None) if exited else (None, info.si_status)
            self.exit_ok = exited and info.si_status == 0
        for fut in self.exited_waiters:
            if not fut.done():
                fut.set_result(self.last_exit)
        self.exited_waiters.clear()
        return self.last_exit

    def signal(self, sig: int) -> None:
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except ProcessLookupError:
                pass

    def read_output(self) -> bool:
        """Move what the child wrote into its log sink; False at end of file."""
        while self.output_fd is not None:
            try:
                data = os.read(self.output_fd, 65536)
            except BlockingIOError:
                return True
            if not data:
                os.close(self.output_fd)
                self.output_fd = None
                self.sink.close()
                return False
            self.sink.write(data)
        return False

    def tail(self, lines: int = 20) -> list[str]:
        return self.sink.tail(lines)


class Standby(Child):
    """A warm interpreter waiting to become one group member (engine_core/standby.py).

    Exec'd with the member's exact environment; it says ``L`` on its channel as it begins to
    import and ``W`` once vLLM is imported, then sleeps until ``send_role`` or until the
    channel closes.
    """

    def __init__(self, member: Child, log_path: Path, on_change: Callable[["Child", str], None],
                 on_exit: Callable[["Child"], None]):
        super().__init__(standby_component(member.component), STANDBY, member.model, log_path, on_change, on_exit)
        self.member = member.component
        self.env: dict[str, str] = {}
        self.channel: socket.socket | None = None
        self.importing = False  # it said "L": it dies with the manager, it may be stopped meanwhile

    def spawn_standby(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # --component: the name its JSON log lines carry until it has a role (servectl/logjson.py).
            self.spawn([sys.executable, "-m", "engine_core.standby", "--channel-fd", str(theirs.fileno()),
                        "--component", self.component], env, (theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self.channel = ours
        self.env = env

    def send_role(self, role: bytes, fds: list[int]) -> bool:
        """Hand over the role and its descriptors; False if the standby is gone."""
        if self.channel is None:
            return False
        try:
            socket.send_fds(self.channel, [role], fds)
            return True
        except OSError:
            return False

    def release(self) -> None:
        """No role for it after all (the manager has hung up its channel): it exits."""
        self.set(ChildState.STOPPING)
        self.signal(signal.SIGTERM)  # a waiting standby reads EOF anyway; one still importing needs this
