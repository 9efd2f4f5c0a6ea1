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


def setup_child_logging(name: str, component: str | None = None, model: str | None = None) -> logging.Logger:
    """The process's logging: text (``name`` starts each line) or, where the manager set
    ``[manager] log_format = "json"`` in the tree's environment, one JSON object per line
    (servectl/logjson.py) naming ``component`` (spawn.py's name, default ``name``) and ``model``.
    Called again by a warm standby once it has a role (``force``: the role's name replaces it)."""
    from servectl import logjson

    level = os.environ.get("SERVECTL_LOG_LEVEL", "INFO")
    if logjson.json_logs():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logjson.JsonFormatter(component or name, model))
        logging.basicConfig(level=level, handlers=[handler], force=True)
        logjson.route_vllm_logs()
        logging.captureWarnings(True)  # warnings.warn as records, not loose lines
        # An uncaught exception as one record with its traceback, not a line per frame.
        sys.excepthook = lambda kind, exc, tb: logging.getLogger(name).critical(
            "uncaught exception", exc_info=(kind, exc, tb))
        return logging.getLogger(name)
    # Under systemd the journal timestamps every line: no second timestamp.
    stamp = "" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s "
    logging.basicConfig(
        level=level,
        format=f"{stamp}{name} %(levelname)s %(message)s",
        stream=sys.stderr,
        force=True,  # a warm standby configured logging before it knew its role
    )
    return logging.getLogger(name)


def package_root() -> str:
    """The directory our packages are imported from (children get it on PYTHONPATH)."""
    return str(Path(__file__).resolve().parent.parent)


def with_package_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with our packages importable first, whatever the child's working directory."""
    root = package_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def process_env(instance: str, extra: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a process of the tree (the manager, or one of its children): ours
    without ``drop``, with ``extra``, the tree's instance tag (in the real environment, so
    /proc/<pid>/environ shows it: kill_instance finds the tree by it) and our packages
    importable first."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra or {})
    env[INSTANCE_ENV] = instance
    return with_package_path(env)


# ---- /proc ---------------------------------------------------------------------------
# The fields of /proc/<pid>/stat after the command name (which may hold spaces
# and parentheses): [0] state, [1] ppid, ... (proc(5), counted from field 3).

def stat_fields(pid: int | str) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def ppid_of(pid: int | None) -> int | None:
    fields = stat_fields(pid) if pid is not None else None
    return int(fields[1]) if fields else None


def is_zombie(pid: int | str) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] == "Z"


def environ_of(pid: int | str) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def carries_instance(pid: int | str, instance: str) -> bool:
    return f"{INSTANCE_ENV}={instance}".encode() in environ_of(pid)


def all_pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def processes_of_instance(instance: str) -> list[int]:
    """Pids of every live process whose environment carries this instance tag."""
    # A zombie has already released everything; it is not a live process.
    return [pid for pid in all_pids() if carries_instance(pid, instance) and not is_zombie(pid)]


def kill_instance(instance: str, exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """SIGKILL every live process carrying this instance tag; returns the pids signalled.

    By pidfd, never by pid: the scan of /proc names pids, and a pid can be
    reused by an unrelated process between the scan and the kill. So each
    pid is opened as a pidfd first, its tag is checked again (now that the
    pidfd pins the process it names), and the signal goes through the pidfd,
    which reaches that process or nothing.
    """
    killed = []
    for pid in processes_of_instance(instance):
        if pid in exclude:
            continue
        try:
            fd = os.pidfd_open(pid)
        except (ProcessLookupError, OSError):
            continue
        try:
            if not carries_instance(pid, instance) or is_zombie(pid):
                continue  # the pid now names another process (or one already gone)
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)
    return killed


# ---- who holds a TCP port (/proc/net/tcp{,6} → socket inode → /proc/<pid>/fd) -------------
TCP_LISTEN = "0A"


def listeners(table: str, port: int) -> list[tuple[int, int]]:
    """(inode, uid) of each listening socket on ``port`` in the text of /proc/net/tcp or tcp6."""
    found = []
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != TCP_LISTEN:
            continue
        try:
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.append((int(fields[9]), int(fields[7])))
        except (IndexError, ValueError):
            continue
    return found


def socket_owner(inode: int) -> int | None:
    """The pid of a process holding socket ``inode`` open (only our own processes unless root)."""
    target = f"socket:[{inode}]"
    for pid in all_pids():
        try:
            fds = os.scandir(f"/proc/{pid}/fd")
        except OSError:
            continue
        with fds:
            for fd in fds:
                try:
                    if os.readlink(fd.path) == target:
                        return pid
                except OSError:
                    continue
    return None


def cmdline_of(pid: int, limit: int = 80) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return ""
    text = " ".join(" ".join(a.decode(errors="replace").split()) for a in args if a)  # one line
    return text if len(text) <= limit else text[: limit - 1] + "…"


def port_holder(port: int) -> str | None:
    """Who listens on TCP ``port``, in words ("pid 123 (python3 -m http.server)"), as far as /proc tells."""
    owners = []
    for name in ("tcp", "tcp6"):
        try:
            owners += listeners(Path(f"/proc/net/{name}").read_text(), port)
        except OSError:
            continue
    for inode, uid in owners:
        pid = socket_owner(inode)
        if pid is not None:
            cmd = cmdline_of(pid)
            return f"pid {pid} ({cmd})" if cmd else f"pid {pid}"
    if not owners:
        return None
    uid = owners[0][1]  # another user's process: /proc shows its socket, not its pid
    try:
        import pwd

        return f"a process of user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"a process of uid {uid}"


def rss_bytes(pid: int | None) -> int:
    """Resident memory of a process (0 if it is gone)."""
    if not pid:
        return 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
