"""Talking to a running manager over its control socket (typed msgspec, never pickle)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import zmq

from servectl import config as C
from servectl.paths import SYSTEM_RUNTIME_DIR, RuntimePaths, open_append, system_dir_denied, user_name, verify_dir
from servectl.wire import control as P
from servectl.wire import status as WS
from servectl.wire.spawn import ManagerSpec, spec_fd

# The largest answer or event the CLI and the library take from the manager (a status with
# many children and their last log lines): generous, so only abuse reaches it (ZMQ_MAXMSGSIZE).
MAX_REPLY_BYTES = 64 << 20


class NotRunning(Exception):
    """No manager answers in this runtime directory."""


class StartFailed(Exception):
    """The manager refused to start and said why in one line (e.g. its port is
    taken); it has exited and started nothing. ``exit_code``: the CLI's (2: usage/config)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def read_startup_failure(report_fd: int | None) -> StartFailed | None:
    """What a manager that exited wrote on its report pipe (``--report-fd``), if anything."""
    if report_fd is None:
        return None
    os.set_blocking(report_fd, False)
    data = b""
    try:
        while chunk := os.read(report_fd, 65536):
            data += chunk
    except OSError:  # BlockingIOError: nothing (more) was written
        pass
    try:
        failure = P.startup_failed_decoder.decode(data.strip().splitlines()[0]) if data.strip() else None
    except Exception:  # noqa: BLE001 - a garbled report is no report
        return None
    return StartFailed(failure.message, failure.exit_code) if failure else None


class PermissionDenied(Exception):
    """This user may not send that command (it changes the daemon; they are not its owner)."""


def not_running_message(root: Path, detail: str) -> str:
    text = f"servectl is not running ({detail})"
    if root != SYSTEM_RUNTIME_DIR and system_dir_denied():
        text += (f"; {SYSTEM_RUNTIME_DIR} exists but you may not enter it: the system daemon is for members of "
                 "its group (servectl)")
    return text


def check_runtime_dir(root: Path) -> None:
    """Before a byte is read from or sent into it: NotRunning if there is no such directory,
    UntrustedDirectory if it is not ours (another user made it: a fake control socket could answer)."""
    try:
        verify_dir(root)
    except FileNotFoundError:
        raise NotRunning(not_running_message(root, f"no runtime directory {root}")) from None
    except PermissionError:
        raise NotRunning(not_running_message(root, f"you may not enter {root}")) from None


class ControlClient:
    def __init__(self, runtime_dir: Path, timeout_s: float = 10.0):
        self.paths = RuntimePaths(Path(runtime_dir))
        self.timeout_s = timeout_s
        self.ctx = zmq.Context.instance()

    def socket_for(self, msg) -> Path:
        """The read-only socket for what only reads, the control socket (owner only) for the rest."""
        check_runtime_dir(self.paths.root)
        if isinstance(msg, P.READ_ONLY):
            path = self.paths.control_ro
            if path.exists() and os.access(path, os.W_OK):
                return path
        path = self.paths.control
        if not path.exists():
            raise NotRunning(not_running_message(self.paths.root, f"no control socket in {self.paths.root}"))
        if not os.access(path, os.W_OK):
            owner = os.stat(path).st_uid
            raise PermissionDenied(
                f"permission denied: {self.paths.control} is its owner's ({user_name(owner)}); "
                + ("this command changes the daemon, so only that user or root may send it; members of its "
                   "group may use status, events and logs" if not isinstance(msg, P.READ_ONLY) else
                   "you are not in the group of its runtime directory"))
        return path

    def request(self, msg, timeout_s: float | None = None):
        path = self.socket_for(msg)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        try:
            sock.connect(RuntimePaths.ipc(path))
            sock.send(P.encoder.encode(msg))
            wait = self.timeout_s if timeout_s is None else timeout_s
            # event-proof: the CLI's bound on one reply; the reply wakes the poll.
            if not sock.poll(None if wait is None or wait < 0 else int(wait * 1000)):
                raise NotRunning(f"servectl is not running (the control socket in {self.paths.root} "
                                 f"did not answer within {wait:g}s)")
            return P.control_out_decoder.decode(sock.recv())
        finally:
            sock.close()

    def status(self) -> P.StatusReply:
        return self.request(P.StatusRequest())

    def running(self) -> bool:
        try:
            self.status()
            return True
        except NotRunning:
            return False


def manager_command(spec_fd: int, extra: list[str] | None = None) -> list[str]:
    """``python -m manager`` reading its spec from ``spec_fd`` (see ``manager_spec_fd``): no secret on the argv."""
    return [sys.executable, "-m", "manager", "--spec-fd", str(spec_fd), *(extra or [])]


def manager_spec_fd(cfg: C.Config, config_path: str | os.PathLike | None = None,
                    overrides: C.Overrides | None = None) -> int:
    """The manager's spec (config with its API keys and model envs) in a sealed memfd; close it after the spawn."""
    return spec_fd(ManagerSpec(config=cfg, config_path=str(config_path) if config_path else None,
                               overrides=overrides), "servectl-manager-spec")


def child_env() -> dict[str, str]:
    """The manager's environment: ours, with a fresh instance tag for its tree."""
    import secrets

    from servectl.proc import process_env

    return process_env(secrets.token_hex(8))


def spawn_manager(cfg: C.Config, log_path: Path, extra: list[str] | None = None, detach: bool = True,
                  pass_fds: tuple[int, ...] = (), config_path: str | os.PathLike | None = None,
                  overrides: C.Overrides | None = None) -> subprocess.Popen:
    """Start ``python -m manager``; ``log_path`` is in a directory ``prepare_dirs`` made or checked."""
    log = open_append(log_path)
    fd = manager_spec_fd(cfg, config_path, overrides)
    try:
        return subprocess.Popen(manager_command(fd, extra), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=detach, env=child_env(),
                                pass_fds=(fd, *pass_fds), close_fds=True)
    finally:
        os.close(fd)
        os.close(log)


def wait_settled(client: ControlClient, manager_pid: int | None, timeout_s: float, on_event=None,
                 report_fd: int | None = None):
    """Wait until every model is ready or failed; follow events meanwhile.

    Returns the final StatusReply. If the manager exits first: raises StartFailed
    with its one line if it wrote one on ``report_fd`` (the read end of the pipe
    passed to it as ``--report-fd``), else NotRunning.
    """
    check_runtime_dir(client.paths.root)  # made by whoever started the manager, before it
    ctx = client.ctx
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    sub.connect(RuntimePaths.ipc(client.paths.events))
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    req.connect(RuntimePaths.ipc(client.paths.control_ro))  # bound soon, if not yet: connecting waits
    req.send(P.encoder.encode(P.WaitSettled()))
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(req, zmq.POLLIN)
    pidfd = None
    if manager_pid is not None:
        try:
            pidfd = os.pidfd_open(manager_pid)
            poller.register(pidfd, zmq.POLLIN)
        except ProcessLookupError:
            raise read_startup_failure(report_fd) or NotRunning("the manager exited during start") from None
    import time

    end = time.monotonic() + timeout_s
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"not settled within {timeout_s:g}s")
            # event-proof: the settle deadline; the reply or an event wakes the poll.
            for sock, _ in poller.poll(int(left * 1000)):
                if sock is req:
                    reply = P.control_out_decoder.decode(req.recv())
                    # The manager published the last state changes before it replied:
                    # show those that have arrived, not only the ones polled first.
                    while on_event and sub.poll(0):
                        on_event(WS.event_decoder.decode(sub.recv()))
                    return reply
                if sock is sub:
                    ev = WS.event_decoder.decode(sub.recv())
                    if on_event:
                        on_event(ev)
                if sock == pidfd:
                    raise read_startup_failure(report_fd) or NotRunning("the manager exited during start")
    finally:
        sub.close()
        req.close()
        if pidfd is not None:
            os.close(pidfd)
