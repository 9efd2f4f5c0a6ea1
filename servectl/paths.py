"""Where a daemon's sockets, pid file, state and logs live.

Lookup order for the runtime directory (the CLI says which one it tried):
1. an explicit ``--runtime-dir`` flag,
2. ``$SERVECTL_RUNTIME_DIR``,
3. ``/run/servectl`` when it holds a control socket (the systemd unit's),
4. ``$XDG_RUNTIME_DIR/servectl``,
5. ``$TMPDIR/servectl-<uid>`` (private, mode 0700).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

SYSTEM_RUNTIME_DIR = Path("/run/servectl")


def user_runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "servectl"
    return Path(tempfile.gettempdir()) / f"servectl-{os.getuid()}"


def resolve_runtime_dir(explicit: str | os.PathLike | None = None) -> Path:
    if explicit:
        return Path(explicit)
    env = os.environ.get("SERVECTL_RUNTIME_DIR")
    if env:
        return Path(env)
    if (SYSTEM_RUNTIME_DIR / "control").exists():
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
    def pidfile(self) -> Path:
        return self.root / "manager.pid"

    def engine(self, model: str) -> Path:
        return self.root / f"engine-{model}"

    def worker(self, model: str, rank: int) -> Path:
        return self.root / f"worker-{model}-{rank}"

    @staticmethod
    def ipc(path: Path) -> str:
        return f"ipc://{path}"


def bind_private(sock, path: Path) -> None:
    """Bind a ZeroMQ socket to ``ipc://path``, the socket file created mode 0600."""
    old = os.umask(0o177)
    try:
        if path.exists():
            path.unlink()
        sock.bind(RuntimePaths.ipc(path))
    finally:
        os.umask(old)


def ensure_private_dir(path: Path, mode: int = 0o700) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    return path
