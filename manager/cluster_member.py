"""A member host's side of a model spread over hosts: its link to each head, the ranks it runs for them.

The member's manager dials each head it serves ranks for (manager/cluster_link.py: both ends
proven with the cluster secret, every frame authenticated) and, when the head asks
(``RunRanks``), execs those ranks as its own children: never a process started by the remote
side, never a fork from its request. What it runs is its own configuration's model of that
name, refused if that configuration is not the head's (``config_id``). Each rank dials the
head's engine itself (engine_core/workers/remote.py) with a key both hosts derive from the
secret; it dies with this manager (PDEATHSIG) and when its engine's connection closes.

One fate: when the link to a head is lost, every rank this host runs for it is killed at
once (the head restarts the group when this host is back); every rank's exit is reported.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Protocol

from manager.children import Child
from manager.cluster import gloo_env, hop_key
from manager.cluster_link import Link, LinkClosed, Refusal, dial, read_secret
from manager.launch import ENGINE_ENV, key_pipe
from manager.worker_cpus import worker_envs as cpu_worker_envs
from servectl import config as C
from servectl.memory import has_accelerator
from servectl.wire import cluster as W
from servectl.wire.spawn import WORKER, log_file_name, worker_component
from servectl.wire.vocab import ChildState

log = logging.getLogger("manager")

REDIAL_S = (0.5, 5.0)  # the first and the longest wait between tries to reach a head


class MemberHost(Protocol):
    """What a member needs of the manager."""

    settings: C.ManagerConfig
    runtime_dir: Path
    log_dir: Path
    shutting_down: bool

    def child_env(self, extra: dict[str, str]) -> dict[str, str]: ...
    def watch(self, child: Child) -> None: ...
    def on_child_change(self, child: Child, detail: str) -> None: ...
    def on_cluster_change(self, host: str, joined: bool, detail: str) -> None: ...
    async def wait_exit(self, children: list[Child], grace_s: float) -> None: ...


class ClusterMember:
    def __init__(self, cfg: C.Config, me: str, host: MemberHost):
        self.host = host
        self.me = me
        self.links: dict[str, Link] = {}
        self.ranks: dict[tuple[str, int], Child] = {}  # (group, rank) -> its process
        self.head_of: dict[str, str] = {}  # group -> its head's host name
        self.incarnation: dict[str, str] = {}  # group -> the incarnation its ranks here serve
        self.configure(cfg)

    def configure(self, cfg: C.Config) -> None:
        """At start and on reload: the models served here for other hosts, the hosts, the secret."""
        self.cluster = cfg.cluster
        self.models = {m.name: m for m in C.cluster.ranks_here(cfg)}
        self.secret = read_secret(cfg.cluster.secret_file)

    def heads(self) -> list[str]:
        return sorted({m.hosts[0] for m in self.models.values()})

    def loops(self) -> list[tuple[str, object]]:
        return [(f"cluster link to {h}", functools.partial(self.follow, h)) for h in self.heads()]

    async def follow(self, head: str) -> None:
        """Stay linked to ``head``: dial, serve its requests, dial again when the link is lost."""
        wait = REDIAL_S[0]
        said = None
        while not self.host.shutting_down:
            try:
                link = await dial(self.cluster.hosts[head], self.cluster.port, self.secret, self.me,
                                  dead_after_s=self.cluster.dead_after_s, local_addr=self.cluster.hosts[self.me])
            except (OSError, Refusal) as exc:
                why = getattr(exc, "reason", None) or str(exc)
                if why != said:  # said once per reason, not once per try
                    log.warning("cluster: cannot reach head %s (%s): %s; trying again", head,
                                self.cluster.hosts[head], why)
                    said = why
                # The head is unreachable (down, or the link cut): nothing here can announce its return,
                # so the member dials again, backing off to REDIAL_S[1].
                await asyncio.sleep(wait)  # event-proof: nothing can announce the head's return
                wait = min(REDIAL_S[1], wait * 2)
                continue
            wait, said = REDIAL_S[0], None
            self.links[head] = link
            log.info("cluster: linked to head %s", head)
            self.host.on_cluster_change(head, True, f"linked to head {head}")
            why = "the link closed"
            try:
                while True:
                    msg = await link.recv()
                    if isinstance(msg, W.RunRanks):
                        await self._run(head, msg)
                    elif isinstance(msg, W.StopRanks):
                        await self._stop(msg.group)
                    elif isinstance(msg, W.GroupServing) and self.incarnation.get(msg.group) == msg.incarnation:
                        for (g, _), child in self.ranks.items():
                            if g == msg.group and child.alive:
                                child.set(ChildState.READY, f"serving {g} for {head}")
            except LinkClosed as exc:
                why = exc.reason
            finally:
                link.close()
                self.links.pop(head, None)
            log.warning("cluster: link to head %s lost (%s): stopping the ranks run for it", head, why)
            self.host.on_cluster_change(head, False, f"link to head {head} lost: {why}")
            await asyncio.gather(*(self._stop(g) for g, h in list(self.head_of.items()) if h == head))

    # ---- the ranks ---------------------------------------------------------------------
    async def _run(self, head: str, msg: W.RunRanks) -> None:
        m = self.models.get(msg.model)
        refusal = None
        if m is None or m.hosts[0] != head:
            refusal = f"model {msg.model!r} is not configured here with {head} as its head"
        elif C.output_identity(m) != msg.config_id:
            refusal = f"model {msg.model!r} is configured differently here (every host needs the same file)"
        elif sorted(r.rank for r in msg.ranks) != C.cluster.ranks_on(m, self.me):
            refusal = f"ranks {[r.rank for r in msg.ranks]} are not this host's share of {msg.model!r}"
        if refusal is not None:
            log.error("cluster: refused %s's request to run %s: %s", head, msg.group, refusal)
            for r in msg.ranks:
                await self._report(head, W.RankState(group=msg.group, incarnation=msg.incarnation, rank=r.rank,
                                                     pid=None, state=ChildState.FAILED, last_exit=refusal))
            return
        await self._stop(msg.group)  # an earlier incarnation's ranks, if any are left
        self.head_of[msg.group] = head
        self.incarnation[msg.group] = msg.incarnation
        key = hop_key(self.secret, msg.group, msg.incarnation, msg.nonce)
        base = self.host.child_env(ENGINE_ENV | gloo_env(self.cluster.hosts[self.me]) | m.env)
        if m.devices is not None:  # this host's devices for its ranks (its own file says which)
            base["CUDA_VISIBLE_DEVICES"] = m.devices if isinstance(m.devices, str) else m.devices[0]
        envs = [base | omp for omp in cpu_worker_envs(len(msg.ranks), has_accelerator(), base)]
        for spec, env in zip(msg.ranks, envs):
            component = worker_component(msg.group, spec.rank)
            child = Child(component, WORKER, msg.group, self.host.log_dir / log_file_name(component),
                          self.host.on_child_change, functools.partial(self._exited, head, msg.incarnation, spec.rank))
            self.ranks[(msg.group, spec.rank)] = child
            fd = key_pipe(key)
            try:
                child.spawn([sys.executable, "-m", "engine_core.workers.worker", "--model", msg.group,
                             "--rank", str(spec.rank), "--runtime-dir", str(self.host.runtime_dir),
                             "--key-fd", str(fd), "--dial", f"{msg.engine_addr}:{msg.engine_port}",
                             "--dial-timeout-s", str(msg.worker_reply_timeout_s),
                             "--dead-after-s", str(self.cluster.dead_after_s),
                             "--source-addr", self.cluster.hosts[self.me]], env, (fd,))
            except OSError as exc:  # e.g. out of processes: the head hears it and restarts the group later
                del self.ranks[(msg.group, spec.rank)]
                log.error("cluster: cannot start %s for %s: %s", component, head, exc)
                await self._report(head, W.RankState(group=msg.group, incarnation=msg.incarnation, rank=spec.rank,
                                                     pid=None, state=ChildState.FAILED, last_exit=str(exc)))
                continue
            finally:
                os.close(fd)
            self.host.watch(child)
            child.set(ChildState.STARTING, f"rank {spec.rank} of {msg.group} for {head}")
            await self._report(head, W.RankState(group=msg.group, incarnation=msg.incarnation, rank=spec.rank,
                                                 pid=child.pid, state=ChildState.STARTING))

    def _exited(self, head: str, incarnation: str, rank: int, child: Child) -> None:
        child.set(ChildState.EXITED, child.last_exit or "")
        asyncio.get_running_loop().create_task(self._report(head, W.RankState(
            group=child.model, incarnation=incarnation, rank=rank, pid=None, state=ChildState.EXITED,
            last_exit=child.last_exit)))

    async def _stop(self, group: str) -> None:
        """Stop every rank of ``group`` run here (thawed first: a stopped process keeps its SIGTERM)."""
        mine = [c for (g, _), c in self.ranks.items() if g == group and c.alive]
        for c in mine:
            c.signal(signal.SIGCONT)
            c.signal(signal.SIGTERM)
        if mine:
            await self.host.wait_exit(mine, self.host.settings.stop_grace_s)
        for key in [k for k in self.ranks if k[0] == group]:
            del self.ranks[key]

    async def _report(self, head: str, msg: W.RankState) -> None:
        link = self.links.get(head)
        if link is None:
            return
        try:
            await link.send(msg)
        except (LinkClosed, OSError) as exc:
            log.warning("cluster: could not tell head %s about rank %d: %s", head, msg.rank, exc)

    def children(self) -> list[Child]:
        return list(self.ranks.values())

    async def stop_all(self) -> None:
        await asyncio.gather(*(self._stop(g) for g in list(self.head_of)))
