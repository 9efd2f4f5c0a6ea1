"""The daemon's lifecycle verbs: `start` (and what it shows while the tree comes up),
`stop` and `status`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from servectl import config as C
from servectl.cli import common
from servectl.cli.common import CONFIG_ERROR, config_errors_exit, parse_engine_args, runtime_option, say, status_or_exit
from servectl.client import ControlClient, NotRunning, StartFailed, spawn_manager, wait_settled
from servectl.messages import last_error, without_tracebacks
from servectl.model_check import check_model_paths
from servectl.paths import prepare_dirs, resolve_runtime_dir
from servectl.status_view import budget_table, fmt_age, models_table, proc_usage
from servectl.wire import control as P
from servectl.wire import status as WS
from servectl.wire.vocab import ChildState, EventKind, ExitCode, ModelState


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="TOML config file (default: $SERVECTL_CONFIG, else ~/.config/servectl/servectl.toml, or "
                   "/etc/servectl/servectl.toml for the system daemon; never ./servectl.toml).")
@runtime_option
@click.option("--host", help="Gateway address (default 127.0.0.1).")
@click.option("--port", type=int, help="Gateway port (default 8000; 0 picks a free one).")
@click.option("--model", help="Model directory to serve (default: the bundled model).")
@click.option("--name", help="Name clients use in `model` (default: 'default').")
@click.option("--tensor-parallel-size", "--tp", "tp", type=int, help="Worker processes for the model.")
@click.option("--gateways", type=int, help="Gateway processes sharing the port.")
@click.option("--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE", help="vLLM engine argument.")
@click.option("--freeze-grace", type=float, help="Seconds idle before workers are frozen (0: never).")
@click.option("--api-key-file", type=click.Path(dir_okay=False), help="File of API keys, one per line.")
@click.option("--state-dir", type=click.Path(file_okay=False), help="Logs directory root (default: RUNTIME/state).")
@click.option("--foreground", is_flag=True, help="Run the manager in this process (for systemd).")
@click.option("--timeout", type=float, default=600, show_default=True, help="Seconds to wait for ready.")
def start(config_path, runtime_dir, host, port, model, name, tp, gateways, engine_args, freeze_grace, api_key_file,
          state_dir, foreground, timeout):
    """Start the daemon and wait until every model is ready or failed."""
    try:
        overrides = C.Overrides(runtime_dir=runtime_dir, state_dir=state_dir, host=host, port=port, gateways=gateways,
                                freeze_grace_s=freeze_grace, api_key_file=api_key_file, model=model, name=name,
                                tensor_parallel_size=tp, engine_args=parse_engine_args(engine_args))
        cfg, found = C.effective_config(config_path, overrides, system=C.is_system_daemon(runtime_dir))
    except C.ConfigError as exc:
        config_errors_exit([str(exc)])
    config_errors_exit(check_model_paths(cfg, found, overrides))
    root = resolve_runtime_dir(cfg.manager.runtime_dir)
    cfg.manager.runtime_dir = str(root)
    state_dir = Path(cfg.manager.state_dir) if cfg.manager.state_dir else root / "state"
    # Made here, or checked if there: never written into if another user made it first.
    log_dir = prepare_dirs(root, state_dir)
    client = ControlClient(root, timeout_s=3)
    if client.running():
        say(common.err, f"servectl is already running in {root}")
        sys.exit(1)
    # The manager re-reads exactly this file on reload and re-applies these options.
    config_path = Path(found).resolve() if found is not None else None
    if foreground:
        from servectl.client import child_env, manager_command, manager_spec_fd

        fd = manager_spec_fd(cfg, config_path, overrides)
        os.set_inheritable(fd, True)
        argv = manager_command(fd)
        os.execve(argv[0], argv, child_env())
    log = log_dir / "manager.log"
    report_r, report_w = os.pipe()  # the manager writes a startup failure here, in one line
    try:
        proc = spawn_manager(cfg, log, ["--report-fd", str(report_w)], pass_fds=(report_w,), config_path=config_path,
                             overrides=overrides)
    except OSError as exc:
        os.close(report_r)
        say(common.err, (f"cannot start the manager: {exc.filename or log}: {exc.strerror or exc}", "red"))
        sys.exit(CONFIG_ERROR)
    finally:
        os.close(report_w)
    announced = []

    def announce() -> None:
        # Once the manager is up (its first event, or its answer): a refused start is one line alone.
        if not announced:
            announced.append(True)
            say(common.console, f"servectl: manager pid {proc.pid}, runtime {root}")

    def show(ev: WS.Event) -> None:
        announce()
        if ev.kind != EventKind.MODEL:
            say(common.console, *start_event_parts(ev))

    try:
        with common.console.status("starting…"):
            reply = wait_settled(client, proc.pid, timeout, show, report_fd=report_r)
    except StartFailed as exc:  # the manager refused to start (e.g. its port is taken): nothing runs
        say(common.err, (str(exc), "red"))
        sys.exit(exc.exit_code)
    except NotRunning:
        announce()
        tail = log.read_text(errors="replace").splitlines()[-50:] if log.exists() else []
        why = last_error(tail)
        say(common.err, ("the manager exited during start", "red"), f": {why}" if why else "", f" (its log: {log})")
        sys.exit(1)
    except TimeoutError as exc:
        announce()
        say(common.err, (str(exc), "red"), "; the daemon keeps starting in the background (`servectl status`)")
        sys.exit(1)
    finally:
        os.close(report_r)
    announce()
    failed = [m for m in reply.models if m.state not in P.AVAILABLE]
    broken_gateways = [c for c in reply.children if c.kind == EventKind.GATEWAY and c.state != ChildState.READY]
    for c in broken_gateways:
        say(common.err, (f"{c.component} {c.state}", "red"), f": {c.last_exit or ''}")
        for line in without_tracebacks(c.last_log)[-10:]:
            say(common.err, f"    {line}")
    if not failed and not broken_gateways:
        say(common.console, ("ready", "green"), f": {', '.join(m.name for m in reply.models)} on "
                                          f"http://{reply.host}:{reply.port}")
        return
    for m in failed:
        show_model_failure(common.err, m, reply.children)
    sys.exit(1)


def start_event_parts(ev: WS.Event) -> tuple:
    """A child's state change as `start` shows it (parts for say())."""
    color = {ChildState.READY: "green", ChildState.FAILED: "red", ChildState.EXITED: "yellow",
             ChildState.BACKOFF: "yellow"}.get(ev.state, "cyan")
    return (f"  {ev.component:<28} pid {ev.pid or '-':<8} ", (ev.state, color), f" ({ev.detail})" if ev.detail else "")


@click.command()
@runtime_option
@click.option("--timeout", type=float, default=None, help="Drain timeout in seconds (default: the config's).")
def stop(runtime_dir, timeout):
    """Drain and stop the daemon; exits 0 if it was not running."""
    client = common.client_for(runtime_dir, timeout=5)
    try:
        status = client.status()
    except NotRunning:
        say(common.console, f"servectl is not running (runtime dir {client.paths.root})")
        return
    pid = status.manager_pid
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    client.request(P.StopRequest(timeout_s=timeout))
    import select

    with common.console.status(f"stopping (manager pid {pid})…"):
        poll = select.poll()
        poll.register(pidfd, select.POLLIN)
        poll.poll()  # the pidfd becomes readable when the manager exits
    os.close(pidfd)
    say(common.console, "stopped")


def show_model_failure(out: Console, model: WS.ModelStatus, children: list[WS.ChildStatus], lines: int = 10) -> None:
    """A model that is not ready: its reason, then its children's last log lines
    (tracebacks reduced to their exception line; the frames stay in the log files).
    A load failure a restart cannot fix is its one-line reason alone."""
    say(out, (f"model {model.name} {model.state}", "red"), f": {model.reason or ''}")
    if any(c.model == model.name and c.kind == EventKind.ENGINE and c.exit_code == ExitCode.PERMANENT
           for c in children):
        return
    for c in children:
        shown = without_tracebacks(c.last_log)[-lines:] if c.model == model.name else []
        if shown:
            say(out, f"  last lines of {c.component} (`servectl logs {c.component}`):")
            for line in shown:
                say(out, f"    {line}")


@click.command()
@runtime_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(runtime_dir, as_json):
    """Show every process of the tree; exit 0 only if every model is ready."""
    st = status_or_exit(common.client_for(runtime_dir))
    ok = all(m.state in P.AVAILABLE for m in st.models)
    if as_json:
        click.echo(msgspec.json.encode(st).decode())
        sys.exit(0 if ok else 1)
    say(common.console, f"manager pid {st.manager_pid}, {st.state}, up {fmt_age(st.started_at)}, "
                 f"http://{st.host}:{st.port}, instance {st.instance}")
    table = Table(show_lines=False)
    # A model spread over hosts: where each rank runs (the head's view), or whose engine it serves.
    hosts = any(c.host or c.head for c in st.children)
    for col in ("component", "model", *(("host",) if hosts else ()), "pid", "state", "uptime", "restarts", "RSS",
                "CPU%", "last exit"):
        table.add_column(col)
    for c in st.children:
        rss, cpu = ("-", "-") if c.host else proc_usage(c.pid)  # another host's pid is not ours to read
        color = {ChildState.READY: "green", ChildState.FROZEN: "blue", ChildState.FAILED: "red"}.get(c.state, "yellow")
        where = (c.host or (f"here, for {c.head}" if c.head else "here"),) if hosts else ()
        # Text cells: a str cell would be read as markup and emoji codes.
        table.add_row(*map(Text, (c.component, c.model or "-", *where, str(c.pid or "-"))), Text(c.state, style=color),
                      *map(Text, (fmt_age(c.started_at), str(c.restarts), rss, cpu, c.last_exit or "-")))
    common.console.print(table)
    common.console.print(models_table(st.models))
    if st.budget.max_loaded_models is not None or any(d.budget_bytes is not None for d in st.budget.devices):
        common.console.print(budget_table(st.budget))
    for m in st.models:
        if m.state == ModelState.FAILED:
            show_model_failure(common.console, m, st.children)
    sys.exit(0 if ok else 1)
