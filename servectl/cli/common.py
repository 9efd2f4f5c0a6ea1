"""What every verb family of the CLI shares: its consoles and `say()`, the runtime option,
and the one way a verb asks the daemon and answers with its reply or an exit code.

Verbs read `console`, `err` and `client_for` through this module (``common.console``), so a
test can replace them here once for every verb.
"""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.text import Text

from servectl import config as C
from servectl.client import ControlClient, NotRunning
from servectl.paths import resolve_runtime_dir
from servectl.wire import control as P
from servectl.wire.vocab import ExitCode


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
NO_PERMISSION = ExitCode.NO_PERMISSION


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


def config_errors_exit(problems: list[str]) -> None:
    """Each problem in red, then the usage/config exit code; nothing if there is none."""
    if problems:
        for msg in problems:
            say(err, (msg, "red"))
        sys.exit(CONFIG_ERROR)


def status_or_exit(client: ControlClient) -> P.StatusReply:
    """The daemon's status, or its absence said and the not-running exit code."""
    try:
        return client.status()
    except NotRunning as exc:
        not_running(exc)


def reply_or_exit(runtime_dir, msg, timeout: float = 10) -> None:
    """Send one control message and exit with its reply: the message on stdout and 0 if it
    was done, on stderr and 1 if not (3 if no daemon runs)."""
    client = client_for(runtime_dir, timeout=timeout)
    try:
        reply = client.request(msg)
    except NotRunning as exc:
        not_running(exc)
    say(console if reply.ok else err, reply.message)
    sys.exit(0 if reply.ok else 1)


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
