"""``python -m manager``: arguments, the runtime directory, then the Manager on uvloop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
from pathlib import Path

import msgspec

from manager.daemon import Manager, StartupError
from manager.journal import journal_own_records
from manager.logs import journal_mode
from servectl.paths import (AlreadyRunning, RuntimePaths, UntrustedDirectory, is_shared, lock_pidfile, remove_stale,
                            resolve_runtime_dir, secure_dir)
from servectl import tracing
from servectl.logjson import LOG_FORMAT_ENV
from servectl.proc import INSTANCE_ENV, become_subreaper, die_with_parent, setup_child_logging
from servectl.wire import control as P
from servectl.wire.spawn import ManagerSpec, read_spec_fd


def claim_runtime_dir(root: Path) -> tuple[RuntimePaths, int]:
    """Create or check the runtime directory, take its lock, then clean what a dead manager left.

    Returns the paths and the locked pid file's descriptor (held for the
    manager's life). Refuses (StartupError with the reason) a directory that is
    not ours and a directory another live manager holds.
    """
    try:
        secure_dir(root)  # systemd's /run/servectl (0750, its group) is checked and keeps its mode
        paths = RuntimePaths(root)
        lock_fd = lock_pidfile(paths)
    except AlreadyRunning as exc:
        raise StartupError(str(exc), exit_code=1) from None
    except UntrustedDirectory as exc:
        raise StartupError(str(exc)) from None
    except OSError as exc:
        raise StartupError(f"cannot use {exc.filename or root}: {exc.strerror or exc}; choose another runtime "
                           "directory with --runtime-dir (manager.runtime_dir)") from None
    removed = remove_stale(paths)  # only under the lock: no live manager owns these
    if removed:
        logging.getLogger("manager").info("removed what a dead manager left in %s: %s", root, ", ".join(removed))
    return paths, lock_fd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m manager")
    ap.add_argument("--spec-fd", type=int, required=True,
                    help="a memfd holding the ManagerSpec (config, its path, start options) as JSON")
    ap.add_argument("--instance", default=None)
    ap.add_argument("--die-with-parent", action="store_true",
                    help="library mode: exit when the starting process dies")
    ap.add_argument("--parent-pipe-fd", type=int, default=None,
                    help="library mode: exit when this pipe reaches end of file")
    ap.add_argument("--report-fd", type=int, default=None,
                    help="a pipe to whoever started us: a startup failure is written there (one JSON line)")
    args = ap.parse_args(argv)
    log = setup_child_logging("manager")
    try:
        return run_manager(args)
    except StartupError as exc:
        # One line, no traceback: in the log (or the journal) and to whoever started us.
        log.error("not started: %s", exc)
        if args.report_fd is not None:
            try:
                os.write(args.report_fd, msgspec.json.encode(P.StartupFailed(message=str(exc),
                                                                              exit_code=exc.exit_code)) + b"\n")
            except OSError:
                pass  # nobody reads any more
        return exc.exit_code


def run_manager(args: argparse.Namespace) -> int:
    spec = read_spec_fd(args.spec_fd, ManagerSpec)
    cfg = spec.config
    # The log format, for us and (in the environment every child inherits: process_env) the
    # whole tree; set even when "text", so a format in the caller's environment does not leak in.
    os.environ[LOG_FORMAT_ENV] = cfg.manager.log_format
    if cfg.manager.otlp_traces_endpoint:  # traces: the whole tree's too (servectl/tracing)
        os.environ[tracing.TRACES_ENDPOINT_ENV] = cfg.manager.otlp_traces_endpoint
    setup_child_logging("manager")
    if journal_mode() and cfg.manager.log_format == "json":
        journal_own_records()  # its records as the journal's own fields (manager/journal.py)
    if (bad := tracing.check_env()) is not None:
        raise StartupError(bad)
    if args.die_with_parent:
        die_with_parent()
    root = resolve_runtime_dir(cfg.manager.runtime_dir)
    paths, lock_fd = claim_runtime_dir(root)
    state_dir = Path(cfg.manager.state_dir) if cfg.manager.state_dir else root / "state"
    try:
        # Logs are readable where the runtime directory is (a group-shared one: its group).
        secure_dir(state_dir, 0o750 if is_shared(os.stat(root)) else 0o700)
    except UntrustedDirectory as exc:
        raise StartupError(str(exc)) from None
    except OSError as exc:
        raise StartupError(f"cannot use {exc.filename or state_dir}: {exc.strerror or exc}; choose another state "
                           "directory with --state-dir (manager.state_dir)") from None
    # The tag must be in our real environment (/proc/<pid>/environ) so a leak
    # of the manager itself can be found; `servectl start` and Server() put it there.
    instance = args.instance or os.environ.get(INSTANCE_ENV) or secrets.token_hex(8)
    os.environ[INSTANCE_ENV] = instance
    become_subreaper()
    import uvloop

    manager = Manager(cfg, paths, instance, state_dir, spec.config_path, spec.overrides, lock_fd=lock_fd,
                      report_fd=args.report_fd)
    from manager.logs import rotate_own_log

    rotate_own_log(manager.log_dir / "manager.log")  # the file the CLI gave us as stdout and stderr
    tracer = tracing.start("manager")
    if tracer is not None:
        from manager.spans import GroupSpans

        manager.spans = GroupSpans(tracer)

    async def run() -> int:
        if args.parent_pipe_fd is not None:
            # End of file on this pipe means the script that started us is gone.
            loop = asyncio.get_running_loop()
            loop.add_reader(args.parent_pipe_fd, lambda: (loop.remove_reader(args.parent_pipe_fd),
                                                          manager.request_shutdown(0)))
        return await manager.run()

    return uvloop.run(run())
