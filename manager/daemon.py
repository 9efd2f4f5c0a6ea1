"""The manager: started first, owns every other process, supervises them.

It never imports torch or vLLM. Every child is a fresh interpreter exec'd
from the event-loop thread (PDEATHSIG follows the thread that forked), learned
dead through its pidfd (``loop.add_reader``), and reaped with
``waitid(P_PIDFD)``. Signal handlers only enqueue work on the loop. Time
passes here only in restart backoff and in the grace periods of a stop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from servectl.wire import control as P
from servectl.wire.spawn import EngineSpec, GatewaySpec, Role, resolve_fd_args
from manager.children import Child, RestartPolicy, Standby
from manager.sdnotify import notify
from servectl import config as C
from servectl.paths import SYSTEM_RUNTIME_DIR, RuntimePaths, ensure_private_dir, resolve_runtime_dir
from servectl.proc import INSTANCE_ENV, PARENT_ENV, become_subreaper, die_with_parent, processes_of_instance

log = logging.getLogger("manager")

# What every engine and worker gets: no hub lookups for local paths, no usage
# reporting thread, vLLM's engine in-process (we are its multiprocessing).
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class EngineGroup:
    """An engine_core and its workers: started, stopped and restarted as a unit."""

    def __init__(self, cfg: C.ModelConfig, manager: "Manager"):
        self.cfg = cfg
        self.name = cfg.name
        self.manager = manager
        m = manager.cfg.manager
        self.policy = RestartPolicy(m.backoff_initial_s, m.backoff_max_s, cfg.crash_loop_count or m.crash_loop_count,
                                    m.crash_loop_window_s)
        logs = manager.log_dir
        self.engine = Child(f"engine_core:{cfg.name}", "engine_core", cfg.name, logs / f"engine_core-{cfg.name}.log",
                            manager.on_child_change)
        self.workers = [
            Child(f"worker:{cfg.name}:{r}", "worker", cfg.name, logs / f"worker-{cfg.name}-{r}.log", manager.on_child_change)
            for r in range(cfg.tensor_parallel_size)
        ]
        self.state = "stopped"
        self.reason: str | None = None
        self.incarnation = ""
        self.frozen = False
        self.freezing = m.freeze_grace_s > 0
        self.restart_timer: asyncio.TimerHandle | None = None
        self.stopping = False
        self.drained: asyncio.Future | None = None
        self.standbys: dict[str, Standby] = {}  # member component -> its warm standby
        self.standby_timer: asyncio.TimerHandle | None = None
        self.standby_policy = RestartPolicy(m.backoff_initial_s, m.backoff_max_s, m.crash_loop_count,
                                            m.crash_loop_window_s)

    @property
    def children(self) -> list[Child]:
        return [self.engine, *self.workers]

    def set_state(self, state: str, reason: str | None = None) -> None:
        self.state = state
        if reason is not None or state in ("ready", "starting"):
            self.reason = reason
        for child in self.children:
            if child.alive or state in ("failed", "stopped", "backoff"):
                child.set(state if state != "exited" else child.state, reason or "")
        self.manager.on_group_change(self)

    def member_envs(self) -> tuple[dict[str, str], dict[str, str]]:
        """The engine's and the workers' environments (their standbys get the same)."""
        base = self.manager.child_env(ENGINE_ENV | self.cfg.env)
        if self.cfg.devices is not None:
            base["CUDA_VISIBLE_DEVICES"] = self.cfg.devices
        worker_env = dict(base)
        # Share the cores between the ranks unless the operator said otherwise.
        worker_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.cfg.tensor_parallel_size)))
        engine_env = dict(base)
        engine_env.setdefault("OMP_NUM_THREADS", "1")  # it schedules; the workers compute
        return engine_env, worker_env

    def start(self) -> None:
        self.restart_timer = None
        self.stopping = False
        self.frozen = False
        self.incarnation = secrets.token_hex(6)
        key = secrets.token_bytes(32)
        mgr = self.manager
        engine_env, worker_env = self.member_envs()
        for rank, worker in enumerate(self.workers):
            fd = key_pipe(key)
            try:
                self.launch(worker, "engine_core.worker", ["--model", self.name, "--rank", str(rank),
                                                           "--runtime-dir", str(mgr.paths.root), "--key-fd", "@fd0"],
                            [fd], worker_env)
            finally:
                os.close(fd)
        m = mgr.cfg.manager
        spec = msgspec.json.encode(EngineSpec(
            model=self.cfg, runtime_dir=str(mgr.paths.root), incarnation=self.incarnation,
            freeze_grace_s=m.freeze_grace_s if self.freezing else 0.0,
            worker_reply_timeout_s=m.worker_reply_timeout_s)).decode()
        fd = key_pipe(key)
        pidfds = [w.pidfd for w in self.workers]
        try:
            self.launch(self.engine, "engine_core",
                        ["--spec", spec, "--key-fd", "@fd0",
                         "--worker-pidfds", ",".join(f"@fd{i + 1}" for i in range(len(pidfds)))],
                        [fd, *pidfds], engine_env)
        finally:
            os.close(fd)
        self.set_state("starting")

    def launch(self, member: Child, module: str, args: list[str], fds: list[int], env: dict[str, str]) -> None:
        """Hand the role to the member's warm standby if it has one, else exec it cold."""
        mgr = self.manager
        standby = self.standbys.pop(member.component, None)
        if standby is not None:
            if standby.env == env and mgr.hand_over(standby, member, Role(module=module, argv=args), fds):
                return
            mgr.release(standby)  # gone, or made for another configuration
        member.spawn([sys.executable, "-m", module, *resolve_fd_args(args, fds)], env, tuple(fds))
        mgr.watch(member)

    # ---- warm standbys -------------------------------------------------------------
    def refill_standbys(self) -> None:
        """One standby per member, exec'd once the group serves (never competing with its start)."""
        if self.standby_timer:
            self.standby_timer.cancel()  # called early (the group became ready): this call does its work
            self.standby_timer = None
        mgr = self.manager
        if not mgr.cfg.manager.warm_standby or self.stopping or self.state != "ready" or mgr.shutdown_started:
            return
        engine_env, worker_env = self.member_envs()
        for member in self.children:
            if member.component not in self.standbys:
                standby = Standby(member, mgr.log_dir / f"standby-{member.component.replace(':', '-')}.log",
                                  mgr.on_child_change)
                standby.spawn_standby(engine_env if member is self.engine else worker_env)
                self.standbys[member.component] = standby
                mgr.watch_standby(standby)

    def release_standbys(self) -> list[Child]:
        if self.standby_timer:
            self.standby_timer.cancel()
            self.standby_timer = None
        released = list(self.standbys.values())
        self.standbys.clear()
        for standby in released:
            self.manager.release(standby)
        return [s for s in released if s.alive]

    def on_standby_exit(self, standby: Standby) -> None:
        if self.standbys.get(standby.member) is not standby:
            return  # released: an exit we asked for
        del self.standbys[standby.member]
        standby.set("exited", standby.last_exit or "")
        delay = self.standby_policy.record_exit(time.monotonic())
        if delay is None:
            log.error("model %s: standbys keep dying (%s); restarts will be cold", self.name, standby.last_exit)
            return
        log.warning("model %s: %s %s; a new one in %.1fs", self.name, standby.component, standby.last_exit, delay)
        self.standby_timer = asyncio.get_running_loop().call_later(delay, self.refill_standbys)

    def on_ready(self, incarnation: str) -> None:
        if incarnation != self.incarnation or self.stopping:
            return
        self.set_state("ready")
        self.refill_standbys()

    def on_member_exit(self, child: Child) -> None:
        if self.stopping:
            return
        if self.state not in ("exited",):
            self.reason = f"{child.component} {child.last_exit}"
            self.frozen = False
            self.state = "exited"
            child.set("exited", child.last_exit or "")
            self.manager.on_group_change(self)
            for other in self.children:
                if other.alive:
                    other.signal(signal.SIGCONT)
                    other.signal(signal.SIGKILL)
        if any(c.alive for c in self.children):
            return  # wait until every member is gone, then decide
        delay = self.policy.record_exit(time.monotonic())
        if delay is None:
            self.release_standbys()
            self.set_state("failed", f"{self.reason}; {self.policy.crash_loop_count} exits within "
                                     f"{self.policy.window_s:g}s")
            log.error("model %s failed: %s", self.name, self.reason)
            return
        log.warning("model %s: %s; restarting in %.1fs", self.name, self.reason, delay)
        self.set_state("backoff", self.reason)
        self.restart_timer = asyncio.get_running_loop().call_later(delay, self.start)

    def kill_hung(self) -> None:
        """Thaw (a SIGKILL needs no thaw, but a later SIGTERM would) and kill: on_member_exit restarts."""
        for c in self.children:
            c.signal(signal.SIGCONT)
        self.engine.signal(signal.SIGKILL)

    async def drain(self, timeout_s: float) -> None:
        """Let the engine finish what it has (no new requests), up to timeout_s."""
        if self.state != "ready" or not self.engine.alive:
            return
        self.state = "stopping"
        self.manager.on_group_change(self)  # gateways stop sending new requests
        self.drained = asyncio.get_running_loop().create_future()
        self.manager.send_to_engine(self, P.Drain())
        await asyncio.wait([self.drained], timeout=timeout_s)

    async def stop(self, grace_s: float, keep_standbys: bool = False) -> None:
        self.stopping = True
        if self.restart_timer:
            self.restart_timer.cancel()
            self.restart_timer = None
        leaving = [] if keep_standbys else self.release_standbys()
        alive = [c for c in self.children if c.alive]
        if alive:
            self.state = "stopping"
            for c in alive:
                c.set("stopping")
            self.manager.on_group_change(self)
            # Thaw first: a SIGTERM stays pending on a stopped process.
            for c in alive:
                c.signal(signal.SIGCONT)
                c.signal(signal.SIGTERM)
        if alive or leaving:
            await self.manager.wait_exit(alive + leaving, grace_s)
        self.frozen = False
        self.set_state("stopped")

    async def restart(self, grace_s: float) -> None:
        await self.drain(self.manager.cfg.manager.drain_timeout_s)
        await self.stop(grace_s, keep_standbys=True)  # same configuration: the standbys fit
        self.policy.reset()
        self.start()


def key_pipe(key: bytes) -> int:
    """A pipe holding the group key; returns the read end (to pass to a child)."""
    r, w = os.pipe()
    os.write(w, key)
    os.close(w)
    return r


class Gateway:
    def __init__(self, index: int, manager: "Manager"):
        m = manager.cfg.manager
        self.index = index
        self.child = Child(f"gateway:{index}", "gateway", None, manager.log_dir / f"gateway-{index}.log",
                           manager.on_child_change)
        self.policy = RestartPolicy(m.backoff_initial_s, m.backoff_max_s, m.crash_loop_count, m.crash_loop_window_s)
        self.restart_timer: asyncio.TimerHandle | None = None
        self.peer = ""
        self.stopping = False  # an exit we asked for (reload), not a crash
        self.ready_waiters: list[asyncio.Future] = []


class Manager:
    def __init__(self, cfg: C.Config, paths: RuntimePaths, instance: str, state_dir: Path,
                 config_path: str | None = None, overrides: C.Overrides | None = None):
        self.cfg = cfg
        self.config_path = config_path
        self.overrides = overrides or C.Overrides()
        self.paths = paths
        self.instance = instance
        self.state_dir = state_dir
        self.log_dir = ensure_private_dir(state_dir / "logs")
        self.started_at = time.time()
        self.state = "starting"
        self.exit_code = 0
        self.ctx = zmq.asyncio.Context()
        self.groups = {m.name: EngineGroup(m, self) for m in cfg.models}
        self.gateways = [Gateway(i, self) for i in range(cfg.gateway.processes)]
        self.settled_waiters: list[bytes] = []
        self.released_standbys: set[Standby] = set()  # told to go, not yet reaped
        self.shutdown_started = False
        self.done = asyncio.Event()
        self.listen_sock: socket.socket | None = None
        self.port = cfg.gateway.port
        # Gateways' prometheus multiprocess files: fresh for each manager.
        self.metrics_dir = paths.root / "metrics"
        if self.metrics_dir.exists():
            for f in self.metrics_dir.iterdir():
                f.unlink()
        ensure_private_dir(self.metrics_dir)

    # ---- children ------------------------------------------------------------
    def child_env(self, extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # only the manager talks to systemd
        env.pop("WATCHDOG_USEC", None)
        env.update(extra)
        env[INSTANCE_ENV] = self.instance
        env[PARENT_ENV] = str(os.getpid())
        env["PYTHONUNBUFFERED"] = "1"
        # Children import our packages from wherever the manager did.
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def watch(self, child: Child) -> None:
        loop = asyncio.get_running_loop()
        if child.stale_output_fd is not None:
            loop.remove_reader(child.stale_output_fd)
            os.close(child.stale_output_fd)
            child.stale_output_fd = None
        loop.add_reader(child.pidfd, self._on_exit, child)
        fd = child.output_fd
        if fd is not None:
            loop.add_reader(fd, self._on_output, child, fd)

    def watch_standby(self, standby: Standby) -> None:
        self.watch(standby)
        asyncio.get_running_loop().add_reader(standby.channel.fileno(), self._on_standby_says, standby)

    def _on_standby_says(self, standby: Standby) -> None:
        channel = standby.channel
        try:
            said = channel.recv(16)
        except BlockingIOError:
            return
        except OSError:
            said = b""
        if said == b"W":
            standby.set("ready")
        else:  # it is going; its pidfd tells the rest
            self._hang_up(standby)

    def _hang_up(self, standby: Standby) -> None:
        """Stop listening to a standby's channel and close our end (it reads EOF if it still waits)."""
        channel, standby.channel = standby.channel, None
        if channel is not None:
            asyncio.get_running_loop().remove_reader(channel.fileno())
            channel.close()

    def hand_over(self, standby: Standby, member: Child, role: Role, fds: list[int]) -> bool:
        """Make a warm standby the member: send it the role, then watch it as the member."""
        sent = standby.alive and standby.send_role(msgspec.json.encode(role), fds)
        self._hang_up(standby)
        if not sent:
            return False
        loop = asyncio.get_running_loop()
        loop.remove_reader(standby.pidfd)
        output_fd = standby.output_fd
        if output_fd is not None:
            loop.remove_reader(output_fd)
            standby.read_output()  # what it said while warming stays in its own log
        standby.sink.close()
        member.adopt(standby)
        self.watch(member)
        log.info("%s: handed to its warm standby (pid %d)", member.component, member.pid)
        return True

    def release(self, standby: Standby) -> None:
        self._hang_up(standby)
        standby.release()
        if standby.alive:
            self.released_standbys.add(standby)

    def _on_output(self, child: Child, fd: int) -> None:
        if child.output_fd != fd or not child.read_output():
            asyncio.get_running_loop().remove_reader(fd)

    def _on_exit(self, child: Child) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(child.pidfd)
        fd = child.output_fd
        if not child.read_output() and fd is not None:  # its last words first
            loop.remove_reader(fd)
        how = child.reap()
        # Orphans reparented to us (we are a subreaper) are reaped here: their
        # parent's exit is the event that made them ours. (uvloop owns SIGCHLD.)
        self.reap_strays()
        log.info("%s (pid %s) exited: %s", child.component, child.popen.pid, how)
        if child.kind == "gateway":
            self._on_gateway_exit(self.gateways[int(child.component.split(":")[1])])
        elif isinstance(child, Standby):
            self.released_standbys.discard(child)
            self._hang_up(child)
            group = self.groups.get(child.model)
            if group is not None:
                group.on_standby_exit(child)
        else:
            self.groups[child.model].on_member_exit(child)
        self._check_settled()

    def start_gateway(self, gw: Gateway) -> None:
        gw.restart_timer = None
        spec = msgspec.json.encode({
            "index": gw.index, "runtime_dir": str(self.paths.root), "instance": self.instance,
            "gateway": self.cfg.gateway, "models": [m.name for m in self.cfg.models],
            "drain_timeout_s": self.cfg.manager.drain_timeout_s,
        }).decode()
        fd = self.listen_sock.fileno()
        env = self.child_env({"PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir)})
        gw.child.spawn([sys.executable, "-m", "api_gateway", "--spec", spec, "--listen-fd", str(fd)], env, (fd,))
        gw.peer = f"gw-{gw.index}-{gw.child.pid}"
        self.watch(gw.child)

    def _on_gateway_exit(self, gw: Gateway) -> None:
        # Its in-flight requests would otherwise run on in the engines.
        for group in self.groups.values():
            self.send_to_engine(group, P.AbortPeer(peer=gw.peer))
        if self.shutdown_started or gw.stopping:
            gw.child.set("stopped", gw.child.last_exit or "")
            return
        gw.child.set("exited", gw.child.last_exit or "")
        delay = gw.policy.record_exit(time.monotonic())
        if delay is None:
            gw.child.set("failed", f"{gw.child.last_exit}; crash loop")
            return
        gw.child.set("backoff")
        gw.restart_timer = asyncio.get_running_loop().call_later(delay, self.start_gateway, gw)

    def send_to_engine(self, group: EngineGroup, msg) -> None:
        if group.engine.alive:
            try:
                self.control.send_multipart([f"engine:{group.name}".encode(), P.encoder.encode(msg)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    async def wait_exit(self, children: list[Child], grace_s: float) -> None:
        """Wait for children to exit; SIGKILL whoever outlives the grace."""
        loop = asyncio.get_running_loop()
        futs = []
        for c in children:
            if c.alive:
                fut = loop.create_future()
                c.exited_waiters.append(fut)
                futs.append(fut)
        if not futs:
            return
        _, pending = await asyncio.wait(futs, timeout=grace_s)
        if pending:
            for c in children:
                if c.alive:
                    log.warning("%s did not stop within %.0fs: SIGKILL", c.component, grace_s)
                    c.signal(signal.SIGCONT)
                    c.signal(signal.SIGKILL)
            await asyncio.wait(pending)

    # ---- state changes -----------------------------------------------------------
    def on_child_change(self, child: Child, detail: str) -> None:
        ev = P.Event(component=child.component, kind=child.kind, model=child.model, state=child.state,
                     pid=child.popen.pid if child.popen else None, time=time.time(),
                     incarnation=self.groups[child.model].incarnation if child.model else "", detail=detail,
                     restarts=child.restarts)
        self.publish(ev)

    def on_group_change(self, group: EngineGroup) -> None:
        self.publish(P.Event(component=f"model:{group.name}", kind="model", model=group.name, state=group.state,
                             pid=group.engine.pid, time=time.time(), incarnation=group.incarnation,
                             detail=group.reason or ""))
        notify(f"STATUS=model {group.name}: {group.state}")
        self._check_settled()

    def publish(self, ev: P.Event) -> None:
        try:
            self.events.send(P.encoder.encode(ev), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def settled(self) -> bool:
        return all(g.state in ("ready", "failed") for g in self.groups.values()) and all(
            gw.child.state in ("ready", "failed") for gw in self.gateways)

    def _check_settled(self) -> None:
        if self.shutdown_started or not self.settled():
            return
        if self.state == "starting":
            self.state = "running"
            failed = [g.name for g in self.groups.values() if g.state == "failed"]
            notify("READY=1\nSTATUS=" + ("serving" if not failed else f"serving; failed: {', '.join(failed)}"))
            log.info("settled: %s", {g.name: g.state for g in self.groups.values()})
        waiters, self.settled_waiters = self.settled_waiters, []
        for ident in waiters:
            self.reply(ident, self.status())

    # ---- control socket ------------------------------------------------------------
    def reply(self, ident: bytes, msg) -> None:
        try:
            self.control.send_multipart([ident, P.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("cannot reply to %r: %s", ident, exc)

    async def serve_control(self) -> None:
        while True:
            frames = await self.control.recv_multipart()
            if len(frames) < 2:
                continue
            ident, body = frames[0], frames[-1]
            try:
                msg = P.control_in_decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("rejected control frame from %r: %s", ident[:32], exc)
                self.reply(ident, P.Ack(ok=False, message=f"bad request: {exc}"))
                continue
            try:
                self.handle(ident, msg)
            except Exception:  # a bug in one handler must not take the supervisor down
                log.exception("control message %r failed", msg)
                self.reply(ident, P.Ack(ok=False, message="internal error; see the manager log"))

    def handle(self, ident: bytes, msg) -> None:
        if isinstance(msg, P.ChildReady):
            self._on_child_ready(msg)
        elif isinstance(msg, P.GroupFrozen):
            group = self.groups.get(msg.model)
            if group and group.engine.alive:
                group.frozen = msg.frozen
                self.on_group_change(group)
        elif isinstance(msg, P.GroupDrained):
            group = self.groups.get(msg.model)
            if group and group.incarnation == msg.incarnation and group.drained and not group.drained.done():
                group.drained.set_result(True)
        elif isinstance(msg, P.GroupHung):
            group = self.groups.get(msg.model)
            if group and group.incarnation == msg.incarnation and group.state == "ready":
                log.error("model %s: a gateway saw no output in time; the group is hung, restarting it", msg.model)
                group.kill_hung()
        elif isinstance(msg, P.StatusRequest):
            self.reply(ident, self.status())
        elif isinstance(msg, P.WaitSettled):
            if self.settled() and not self.shutdown_started:
                self.reply(ident, self.status())
            else:
                self.settled_waiters.append(ident)
        elif isinstance(msg, P.StopRequest):
            self.reply(ident, P.Ack(ok=True, message="stopping"))
            self.request_shutdown(msg.timeout_s)
        elif isinstance(msg, P.RestartRequest):
            self._restart(ident, msg.model)
        elif isinstance(msg, P.ReloadRequest):
            self.request_reload(ident)
        elif isinstance(msg, P.LoadModel):
            if msg.model.name in self.groups:
                self.reply(ident, P.Ack(ok=False, message=f"model {msg.model.name!r} is already served"))
                return
            cfg = C.finalize(C.Config(gateway=self.cfg.gateway, manager=self.cfg.manager, models=[msg.model]))
            self.add_model(cfg.models[0])
            self.reply(ident, P.Ack(ok=True, message=f"loading {msg.model.name}"))
        elif isinstance(msg, P.UnloadModel):
            if msg.name not in self.groups:
                self.reply(ident, P.Ack(ok=False, message=f"no model {msg.name!r}; served: {', '.join(self.groups)}"))
                return
            asyncio.get_running_loop().create_task(self.remove_model(msg.name))
            self.reply(ident, P.Ack(ok=True, message=f"unloading {msg.name}"))
        elif isinstance(msg, P.SetFreezing):
            group = self.groups.get(msg.model)
            if group is None:
                self.reply(ident, P.Ack(ok=False, message=f"no model {msg.model!r}"))
                return
            group.freezing = msg.enabled
            self.send_to_engine(group, P.FreezingControl(enabled=msg.enabled))
            self.reply(ident, P.Ack(ok=True, message=f"freezing {'on' if msg.enabled else 'off'} for {msg.model}"))

    def _on_child_ready(self, msg: P.ChildReady) -> None:
        if msg.component.startswith("engine_core:"):
            group = self.groups.get(msg.component.split(":", 1)[1])
            if group and group.engine.pid == msg.pid:
                group.on_ready(msg.incarnation)
        elif msg.component.startswith("gateway:"):
            idx = int(msg.component.split(":")[1])
            if idx < len(self.gateways) and self.gateways[idx].child.pid == msg.pid:
                self.gateways[idx].child.set("ready")
                waiters, self.gateways[idx].ready_waiters = self.gateways[idx].ready_waiters, []
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(True)
                self._check_settled()

    def _restart(self, ident: bytes, model: str | None) -> None:
        if model is not None and model not in self.groups:
            self.reply(ident, P.Ack(ok=False, message=f"no model {model!r}; served: {', '.join(self.groups)}"))
            return
        targets = [self.groups[model]] if model else list(self.groups.values())

        async def run():
            for group in targets:  # one at a time: the others keep serving
                await group.restart(self.cfg.manager.stop_grace_s)

        asyncio.get_running_loop().create_task(run())
        self.reply(ident, P.Ack(ok=True, message=f"restarting {', '.join(g.name for g in targets)}"))

    def status(self) -> P.StatusReply:
        children = []
        for c in [gw.child for gw in self.gateways] + [
                c for g in self.groups.values() for c in [*g.children, *g.standbys.values()]]:
            state = c.state
            group = self.groups.get(c.model) if c.model else None
            if group and group.frozen and c.kind == "worker" and state == "ready":
                state = "idle (frozen)"
            children.append(P.ChildStatus(
                component=c.component, kind=c.kind, model=c.model, pid=c.pid, ppid=_ppid(c.pid),
                state=state, since=c.since, started_at=c.started_at if c.alive else None, restarts=c.restarts,
                last_exit=c.last_exit, last_log=c.tail(15) if c.state in ("failed", "backoff", "exited") else []))
        models = [P.ModelStatus(name=g.name, state=g.state, frozen=g.frozen, incarnation=g.incarnation,
                                reason=g.reason) for g in self.groups.values()]
        return P.StatusReply(version=P.PROTOCOL_VERSION, instance=self.instance, manager_pid=os.getpid(),
                             started_at=self.started_at, state=self.state, port=self.port,
                             state_dir=str(self.state_dir),
                             host=self.cfg.gateway.host, children=children, models=models)

    # ---- changing what is served ---------------------------------------------------------
    def add_model(self, model: C.ModelConfig) -> None:
        self.cfg.models = [*self.cfg.models, model]
        group = EngineGroup(model, self)
        self.groups[model.name] = group
        group.start()

    async def remove_model(self, name: str) -> None:
        group = self.groups[name]
        await group.drain(self.cfg.manager.drain_timeout_s)
        await group.stop(self.cfg.manager.stop_grace_s)
        del self.groups[name]
        self.cfg.models = [m for m in self.cfg.models if m.name != name]
        self.publish(P.Event(component=f"model:{name}", kind="model", model=name, state="removed", pid=None,
                             time=time.time()))
        self._check_settled()

    def request_reload(self, ident: bytes | None = None) -> None:
        if self.shutdown_started:
            return
        asyncio.get_running_loop().create_task(self.reload(ident))

    async def reload(self, ident: bytes | None) -> None:
        """Re-read the file, re-apply the start options, and apply only the difference."""
        notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}\nSTATUS=reloading")
        try:
            new, _ = C.effective_config(self.config_path, self.overrides)
        except C.ConfigError as exc:
            log.error("reload refused: %s", exc)
            notify("READY=1\nSTATUS=reload refused: config error")
            if ident is not None:
                self.reply(ident, P.Ack(ok=False, message=str(exc)))
            return
        old = {m.name: m for m in self.cfg.models}
        fresh = {m.name: m for m in new.models}
        added = [n for n in fresh if n not in old]
        removed = [n for n in old if n not in fresh]
        changed = [n for n in fresh if n in old and fresh[n] != old[n]]
        gateway_changed = new.gateway != self.cfg.gateway
        self.cfg.manager = new.manager
        summary = (f"added {added or '-'}, removed {removed or '-'}, changed {changed or '-'}, "
                   f"gateway {'changed' if gateway_changed else 'unchanged'}")
        log.info("reload: %s", summary)
        if ident is not None:
            self.reply(ident, P.Ack(ok=True, message=f"reloading: {summary}"))
        for name in removed:
            await self.remove_model(name)
        for name in added:
            self.add_model(fresh[name])
        for name in changed:
            group = self.groups[name]
            await group.drain(self.cfg.manager.drain_timeout_s)
            await group.stop(self.cfg.manager.stop_grace_s)
            group = EngineGroup(fresh[name], self)
            self.groups[name] = group
            self.cfg.models = [fresh[name] if m.name == name else m for m in self.cfg.models]
            group.start()
        for group in self.groups.values():  # [manager] warm_standby may have changed
            if new.manager.warm_standby:
                group.refill_standbys()
            else:
                group.release_standbys()
        if gateway_changed:
            await self.replace_gateways(new.gateway)
        notify("READY=1\nSTATUS=serving")

    async def replace_gateways(self, gateway: C.GatewayConfig) -> None:
        """Restart the gateways one by one with the new [gateway] section."""
        old_sock = None
        if (gateway.host, gateway.port) != (self.cfg.gateway.host, self.cfg.gateway.port):
            old_sock = self.listen_sock
            self.bind_listener(gateway)
        self.cfg.gateway = gateway
        for gw in list(self.gateways):
            if gw.child.alive:
                gw.child.set("stopping")
                gw.stopping = True
                gw.child.signal(signal.SIGTERM)
                await self.wait_exit([gw.child], self.cfg.manager.drain_timeout_s + self.cfg.manager.stop_grace_s)
            gw.stopping = False
            self.start_gateway(gw)
            ready = asyncio.get_running_loop().create_future()
            gw.ready_waiters.append(ready)
            await asyncio.wait([ready], timeout=120)
        for i in range(len(self.gateways), gateway.processes):
            gw = Gateway(i, self)
            self.gateways.append(gw)
            self.start_gateway(gw)
        while len(self.gateways) > gateway.processes:
            gw = self.gateways.pop()
            gw.stopping = True
            gw.child.signal(signal.SIGTERM)
            await self.wait_exit([gw.child], self.cfg.manager.drain_timeout_s + self.cfg.manager.stop_grace_s)
        if old_sock is not None:
            old_sock.close()

    def bind_listener(self, gateway: C.GatewayConfig) -> None:
        self.listen_sock = socket.create_server((gateway.host, gateway.port), backlog=1024)
        self.listen_sock.set_inheritable(True)
        self.port = self.listen_sock.getsockname()[1]

    # ---- lifecycle -------------------------------------------------------------------
    def request_shutdown(self, timeout_s: float | None = None) -> None:
        if not self.shutdown_started:
            self.shutdown_started = True
            asyncio.get_running_loop().create_task(self.shutdown(timeout_s))

    async def shutdown(self, timeout_s: float | None) -> None:
        self.state = "stopping"
        notify("STOPPING=1")
        drain = self.cfg.manager.drain_timeout_s if timeout_s is None else timeout_s
        grace = self.cfg.manager.stop_grace_s
        log.info("stopping: draining gateways (up to %.0fs)", drain)
        for gw in self.gateways:
            if gw.restart_timer:
                gw.restart_timer.cancel()
            if gw.child.alive:
                gw.child.set("stopping")
                gw.child.signal(signal.SIGTERM)  # the gateway drains, then exits
        await self.wait_exit([gw.child for gw in self.gateways], drain + grace)
        # No gateway accepts any more: close the socket so clients are refused, not queued.
        self.listen_sock.close()
        for group in self.groups.values():
            await group.stop(grace)
        self.kill_strays()
        self.state = "stopped"
        self.done.set()

    def start_watchdog(self) -> None:
        """systemd's watchdog: the one periodic wake-up, and only when systemd asks for it."""
        usec = os.environ.get("WATCHDOG_USEC")
        wpid = os.environ.get("WATCHDOG_PID")
        if not usec or (wpid and int(wpid) != os.getpid()):
            return
        interval = int(usec) / 1e6 / 2
        loop = asyncio.get_running_loop()

        def ping() -> None:  # event-proof: systemd's watchdog protocol requires a periodic keep-alive
            notify("WATCHDOG=1")
            if not self.shutdown_started:
                loop.call_later(interval, ping)

        ping()

    def kill_strays(self) -> None:
        """Kill grandchildren reparented to us (we are their subreaper)."""
        me = os.getpid()
        for pid in processes_of_instance(self.instance):
            if pid != me:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.reap_strays()

    def reap_strays(self) -> None:
        """Reap exited orphans reparented to us; our own children are reaped through pidfds."""
        ours = {c.popen.pid for g in self.groups.values() for c in [*g.children, *g.standbys.values()] if c.popen} | {
            gw.child.popen.pid for gw in self.gateways if gw.child.popen} | {
            s.popen.pid for s in self.released_standbys if s.popen}
        me = str(os.getpid())
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in ours:
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] == "Z":
                try:
                    os.waitpid(int(entry.name), os.WNOHANG)
                except ChildProcessError:
                    pass

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_shutdown)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        self.start_watchdog()
        self.control = self.ctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        # A restarted engine comes back as `engine:<model>`; if the old
        # connection is not torn down yet, the new one must take the name over
        # (otherwise AbortPeer and Drain would go nowhere). See engine_core.
        self.control.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.events = self.ctx.socket(zmq.PUB)
        self.events.setsockopt(zmq.LINGER, 0)
        old = os.umask(0o177)
        try:
            self.control.bind(RuntimePaths.ipc(self.paths.control))
            self.events.bind(RuntimePaths.ipc(self.paths.events))
        finally:
            os.umask(old)
        if self.paths.root.stat().st_mode & 0o070:
            # A system daemon's runtime dir is 0750 with the operators' group:
            # they may use the control socket (0660); every other socket stays 0600.
            os.chmod(self.paths.control, 0o660)
        self.paths.pidfile.write_text(f"{os.getpid()}\n{self.instance}\n")
        self.bind_listener(self.cfg.gateway)
        log.info("manager %d: runtime %s, gateway on %s:%d", os.getpid(), self.paths.root, self.cfg.gateway.host,
                 self.port)
        control_task = loop.create_task(self.serve_control())
        for group in self.groups.values():
            group.start()
        for gw in self.gateways:
            self.start_gateway(gw)
        await self.done.wait()
        control_task.cancel()
        for path in (self.paths.control, self.paths.events, self.paths.pidfile):
            path.unlink(missing_ok=True)
        self.ctx.destroy(linger=0)
        return self.exit_code


def _ppid(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def check_not_running(paths: RuntimePaths) -> None:
    """Refuse to start over a live manager; clean what a dead one left."""
    try:
        pid_text, instance = paths.pidfile.read_text().split()[:2]
        pid = int(pid_text)
    except (OSError, ValueError):
        pid, instance = None, None
    if pid is not None:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            env = []
        if f"{INSTANCE_ENV}={instance}".encode() in env:
            raise SystemExit(f"servectl manager already running (pid {pid}) in {paths.root}")
    # Stale: sockets and pid file of a dead manager are never trusted.
    for entry in paths.root.iterdir():
        if entry.name in ("control", "events", "manager.pid") or entry.name.startswith(("engine-", "worker-", "dist-")):
            entry.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m manager")
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--instance", default=None)
    ap.add_argument("--config-path", default=None, help="the file to re-read on reload")
    ap.add_argument("--overrides-json", default=None, help="start options re-applied on reload")
    ap.add_argument("--die-with-parent", action="store_true",
                    help="library mode: exit when the starting process dies")
    ap.add_argument("--parent-pipe-fd", type=int, default=None,
                    help="library mode: exit when this pipe reaches end of file")
    args = ap.parse_args(argv)
    from servectl.proc import setup_child_logging

    setup_child_logging("manager")
    cfg = C.decode(args.config_json)
    if args.die_with_parent:
        die_with_parent()
    root = resolve_runtime_dir(cfg.manager.runtime_dir)
    if root == SYSTEM_RUNTIME_DIR and root.is_dir():
        pass  # systemd made it (RuntimeDirectoryMode=0750): keep its mode and group
    else:
        ensure_private_dir(root)
    paths = RuntimePaths(root)
    check_not_running(paths)
    state_dir = Path(cfg.manager.state_dir) if cfg.manager.state_dir else root / "state"
    ensure_private_dir(state_dir)
    # The tag must be in our real environment (/proc/<pid>/environ) so a leak
    # of the manager itself can be found; `servectl start` and Server() put it there.
    instance = args.instance or os.environ.get(INSTANCE_ENV) or secrets.token_hex(8)
    os.environ[INSTANCE_ENV] = instance
    become_subreaper()
    import uvloop

    overrides = msgspec.json.decode(args.overrides_json, type=C.Overrides) if args.overrides_json else None
    manager = Manager(cfg, paths, instance, state_dir, args.config_path, overrides)

    async def run() -> int:
        if args.parent_pipe_fd is not None:
            # End of file on this pipe means the script that started us is gone.
            loop = asyncio.get_running_loop()
            loop.add_reader(args.parent_pipe_fd, lambda: (loop.remove_reader(args.parent_pipe_fd),
                                                          manager.request_shutdown(0)))
        return await manager.run()

    return uvloop.run(run())
