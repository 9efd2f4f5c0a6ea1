"""`servectl`: the operator's command line. Talks to the manager only through
its control socket; never imports torch or vLLM.

Exit codes: 0 success; 1 failure (e.g. a model failed to start); 2 usage or
config error; 3 the daemon is not running (as `systemctl status`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click
import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from servectl import __version__
from servectl.wire import control as P
from servectl import config as C
from servectl.client import (MAX_REPLY_BYTES, ControlClient, NotRunning, PermissionDenied, StartFailed, spawn_manager,
                             wait_settled)
from servectl.messages import last_error, one_line, without_tracebacks
from servectl.model_check import budget_warnings, check_model_paths
from servectl.paths import UntrustedDirectory, prepare_dirs, resolve_runtime_dir, verify_dir
from servectl.status_view import budget_table, fmt_age, models_table, proc_usage
from servectl.wire.vocab import ChildState, EventKind, ExitCode, ModelState

# Piped output (scripts, logs) gets a wide fixed width rather than 80 columns.
# Text from users and processes (model and component names, reasons, log lines,
# paths) is printed literally: no emoji codes (`worker:fire:0` is not
# `worker🔥0`), no markup, no highlighting. Everything goes through say(), whose
# parts are literal strings or (string, style) pairs, or through Text objects.
def make_console(**kwargs) -> Console:
    return Console(emoji=False, highlight=False, **kwargs)


console = make_console(width=None if sys.stdout.isatty() else 160)
err = make_console(stderr=True, width=None if sys.stderr.isatty() else 160)
NOT_RUNNING = ExitCode.NOT_RUNNING
CONFIG_ERROR = ExitCode.USAGE
# A LoRA change waits for the engine to read the adapter (the manager bounds that wait itself).
LORA_TIMEOUT_S = P.LORA_CHANGE_TIMEOUT_S + 30


def say(out: Console, *parts: str | tuple[str, str]) -> None:
    """Print one line made of literal parts: a str as it is, a (str, style) pair styled.
    Nothing in a part is read as markup or an emoji code; the line is not wrapped."""
    out.print(Text.assemble(*parts), soft_wrap=True)


def runtime_option(f):
    return click.option("--runtime-dir", envvar="SERVECTL_RUNTIME_DIR",
                        help="Runtime directory (default: /run/servectl if it has a daemon, "
                             "else $XDG_RUNTIME_DIR/servectl, else $TMPDIR/servectl-$UID).")(f)


def client_for(runtime_dir: str | None, timeout: float = 10.0) -> ControlClient:
    return ControlClient(resolve_runtime_dir(runtime_dir), timeout_s=timeout)


def not_running(exc: NotRunning) -> None:
    say(err, (str(exc), "yellow"))
    sys.exit(NOT_RUNNING)


NO_PERMISSION = ExitCode.NO_PERMISSION


class Main(click.Group):
    """Refusals are one clear line and an exit code, never a traceback; so is an
    unexpected error (SERVECTL_DEBUG=1 shows its traceback)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UntrustedDirectory as exc:
            say(err, (str(exc), "red"))
            sys.exit(CONFIG_ERROR)
        except PermissionDenied as exc:
            say(err, (str(exc), "red"))
            sys.exit(NO_PERMISSION)
        except PermissionError as exc:  # a file or socket of a daemon this user may not reach
            what = f" {exc.filename}" if exc.filename else ""
            say(err, (f"permission denied:{what}", "red"), " (a daemon of another user? members of its "
                "group may use status, events and logs; its owner and root everything)")
            sys.exit(NO_PERMISSION)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as exc:
            if os.environ.get("SERVECTL_DEBUG"):
                raise
            say(err, ("servectl: unexpected error: ", "red"), f"{type(exc).__name__}: {one_line(str(exc))}",
                " (SERVECTL_DEBUG=1 shows where)")
            sys.exit(1)


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="servectl")
def main() -> None:
    """Serve LLMs with a supervisor that owns every process."""


def parse_engine_args(items: tuple[str, ...]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise C.ConfigError(f"--engine-arg wants KEY=VALUE, got {item!r}")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    return out


@main.command()
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
        say(err, (str(exc), "red"))
        sys.exit(CONFIG_ERROR)
    bad = check_model_paths(cfg, found, overrides)
    if bad:
        for msg in bad:
            say(err, (msg, "red"))
        sys.exit(CONFIG_ERROR)
    root = resolve_runtime_dir(cfg.manager.runtime_dir)
    cfg.manager.runtime_dir = str(root)
    state_dir = Path(cfg.manager.state_dir) if cfg.manager.state_dir else root / "state"
    # Made here, or checked if there: never written into if another user made it first.
    log_dir = prepare_dirs(root, state_dir)
    client = ControlClient(root, timeout_s=3)
    if client.running():
        say(err, f"servectl is already running in {root}")
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
        say(err, (f"cannot start the manager: {exc.filename or log}: {exc.strerror or exc}", "red"))
        sys.exit(CONFIG_ERROR)
    finally:
        os.close(report_w)
    announced = []

    def announce() -> None:
        # Once the manager is up (its first event, or its answer): a refused start is one line alone.
        if not announced:
            announced.append(True)
            say(console, f"servectl: manager pid {proc.pid}, runtime {root}")

    def show(ev: P.Event) -> None:
        announce()
        if ev.kind != EventKind.MODEL:
            say(console, *start_event_parts(ev))

    try:
        with console.status("starting…"):
            reply = wait_settled(client, proc.pid, timeout, show, report_fd=report_r)
    except StartFailed as exc:  # the manager refused to start (e.g. its port is taken): nothing runs
        say(err, (str(exc), "red"))
        sys.exit(exc.exit_code)
    except NotRunning:
        announce()
        tail = log.read_text(errors="replace").splitlines()[-50:] if log.exists() else []
        why = last_error(tail)
        say(err, ("the manager exited during start", "red"), f": {why}" if why else "", f" (its log: {log})")
        sys.exit(1)
    except TimeoutError as exc:
        announce()
        say(err, (str(exc), "red"), "; the daemon keeps starting in the background (`servectl status`)")
        sys.exit(1)
    finally:
        os.close(report_r)
    announce()
    failed = [m for m in reply.models if m.state not in P.AVAILABLE]
    broken_gateways = [c for c in reply.children if c.kind == EventKind.GATEWAY and c.state != ChildState.READY]
    for c in broken_gateways:
        say(err, (f"{c.component} {c.state}", "red"), f": {c.last_exit or ''}")
        for line in without_tracebacks(c.last_log)[-10:]:
            say(err, f"    {line}")
    if not failed and not broken_gateways:
        say(console, ("ready", "green"), f": {', '.join(m.name for m in reply.models)} on "
                                          f"http://{reply.host}:{reply.port}")
        return
    for m in failed:
        show_model_failure(err, m, reply.children)
    sys.exit(1)


def start_event_parts(ev: P.Event) -> tuple:
    """A child's state change as `start` shows it (parts for say())."""
    color = {ChildState.READY: "green", ChildState.FAILED: "red", ChildState.EXITED: "yellow",
             ChildState.BACKOFF: "yellow"}.get(ev.state, "cyan")
    return (f"  {ev.component:<28} pid {ev.pid or '-':<8} ", (ev.state, color), f" ({ev.detail})" if ev.detail else "")


def event_line(ev: P.Event) -> str:
    """One event as `servectl events` prints it."""
    stamp = time.strftime("%H:%M:%S", time.localtime(ev.time))
    return f"{stamp} {ev.component:<28} {ev.state:<10} pid {ev.pid or '-'} {ev.detail}"


@main.command()
@runtime_option
@click.option("--timeout", type=float, default=None, help="Drain timeout in seconds (default: the config's).")
def stop(runtime_dir, timeout):
    """Drain and stop the daemon; exits 0 if it was not running."""
    client = client_for(runtime_dir, timeout=5)
    try:
        status = client.status()
    except NotRunning:
        say(console, f"servectl is not running (runtime dir {client.paths.root})")
        return
    pid = status.manager_pid
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    client.request(P.StopRequest(timeout_s=timeout))
    import select

    with console.status(f"stopping (manager pid {pid})…"):
        poll = select.poll()
        poll.register(pidfd, select.POLLIN)
        poll.poll()  # the pidfd becomes readable when the manager exits
    os.close(pidfd)
    say(console, "stopped")


def show_model_failure(out: Console, model: P.ModelStatus, children: list[P.ChildStatus], lines: int = 10) -> None:
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


@main.command()
@runtime_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(runtime_dir, as_json):
    """Show every process of the tree; exit 0 only if every model is ready."""
    client = client_for(runtime_dir)
    try:
        st = client.status()
    except NotRunning as exc:
        not_running(exc)
    ok = all(m.state in P.AVAILABLE for m in st.models)
    if as_json:
        click.echo(msgspec.json.encode(st).decode())
        sys.exit(0 if ok else 1)
    say(console, f"manager pid {st.manager_pid}, {st.state}, up {fmt_age(st.started_at)}, "
                 f"http://{st.host}:{st.port}, instance {st.instance}")
    table = Table(show_lines=False)
    for col in ("component", "model", "pid", "state", "uptime", "restarts", "RSS", "CPU%", "last exit"):
        table.add_column(col)
    for c in st.children:
        rss, cpu = proc_usage(c.pid)
        color = {ChildState.READY: "green", ChildState.FROZEN: "blue", ChildState.FAILED: "red"}.get(c.state, "yellow")
        # Text cells: a str cell would be read as markup and emoji codes.
        table.add_row(*map(Text, (c.component, c.model or "-", str(c.pid or "-"))), Text(c.state, style=color),
                      *map(Text, (fmt_age(c.started_at), str(c.restarts), rss, cpu, c.last_exit or "-")))
    console.print(table)
    console.print(models_table(st.models))
    if st.budget.max_loaded_models is not None or any(d.budget_bytes is not None for d in st.budget.devices):
        console.print(budget_table(st.budget))
    for m in st.models:
        if m.state == ModelState.FAILED:
            show_model_failure(console, m, st.children)
    sys.exit(0 if ok else 1)


def wait_options(f):
    """--wait/--no-wait and --timeout of a model verb (load, unload, restart)."""
    f = click.option("--timeout", "wait_s", type=click.FloatRange(0, P.MAX_VERB_WAIT_S), default=None,
                     help="Seconds to wait for the change (default: until it is done); past it, exit 0 "
                          "saying it is under way.")(f)
    return click.option("--wait/--no-wait", default=True, show_default=True,
                        help="Return once the change is done, or once it is under way.")(f)


def verb_wait(wait: bool, wait_s: float | None) -> float | None:
    return wait_s if wait else 0.0


def verb_timeout(wait: bool, wait_s: float | None) -> float:
    """How long the CLI waits for the manager's answer: past the wait the manager keeps to."""
    return (P.MAX_VERB_WAIT_S if wait and wait_s is None else verb_wait(wait, wait_s)) + 10


@main.command()
@runtime_option
@click.argument("model", required=False)
@wait_options
def restart(runtime_dir, model, wait, wait_s):
    """Restart one model's engine group (clears `failed`), or every group one at a time.

    Returns once restarted (serving again, or failed: exit 1), unless --no-wait."""
    ack_or_exit(runtime_dir, P.RestartRequest(model=model, wait_s=verb_wait(wait, wait_s)),
                timeout=verb_timeout(wait, wait_s))


def ack_or_exit(runtime_dir, msg, timeout: float = 10) -> None:
    client = client_for(runtime_dir, timeout=timeout)
    try:
        reply = client.request(msg)
    except NotRunning as exc:
        not_running(exc)
    say(console if reply.ok else err, reply.message)
    sys.exit(0 if reply.ok else 1)


@main.command()
@runtime_option
def reload(runtime_dir):
    """Re-read the config file and apply only the difference (also: SIGHUP to the manager).

    Returns once the reload is applied (models drained, stopped, started)."""
    ack_or_exit(runtime_dir, P.ReloadRequest(), timeout=900)


@main.command()
@runtime_option
@click.argument("name")
@click.option("--model", "path", help="Model directory (Hugging Face format); without it, NAME is a model of "
                                      "the configuration that was unloaded.")
@click.option("--tensor-parallel-size", "--tp", "tp", type=int, default=1, show_default=True)
@click.option("--devices", help="CUDA_VISIBLE_DEVICES for this model's workers.")
@click.option("--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE", help="vLLM engine argument.")
@wait_options
def load(runtime_dir, name, path, tp, devices, engine_args, wait, wait_s):
    """Start serving another model at runtime (until the next reload), or a configured one again.

    Returns once it serves (or is released until its first request, as configured; or failed:
    exit 1), unless --no-wait. While the model is being unloaded, it is loaded once it is gone."""
    timeout = verb_timeout(wait, wait_s)
    if path is None:
        ack_or_exit(runtime_dir, P.LoadConfigured(name=name, wait_s=verb_wait(wait, wait_s)), timeout=timeout)
    try:
        model = msgspec.convert({"name": name, "model": path, "tensor_parallel_size": tp, "devices": devices,
                                 "engine_args": parse_engine_args(engine_args)}, C.ModelConfig)
    except (msgspec.ValidationError, C.ConfigError) as exc:
        say(err, (f"bad model: {exc}", "red"))
        sys.exit(CONFIG_ERROR)
    bad = check_model_paths(C.Config(models=[model]), None, C.Overrides(model=path))
    if bad:
        for msg in bad:
            say(err, (msg, "red"))
        sys.exit(CONFIG_ERROR)
    ack_or_exit(runtime_dir, P.LoadModel(model=model, wait_s=verb_wait(wait, wait_s)), timeout=timeout)


@main.command()
@runtime_option
@click.argument("name")
@wait_options
def unload(runtime_dir, name, wait, wait_s):
    """Drain and stop one model's engine groups; returns once they are gone, unless --no-wait."""
    ack_or_exit(runtime_dir, P.UnloadModel(name=name, wait_s=verb_wait(wait, wait_s)),
                timeout=verb_timeout(wait, wait_s))


@main.command()
@runtime_option
@click.argument("model")
@click.argument("state", type=click.Choice(["on", "off"]))
def freeze(runtime_dir, model, state):
    """Turn freezing of a model's idle workers on or off (diagnostics)."""
    ack_or_exit(runtime_dir, P.SetFreezing(model=model, enabled=state == "on"))


@main.group()
def lora():
    """LoRA adapters of a model whose engine_args have `enable_lora = true`: load, unload, list.

    Adapters loaded here are served until unloaded (engine restarts, idle releases and reloads
    that keep the model included); the config's lora_modules come back with the next reload
    that changes the model."""


@lora.command("load")
@runtime_option
@click.argument("name")
@click.argument("path")
@click.option("--model", help="The model that takes it (needed when several models take adapters).")
@click.option("--inplace", is_flag=True, help="Replace an adapter of that name (vLLM's load_inplace).")
def lora_load(runtime_dir, name, path, model, inplace):
    """Load the adapter at PATH and serve it as NAME (a model name of its own in requests)."""
    try:
        # A local path as the daemon sees it (its working directory is not the caller's); else a hub id.
        where = os.path.abspath(path) if os.path.exists(path) else path
        lora_module = msgspec.convert({"name": name, "path": where}, C.LoraModule)
    except msgspec.ValidationError as exc:
        say(err, (f"bad adapter name {name!r}: {exc}", "red"))
        sys.exit(CONFIG_ERROR)
    lora_reply_or_exit(runtime_dir, P.LoadLora(lora=lora_module, model=model, load_inplace=inplace))


@lora.command("unload")
@runtime_option
@click.argument("name")
@click.option("--model", help="The model that serves it (found by the name otherwise).")
def lora_unload(runtime_dir, name, model):
    """Stop serving the adapter NAME (requests may no longer name it)."""
    lora_reply_or_exit(runtime_dir, P.UnloadLora(name=name, model=model))


@lora.command("list")
@runtime_option
@click.option("--json", "as_json", is_flag=True)
def lora_list(runtime_dir, as_json):
    """Every model that takes adapters, and the adapters each serves."""
    client = client_for(runtime_dir)
    try:
        st = client.status()
    except NotRunning as exc:
        not_running(exc)
    rows = [{"model": m.name, "state": str(m.state), "adapter": lora.name, "path": lora.path}
            for m in st.models if m.lora_enabled for lora in (m.loras or [None]) if lora is not None]
    if as_json:
        print(json.dumps({"models": [{"name": m.name, "state": str(m.state),
                                      "loras": [msgspec.to_builtins(lora) for lora in m.loras]}
                                     for m in st.models if m.lora_enabled]}, indent=2))
        return
    enabled = [m for m in st.models if m.lora_enabled]
    if not enabled:
        say(console, "no served model takes LoRA adapters (engine_args.enable_lora)")
        return
    for m in enabled:
        say(console, f"{m.name} ({m.state}): {len(m.loras)} adapter(s)")
        for row in (r for r in rows if r["model"] == m.name):
            say(console, f"  {row['adapter']}  {row['path']}")


def lora_reply_or_exit(runtime_dir, msg) -> None:
    client = client_for(runtime_dir, timeout=LORA_TIMEOUT_S)
    try:
        reply = client.request(msg)
    except NotRunning as exc:
        not_running(exc)
    say(console if reply.ok else err, reply.message)
    sys.exit(0 if reply.ok else 1)


@main.command()
@runtime_option
def events(runtime_dir):
    """Follow the manager's state-change events."""
    import zmq

    client = client_for(runtime_dir)
    try:
        client.status()
    except NotRunning as exc:
        not_running(exc)
    sub = client.ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    sub.connect(f"ipc://{client.paths.events}")
    try:
        while True:
            say(console, event_line(P.event_decoder.decode(sub.recv())))
    except KeyboardInterrupt:
        pass


@main.command()
@runtime_option
@click.argument("component", required=False)
@click.option("-n", "lines", type=int, default=50, show_default=True)
@click.option("-f", "follow", is_flag=True, help="Follow the file(s).")
def logs(runtime_dir, component, lines, follow):
    """Show a component's log (e.g. gateway-0, engine_core-default, manager)."""
    root = resolve_runtime_dir(runtime_dir)
    try:
        state_dir = Path(ControlClient(root, timeout_s=3).status().state_dir)
    except NotRunning:
        state_dir = root / "state"  # the default, for reading the logs of a stopped daemon
        if root.exists():
            verify_dir(root)  # not another user's directory
    log_dir = state_dir / "logs"
    if not log_dir.exists():
        not_running(NotRunning(f"no logs in {log_dir}"))
    files = sorted(log_dir.glob("*.log"))
    if component:
        want = component.replace(":", "-")
        files = [f for f in files if f.stem == want or f.stem.startswith(want)]
        if not files:
            say(err, f"no log for {component!r}; have: {', '.join(f.stem for f in sorted(log_dir.glob('*.log')))}")
            sys.exit(CONFIG_ERROR)
    argv = ["tail", "-n", str(lines), *(["-F"] if follow else []), *map(str, files)]
    os.execvp("tail", argv)


@main.group()
def config():
    """Configuration files."""


@config.command("check")
@click.argument("path", required=False)
def config_check(path):
    """Validate a config file and print the effective configuration."""
    try:
        cfg, found = C.load_config(path)
    except C.ConfigError as exc:
        say(err, (str(exc), "red"))
        sys.exit(CONFIG_ERROR)
    # Model paths first (no process needed), then vLLM's judgement of the engine arguments.
    bad = check_model_paths(cfg, found) or check_engine_args(cfg)
    if bad:
        for msg in bad:
            say(err, (msg, "red"))
        sys.exit(CONFIG_ERROR)
    for warning in budget_warnings(cfg):
        say(err, (f"warning: {warning}", "yellow"))
    say(err, f"effective configuration ({found or 'built-in defaults'}; API keys and env values redacted):")
    click.echo(msgspec.json.format(msgspec.json.encode(C.redacted(cfg)), indent=2).decode())


def check_engine_args(cfg: C.Config) -> list[str]:
    """Let vLLM judge each model's engine arguments in a short-lived process
    (`python -m engine_core --check`), since the CLI never imports vLLM."""
    import json
    import subprocess
    import sys

    problems = []
    for m in cfg.models:
        chat = {"tool_call_parser": m.tool_call_parser, "tool_parser_plugin": m.tool_parser_plugin}
        proc = subprocess.run([sys.executable, "-m", "engine_core", "--check", "--engine-args",
                               json.dumps(m.engine_args), "--chat", json.dumps(chat)], capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            problems.append(f"model {m.name}: {lines[-1] if lines else 'engine argument check failed'}")
        else:
            for line in proc.stdout.splitlines():  # the parsers it uses, as vLLM resolved them
                if line.strip():
                    say(err, f"model {m.name}: {line.strip()}")
    return problems


if __name__ == "__main__":
    main()
