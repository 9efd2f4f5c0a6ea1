"""The verbs that watch the daemon: `events` follows its state changes, `logs` shows (or
follows) its components' log files, also a stopped daemon's; `usage` its usage per key.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click
import msgspec

from servectl.cli import common
from servectl.cli.common import CONFIG_ERROR, not_running, runtime_option, say, status_or_exit
from servectl.client import MAX_REPLY_BYTES, ControlClient, NotRunning
from servectl.paths import resolve_runtime_dir, verify_dir
from servectl.wire import control as P
from servectl.wire import status as WS


def event_line(ev: WS.Event) -> str:
    """One event as `servectl events` prints it."""
    stamp = time.strftime("%H:%M:%S", time.localtime(ev.time))
    return f"{stamp} {ev.component:<28} {ev.state:<10} pid {ev.pid or '-'} {ev.detail}"


@click.command()
@runtime_option
def events(runtime_dir):
    """Follow the manager's state-change events."""
    import zmq

    client = common.client_for(runtime_dir)
    status_or_exit(client)
    sub = client.ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    sub.connect(f"ipc://{client.paths.events}")
    try:
        while True:
            say(common.console, event_line(WS.event_decoder.decode(sub.recv())))
    except KeyboardInterrupt:
        pass


@click.command()
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
            have = ", ".join(f.stem for f in sorted(log_dir.glob("*.log")))
            say(common.err, f"no log for {component!r}; have: {have}")
            sys.exit(CONFIG_ERROR)
    argv = ["tail", "-n", str(lines), *(["-F"] if follow else []), *map(str, files)]
    os.execvp("tail", argv)


@click.command()
@runtime_option
@click.option("--since", type=float, default=None, help="Unix seconds (default: all that is kept).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object, as GET /servectl/v1/usage answers.")
def usage(runtime_dir, since, as_json):
    """Usage per API key and model: requests, prompt and completion tokens, errors (docs/tenancy.md)."""
    client = common.client_for(runtime_dir)
    try:
        reply = client.request(P.UsageRequest(since=since))
    except NotRunning as exc:
        not_running(exc)
    if as_json:
        click.echo(json.dumps({"since": reply.since, "until": reply.until, "data": msgspec.to_builtins(reply.rows)}))
        return
    click.echo(f"{'KEY':<24} {'MODEL':<24} {'REQUESTS':>9} {'PROMPT':>10} {'COMPLETION':>11} {'ERRORS':>7}")
    for r in reply.rows:
        click.echo(f"{r.key:<24} {r.model:<24} {r.requests:>9} {r.prompt_tokens:>10} {r.completion_tokens:>11} "
                   f"{r.errors:>7}")
