"""`servectl`: the operator's command line. Talks to the manager only through
its control socket; never imports torch or vLLM.

This package's surface is `main`, the command group every verb family adds its verbs to:
lifecycle (start, stop, status), models (restart, reload, load, unload, freeze, lora),
watch (events, logs) and config_check (config check).

Exit codes: 0 success; 1 failure (e.g. a model failed to start); 2 usage or
config error; 3 the daemon is not running (as `systemctl status`).
"""

from __future__ import annotations

import os
import sys

import click

from servectl import __version__
from servectl.cli import common
from servectl.cli.common import CONFIG_ERROR, NO_PERMISSION, say
from servectl.cli.config_check import config
from servectl.cli.lifecycle import start, status, stop
from servectl.cli.models import freeze, load, lora, reload, restart, unload
from servectl.cli.watch import events, logs, usage
from servectl.client import PermissionDenied
from servectl.messages import one_line
from servectl.paths import UntrustedDirectory

__all__ = ["main"]


class Main(click.Group):
    """Refusals are one clear line and an exit code, never a traceback; so is an
    unexpected error (SERVECTL_DEBUG=1 shows its traceback)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UntrustedDirectory as exc:
            say(common.err, (str(exc), "red"))
            sys.exit(CONFIG_ERROR)
        except PermissionDenied as exc:
            say(common.err, (str(exc), "red"))
            sys.exit(NO_PERMISSION)
        except PermissionError as exc:  # a file or socket of a daemon this user may not reach
            what = f" {exc.filename}" if exc.filename else ""
            say(common.err, (f"permission denied:{what}", "red"), " (a daemon of another user? members of its "
                "group may use status, events and logs; its owner and root everything)")
            sys.exit(NO_PERMISSION)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as exc:
            if os.environ.get("SERVECTL_DEBUG"):
                raise
            say(common.err, ("servectl: unexpected error: ", "red"), f"{type(exc).__name__}: {one_line(str(exc))}",
                " (SERVECTL_DEBUG=1 shows where)")
            sys.exit(1)


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="servectl")
def main() -> None:
    """Serve LLMs with a supervisor that owns every process."""


for verb in (start, stop, status, restart, reload, load, unload, freeze, lora, events, logs, usage, config):
    main.add_command(verb)
