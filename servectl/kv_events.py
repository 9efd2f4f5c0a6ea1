"""Where each engine publishes vLLM's KV-cache events (``engine_args.kv_events_config``). Pure.

vLLM's default endpoint, ``tcp://*:5557``, binds every interface, and two
engines on one host would both want it. Here a model's events go by default to
``[gateway] host`` (the address the operator chose to serve on) and port 5557;
an endpoint given explicitly is taken as it is. Each engine group of a model
binds ``port + slot``, its slot being one of ``0 .. replicas`` that no other
group of the model holds (the manager's ``events_slot``; a restart keeps it), as
vLLM offsets data-parallel ranks: a model holds ports ``port .. port + replicas``
(the extra one for a rolling reload's new group beside the old), and config
checks refuse two models whose ranges meet (or meet the gateway's port). A roll
that finds every slot held (one that shrinks ``replicas``) binds a port the
system picks, and ``/kv_event_sources`` says which.
"""

from __future__ import annotations

import json
import os
from typing import Any


DEFAULT_PORT = 5557
KEY = "kv_events_config"


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
    it depends on ``[gateway] host``, which a command-line override may change (``endpoint``)."""
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


def endpoint(cfg: dict[str, Any], gateway_host: str) -> str:
    """A model's events endpoint: the one configured, else ``[gateway] host`` and port 5557."""
    return cfg.get("endpoint") or tcp_endpoint(gateway_host, DEFAULT_PORT)


def port_range(engine_args: dict[str, Any], replicas: int) -> dict[str, range]:
    """The TCP ports a model's engines may bind for events (``port .. port + replicas``), by
    endpoint key: one per replica, one for a rolling reload's new group beside the old."""
    cfg = events_config(engine_args)
    ranges: dict[str, range] = {}
    for key in ("endpoint", "replay_endpoint"):
        value = (cfg.get(key) or (tcp_endpoint("*", DEFAULT_PORT) if key == "endpoint" else "")) if cfg else ""
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


def for_slot(cfg: dict[str, Any], slot: int, gateway_host: str) -> dict[str, Any]:
    """One engine group's KV-events settings: the model's, its endpoints moved to its slot (the
    manager gives each group of a model one of ``0 .. replicas`` while it runs)."""
    return {**cfg, "endpoint": offset(endpoint(cfg, gateway_host), slot),
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
