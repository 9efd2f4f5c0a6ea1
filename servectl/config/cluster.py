"""A model spread over hosts, as the configuration says it: which host this is, where each
rank runs, which models this host's manager starts engines for and which it only runs ranks
of. Pure (the one probe of the machine, ``this_host``, binds a socket to see whether an
address is local). docs/cluster.md is the operator's side.
"""

from __future__ import annotations

import ipaddress
import socket

from servectl.config.schema import ClusterConfig, Config, ConfigError, ModelConfig


def world_size(m: ModelConfig) -> int:
    """The ranks of one of its groups: tensor x pipeline parallel (vLLM's world size)."""
    return m.tensor_parallel_size * int(m.engine_args.get("pipeline_parallel_size", 1) or 1)


def head_of(m: ModelConfig) -> str | None:
    """The host that runs its engine (None: every host serves it, each alone)."""
    return m.hosts[0] if m.hosts else None


def ranks_on(m: ModelConfig, host: str) -> list[int]:
    """The ranks ``host`` runs: an equal share, in host order (the head's are the first)."""
    if host not in m.hosts:
        return []
    per = world_size(m) // len(m.hosts)
    i = m.hosts.index(host)
    return list(range(i * per, (i + 1) * per))


def is_local(addr: str) -> bool:
    """Whether ``addr`` is an address of this machine (of this network namespace)."""
    family = socket.AF_INET6 if ipaddress.ip_address(addr).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((addr, 0))
        except OSError:
            return False
    return True


def this_host(cluster: ClusterConfig) -> str | None:
    """Which of the cluster's hosts this is: as configured, else the one whose address is here."""
    if cluster.this_host:
        return cluster.this_host
    here = [name for name, addr in cluster.hosts.items() if is_local(addr)]
    return here[0] if len(here) == 1 else None


def check(cfg: Config, where: str) -> None:
    """The cross-field rules of [cluster] and models' ``hosts`` (from finalize)."""
    c = cfg.cluster
    for name, addr in c.hosts.items():
        try:
            ipaddress.ip_address(addr)
        except ValueError:
            raise ConfigError(f"config error{where}: cluster.hosts.{name}: {addr!r} is not an IP address") from None
    if c.this_host and c.this_host not in c.hosts:
        raise ConfigError(f"config error{where}: cluster.this_host: {c.this_host!r} is not one of cluster.hosts")
    spread = [m for m in cfg.models if m.hosts]
    for m in spread:
        unknown = [h for h in m.hosts if h not in c.hosts]
        if unknown:
            raise ConfigError(f"config error{where}: models.{m.name}.hosts: {unknown} not in [cluster] hosts")
        if len(set(m.hosts)) != len(m.hosts):
            raise ConfigError(f"config error{where}: models.{m.name}.hosts: a host is named twice")
        if len(m.hosts) > 1:
            if world_size(m) % len(m.hosts):
                raise ConfigError(f"config error{where}: models.{m.name}: {world_size(m)} rank(s) do not split "
                                  f"evenly over {len(m.hosts)} hosts")
            if m.replicas != 1:
                raise ConfigError(f"config error{where}: models.{m.name}: a model spread over hosts has one "
                                  "replica (replicas = 1)")
            if int(m.engine_args.get("pipeline_parallel_size", 1) or 1) > 1:
                raise ConfigError(f"config error{where}: models.{m.name}.engine_args.pipeline_parallel_size: "
                                  "servectl runs tensor parallelism only (docs/cluster.md, \"Limits\")")
    if any(len(m.hosts) > 1 for m in spread) and not c.secret_file:
        raise ConfigError(f"config error{where}: cluster.secret_file: a model spread over hosts needs the "
                          "cluster's shared secret (a file readable by its owner only)")
    if spread and this_host(c) is None:
        raise ConfigError(f"config error{where}: cluster: none (or more than one) of the hosts' addresses "
                          f"{sorted(c.hosts.values())} is on this machine; set cluster.this_host")


def engines_here(cfg: Config) -> list[ModelConfig]:
    """The models this host's manager starts engines for: its own, and those it heads."""
    me = this_host(cfg.cluster) if any(m.hosts for m in cfg.models) else None
    return [m for m in cfg.models if head_of(m) in (None, me)]


def ranks_here(cfg: Config) -> list[ModelConfig]:
    """The models this host runs ranks of for another host's engine."""
    spread = [m for m in cfg.models if len(m.hosts) > 1]
    if not spread:
        return []
    me = this_host(cfg.cluster)
    return [m for m in spread if me in m.hosts and m.hosts[0] != me]
