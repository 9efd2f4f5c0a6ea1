"""Where each engine publishes vLLM's KV-cache events (``engine_args.kv_events_config``), and
who may read them. Pure.

vLLM's events carry each stored block's token ids: whoever reads them reads the
prompts. So by default a model's events go to ``ipc://$RT/kv-events-<model>@<slot>``
in the runtime directory (its mode keeps other users out; the socket is 0600),
and the engine strips token ids, extra keys (LoRA names, media ids,
``cache_salt``) and session ids from ``BlockStored`` (engine_core/kv_events.py):
the block hashes stay, which is what a router matches. An endpoint given
explicitly is taken as it is, within these rules (``exposure_problem``): TCP on a
loopback address is allowed (hashes only); TCP off loopback only with the
model's ``kv_events_network = true`` (ZeroMQ over TCP is unauthenticated here:
anyone who reaches the port reads it); token ids (``kv_events_token_ids = true``)
only over ``ipc://``.

Each engine group of a model binds its own endpoint: ``port + slot`` for TCP, the
path with ``-<slot>`` for an explicit ``ipc://`` one, its slot being one of
``0 .. replicas`` that no other group of the model holds (the manager's
``events_slot``; a restart keeps it), as vLLM offsets data-parallel ranks: a model
holds ports ``port .. port + replicas`` (the extra one for a rolling reload's new
group beside the old), and config checks refuse two models whose ranges meet (or
meet the gateway's port). A roll that finds every slot held (one that shrinks
``replicas``) binds a port the system picks (a path with the engine's pid), and
``/kv_event_sources`` says which.
"""

from __future__ import annotations

import ipaddress
import json
import os
from typing import Any


KEY = "kv_events_config"
SOCKET_PREFIX = "kv-events-"  # the default endpoint's file in the runtime directory (servectl/paths.py cleans it)


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def split_endpoint(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://host:port`` endpoint, else None (ipc://, inproc://)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return host.strip("[]"), int(port)


def events_config(engine_args: dict[str, Any]) -> dict[str, Any] | None:
    """The model's KV-events settings as a dict when it publishes events, else None."""
    raw = engine_args.get(KEY)
    if raw is None:
        return None
    cfg = json.loads(raw) if isinstance(raw, str) else dict(raw)
    if not cfg.get("enable_kv_cache_events") or cfg.get("publisher", "zmq") != "zmq":
        return None
    return cfg


def resolve(engine_args: dict[str, Any]) -> None:
    """Check a model's KV-events settings and keep them as a dict (a JSON string is taken too, as
    ``vllm serve --kv-events-config``). Raises ValueError for an endpoint that is not
    ``tcp://host:port``, ``ipc://`` or ``inproc://``. The default endpoint is not written here:
    it depends on the runtime directory and the group's slot (``for_slot``)."""
    raw = engine_args.get(KEY)
    if raw is None:
        return
    cfg = json.loads(raw) if isinstance(raw, str) else dict(raw)
    if not isinstance(cfg, dict):
        raise ValueError("must be a table (vLLM's KVEventsConfig)")
    for key in ("endpoint", "replay_endpoint"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"{key}: {value!r} is not tcp://host:port, ipc:// or inproc://")
        if value.startswith("tcp://"):
            try:
                split_endpoint(value)
            except ValueError:
                raise ValueError(f"{key}: {value!r} has no port") from None
    engine_args[KEY] = cfg


def default_endpoint(runtime_dir: str, model: str, slot: int) -> str:
    """A group's events endpoint when none is configured: a socket in the runtime directory,
    named by model and slot ("@" is in no model name, so two models' never meet)."""
    return f"ipc://{os.path.join(runtime_dir, SOCKET_PREFIX + model)}@{slot if slot >= 0 else f'x{os.getpid()}'}"


def is_loopback(host: str) -> bool:
    """A host only this machine reaches: a loopback IP or ``localhost``; ``*``, ``0.0.0.0``, an
    interface name or any other address is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_problem(cfg: dict[str, Any] | None, token_ids: bool, network: bool) -> str | None:
    """Why a model's events would reach readers they must not, else None (no events: None).
    ``token_ids``: the model's ``kv_events_token_ids`` (vLLM's events whole: the prompts);
    ``network``: its ``kv_events_network`` (a TCP endpoint off loopback, unauthenticated)."""
    if cfg is None:
        return None
    for key in ("endpoint", "replay_endpoint"):
        hp = split_endpoint(cfg.get(key) or "")
        if hp is None:
            continue
        if token_ids:
            return (f"{KEY}.{key}: {cfg[key]} is TCP, which has no authentication here, and kv_events_token_ids "
                    "publishes the prompts' token ids: use ipc:// (the default, in the runtime directory) "
                    "or turn kv_events_token_ids off")
        if not is_loopback(hp[0]) and not network:
            return (f"{KEY}.{key}: {cfg[key]} is reachable from other hosts, unauthenticated: set the model's "
                    "kv_events_network = true to publish there (block hashes only, no token ids), or use "
                    "ipc:// (the default) or a loopback address")
    return None


def port_range(engine_args: dict[str, Any], replicas: int) -> dict[str, range]:
    """The TCP ports a model's engines may bind for events (``port .. port + replicas``), by
    endpoint key: one per replica, one for a rolling reload's new group beside the old."""
    cfg = events_config(engine_args)
    ranges: dict[str, range] = {}
    for key in ("endpoint", "replay_endpoint"):
        value = (cfg.get(key) or "") if cfg else ""
        hp = split_endpoint(value)
        if hp is not None and hp[1] != 0:
            ranges[key] = range(hp[1], hp[1] + replicas + 1)
    return ranges


def offset(value: str | None, n: int) -> str | None:
    """An endpoint for slot ``n``: the port + n (port 0 stays 0: the system picks), an ipc or
    inproc path with a suffix; slot -1 (none left): port 0."""
    if not value or n == 0:
        return value
    hp = split_endpoint(value)
    if hp is None:
        return f"{value}-{n}" if n > 0 else f"{value}-x{os.getpid()}"
    host, port = hp
    return value if port == 0 else tcp_endpoint(host, 0 if n < 0 else port + n)


def for_slot(cfg: dict[str, Any], slot: int, runtime_dir: str, model: str) -> dict[str, Any]:
    """One engine group's KV-events settings: the model's, its endpoints moved to its slot (the
    manager gives each group of a model one of ``0 .. replicas`` while it runs); without an
    endpoint, the socket in the runtime directory."""
    configured = cfg.get("endpoint")
    return {**cfg, "endpoint": offset(configured, slot) if configured else default_endpoint(runtime_dir, model, slot),
            "replay_endpoint": offset(cfg.get("replay_endpoint"), slot)}


def port_clash(models: list, gateway_port: int) -> str | None:
    """Why two models' event endpoints (or one and the gateway's port) meet, else None. Ports
    are compared whatever the hosts (one host's engines), ipc and inproc paths by name."""
    taken: list[tuple[str, range]] = [("gateway.port", range(gateway_port, gateway_port + 1))]
    paths: dict[str, str] = {}
    for m in models:
        for key, ports in port_range(m.engine_args, m.replicas).items():
            if ports.stop - 1 > 65535:
                return f"models.{m.name}.engine_args.{KEY}.{key}: ports {ports.start}-{ports.stop - 1} pass 65535"
            for owner, other in taken:
                if ports.start < other.stop and other.start < ports.stop:
                    return (f"models.{m.name}.engine_args.{KEY}.{key}: ports {ports.start}-{ports.stop - 1} "
                            f"(one per replica, and one for a rolling reload) meet {owner}'s "
                            f"{other.start}-{other.stop - 1}")
            taken.append((f"models.{m.name} ({key})", ports))
        cfg = events_config(m.engine_args) or {}
        for key in ("endpoint", "replay_endpoint"):
            value = cfg.get(key) or ""
            if value and split_endpoint(value) is None:
                if value in paths:
                    return f"models.{m.name}.engine_args.{KEY}.{key}: {value} is {paths[value]}'s too"
                paths[value] = f"models.{m.name} ({key})"
    return None
