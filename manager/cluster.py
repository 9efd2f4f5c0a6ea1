"""The head's side of a model spread over hosts: the other hosts' links, their ranks, a start's remote part.

The head's manager owns the engine and its own share of the ranks (an ``EngineGroup`` like
any other); the other hosts' managers dial it on ``[cluster] port`` (manager/cluster_link.py
proves both ends with the cluster secret and authenticates every frame) and run the ranks
that live with them when it asks (``RunRanks``), reporting each one's state (``RankState``).
This file keeps those links, what each host runs for each group (``RemoteRank``, shown by
`servectl status` with its host), and the part of a group's start that concerns the other
hosts (``remote_part``: the hop key derived from the secret, the socket the remote ranks
dial, torch's rendezvous address). One fate: a remote rank's exit or its host's link lost
kills the group's engine, and the group restarts as after any member's death, once every
host it needs is back (``waits``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Mapping, Protocol

from manager.cluster_link import Link, LinkClosed, Refusal, accept, derive, read_secret
from servectl import config as C
from servectl.wire import cluster as W
from servectl.wire.spawn import worker_component
from servectl.wire.vocab import ChildState, ModelState

log = logging.getLogger("manager")

# A group in one of these states may be waiting for a host (its start said so): it starts when
# the last one joins. A failed or released group does not.
WAITING = frozenset({ModelState.STOPPED, ModelState.BACKOFF})
# How long after the head starts a group waiting for a host keeps the daemon from being settled
# (`servectl start` waiting, systemd's READY=1 held): long enough for members already up to
# dial in (their redial backs off to 5 s); a host still missing then does not hold the head's
# start (nor make systemd fail it): the model waits, said in its reason and /ready.
JOIN_GRACE_S = 12.0


@dataclass
class RemoteRank:
    """One rank another host runs for a group here, as that host last said."""

    host: str
    rank: int
    incarnation: str
    state: ChildState = ChildState.STARTING
    pid: int | None = None
    since: float = field(default_factory=time.time)
    last_exit: str | None = None


@dataclass
class RemotePart:
    """What a spread group's start needs beyond a local one (manager/launch.py)."""

    key: bytes  # the hop key: derived from the secret on every host, never sent
    nonce: bytes
    listener: socket.socket  # the remote ranks dial it; passed to the engine (then closed here)
    port: int  # its port
    init_methods: list[str]  # torch's rendezvous (tcp://head:port), as each rank gets it
    remote_ranks: list[int]
    local_ranks: list[int]  # each rank's index on its host (vLLM's local_rank)
    env: dict[str, str]  # the head's ranks' extra environment (gloo's interface)
    dead_after_s: float = 6.0


class Spread(Protocol):
    """What this file reads of a group (manager/group.py's EngineGroup)."""

    name: str
    cfg: C.ModelConfig
    incarnation: str
    config_id: str
    state: ModelState

    def start(self) -> None: ...
    def on_remote_lost(self, incarnation: str, why: str) -> None: ...


class HeadHost(Protocol):
    """What the head needs of the manager."""

    groups: Mapping[str, Spread]

    def on_cluster_change(self, host: str, joined: bool, detail: str) -> None: ...
    def audit_cluster(self, addr: str, what: str, outcome: str, detail: str) -> None: ...
    def on_remote_rank(self, group: str) -> None: ...
    def check_settled(self) -> None: ...


def interface_of(addr: str) -> str | None:
    """The network interface holding ``addr`` (gloo's GLOO_SOCKET_IFNAME), or None: a loopback
    address is lo's; otherwise the interface whose (first) IPv4 address it is."""
    import fcntl
    import ipaddress
    import struct

    if ipaddress.ip_address(addr).is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    return None


def hop_key(secret: bytes, group: str, incarnation: str, nonce: bytes) -> bytes:
    return derive(secret, "servectl-hop", group, incarnation, nonce)


def gloo_env(addr: str) -> dict[str, str]:
    """Where torch's gloo (and NCCL's bootstrap) meet the other hosts: the interface of this
    host's cluster address, not whatever the machine's hostname resolves to. A model's env wins."""
    ifname = interface_of(addr)
    return {"GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname} if ifname else {}


class ClusterHead:
    def __init__(self, cluster: C.ClusterConfig, me: str, host: HeadHost):
        self.host = host
        self.me = me
        self.grace_over = False  # JOIN_GRACE_S passed since the head started listening
        self.links: dict[str, Link] = {}
        self.ranks: dict[str, dict[int, RemoteRank]] = {}  # group -> rank -> what its host said
        self.configure(cluster)

    def configure(self, cluster: C.ClusterConfig) -> None:
        """At start and on reload: the hosts and the secret (a rotated secret applies to the next
        links; those up stay, their session keys made with the old one)."""
        self.cluster = cluster
        self.addr = cluster.hosts[self.me]
        self.secret = read_secret(cluster.secret_file)

    async def serve(self) -> None:
        """Accept the other hosts' managers until cancelled."""
        server = await asyncio.start_server(self._on_connect, self.addr, self.cluster.port)
        log.info("cluster: listening for the other hosts on %s:%d", self.addr, self.cluster.port)
        if not self.grace_over:
            # event-proof: one shot, once per manager: the end of the join grace at start.
            asyncio.get_running_loop().call_later(JOIN_GRACE_S, self._grace_ends)
        async with server:
            await server.serve_forever()

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = (writer.get_extra_info("peername") or ("?",))[0]
        try:
            link = await accept(reader, writer, self.secret, self.cluster.hosts, dead_after_s=self.cluster.dead_after_s)
        except Refusal as exc:
            log.warning("cluster: refused %s: %s", peer, exc.reason)
            self.host.audit_cluster(peer, "join", "denied", exc.reason)
            writer.close()
            return
        name = link.peer_host
        old = self.links.pop(name, None)
        if old is not None:
            old.close()  # its old link's loop ends and finds itself replaced
            self._lost(name, "it joined again")
        self.links[name] = link
        self.host.audit_cluster(peer, f"join {name}", "accepted", "")
        log.info("cluster: host %s (%s) joined", name, peer)
        self.host.on_cluster_change(name, True, f"host {name} joined")
        for group in list(self.host.groups.values()):  # a group that waited for it starts now
            if name in group.cfg.hosts[1:] and not self.missing(group) and group.state in WAITING:
                group.start()
        try:
            while True:
                msg = await link.recv()
                if isinstance(msg, W.RankState):
                    self._on_rank(name, msg)
        except LinkClosed as exc:
            why = exc.reason
        finally:
            link.close()
        if self.links.get(name) is link:
            del self.links[name]
            log.warning("cluster: host %s left: %s", name, why)
            self.host.on_cluster_change(name, False, f"host {name} left: {why}")
            self._lost(name, f"host {name} left ({why})")

    def _lost(self, name: str, why: str) -> None:
        for group in list(self.host.groups.values()):
            if name in group.cfg.hosts[1:]:
                for r in self.ranks.get(group.name, {}).values():
                    if r.host == name and r.state not in (ChildState.EXITED, ChildState.STOPPED):
                        r.state, r.pid, r.since, r.last_exit = ChildState.EXITED, None, time.time(), why
                self.host.on_remote_rank(group.name)
                group.on_remote_lost(group.incarnation, why)

    def _on_rank(self, host: str, msg: W.RankState) -> None:
        group = self.host.groups.get(msg.group)
        if group is None or host not in group.cfg.hosts[1:] or msg.rank not in C.cluster.ranks_on(group.cfg, host):
            log.warning("cluster: host %s reported rank %d of %r, which it does not run", host, msg.rank, msg.group)
            return
        if msg.incarnation != group.incarnation:
            return  # a rank of an earlier start: already replaced
        self.ranks.setdefault(msg.group, {})[msg.rank] = RemoteRank(host, msg.rank, msg.incarnation, msg.state,
                                                                   msg.pid, time.time(), msg.last_exit)
        self.host.on_remote_rank(msg.group)
        if msg.state in (ChildState.EXITED, ChildState.FAILED):
            group.on_remote_lost(msg.incarnation, f"{worker_component(msg.group, msg.rank)} on {host} "
                                                  f"{msg.last_exit or 'exited'}")

    def _grace_ends(self) -> None:
        self.grace_over = True
        self.host.check_settled()

    def settled_waiting(self, group: Spread) -> bool:
        """The group waits for a host past the join grace: settled as far as the daemon's start goes."""
        return self.grace_over and group.state in WAITING and self.waits(group) is not None

    # ---- what a group asks -----------------------------------------------------------
    def missing(self, group: Spread) -> list[str]:
        return [h for h in group.cfg.hosts[1:] if h not in self.links]

    def waits(self, group: Spread) -> str | None:
        """Why the group cannot start now (a host it needs is not connected), or None."""
        missing = self.missing(group)
        return f"waiting for host {', '.join(missing)} to join" if missing else None

    def remote_part(self, group: Spread) -> RemotePart:
        cfg = group.cfg
        nonce = os.urandom(16)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((self.addr, 0))
        listener.listen(16)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # a free port for torch's store
            probe.bind((self.addr, 0))
            store_port = probe.getsockname()[1]
        local = {r: i for h in cfg.hosts for i, r in enumerate(C.cluster.ranks_on(cfg, h))}
        host_of = {r: h for h in cfg.hosts for r in C.cluster.ranks_on(cfg, h)}
        mine = set(C.cluster.ranks_on(cfg, self.me))
        return RemotePart(
            key=hop_key(self.secret, group.name, group.incarnation, nonce), nonce=nonce, listener=listener,
            port=listener.getsockname()[1],
            # ?host=: vLLM's CPU workers name their shared-memory all-reduce after this URL's tail;
            # a per-host tail keeps ranks on different hosts off it (they use gloo, over the network).
            init_methods=[f"tcp://{self.addr}:{store_port}?host={host_of[r]}" for r in range(C.cluster.world_size(cfg))],
            remote_ranks=[r for r in range(C.cluster.world_size(cfg)) if r not in mine],
            local_ranks=[local[r] for r in range(C.cluster.world_size(cfg))], env=gloo_env(self.addr),
            dead_after_s=self.cluster.dead_after_s)

    def run_remote(self, group: Spread, part: RemotePart, reply_timeout_s: float) -> None:
        """Ask every other host of the group to start its ranks of this incarnation."""
        self.ranks[group.name] = {}
        port = part.port
        for h in group.cfg.hosts[1:]:
            ranks = C.cluster.ranks_on(group.cfg, h)
            for r in ranks:
                self.ranks[group.name][r] = RemoteRank(h, r, group.incarnation)
            self._send(h, W.RunRanks(
                group=group.name, incarnation=group.incarnation, model=group.cfg.name, config_id=group.config_id,
                ranks=[W.RankSpec(rank=r, local_rank=i) for i, r in enumerate(ranks)],
                world_size=C.cluster.world_size(group.cfg), nonce=part.nonce, engine_addr=self.addr,
                engine_port=port, init_method=part.init_methods[ranks[0]],
                worker_reply_timeout_s=reply_timeout_s))
        self.host.on_remote_rank(group.name)

    def on_group_state(self, group: Spread) -> None:
        """A spread group serves: its remote ranks do too (the head's status; their hosts told)."""
        if group.state is not ModelState.READY:
            return
        for r in self.ranks.get(group.name, {}).values():
            if r.state is ChildState.STARTING and r.incarnation == group.incarnation:
                r.state, r.since = ChildState.READY, time.time()
        for h in group.cfg.hosts[1:]:
            self._send(h, W.GroupServing(group=group.name, incarnation=group.incarnation))

    def stop_remote(self, group: Spread) -> None:
        for h in group.cfg.hosts[1:]:
            self._send(h, W.StopRanks(group=group.name))
        for r in self.ranks.get(group.name, {}).values():
            if r.state not in (ChildState.EXITED, ChildState.FAILED):
                r.state, r.since = ChildState.STOPPING, time.time()

    def _send(self, host: str, msg) -> None:
        link = self.links.get(host)
        if link is None:
            return
        task = asyncio.get_running_loop().create_task(link.send(msg))
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                               or log.warning("cluster: sending to %s failed: %s", host, t.exception()))

    def remote_ranks(self) -> list[tuple[str, RemoteRank]]:
        return [(g, r) for g, ranks in self.ranks.items() if g in self.host.groups for r in ranks.values()]

