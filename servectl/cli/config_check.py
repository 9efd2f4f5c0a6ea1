"""`servectl config check`: validate a configuration file (model paths, then vLLM's
judgement of the engine arguments in a short-lived process) and print the effective one.
"""

from __future__ import annotations

import json
import subprocess
import sys

import click
import msgspec

from servectl import config as C
from servectl.cli import common
from servectl.cli.common import config_errors_exit, say
from servectl.model_check import budget_warnings, check_model_paths


@click.group()
def config():
    """Configuration files."""


@config.command("check")
@click.argument("path", required=False)
def config_check(path):
    """Validate a config file and print the effective configuration."""
    try:
        cfg, found = C.load_config(path)
    except C.ConfigError as exc:
        config_errors_exit([str(exc)])
    # Model paths first (no process needed), then vLLM's judgement of the engine arguments.
    config_errors_exit(check_model_paths(cfg, found) or check_engine_args(cfg))
    for warning in budget_warnings(cfg):
        say(common.err, (f"warning: {warning}", "yellow"))
    for line in cluster_lines(cfg):
        say(common.err, line)
    say(common.err, f"effective configuration ({found or 'built-in defaults'}; API keys and env values redacted):")
    click.echo(msgspec.json.format(msgspec.json.encode(C.redacted(cfg)), indent=2).decode())


def cluster_lines(cfg: C.Config) -> list[str]:
    """What this host does for the models spread over hosts (docs/cluster.md)."""
    if not any(m.hosts for m in cfg.models):
        return []
    me = C.cluster.this_host(cfg.cluster)
    lines = [f"this host is {me} ({cfg.cluster.hosts[me]})"]
    for m in cfg.models:
        if len(m.hosts) > 1 and m.hosts[0] == me:
            lines.append(f"model {m.name}: head (engine and ranks {C.cluster.ranks_on(m, me)}); the others: "
                         + ", ".join(f"{h} ranks {C.cluster.ranks_on(m, h)}" for h in m.hosts[1:]))
        elif me in m.hosts[1:]:
            lines.append(f"model {m.name}: ranks {C.cluster.ranks_on(m, me)} here, for the head {m.hosts[0]}")
    return lines


def check_engine_args(cfg: C.Config) -> list[str]:
    """Let vLLM judge each model's engine arguments in a short-lived process
    (`python -m engine_core --check`), since the CLI never imports vLLM."""
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
                    say(common.err, f"model {m.name}: {line.strip()}")
    return problems
