"""``python -m manager``: arguments, the runtime directory, then the Manager on uvloop."""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
from pathlib import Path

from manager.daemon import Manager
from servectl import config as C
from servectl.paths import SYSTEM_RUNTIME_DIR, RuntimePaths, ensure_private_dir, resolve_runtime_dir
from servectl.wire.spawn import ManagerSpec, read_spec_fd
from servectl.proc import INSTANCE_ENV, become_subreaper, carries_instance, die_with_parent


def check_not_running(paths: RuntimePaths) -> None:
    """Refuse to start over a live manager; clean what a dead one left."""
    try:
        pid_text, instance = paths.pidfile.read_text().split()[:2]
        pid = int(pid_text)
    except (OSError, ValueError):
        pid, instance = None, None
    if pid is not None and carries_instance(pid, instance):
        raise SystemExit(f"servectl manager already running (pid {pid}) in {paths.root}")
    # Stale: sockets and pid file of a dead manager are never trusted.
    for entry in paths.root.iterdir():
        if entry.name in ("control", "events", "manager.pid") or entry.name.startswith(("engine-", "worker-", "dist-")):
            entry.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m manager")
    ap.add_argument("--spec-fd", type=int, required=True,
                    help="a memfd holding the ManagerSpec (config, its path, start options) as JSON")
    ap.add_argument("--instance", default=None)
    ap.add_argument("--die-with-parent", action="store_true",
                    help="library mode: exit when the starting process dies")
    ap.add_argument("--parent-pipe-fd", type=int, default=None,
                    help="library mode: exit when this pipe reaches end of file")
    args = ap.parse_args(argv)
    from servectl.proc import setup_child_logging

    setup_child_logging("manager")
    spec = read_spec_fd(args.spec_fd, ManagerSpec)
    cfg = spec.config
    if args.die_with_parent:
        die_with_parent()
    root = resolve_runtime_dir(cfg.manager.runtime_dir)
    if root == SYSTEM_RUNTIME_DIR and root.is_dir():
        pass  # systemd made it (RuntimeDirectoryMode=0750): keep its mode and group
    else:
        ensure_private_dir(root)
    paths = RuntimePaths(root)
    check_not_running(paths)
    state_dir = Path(cfg.manager.state_dir) if cfg.manager.state_dir else root / "state"
    ensure_private_dir(state_dir)
    # The tag must be in our real environment (/proc/<pid>/environ) so a leak
    # of the manager itself can be found; `servectl start` and Server() put it there.
    instance = args.instance or os.environ.get(INSTANCE_ENV) or secrets.token_hex(8)
    os.environ[INSTANCE_ENV] = instance
    become_subreaper()
    import uvloop

    manager = Manager(cfg, paths, instance, state_dir, spec.config_path, spec.overrides)

    async def run() -> int:
        if args.parent_pipe_fd is not None:
            # End of file on this pipe means the script that started us is gone.
            loop = asyncio.get_running_loop()
            loop.add_reader(args.parent_pipe_fd, lambda: (loop.remove_reader(args.parent_pipe_fd),
                                                          manager.request_shutdown(0)))
        return await manager.run()

    return uvloop.run(run())
