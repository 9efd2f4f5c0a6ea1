"""The verbs that change which models are served and how: restart, reload, load, unload,
freeze, and the lora group (load, unload, list adapters).
"""

from __future__ import annotations

import json
import os

import click
import msgspec

from servectl import config as C
from servectl.cli import common
from servectl.cli.common import (config_errors_exit, parse_engine_args, reply_or_exit, runtime_option, say,
                                 status_or_exit)
from servectl.model_check import check_model_paths
from servectl.wire import control as P

# A LoRA change waits for the engine to read the adapter (the manager bounds that wait itself).
LORA_TIMEOUT_S = P.LORA_CHANGE_TIMEOUT_S + 30


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


@click.command()
@runtime_option
@click.argument("model", required=False)
@wait_options
def restart(runtime_dir, model, wait, wait_s):
    """Restart one model's engine group (clears `failed`), or every group one at a time.

    Returns once restarted (serving again, or failed: exit 1), unless --no-wait."""
    reply_or_exit(runtime_dir, P.RestartRequest(model=model, wait_s=verb_wait(wait, wait_s)),
                  timeout=verb_timeout(wait, wait_s))


@click.command()
@runtime_option
def reload(runtime_dir):
    """Re-read the config file and apply only the difference (also: SIGHUP to the manager).

    Returns once the reload is applied (models drained, stopped, started)."""
    reply_or_exit(runtime_dir, P.ReloadRequest(), timeout=900)


@click.command()
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
        reply_or_exit(runtime_dir, P.LoadConfigured(name=name, wait_s=verb_wait(wait, wait_s)), timeout=timeout)
    try:
        model = msgspec.convert({"name": name, "model": path, "tensor_parallel_size": tp, "devices": devices,
                                 "engine_args": parse_engine_args(engine_args)}, C.ModelConfig)
    except (msgspec.ValidationError, C.ConfigError) as exc:
        config_errors_exit([f"bad model: {exc}"])
    config_errors_exit(check_model_paths(C.Config(models=[model]), None, C.Overrides(model=path)))
    reply_or_exit(runtime_dir, P.LoadModel(model=model, wait_s=verb_wait(wait, wait_s)), timeout=timeout)


@click.command()
@runtime_option
@click.argument("name")
@wait_options
def unload(runtime_dir, name, wait, wait_s):
    """Drain and stop one model's engine groups; returns once they are gone, unless --no-wait."""
    reply_or_exit(runtime_dir, P.UnloadModel(name=name, wait_s=verb_wait(wait, wait_s)),
                  timeout=verb_timeout(wait, wait_s))


@click.command()
@runtime_option
@click.argument("model")
@click.argument("state", type=click.Choice(["on", "off"]))
def freeze(runtime_dir, model, state):
    """Turn freezing of a model's idle workers on or off (diagnostics)."""
    reply_or_exit(runtime_dir, P.SetFreezing(model=model, enabled=state == "on"))


@click.group()
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
        config_errors_exit([f"bad adapter name {name!r}: {exc}"])
    reply_or_exit(runtime_dir, P.LoadLora(lora=lora_module, model=model, load_inplace=inplace),
                  timeout=LORA_TIMEOUT_S)


@lora.command("unload")
@runtime_option
@click.argument("name")
@click.option("--model", help="The model that serves it (found by the name otherwise).")
def lora_unload(runtime_dir, name, model):
    """Stop serving the adapter NAME (requests may no longer name it)."""
    reply_or_exit(runtime_dir, P.UnloadLora(name=name, model=model), timeout=LORA_TIMEOUT_S)


@lora.command("list")
@runtime_option
@click.option("--json", "as_json", is_flag=True)
def lora_list(runtime_dir, as_json):
    """Every model that takes adapters, and the adapters each serves."""
    st = status_or_exit(common.client_for(runtime_dir))
    rows = [{"model": m.name, "state": str(m.state), "adapter": lora.name, "path": lora.path}
            for m in st.models if m.lora_enabled for lora in (m.loras or [None]) if lora is not None]
    if as_json:
        print(json.dumps({"models": [{"name": m.name, "state": str(m.state),
                                      "loras": [msgspec.to_builtins(lora) for lora in m.loras]}
                                     for m in st.models if m.lora_enabled]}, indent=2))
        return
    enabled = [m for m in st.models if m.lora_enabled]
    if not enabled:
        say(common.console, "no served model takes LoRA adapters (engine_args.enable_lora)")
        return
    for m in enabled:
        say(common.console, f"{m.name} ({m.state}): {len(m.loras)} adapter(s)")
        for row in (r for r in rows if r["model"] == m.name):
            say(common.console, f"  {row['adapter']}  {row['path']}")
