"""The manager: started first, owns every other process; this file starts, settles and stops it.

It never imports torch or vLLM. Every child is a fresh interpreter exec'd
from the event-loop thread (PDEATHSIG follows the thread that forked) and
watched through its pidfd (manager/watch.py). Signal handlers only enqueue
work on the loop. Time passes here only in restart backoff and in the grace
periods of a stop.

Who owns what: ``EngineGroup`` (manager/group.py) a model's state and its
members; ``ServedModels`` (served.py) the changes to what is served, whose
groups (``Manager.groups``, the one source of truth) this file holds;
``StandbyPool`` (standbys.py) every warm standby; ``GatewayPool``
(gateways.py) the gateways and the listening socket; ``ControlServer``
(control.py) the control socket, one handler per message; ``Reloader``
(reload.py) a reload; status.py what status and events say. This file: the
parts put together, events sent, settling, and the daemon's own lifecycle.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import zmq
import zmq.asyncio

from manager import status as report
from manager.budget import Budget
from manager.children import Child
from manager.cluster import ClusterHead
from manager.cluster_link import ClusterSecretError
from manager.cluster_member import ClusterMember
from manager.control import ControlServer
from manager.gateways import GatewayPool
from manager.group import IDLE_RELEASED, EngineGroup, GroupState
from manager.limits import KeyLimits
from manager.reload import Reloader
from manager.sdnotify import notify, start_watchdog
from manager.served import ServedModels
from manager.spans import GroupSpans
from manager.standbys import StandbyPool
from manager.start_gate import StartGate
from manager.usage import UsageLedger
from manager.verbs import ModelVerbs
from manager.watch import ChildWatch
from servectl import config as C
from servectl.memory import device_totals, has_accelerator
from servectl.messages import bind_failure
from servectl.model_check import model_estimate
from servectl.paths import RuntimePaths, UntrustedDirectory, is_shared, remove_stale, secure_dir, write_pidfile
from servectl.tasks import Tasks
from servectl.proc import PARENT_ENV, kill_instance, port_holder, process_env
from servectl.wire import control as P
from servectl.wire import status as WS
from servectl.wire.spawn import engine_identity
from servectl.wire.vocab import ExitCode, ManagerState

log = logging.getLogger("manager")


class StartupError(Exception):
    """The manager cannot start for a reason a retry would not fix (its listening
    address is taken, ...): one line for the operator, nothing started.
    ``python -m manager`` reports it (``--report-fd``, its log) and exits ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class Manager:
    def __init__(self, cfg: C.Config, paths: RuntimePaths, instance: str, state_dir: Path,
                 config_path: str | None = None, overrides: C.Overrides | None = None, lock_fd: int | None = None,
                 report_fd: int | None = None):
        self.settings = cfg.manager
        self.gateway_cfg = cfg.gateway
        self.config_path = config_path
        self.overrides = overrides or C.Overrides()
        self.paths = paths
        self.runtime_dir = paths.root
        self.instance = instance
        self.state_dir = state_dir
        self.lock_fd = lock_fd  # manager.pid, flocked for our whole life (manager/main.py)
        self.report_fd = report_fd  # StartupError goes there (python -m manager); closed once bound
        self.spans: GroupSpans | None = None  # tracing on: restarts, evictions, wakes, rolls (spans.py)
        self.shared = is_shared(os.stat(paths.root))  # its group may use the read-only socket and read logs
        self.log_dir = secure_dir(state_dir / "logs", 0o750 if self.shared else 0o700)
        self.started_at = time.time()
        self.state = ManagerState.STARTING
        self.exit_code = 0
        self.tasks = Tasks(log)  # what runs in the background: restarts, reloads, unloads, the shutdown
        self.ctx = zmq.asyncio.Context()
        self.watcher = ChildWatch(instance, self.pids, self.check_settled)
        self.control = ControlServer(self, self.ctx)
        self.limits = KeyLimits(cfg.gateway.keys)  # the named keys' limits, across every gateway
        self.usage = UsageLedger(state_dir / "usage")  # usage per key and model (opened in run)
        self.standbys = StandbyPool(self)
        accelerator = has_accelerator()
        self.start_gate = StartGate(accelerator)  # one start at a time per device
        # The served models' engine groups by group name (a model's name, or <model>@<i> for each
        # of its replicas): the one source of truth, shared with those that change or count them.
        self.groups: dict[str, EngineGroup] = {}
        # A model spread over hosts: this host heads some (their engines are here) and runs ranks
        # of others' (manager/cluster.py, cluster_member.py); it serves only the models it heads.
        self.me = C.cluster.this_host(cfg.cluster) if any(m.hosts for m in cfg.models) else None
        try:
            self.cluster = (ClusterHead(cfg.cluster, self.me, self)
                            if any(len(m.hosts) > 1 and m.hosts[0] == self.me for m in cfg.models) else None)
            self.member = ClusterMember(cfg, self.me, self) if C.cluster.ranks_here(cfg) else None
        except ClusterSecretError as exc:
            raise StartupError(str(exc)) from None
        cfg.models = C.cluster.engines_here(cfg)
        self.served = ServedModels(self, cfg.models)  # and the configuration's models (`configured`)
        self.groups.update((g.name, g) for m in cfg.models for g in self.served.new_groups(m))
        # max_loaded_models and memory_budget; a fraction's base is the device's memory.
        totals = device_totals(accelerator) if cfg.manager.memory_budget else {}
        self.budget = Budget(cfg.manager.max_loaded_models, self.groups, labels=self.start_gate.labels,
                             memory=C.memory_budget(cfg.manager), totals=totals,
                             estimate=lambda g: model_estimate(g.cfg, self.start_gate.labels(g), accelerator,
                                                               self.budget.totals))
        for label in self.budget.unresolved:
            log.warning("memory_budget.%s is a fraction of device %s, whose memory is not known here: not applied "
                        "(give it in bytes)", label, label)
        self.start_gate.groups = self.groups
        self.gateways = GatewayPool(self)
        self.verbs = ModelVerbs(self.served, lambda coro, name: self.tasks.start(coro, name))
        self.reloader = Reloader(self)
        self.done = asyncio.Event()
        # Gateways' prometheus multiprocess files: fresh for each manager (a dead
        # one's were removed under the lock: servectl.paths.remove_stale).
        self.metrics_dir = secure_dir(paths.metrics)

    @property
    def shutting_down(self) -> bool:
        return self.state in (ManagerState.STOPPING, ManagerState.STOPPED)

    def served_models(self) -> list[str]:
        """Every engine group's name (gateways keep a link to each)."""
        return list(self.groups)

    def group(self, model: str) -> EngineGroup | None:
        return self.groups.get(model)

    def events_slot(self, group: EngineGroup) -> int:
        """A group's KV-events port slot (servectl/kv_events.py): the lowest of 0 .. replicas that no
        other group of its model holds; -1 when every one is (a roll that shrinks the model)."""
        held = {g.events_slot for g in self.groups.values() if g.model == group.model and g is not group}
        return next((n for n in range(group.model_cfg.replicas + 1) if n not in held), -1)

    # ---- children ------------------------------------------------------------
    def child_env(self, extra: dict[str, str]) -> dict[str, str]:
        # Only the manager talks to systemd; children import our packages from wherever it did.
        return process_env(self.instance, {**extra, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"},
                         drop=("NOTIFY_SOCKET", "WATCHDOG_USEC"))

    def watch(self, child: Child) -> None:
        self.watcher.watch(child)

    def unwatch(self, child: Child) -> None:
        self.watcher.unwatch(child)

    async def wait_exit(self, children: list[Child], grace_s: float) -> None:
        await self.watcher.wait_exit(children, grace_s)

    def pids(self) -> set[int]:
        """Every child's pid (a stray is any other process reparented to us)."""
        return {c.popen.pid for g in self.groups.values() for c in g.children if c.popen} | \
            self.standbys.pids() | self.gateways.pids()

    def send_to_engine(self, group: EngineGroup, msg: P.ToEngine) -> None:
        if group.engine.alive:
            self.control.send(engine_identity(group.name), msg)

    def send_to_gateway(self, peer: str, msg: P.ControlOut) -> None:
        self.control.send(peer.encode(), msg)

    def abort_peer_everywhere(self, peer: str) -> None:
        """A gateway died: every engine drops the requests it sent, and its keys' slots are free."""
        self.limits.gateway_gone(peer.encode())
        for group in self.groups.values():
            self.send_to_engine(group, P.AbortPeer(peer=peer))

    # ---- state changes and events -------------------------------------------------
    def on_child_change(self, child: Child, detail: str) -> None:
        group = self.groups.get(child.model) if child.model else None
        self.publish(report.child_event(child, group, detail))

    def on_group_change(self, group: EngineGroup) -> None:
        self.publish(report.group_event(group))
        if self.spans is not None:
            self.spans.changed(group.name, group.cfg.name, group.state, group.reason, group.incarnation)
        if self.cluster is not None and group.spread:
            self.cluster.on_group_state(group)  # its other hosts learn it serves (their status says so)
        notify(f"STATUS=model {group.name}: {group.state}")
        self.served.changed(group)
        self.budget.changed(group)
        # Standbys import only while no model serves; a model that never freezes cannot say it is idle.
        self.standbys.pace(any(g.state is GroupState.READY and g.freezing and not g.frozen
                               for g in self.groups.values()))
        self.check_settled()

    def on_step_deadline(self, group: EngineGroup) -> None:
        """The engine's step deadline changed: an event (gateways find hangs by it; an operator sees it)."""
        self.publish(report.deadline_event(group))

    def publish(self, ev: WS.Event) -> None:
        try:
            self.events.send(P.encoder.encode(ev), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def settled(self) -> bool:
        return all(g.state in (GroupState.READY, GroupState.FAILED, *IDLE_RELEASED)
                   or (g.spread and self.cluster is not None and self.cluster.settled_waiting(g))
                   for g in self.groups.values()) and self.gateways.settled()

    def check_settled(self) -> None:
        if self.shutting_down or not self.settled():
            return
        if self.state is ManagerState.STARTING:
            self.state = ManagerState.RUNNING
            failed = [g.name for g in self.groups.values() if g.state is GroupState.FAILED]
            notify("READY=1\nSTATUS=" + ("serving" if not failed else f"serving; failed: {', '.join(failed)}"))
            log.info("settled: %s", {g.name: str(g.state) for g in self.groups.values()})
        self.control.notify_settled()

    def children(self) -> list:
        return [*self.gateways.children(),
                *(c for g in self.groups.values() for c in [*g.children, *self.standbys.of_model(g.name)]),
                *(self.member.children() if self.member else [])]

    # ---- other hosts (a model spread over hosts) ----------------------------------------
    def on_cluster_change(self, host: str, joined: bool, detail: str) -> None:
        self.publish(report.host_event(host, joined, detail))

    def on_remote_rank(self, group: str) -> None:
        g = self.groups.get(group)
        if g is not None:
            self.publish(report.group_event(g))

    def reconfigure_cluster(self, new: C.Config) -> str | None:
        """A reload's [cluster] and models' hosts: None when applied (new.models left as the
        models whose engines run here), else why not. A host taking a new role (heading a spread
        model, or running ranks for one, where it did neither) needs a restart."""
        me = C.cluster.this_host(new.cluster) if any(m.hosts for m in new.models) else None
        heads = any(len(m.hosts) > 1 and m.hosts[0] == me for m in new.models)
        ranks = bool(C.cluster.ranks_here(new))
        if me != self.me or heads != (self.cluster is not None) or ranks != (self.member is not None):
            return "this host's part in [cluster] changed: restart servectl to apply it (docs/cluster.md)"
        try:
            if self.cluster is not None:
                self.cluster.configure(new.cluster)
            if self.member is not None:
                self.member.configure(new)
        except ClusterSecretError as exc:
            return str(exc)
        new.models = C.cluster.engines_here(new)
        return None

    def audit_cluster(self, addr: str, what: str, outcome: str, detail: str) -> None:
        self.control.record_cluster(addr, what, outcome, detail)

    def child(self, component: str):
        """A supervised process by its component name (None if there is none now)."""
        return next((c for c in self.children() if c.component == component), None)

    def status(self) -> P.StatusReply:
        return report.status_reply(self)

    def request_reload(self) -> None:
        """SIGHUP: as `servectl reload`, audited as the signal (its sender is not known here)."""
        self.control.record(None, "reload (SIGHUP)", "accepted")
        if not self.shutting_down:
            self.tasks.start(self.reload(), "reload (SIGHUP)")

    async def reload(self) -> tuple[bool, str]:
        return await self.reloader.reload()

    # ---- lifecycle -------------------------------------------------------------------
    def request_shutdown(self, timeout_s: float | None = None) -> None:
        if not self.shutting_down:
            self.state = ManagerState.STOPPING
            self.tasks.start(self.shutdown(timeout_s), "shutdown")

    def task_died(self, name: str, exc: BaseException) -> None:
        """A long-lived task (a control loop) kept failing: the manager cannot be controlled,
        so it stops its tree and exits TASK_DIED (systemd's Restart= starts it again)."""
        log.critical("task %r died (%s: %s): stopping and exiting %d", name, type(exc).__name__,
                     str(exc)[:200], ExitCode.TASK_DIED)
        self.exit_code = int(ExitCode.TASK_DIED)
        self.request_shutdown()

    async def shutdown(self, timeout_s: float | None) -> None:
        # The way out, whatever fails on it: a shutdown that raised still kills what is left
        # and ends the manager (run returns), never a live manager that supervises nothing.
        try:
            notify("STOPPING=1")
            drain = self.settings.drain_timeout_s if timeout_s is None else timeout_s
            if self.settings.unready_grace_s:
                log.info("stopping: /ready fails for %.1fs before new requests are refused",
                         self.settings.unready_grace_s)
                await self.gateways.stop_being_ready(self.settings.unready_grace_s)
            log.info("stopping: draining gateways (up to %.0fs)", drain)
            await self.gateways.stop_all(drain + self.settings.stop_grace_s)
            for group in self.groups.values():
                await group.stop(self.settings.stop_grace_s)
            if self.member is not None:
                await self.member.stop_all()
        except Exception:
            log.exception("shutdown failed; killing what is left")
            self.exit_code = self.exit_code or int(ExitCode.TASK_DIED)
        finally:
            try:
                self.kill_strays()
            finally:
                self.state = ManagerState.STOPPED
                self.done.set()

    def kill_strays(self) -> None:
        """Kill grandchildren reparented to us (we are their subreaper)."""
        killed = kill_instance(self.instance, exclude={os.getpid()})  # by pidfd: a reused pid is never hit
        if killed:
            log.warning("killed strays of this tree: %s", killed)
        self.watcher.reap_strays()

    def bind_failure(self, gateway: C.GatewayConfig, exc: OSError) -> str:
        return bind_failure(gateway.host, gateway.port, exc, port_holder(gateway.port), self.config_path)

    async def run(self) -> int:
        # The listening socket first: if its address is taken, nothing has started
        # (no socket, no child) and the operator reads one line.
        try:
            self.gateways.bind(self.gateway_cfg)
        except OSError as exc:
            self.paths.pidfile.unlink(missing_ok=True)  # ours: we hold its lock
            raise StartupError(self.bind_failure(self.gateway_cfg, exc)) from None
        if self.report_fd is not None:  # past the last startup failure
            os.close(self.report_fd)
            self.report_fd = None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_shutdown)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        start_watchdog(loop, lambda: self.shutting_down)
        self.events = self.ctx.socket(zmq.PUB)
        self.events.setsockopt(zmq.LINGER, 0)
        old = os.umask(0o177)
        try:
            self.control.bind(self.paths)
            self.events.bind(RuntimePaths.ipc(self.paths.events))
        finally:
            os.umask(old)
        if self.shared:
            # A system daemon's runtime dir is 0750 with the operators' group:
            # they may follow events and use the read-only control socket (0660);
            # the control socket and every other socket stay 0600.
            os.chmod(self.paths.control_ro, 0o660)
            os.chmod(self.paths.events, 0o660)
        if self.lock_fd is not None:
            write_pidfile(self.lock_fd, os.getpid(), self.instance)
        else:
            self.paths.pidfile.write_text(f"{os.getpid()}\n{self.instance}\n")
        log.info("manager %d: runtime %s, gateway on %s:%d, config %s", os.getpid(), self.paths.root,
                 self.gateway_cfg.host, self.gateways.port, self.config_path or "(none: built-in defaults)")
        # Restarted when one raises (the children go on being supervised meanwhile); past its
        # restarts the manager shuts down and exits TASK_DIED, and systemd restarts it.
        loops = [*self.control.loops(), *(self.member.loops() if self.member else [])]
        if self.cluster is not None:
            loops.append(("cluster listener", self.cluster.serve))
        control_tasks = [self.tasks.keep(factory, name, give_up=self.task_died) for name, factory in loops]
        try:
            self.usage.open(time.time())
        except OSError as exc:  # not worth refusing to serve over: counted in memory, said loudly
            log.error("usage per key is not kept in %s (%s): counted in memory until the next start",
                      self.usage.dir, exc)
        for group in self.groups.values():
            self.served.start_group(group)
        self.gateways.start_all()
        await self.done.wait()
        self.usage.close()
        for task in control_tasks:
            task.cancel()
        try:  # the children are gone: their sockets and files too, before the lock is let go
            remove_stale(self.paths)  # so the next start finds nothing a dead manager left
        except (OSError, UntrustedDirectory) as exc:
            log.warning("could not remove the children's files: %s", exc)
        for path in (self.paths.control, self.paths.control_ro, self.paths.events, self.paths.pidfile):
            path.unlink(missing_ok=True)
        self.ctx.destroy(linger=0)
        return self.exit_code
