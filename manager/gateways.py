"""The gateway processes: started with the shared listening socket, restarted on crashes.

The manager binds the listening socket once and passes it to every gateway
(gunicorn's model): a gateway that dies leaves the accept queue intact for
its siblings. A gateway's state is its child's state; ``stopping`` means the
exit was asked for (a stop, a reload that replaces it), so it is not a crash.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Protocol

import msgspec
from prometheus_client import multiprocess

from manager.children import Child, ChildState, RestartPolicy
from servectl import config as C
from servectl.wire import control as P
from servectl.wire.spawn import GATEWAY, GatewaySpec, gateway_component, gateway_identity, log_file_name, spec_fd

log = logging.getLogger("manager")


class GatewayHost(Protocol):
    settings: C.ManagerConfig
    gateway_cfg: C.GatewayConfig
    runtime_dir: Path
    state_dir: Path
    instance: str
    log_dir: Path
    metrics_dir: Path
    shutting_down: bool

    def served_models(self) -> list[str]: ...
    def send_to_gateway(self, peer: str, msg: P.ControlOut) -> None: ...
    def child_env(self, extra: dict[str, str]) -> dict[str, str]: ...
    def watch(self, child: Child) -> None: ...
    def on_child_change(self, child: Child, detail: str) -> None: ...
    def abort_peer_everywhere(self, peer: str) -> None: ...
    async def wait_exit(self, children: list[Child], grace_s: float) -> None: ...


def keys_of(cfg: C.GatewayConfig) -> P.ApiKeys:
    """The keys a gateway with this [gateway] section checks (API keys, admin keys)."""
    return P.ApiKeys(keys=list(cfg.api_keys), admin_keys=list(cfg.admin_keys), named=list(cfg.keys))


class GatewayProcess:
    def __init__(self, index: int, pool: "GatewayPool"):
        host = pool.host
        m = host.settings
        component = gateway_component(index)
        self.index = index
        self.pool = pool
        self.child = Child(component, GATEWAY, None, host.log_dir / log_file_name(component), host.on_child_change,
                           lambda child: pool.on_exit(self))
        self.policy = RestartPolicy(m.backoff_initial_s, m.backoff_max_s, m.crash_loop_count, m.crash_loop_window_s)
        self.restart_timer: asyncio.TimerHandle | None = None
        self.peer = ""  # its identity on engines' sockets, for AbortPeer when it dies
        self.ready_waiters: list[asyncio.Future] = []
        self.keys: P.ApiKeys | None = None  # the API and admin keys it checks (its spec's, then what it confirmed)
        self.keys_sent: P.ApiKeys | None = None  # sent, not yet confirmed
        self.keys_waiters: list[asyncio.Future] = []


class GatewayPool:
    def __init__(self, host: GatewayHost):
        self.host = host
        self.listen_sock: socket.socket | None = None
        self.port = host.gateway_cfg.port
        self.members = [GatewayProcess(i, self) for i in range(host.gateway_cfg.processes)]
        # Signs the status page's sessions (api_gateway/ui.py): one per daemon, shared by its gateways
        # (a page's requests may reach any of them), never written anywhere but their specs' memfds.
        self.ui_secret = secrets.token_hex(32)
        self.unready = False  # a stop's readiness grace has begun (stop_being_ready)

    def children(self) -> list[Child]:
        return [gw.child for gw in self.members]

    def settled(self) -> bool:
        return all(gw.child.state in (ChildState.READY, ChildState.FAILED) for gw in self.members)

    def bind(self, gateway: C.GatewayConfig) -> None:
        self.listen_sock = socket.create_server((gateway.host, gateway.port), backlog=1024)
        self.listen_sock.set_inheritable(True)
        self.port = self.listen_sock.getsockname()[1]

    def start_all(self) -> None:
        for gw in self.members:
            self.start(gw)

    def start(self, gw: GatewayProcess) -> None:
        host = self.host
        gw.restart_timer = None
        # The spec carries the API keys: a memfd the gateway inherits, never its argv.
        spec = spec_fd(GatewaySpec(
            index=gw.index, runtime_dir=str(host.runtime_dir), instance=host.instance, gateway=host.gateway_cfg,
            models=host.served_models(), drain_timeout_s=host.settings.drain_timeout_s,
            ui_secret=self.ui_secret, state_dir=str(host.state_dir)), "servectl-gateway-spec")
        fd = self.listen_sock.fileno()
        env = host.child_env({"PROMETHEUS_MULTIPROC_DIR": str(host.metrics_dir)})
        try:
            gw.child.spawn([sys.executable, "-m", "api_gateway", "--spec-fd", str(spec), "--listen-fd", str(fd)],
                           env, (fd, spec))
        finally:
            os.close(spec)
        gw.peer = gateway_identity(gw.index, gw.child.pid)
        gw.keys, gw.keys_sent = keys_of(host.gateway_cfg), None
        host.watch(gw.child)

    def pids(self) -> set[int]:
        """The running gateways' pids (who may send a gateway's reports)."""
        return {gw.child.pid for gw in self.members if gw.child.pid is not None}

    def on_ready(self, msg: P.ChildReady, index: int) -> None:
        if index >= len(self.members) or self.members[index].child.pid != msg.pid:
            return
        gw = self.members[index]
        gw.child.set(ChildState.READY)
        waiters, gw.ready_waiters = gw.ready_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(True)
        self.send_keys(gw)  # keys rotated while it started: it is connected now
        if self.unready:  # started during a stop's readiness grace: not ready for routers either
            gw.child.signal(signal.SIGUSR1)

    # ---- API keys: rotated in place, old ones refused at once -------------------------------
    def send_keys(self, gw: GatewayProcess) -> asyncio.Future | None:
        """Send a ready gateway the current keys if it checks others; the future resolves on its KeysApplied."""
        keys = keys_of(self.host.gateway_cfg)
        if gw.keys == keys or gw.child.state is not ChildState.READY:
            return None  # up to date, or it will be sent on ready (a gateway starting now gets them in its spec)
        fut = asyncio.get_running_loop().create_future()
        gw.keys_waiters.append(fut)
        gw.keys_sent = keys
        self.host.send_to_gateway(gw.peer, keys)
        return fut

    def on_keys_applied(self, msg: P.KeysApplied, index: int) -> None:
        if index >= len(self.members) or self.members[index].child.pid != msg.pid:
            return
        gw = self.members[index]
        if gw.keys_sent is not None:
            gw.keys, gw.keys_sent = gw.keys_sent, None
        waiters, gw.keys_waiters = gw.keys_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(True)

    async def rotate_keys(self, timeout_s: float = 10.0) -> None:
        """Every running gateway checks the current keys before this returns (bounded)."""
        sent = [fut for fut in (self.send_keys(gw) for gw in self.members) if fut is not None]
        if sent:
            # event-proof: a bound on the gateways' confirmations; each KeysApplied settles its future.
            _, late = await asyncio.wait(sent, timeout=timeout_s)
            if late:
                log.warning("%d gateway(s) did not confirm the new API keys within %.0fs", len(late), timeout_s)

    def on_exit(self, gw: GatewayProcess) -> None:
        # Its in-flight requests would otherwise run on in the engines.
        self.host.abort_peer_everywhere(gw.peer)
        if gw.child.popen is not None:
            # Its gauges of what is now (states, queues) leave /metrics; its counters stay in the sums.
            multiprocess.mark_process_dead(gw.child.popen.pid, str(self.host.metrics_dir))
        if self.host.shutting_down or gw.child.state is ChildState.STOPPING:
            gw.child.set(ChildState.STOPPED, gw.child.last_exit or "")
            return
        gw.child.set(ChildState.EXITED, gw.child.last_exit or "")
        delay = gw.policy.record_exit(time.monotonic())
        if delay is None:
            gw.child.set(ChildState.FAILED, f"{gw.child.last_exit}; crash loop")
            return
        gw.child.set(ChildState.BACKOFF)
        # event-proof: a one-shot backoff after a gateway's exit, cancelled by a stop.
        gw.restart_timer = asyncio.get_running_loop().call_later(delay, self.start, gw)

    async def stop(self, gw: GatewayProcess, grace_s: float) -> None:
        """SIGTERM (the gateway drains, then exits); SIGKILL past the grace."""
        if gw.restart_timer:
            gw.restart_timer.cancel()
            gw.restart_timer = None
        if gw.child.alive:
            gw.child.set(ChildState.STOPPING)
            gw.child.signal(signal.SIGTERM)
            await self.host.wait_exit([gw.child], grace_s)

    async def stop_being_ready(self, grace_s: float) -> None:
        """Every gateway's /ready fails (SIGUSR1); new requests are still served for ``grace_s``.
        Only ready gateways are signalled (their handler is installed before they say ready: a
        starting one would die of it); one that becomes ready meanwhile is signalled then."""
        self.unready = True
        for gw in self.members:
            if gw.child.alive and gw.child.state is ChildState.READY:
                gw.child.signal(signal.SIGUSR1)
        await asyncio.sleep(grace_s)  # event-proof: the operator's configured grace, once, on the way out

    async def stop_all(self, grace_s: float) -> None:
        await asyncio.gather(*(self.stop(gw, grace_s) for gw in self.members))
        # No gateway accepts any more: close the socket so clients are refused, not queued.
        if self.listen_sock is not None:
            self.listen_sock.close()

    async def replace(self, gateway: C.GatewayConfig) -> None:
        """Restart the gateways one by one with a new [gateway] section (the others keep serving)."""
        host = self.host
        grace = host.settings.drain_timeout_s + host.settings.stop_grace_s
        old_sock = None
        old = host.gateway_cfg
        if (gateway.host, gateway.port) != (old.host, old.port):
            old_sock = self.listen_sock
            self.bind(gateway)
        host.gateway_cfg = gateway
        # New keys hold in every running gateway before anything else: the old
        # ones are refused at once, not once each gateway's turn to restart comes.
        await self.rotate_keys()
        if msgspec.structs.replace(old, api_keys=gateway.api_keys, api_key_file=gateway.api_key_file,
                                   admin_keys=gateway.admin_keys, admin_key_file=gateway.admin_key_file,
                                   keys=gateway.keys) == gateway:
            return  # only the keys changed: nothing to restart
        for gw in list(self.members):
            await self.stop(gw, grace)
            ready = asyncio.get_running_loop().create_future()
            gw.ready_waiters.append(ready)
            self.start(gw)
            # event-proof: a bound on a replaced gateway's start; its ChildReady settles the future.
            await asyncio.wait([ready], timeout=120)
        for i in range(len(self.members), gateway.processes):
            gw = GatewayProcess(i, self)
            self.members.append(gw)
            self.start(gw)
        while len(self.members) > gateway.processes:
            # Stopped while still a member: it drains, and its reports (a hang, a wake) are a gateway's.
            await self.stop(self.members[-1], grace)
            self.members.pop()
        if old_sock is not None:
            old_sock.close()
