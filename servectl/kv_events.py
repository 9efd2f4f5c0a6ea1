"""Where each engine publishes vLLM's KV-cache events (``engine_args.kv_events_config``). Pure.

vLLM's default endpoint, ``tcp://*:5557``, binds every interface, and two
engines on one host would both want it. Here a model's events go by default to
``[gateway] host`` (the address the operator chose to serve on) and port 5557;
an endpoint given explicitly is taken as it is. The model's endpoint is its
first replica's; each engine group binds ``port + n`` where ``n`` is the number
in its name (``<model>@<n>``, 0 for a model's only group), as vLLM offsets data-
parallel ranks. A rolling reload starts a replica's new group under a free
number beside the old one, so a model holds ports ``port .. port + replicas``;
config checks refuse two models whose ranges meet (or meet the gateway's port).
"""

from __future__ import annotations

import json
from typing import Any

from servectl.wire.vocab import REPLICA_MARK

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


def resolve(engine_args: dict[str, Any], gateway_host: str) -> None:
    """Give a model's KV-events settings their endpoint: ``[gateway] host``:5557 unless one is given.
    Raises ValueError for an endpoint that is not ``tcp://host:port``, ``ipc://`` or ``inproc://``."""
    raw = engine_args.get(KEY)
    if raw is None:
        return
    cfg = json.loads(raw) if isinstance(raw, str) else dict(raw)
    if not isinstance(cfg, dict):
        raise ValueError("must be a table (vLLM's KVEventsConfig)")
    if cfg.get("enable_kv_cache_events") and cfg.get("publisher", "zmq") == "zmq":
        cfg.setdefault("endpoint", tcp_endpoint(gateway_host, DEFAULT_PORT))
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


def port_range(engine_args: dict[str, Any], replicas: int) -> dict[str, range]:
    """The TCP ports a model's engines may bind for events (``port .. port + replicas``), by endpoint key."""
    cfg = events_config(engine_args)
    ranges: dict[str, range] = {}
    for key in ("endpoint", "replay_endpoint"):
        hp = split_endpoint(cfg.get(key) or "") if cfg else None
        if hp is not None and hp[1] != 0:
            ranges[key] = range(hp[1], hp[1] + replicas + 1)
    return ranges


def group_number(group: str) -> int:
    """The number in an engine group's name (``<model>@<n>``); 0 for a model's only group."""
    _, mark, number = group.partition(REPLICA_MARK)
    return int(number) if mark and number.isdigit() else 0


def offset(endpoint: str | None, n: int) -> str | None:
    """An endpoint for group number ``n``: the port + n (port 0 stays 0: the system picks), an
    ipc/inproc path with a suffix."""
    if not endpoint or n == 0:
        return endpoint
    hp = split_endpoint(endpoint)
    if hp is None:
        return f"{endpoint}-{n}"
    host, port = hp
    return endpoint if port == 0 else tcp_endpoint(host, port + n)


def for_group(cfg: dict[str, Any], group: str) -> dict[str, Any]:
    """One engine group's KV-events settings: the model's, its endpoints offset by the group's number."""
    n = group_number(group)
    return {**cfg, "endpoint": offset(cfg.get("endpoint"), n),
            "replay_endpoint": offset(cfg.get("replay_endpoint"), n)}


def port_clash(models: list, gateway_host: str, gateway_port: int) -> str | None:
    """Why two models' event ports (or one and the gateway's) meet, else None."""
    taken: list[tuple[str, range]] = [("gateway.port", range(gateway_port, gateway_port + 1))]
    for m in models:
        for key, ports in port_range(m.engine_args, m.replicas).items():
            for owner, other in taken:
                if ports.start < other.stop and other.start < ports.stop:
                    return (f"models.{m.name}.engine_args.{KEY}.{key}: ports {ports.start}-{ports.stop - 1} "
                            f"(one per replica, and one for a rolling reload) meet {owner}'s "
                            f"{other.start}-{other.stop - 1}")
            taken.append((f"models.{m.name} ({key})", ports))
    return None
