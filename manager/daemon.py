"""The manager: started first, owns every other process, supervises them.

It never imports torch or vLLM. Every child is a fresh interpreter exec'd
from the event-loop thread (PDEATHSIG follows the thread that forked), learned
dead through its pidfd (``loop.add_reader``), and reaped with
``waitid(P_PIDFD)``; its owner (engine group, standby pool, gateway pool)
then decides what the exit means. Signal handlers only enqueue work on the
loop. Time passes here only in restart backoff and in the grace periods of a
stop.

Who owns what: ``EngineGroup`` (manager/group.py) a model's state and its
members; ``StandbyPool`` (standbys.py) every warm standby; ``GatewayPool``
(gateways.py) the gateways and the listening socket; ``ControlServer``
(control.py) the control socket, one handler per message; this file the
served models (``groups``, the one source of truth), events, settling and the
daemon's own lifecycle.
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

from manager.budget import Budget
from manager.children import Child
from manager.control import ControlServer
from manager.gateways import GatewayPool
from manager.group import IDLE_RELEASED, EngineGroup, GroupState
from manager.reload import plan_reload
from manager.rollout import Rollout
from manager.sdnotify import notify
from manager.standbys import StandbyPool
from manager.start_gate import StartGate
from servectl import config as C
from servectl.memory import device_totals, has_accelerator
from servectl.messages import bind_failure
from servectl.model_check import check_model_paths, model_estimate
from servectl.paths import RuntimePaths, UntrustedDirectory, is_shared, remove_stale, secure_dir, write_pidfile
from servectl.tasks import Tasks
from servectl.proc import (PARENT_ENV, all_pids, is_zombie, kill_instance, port_holder, ppid_of, process_env,
                           rss_bytes)
from servectl.wire import control as P
from servectl.wire.spawn import MODEL, engine_component, engine_identity, model_component
from servectl.wire.vocab import ARMED, CHILD_DOWN, EventKind, ExitCode, ManagerState

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
        self.shared = is_shared(os.stat(paths.root))  # its group may use the read-only socket and read logs
        self.log_dir = secure_dir(state_dir / "logs", 0o750 if self.shared else 0o700)
        self.started_at = time.time()
        self.state = ManagerState.STARTING
        self.exit_code = 0
        self.tasks = Tasks(log)  # what runs in the background: restarts, reloads, unloads, the shutdown
        self.ctx = zmq.asyncio.Context()
        self.control = ControlServer(self, self.ctx)
        self.standbys = StandbyPool(self)
        accelerator = has_accelerator()
        self.start_gate = StartGate(accelerator)  # one start at a time per device
        # The served models' engine groups by group name (a model's name, or <model>@<i> for each
        # of its replicas): the one source of truth.
        self.groups = {g.name: g for m in cfg.models for g in self.new_groups(m)}
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
        # The configuration's models (file and start options, as last loaded or reloaded): what
        # `LoadConfigured` may start again once unloaded.
        self.configured = {m.name: m for m in cfg.models}
        self.gateways = GatewayPool(self)
        self.state_waiters: dict[EngineGroup, list[asyncio.Future]] = {}  # Manager.state_in
        self.rollout = Rollout(self)
        self.reload_lock = asyncio.Lock()
        self.lora_changes: set[str] = set()  # adapters a load or unload is under way for (manager/loras.py)
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

    def new_groups(self, model: C.ModelConfig) -> list[EngineGroup]:
        """A model's engine groups, one per replica (not started)."""
        return [EngineGroup(model, self, replica) for replica in range(model.replicas)]

    def events_slot(self, group: EngineGroup) -> int:
        """A group's KV-events port slot (servectl/kv_events.py): the lowest of 0 .. replicas that no
        other group of its model holds; -1 when every one is (a roll that shrinks the model)."""
        held = {g.events_slot for g in self.groups.values() if g.model == group.model and g is not group}
        return next((n for n in range(group.model_cfg.replicas + 1) if n not in held), -1)

    def groups_of(self, name: str) -> list[EngineGroup]:
        """What an operator's verb names: a model (all its replicas) or one replica's group."""
        if name in self.groups and self.groups[name].name != self.groups[name].model:
            return [self.groups[name]]
        return [g for g in self.groups.values() if g.model == name]

    def serves(self, model: str) -> bool:
        return any(g.model == model for g in self.groups.values())

    # ---- children ------------------------------------------------------------
    def child_env(self, extra: dict[str, str]) -> dict[str, str]:
        # Only the manager talks to systemd; children import our packages from wherever it did.
        return process_env(self.instance, {**extra, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"},
                         drop=("NOTIFY_SOCKET", "WATCHDOG_USEC"))

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

    def unwatch(self, child: Child) -> None:
        loop = asyncio.get_running_loop()
        if child.pidfd is not None:
            loop.remove_reader(child.pidfd)
        if child.output_fd is not None:
            loop.remove_reader(child.output_fd)

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
        child.on_exit(child)
        self.check_settled()

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
        # event-proof: the stop grace, once per stop; each child's exit settles its future at once.
        _, pending = await asyncio.wait(futs, timeout=grace_s)
        if pending:
            for c in children:
                if c.alive:
                    log.warning("%s did not stop within %.0fs: SIGKILL", c.component, grace_s)
                    c.signal(signal.SIGCONT)
                    c.signal(signal.SIGKILL)
            await asyncio.wait(pending)

    def send_to_engine(self, group: EngineGroup, msg: P.ToEngine) -> None:
        if group.engine.alive:
            self.control.send(engine_identity(group.name), msg)

    def send_to_gateway(self, peer: str, msg: P.ControlOut) -> None:
        self.control.send(peer.encode(), msg)

    def abort_peer_everywhere(self, peer: str) -> None:
        """A gateway died: every engine drops the requests it sent."""
        for group in self.groups.values():
            self.send_to_engine(group, P.AbortPeer(peer=peer))

    # ---- state changes and events -------------------------------------------------
    def on_child_change(self, child: Child, detail: str) -> None:
        group = self.groups.get(child.model) if child.model else None
        self.publish(P.Event(component=child.component, kind=child.kind, model=child.model, state=child.state,
                             pid=child.popen.pid if child.popen else None, time=time.time(),
                             incarnation=group.incarnation if group else "", detail=detail,
                             restarts=child.restarts))

    def on_group_change(self, group: EngineGroup) -> None:
        self.publish(P.Event(component=model_component(group.name), kind=MODEL, model=group.name, state=group.state,
                             pid=group.engine.pid, time=time.time(), incarnation=group.incarnation,
                             detail=group.reason or "", hold_timeout_s=group.cfg.hold_timeout_s,
                             start_s=group.start_s, config_id=group.config_id, loras=list(group.loras),
                             unfit=group.unfit is not None,
                             hung=group.killed_hung and group.state in (GroupState.EXITED, GroupState.BACKOFF)))
        notify(f"STATUS=model {group.name}: {group.state}")
        for fut in self.state_waiters.pop(group, []):
            if not fut.done():
                fut.set_result(None)
        self.budget.changed(group)
        self.check_settled()

    def on_step_deadline(self, group: EngineGroup) -> None:
        """The engine's step deadline changed: an event (gateways find hangs by it; an operator sees it)."""
        self.publish(P.Event(component=engine_component(group.name), kind=EventKind.DEADLINE, model=group.name,
                             state=ARMED, pid=group.engine.pid, time=time.time(), incarnation=group.incarnation,
                             detail=f"{group.step_deadline_s:.3f}", step_deadline_s=group.step_deadline_s))

    def publish(self, ev: P.Event) -> None:
        try:
            self.events.send(P.encoder.encode(ev), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def settled(self) -> bool:
        return all(g.state in (GroupState.READY, GroupState.FAILED, *IDLE_RELEASED) for g in self.groups.values()) \
            and self.gateways.settled()

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
                *(c for g in self.groups.values() for c in [*g.children, *self.standbys.of_model(g.name)])]

    def child(self, component: str):
        """A supervised process by its component name (None if there is none now)."""
        return next((c for c in self.children() if c.component == component), None)

    def status(self) -> P.StatusReply:
        children = self.children()
        return P.StatusReply(
            version=P.PROTOCOL_VERSION, instance=self.instance, manager_pid=os.getpid(), started_at=self.started_at,
            state=self.state, port=self.gateways.port, host=self.gateway_cfg.host, state_dir=str(self.state_dir),
            children=[P.ChildStatus(
                component=c.component, kind=c.kind, model=c.model, pid=c.pid, ppid=ppid_of(c.pid), state=c.state,
                since=c.since, started_at=c.started_at if c.alive else None, restarts=c.restarts,
                last_exit=c.last_exit, last_log=c.tail(15) if c.state in CHILD_DOWN else [],
                exit_code=c.exit_code, exit_signal=c.exit_signal)
                for c in children],
            models=[self.model_status(g) for g in self.groups.values()], budget=self.budget.status(),
            unloaded=[name for name in self.configured if not self.serves(name)])

    def model_status(self, g: EngineGroup) -> P.ModelStatus:
        idle = g.idle_policy
        fp = self.budget.footprint(g)
        return P.ModelStatus(
            name=g.name, state=g.state, frozen=g.frozen, incarnation=g.incarnation, reason=g.reason,
            release_after_s=idle.after_s, release_mode=g.release_mode if idle.after_s > 0 else "",
            idle_since=g.idle_since, released_since=g.released_since,
            memory_bytes=sum(rss_bytes(c.pid) for c in g.children if c.alive),
            device_memory_bytes=g.device_memory_bytes, hold_timeout_s=g.cfg.hold_timeout_s,
            step_deadline_s=g.step_deadline_s, restarts=g.engine.restarts, devices=g.cfg.devices,
            start_s=g.start_s, config_id=g.config_id, lora_enabled=C.lora_enabled(g.cfg), loras=list(g.loras),
            footprint_bytes=fp.bytes, footprint_measured=fp.measured, footprint_source=fp.source,
            device_labels=list(self.start_gate.labels(g)), unfit=g.unfit,
            standby_memory_bytes=sum(rss_bytes(c.pid) for c in self.standbys.of_model(g.name) if c.alive))

    # ---- changing what is served ---------------------------------------------------------
    def name_taken_by_adapter(self, models: list[C.ModelConfig]) -> str | None:
        """Why one of these models (or its configured adapters) cannot be served beside the LoRA
        adapters served now, or None: requests name adapters as they name models."""
        from manager.loras import adapter_owner

        for model in models:
            names = [model.name, *(lora.name for lora in model.lora_modules if isinstance(lora, C.LoraModule))]
            for name in names:
                owner = adapter_owner({k: g for k, g in self.groups.items() if g.model != model.name}, name)
                if owner is not None:
                    return (f"{name!r} is the name of a LoRA adapter of model {owner!r}; unload it first "
                            f"(servectl lora unload {name})")
        return None

    def add_model(self, model: C.ModelConfig) -> None:
        for group in self.new_groups(model):
            self.groups[group.name] = group
            self.start_group(group)

    def start_group(self, group: EngineGroup) -> None:
        """Start a configured model, or leave it released until its first request: autostart =
        false, or no room beside those started before it (models start in config order), or
        larger than its memory budget alone (its requests are refused)."""
        if group.refuse_if_unfit():
            return
        if not group.cfg.autostart:
            group.park()
        elif (no_room := self.budget.room_at_start(group)) is not None:
            log.info("model %s: %s; released until its first request", group.name, no_room)
            group.park(no_room)
        else:
            group.start()

    async def remove_model(self, name: str) -> None:
        """Unload a model: each of its groups drained and stopped, together."""
        await asyncio.gather(*(self.remove_group(g) for g in self.groups_of(name)))

    async def remove_group(self, group: EngineGroup) -> None:
        if self.groups.get(group.name) is not group:
            return  # removed meanwhile (an unload during a reload's roll)
        await group.drain(self.settings.drain_timeout_s)
        await group.stop(self.settings.stop_grace_s)
        if self.groups.get(group.name) is not group:
            return  # another unload (or a reload) removed it meanwhile: a new group under that name stays
        del self.groups[group.name]
        self.standbys.forget_model(group.name)
        group.remove()  # publishes `removed`: gateways drop the group

    async def restart_group(self, old: EngineGroup, model: C.ModelConfig) -> None:
        """A replica's changed configuration where no new group fits beside it: drain and stop it,
        start it again (cold: new interpreters) under its name, its requests held meanwhile."""
        await old.drain(self.settings.drain_timeout_s)
        await old.stop(self.settings.stop_grace_s)
        self.standbys.forget_model(old.name)
        group = self.groups[old.name] = EngineGroup(model, self, old.replica, old.name)
        self.start_group(group)

    async def state_in(self, group: EngineGroup, states: frozenset[GroupState], timeout_s: float) -> bool:
        """Until the group's state is one of ``states`` (told by its state changes); False past
        ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while group.state not in states:
            fut = loop.create_future()
            self.state_waiters.setdefault(group, []).append(fut)
            try:
                # event-proof: a bound on one reload's (or restart's) wait for a group it started.
                await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return False
        return True

    def hold_s(self, model: C.ModelConfig) -> float:
        """How long a start of ``model`` may take before a reload or restart stops waiting for it:
        what a request would wait for it (its hold timeout, else the gateways')."""
        return model.hold_timeout_s or self.gateway_cfg.hold_timeout_s

    def request_reload(self) -> None:
        """SIGHUP: as `servectl reload`, audited as the signal (its sender is not known here)."""
        self.control.record(None, "reload (SIGHUP)", "accepted")
        if not self.shutting_down:
            self.tasks.start(self.reload(), "reload (SIGHUP)")

    async def reload(self) -> tuple[bool, str]:
        """Re-read the file, re-apply the start options, and apply only the difference; one
        reload at a time (a second waits for the first: each compares with what is served)."""
        async with self.reload_lock:
            return await self._reload()

    async def _reload(self) -> tuple[bool, str]:
        notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}\nSTATUS=reloading")
        try:
            # Exactly the file it started with (none: the defaults), wherever reload is asked from.
            new, _ = C.effective_config(self.config_path, self.overrides, search=False)
        except C.ConfigError as exc:
            log.error("reload refused: %s", exc)
            notify("READY=1\nSTATUS=reload refused: config error")
            return False, str(exc)
        bad = check_model_paths(new, self.config_path, self.overrides)
        if bad:
            log.error("reload refused: %s", "; ".join(bad))
            notify("READY=1\nSTATUS=reload refused: config error")
            return False, "\n".join(bad)
        # A model is changed while any of its groups differs from the file (a roll that stopped short).
        wanted = {m.name: m for m in new.models}
        served: dict[str, C.ModelConfig] = {}
        for g in self.groups.values():
            if g.model not in served or g.model_cfg != wanted.get(g.model):
                served[g.model] = g.model_cfg
        plan = plan_reload(list(served.values()), self.gateway_cfg, new)
        clash = self.name_taken_by_adapter([*plan.added, *plan.changed])
        if clash is not None:
            log.error("reload refused: %s", clash)
            notify("READY=1\nSTATUS=reload refused: a name is a LoRA adapter's")
            return False, clash
        log.info("reload: %s", plan.summary())
        self.settings = plan.manager
        self.budget.cap = plan.manager.max_loaded_models
        if plan.manager.memory_budget and not self.budget.totals:
            self.budget.totals = device_totals(self.start_gate.accelerator)
        self.budget.set_memory(C.memory_budget(plan.manager))
        for group in self.groups.values():  # a model too large for the old budget may fit the new
            if group.unfit is not None:
                group.refuse_if_unfit()
        self.budget.retry()  # a raised (or removed) cap or budget lets waiting models start
        self.configured = {m.name: m for m in new.models}
        for name in plan.removed:
            await self.remove_model(name)
        for model in plan.added:
            self.add_model(model)
        ways = {}
        for model in plan.changed:  # one after another: one start at a time per device anyway
            ways[model.name] = await self.rollout.apply(model)
        for group in self.groups.values():  # [manager] warm_standby may have changed
            if self.settings.warm_standby:
                self.standbys.refill(group)
            else:
                self.standbys.release_model(group.name)
        if plan.gateway is not None:
            try:
                await self.gateways.replace(plan.gateway)
            except OSError as exc:  # the new address cannot be bound: the gateways keep the old one
                message = self.bind_failure(plan.gateway, exc)
                log.error("reload: %s", message)
                notify("READY=1\nSTATUS=serving; reload: gateway address refused")
                return False, f"gateway not reloaded: {message}"
        notify("READY=1\nSTATUS=serving")
        return True, f"reloaded: {plan.summary()}" + "".join(f"; {name} {way}" for name, way in ways.items())

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
        except Exception:
            log.exception("shutdown failed; killing what is left")
            self.exit_code = self.exit_code or int(ExitCode.TASK_DIED)
        finally:
            try:
                self.kill_strays()
            finally:
                self.state = ManagerState.STOPPED
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
            if not self.shutting_down:
                loop.call_later(interval, ping)  # event-proof: systemd's watchdog (above)

        ping()

    def kill_strays(self) -> None:
        """Kill grandchildren reparented to us (we are their subreaper)."""
        killed = kill_instance(self.instance, exclude={os.getpid()})  # by pidfd: a reused pid is never hit
        if killed:
            log.warning("killed strays of this tree: %s", killed)
        self.reap_strays()

    def reap_strays(self) -> None:
        """Reap exited orphans reparented to us; our own children are reaped through pidfds."""
        ours = {c.popen.pid for g in self.groups.values() for c in g.children if c.popen} | self.standbys.pids() | \
            self.gateways.pids()
        me = os.getpid()
        for pid in all_pids():
            if pid not in ours and ppid_of(pid) == me and is_zombie(pid):
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

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
        self.start_watchdog()
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
        control_tasks = [self.tasks.keep(factory, name, give_up=self.task_died)
                         for name, factory in self.control.loops()]
        for group in self.groups.values():
            self.start_group(group)
        self.gateways.start_all()
        await self.done.wait()
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
