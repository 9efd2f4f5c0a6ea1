"""Where a daemon's sockets, pid file, state and logs live, and whether to trust it.

Lookup order for the runtime directory (the CLI says which one it tried):
1. an explicit ``--runtime-dir`` flag,
2. ``$SERVECTL_RUNTIME_DIR``,
3. ``/run/servectl`` when it holds a control socket (the systemd unit's),
4. ``$XDG_RUNTIME_DIR/servectl``,
5. ``$TMPDIR/servectl-<uid>`` (private, mode 0700).

Trust (``secure_dir``): the CLI, the library and the manager create a
directory with ``mkdir`` (which never follows a symlink) and check it through
a descriptor opened ``O_NOFOLLOW``: it must be a real directory, owned by
this user (``/run/servectl``: also root or the ``servectl`` service user), not
group- or world-writable, in a parent nobody else can rename it out of. A
directory another user made first (``/tmp/servectl-<uid>`` on a shared host)
is refused before anything is read from or written into it. An existing
directory's mode is never changed.

One manager per directory: it holds an ``flock`` on ``manager.pid``
(``lock_pidfile``) for its whole life, taken before it cleans anything; start-up
removes only servectl's own names (``stale_entries``), and only under that lock.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from servectl.wire.vocab import MODEL_NAME

SYSTEM_RUNTIME_DIR = Path("/run/servectl")
SERVICE_USER = "servectl"  # the systemd unit's User=


class UntrustedDirectory(Exception):
    """A runtime or state directory servectl refuses to use; the message says why and what to do."""


class AlreadyRunning(Exception):
    """Another manager holds this runtime directory's lock."""


def user_runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "servectl"
    return Path(tempfile.gettempdir()) / f"servectl-{os.getuid()}"


def system_daemon_present() -> bool:
    """``/run/servectl`` holds a control socket we may see (False, not PermissionError, for users outside its group)."""
    try:
        return (SYSTEM_RUNTIME_DIR / "control").exists()
    except OSError:
        return False


def system_dir_denied() -> bool:
    """``/run/servectl`` exists but this user may not enter it (not in the service's group)."""
    try:
        return SYSTEM_RUNTIME_DIR.is_dir() and not os.access(SYSTEM_RUNTIME_DIR, os.X_OK)
    except OSError:
        return False


def resolve_runtime_dir(explicit: str | os.PathLike | None = None) -> Path:
    if explicit:
        return Path(explicit)
    env = os.environ.get("SERVECTL_RUNTIME_DIR")
    if env:
        return Path(env)
    if system_daemon_present():
        return SYSTEM_RUNTIME_DIR
    return user_runtime_dir()


@dataclass(frozen=True)
class RuntimePaths:
    """Every file of one daemon instance, derived from its runtime directory."""

    root: Path

    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def events(self) -> Path:
        return self.root / "events"

    @property
    def control_ro(self) -> Path:
        """The read-only control socket (status, wait-settled): the group's way in."""
        return self.root / "control-ro"

    @property
    def pidfile(self) -> Path:
        return self.root / "manager.pid"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    def engine(self, model: str) -> Path:
        return self.root / f"engine-{model}"

    def worker(self, model: str, rank: int) -> Path:
        return self.root / f"worker-{model}-{rank}"

    def dist(self, model: str, incarnation: str) -> Path:
        """torch.distributed's rendezvous file of one engine incarnation."""
        return self.root / f"dist-{model}-{incarnation}"

    @staticmethod
    def ipc(path: Path) -> str:
        return f"ipc://{path}"


def bind_private(sock, path: Path) -> None:
    """Bind a ZeroMQ socket to ``ipc://path``, or a plain Unix socket to ``path``: the socket file created mode 0600."""
    old = os.umask(0o177)
    try:
        if path.exists() or path.is_symlink():
            path.unlink()
        sock.bind(str(path) if isinstance(sock, socket.socket) else RuntimePaths.ipc(path))
    finally:
        os.umask(old)


# ---- trust -------------------------------------------------------------------------------

def user_name(uid: int) -> str:
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def service_uid() -> int | None:
    import pwd

    try:
        return pwd.getpwnam(SERVICE_USER).pw_uid
    except KeyError:
        return None


def trusted_owners(path: Path) -> set[int]:
    """Who may own ``path`` for us to use it: ourselves; for ``/run/servectl`` also root and the service user."""
    owners = {os.geteuid()}
    if Path(os.path.abspath(path)) == SYSTEM_RUNTIME_DIR:
        owners.add(0)
        svc = service_uid()
        if svc is not None:
            owners.add(svc)
    return owners


def dir_problem(st: os.stat_result, owners: set[int]) -> str | None:
    """Why a directory with this ``lstat``/``fstat`` result is not to be trusted, or None. Pure."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link (give the real directory)"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid not in owners:
        mine = " or ".join(user_name(u) for u in sorted(owners))
        return f"it is owned by {user_name(st.st_uid)}, not by {mine}; someone else may have made it to " \
               "intercept servectl"
    if st.st_mode & 0o022:
        return f"it is {'world' if st.st_mode & 0o002 else 'group'}-writable (mode " \
               f"{stat.S_IMODE(st.st_mode):04o}): others could plant sockets or links in it"
    return None


def parent_problem(st: os.stat_result) -> str | None:
    """Why a directory's parent lets anyone rename it away, or None (sticky /tmp is fine). Pure."""
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        return f"its parent is world-writable and not sticky (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _refuse(path: Path, why: str) -> UntrustedDirectory:
    return UntrustedDirectory(f"refusing to use {path}: {why}. Remove it, or choose another directory with "
                              "--runtime-dir (or $SERVECTL_RUNTIME_DIR, manager.runtime_dir; for state: --state-dir)")


def open_dir(path: Path) -> int:
    """A descriptor on ``path`` itself, never on what a symlink there points to."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                st = os.lstat(path)
            except OSError:
                raise exc from None
            raise _refuse(path, dir_problem(st, set()) or "it is not a directory") from None
        raise


def verify_dir(path: Path, owners: set[int] | None = None) -> os.stat_result:
    """Check an existing directory (FileNotFoundError if there is none); UntrustedDirectory if it is not ours."""
    owners = trusted_owners(path) if owners is None else owners
    fd = open_dir(path)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    why = dir_problem(st, owners)
    if why is None:
        try:
            why = parent_problem(os.stat(Path(os.path.abspath(path)).parent))
        except OSError:
            why = None
    if why is not None:
        raise _refuse(path, why)
    return st


def secure_dir(path: Path, mode: int = 0o700, owners: set[int] | None = None) -> Path:
    """Create ``path`` (mode ``mode``; missing parents too) or check the one there; return it.

    ``mkdir`` never follows a symlink, so a link planted at ``path`` is found
    by the check, not written through; an existing directory keeps its mode.
    """
    path = Path(path)
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, mode)
        created = True
    except FileExistsError:
        created = False
    st = verify_dir(path, owners)
    if created and st.st_mode & 0o777 != mode:
        fd = open_dir(path)
        try:
            # The umask took bits we asked for (mkdir's mode is masked); a setgid bit
            # inherited from a group-shared parent stays, so files keep that group.
            os.fchmod(fd, mode | (st.st_mode & stat.S_ISGID))
        finally:
            os.close(fd)
    return path


def is_shared(st: os.stat_result) -> bool:
    """A runtime directory its group may enter and read (systemd's 0750): read-only access for that group."""
    return st.st_mode & 0o050 == 0o050


def prepare_dirs(root: Path, state_dir: Path | None = None) -> Path:
    """Create or check a daemon's runtime directory, its state directory and the logs in it, before a
    manager exists (the CLI writes the manager's log there). Returns the logs directory."""
    secure_dir(root)
    mode = 0o750 if is_shared(os.stat(root)) else 0o700
    state = secure_dir(state_dir or root / "state", mode)
    return secure_dir(state / "logs", mode)


def open_append(path: Path, mode: int = 0o640) -> int:
    """Open a log for appending in a checked directory; never through a symlink planted at ``path``.

    The mode is set on the file itself, whatever the umask (the unit's is 0077): the runtime
    directory's group may read the logs (docs/operations.md), which their 0750 directory decides."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
    except OSError:
        os.close(fd)
        raise
    return fd


def ensure_private_dir(path: Path, mode: int = 0o700) -> Path:
    """Kept for callers that want a private directory: ``secure_dir``."""
    return secure_dir(path, mode)


# ---- one manager per directory, and what a dead one left -----------------------------------

def lock_pidfile(paths: RuntimePaths) -> int:
    """Take ``manager.pid``'s flock, held until the manager exits (fails fast: AlreadyRunning).

    The descriptor is close-on-exec: no child keeps the lock after the manager is gone.
    """
    fd = os.open(paths.pidfile, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise _refuse(paths.root, f"{paths.pidfile.name} is not a regular file of ours")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).split(b"\n")[0].decode(errors="replace").strip() or "?"
            raise AlreadyRunning(f"servectl is already running (manager pid {pid}) in {paths.root}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_pidfile(fd: int, pid: int, instance: str) -> None:
    data = f"{pid}\n{instance}\n".encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


_MODEL = MODEL_NAME
_STALE_SOCKETS = re.compile(rf"(control|control-ro|events|engine-{_MODEL}|worker-{_MODEL}-(0|[1-9][0-9]*)"
                            rf"|kv-events-{_MODEL}@x?[0-9]+)\Z")  # kv-events: servectl/kv_events.py's default
_STALE_FILES = re.compile(rf"dist-{_MODEL}-[0-9a-f]+\Z")
_METRICS_FILE = re.compile(r"[a-z_]+_[0-9]+\.db\Z")  # prometheus_client's multiprocess files


def stale_entries(names_and_stats: list[tuple[str, os.stat_result]], uid: int) -> list[str]:
    """Which entries of a runtime directory a dead manager left: servectl's own names only. Pure.

    Sockets named as servectl names them, and torch's rendezvous files; each
    ours (uid) and of the right type. Nothing else, ever.
    """
    out = []
    for name, st in names_and_stats:
        if st.st_uid != uid:
            continue
        if stat.S_ISSOCK(st.st_mode) and _STALE_SOCKETS.match(name) or \
                stat.S_ISREG(st.st_mode) and _STALE_FILES.match(name):
            out.append(name)
    return out


def stale_metrics(names_and_stats: list[tuple[str, os.stat_result]], uid: int) -> list[str]:
    """The prometheus multiprocess files in the metrics directory (regular, ours). Pure."""
    return [name for name, st in names_and_stats
            if st.st_uid == uid and stat.S_ISREG(st.st_mode) and _METRICS_FILE.match(name)]


def _entries(directory: Path) -> list[tuple[str, os.stat_result]]:
    out = []
    with os.scandir(directory) as it:
        for entry in it:
            try:
                out.append((entry.name, entry.stat(follow_symlinks=False)))
            except OSError:
                continue
    return out


def remove_stale(paths: RuntimePaths) -> list[str]:
    """Remove what a dead manager left (call only while holding ``lock_pidfile``); returns the names removed."""
    uid = os.geteuid()
    removed = []
    for name in stale_entries(_entries(paths.root), uid):
        try:
            os.unlink(paths.root / name)
            removed.append(name)
        except FileNotFoundError:
            pass
    if paths.metrics.is_dir() and not paths.metrics.is_symlink():
        verify_dir(paths.metrics)
        for name in stale_metrics(_entries(paths.metrics), uid):
            try:
                os.unlink(paths.metrics / name)
                removed.append(f"metrics/{name}")
            except FileNotFoundError:
                pass
    return removed
