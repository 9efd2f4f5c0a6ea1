"""One engine group: an engine_core and its workers, started, stopped and restarted as a unit.

The group is the single owner of its state (``GroupState``), which is also the
model's state in status and events. Every change goes through ``_enter``,
which checks the transition table and publishes; ``_swap(expected, new)``
changes state only from the states it expects (llama-swap's swapState), so a
late event never drags a group backwards.

The group talks to its supervisor through a narrow interface (``GroupHost``):
settings, where logs go, the child environment, watching a child, publishing,
sending to its engine, waiting for exits, and the standby pool. Its members'
launch is manager/launch.py's, its LoRA calls in flight manager/lora_calls.py's;
what its engine says once it serves, its release and its wake are
manager/group_release.py's (``ReleaseAndWake``, mixed in: the same object, the
same one setter); its transition table manager/group_states.py's.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import time
from pathlib import Path
from typing import Protocol

import msgspec

from manager.budget import Budget
from manager.children import Child, ChildState, RestartPolicy
from manager.cluster import ClusterHead
from manager.group_release import ReleaseAndWake
from manager.group_states import MEMBER_STATE, TRANSITIONS, BadTransition, GroupState
from manager.launch import launch, member_envs
from manager.lora_calls import LoraCalls
from manager.standbys import StandbyPool
from manager.start_gate import StartGate
from servectl import config as C
from servectl.memory import has_accelerator
from servectl.tasks import Tasks
from servectl.wire import control as P
from servectl.wire.vocab import IDLE_RELEASED, ExitCode
from servectl.wire.spawn import ENGINE, WORKER, engine_component, group_name, log_file_name, worker_component

log = logging.getLogger("manager")


S = GroupState


class GroupHost(Protocol):
    """What an engine group needs from its supervisor (the Manager)."""

    settings: C.ManagerConfig
    gateway_cfg: C.GatewayConfig  # its max_body_bytes sizes the engine's frontend (EngineSpec)
    runtime_dir: Path
    log_dir: Path
    standbys: StandbyPool
    tasks: Tasks  # what the group starts in the background (an unload's stop)
    start_gate: StartGate  # one start at a time per device
    budget: Budget  # at most max_loaded_models loaded
    cluster: ClusterHead | None  # the other hosts, where a model is spread over hosts
    shutting_down: bool  # nothing starts any more

    def child_env(self, extra: dict[str, str]) -> dict[str, str]: ...
    def events_slot(self, group: "EngineGroup") -> int: ...
    def watch(self, child: Child) -> None: ...
    def on_child_change(self, child: Child, detail: str) -> None: ...
    def on_group_change(self, group: "EngineGroup") -> None: ...
    def send_to_engine(self, group: "EngineGroup", msg: P.ToEngine) -> None: ...
    async def wait_exit(self, children: list[Child], grace_s: float) -> None: ...


class EngineGroup(ReleaseAndWake):
    def __init__(self, cfg: C.ModelConfig, host: GroupHost, replica: int = 0, name: str | None = None):
        # The model as configured (every replica's), and this group's share of it: its devices.
        self.model_cfg = cfg
        self.cfg = msgspec.structs.replace(cfg, devices=C.replica_devices(cfg, accelerator=has_accelerator())[replica],
                                           env={**cfg.env, **(cfg.replica_env[replica] if cfg.replica_env else {})})
        self.replica = replica
        self.model = cfg.name  # what requests name
        self.events_slot: int | None = None  # its KV-events port slot, from its first start on
        # This group: its sockets, events, status (a rolled out one's differs from its replica's).
        self.name = name or group_name(cfg.name, replica, cfg.replicas)
        self.host = host
        m = host.settings
        self.policy = RestartPolicy(m.backoff_initial_s, m.backoff_max_s, cfg.crash_loop_count or m.crash_loop_count,
                                    m.crash_loop_window_s)
        self.engine = self._member(engine_component(self.name), ENGINE)
        # A model spread over hosts (cfg.hosts; manager/cluster.py): this host runs the first
        # share of its ranks, the other hosts' managers the rest, at this host's request.
        self.spread = len(cfg.hosts) > 1
        local = C.cluster.ranks_on(cfg, cfg.hosts[0]) if self.spread else range(cfg.tensor_parallel_size)
        self.workers = [self._member(worker_component(self.name, r), WORKER) for r in local]
        self.lost_remote: str | None = None  # why this incarnation's engine was killed: a remote rank or host
        self.state = GroupState.STOPPED
        self.reason: str | None = None
        self.incarnation = ""
        self.killed_hung = False
        self.frozen = False  # as the engine last reported (GroupFrozen)
        self.step_deadline_s: float | None = None  # as the engine last published it (StepDeadlineChanged)
        self.freezing = m.freeze_grace_s > 0
        self.restart_timer: asyncio.TimerHandle | None = None
        self.drained: asyncio.Future | None = None
        # This incarnation's engine reported a load failure a restart cannot fix (EngineFailed).
        self.permanent_failure: str | None = None
        # Idle release. The mode in force is the engine's word at ready (a configured
        # "sleep" falls back to "unload" where vLLM has no sleep mode).
        self.release_mode = self.idle_policy.mode
        self.idle_since: float | None = None  # wall clock; known while frozen (GroupFrozen)
        self.released_since: float | None = None
        self.device_memory_bytes: int | None = None  # as the engine last reported
        # What it holds per device, as its engine measured it at its last load (ChildReady), and
        # how; before that, the budget's estimate (manager/budget.py), made once.
        self.footprint_bytes: int | None = None
        self.footprint_source = ""
        self.estimate = None
        # Why it can never be loaded under the memory budget (larger than a device's alone):
        # its requests are refused (the gateways' 503) instead of held.
        self.unfit: str | None = None
        self.wake_wanted = False  # a gateway asked while the release was under way
        # The longest start (launch to ready) seen, and when the one under way began: a held
        # request's wait covers a start as long (the gateways' EngineLink.hold_s).
        self.start_s: float | None = None
        self.start_began: float | None = None
        self.config_id = C.output_identity(cfg)
        self.exited_from: GroupState | None = None  # the state a member's death interrupted
        self.stopping: asyncio.Future | None = None  # the stop under way, if any (done when over)
        # Its engine refused a release (a request in flight) since it was last idle: not asked
        # again to make room until its workers freeze (manager/budget.py).
        self.release_refused = False
        # The LoRA adapters it serves: the configured ones, plus those loaded at run time, less
        # those unloaded; each start's engine loads these (EngineSpec.loras), so they outlive
        # crashes, idle releases and reloads that keep the model.
        self.loras: list[C.LoraModule] = [lora for lora in cfg.lora_modules if isinstance(lora, C.LoraModule)]
        self.lora_calls = LoraCalls()  # changes sent to this incarnation's engine, not answered yet

    def _member(self, component: str, kind: str) -> Child:
        return Child(component, kind, self.name, self.host.log_dir / log_file_name(component),
                     self.host.on_child_change, self.on_member_exit)

    @property
    def children(self) -> list[Child]:
        return [self.engine, *self.workers]

    @property
    def idle_policy(self) -> C.IdlePolicy:
        return C.IdlePolicy.of(self.cfg, self.host.settings)

    # ---- the one setter ------------------------------------------------------------
    def _enter(self, new: GroupState, reason: str | None = None) -> None:
        if new not in TRANSITIONS[self.state]:
            raise BadTransition(f"model {self.name}: {self.state} → {new}")
        was, self.state = self.state, new
        if reason is not None or new in (S.READY, S.STARTING):
            self.reason = reason
        if new is not S.READY:
            self.frozen = False  # only a serving engine has frozen workers
            self.idle_since = None
        if new in (S.STARTING, S.READY):
            self.wake_wanted = False
            self.released_since = None
        elif new in IDLE_RELEASED and self.released_since is None:
            self.released_since = time.time()
        member_state = MEMBER_STATE[new]
        if member_state is not None:
            for child in self.children:
                if child.alive or new in (S.FAILED, S.STOPPED, S.BACKOFF, S.RELEASED):
                    child.set(member_state, reason or "")
        self.host.on_group_change(self)
        if was is S.STARTING:  # its start is over (ready, exited, stopping): the next on its devices may go
            self.host.start_gate.done(self)

    def _swap(self, expected: set[GroupState] | frozenset[GroupState], new: GroupState,
              reason: str | None = None) -> bool:
        """Enter ``new`` only from an expected state; False (and nothing changes) otherwise."""
        if self.state not in expected:
            log.debug("model %s: not %s → %s (is %s)", self.name, "/".join(expected), new, self.state)
            return False
        self._enter(new, reason)
        return True

    # ---- starting -------------------------------------------------------------------
    def member_envs(self) -> tuple[dict[str, str], list[dict[str, str]]]:
        """The engine's environment and each rank's (manager/launch.py); its standbys get the same."""
        return member_envs(self.cfg, self.host)

    def start(self) -> None:
        """Workers first (the engine gets their pidfds), each with the group key on a pipe; once
        no other model is starting on its devices (manager/start_gate.py)."""
        if self.state not in (S.STOPPED, S.BACKOFF, S.FAILED, S.RELEASED) or self.host.shutting_down:
            return
        if self.refuse_if_unfit():
            return
        waits = ((self.host.cluster.waits(self) if self.spread and self.host.cluster else None)
                 or self.host.budget.admit(self) or self.host.start_gate.admit(self))
        if waits is not None:
            if self.reason != waits:
                log.info("model %s: %s", self.name, waits)
                self.reason = waits  # said in its state's event: the decision and why
                self.host.on_group_change(self)
            return
        self._enter(S.STARTING)
        self.release_refused = False
        self.restart_timer = None
        self.permanent_failure = None
        self.incarnation = secrets.token_hex(6)
        self.killed_hung = False  # this incarnation's engine was killed as hung (kill_hung)
        self.step_deadline_s = None  # a new engine lifetime is cold until it publishes its own
        self.start_began = time.monotonic()
        idle = self.idle_policy
        self.release_mode = idle.mode
        if self.events_slot is None:
            self.events_slot = self.host.events_slot(self)
        self.lost_remote = None
        if self.spread and self.host.cluster:
            remote = self.host.cluster.remote_part(self)
            launch(self, self.host, idle, remote.key, remote)
            self.host.cluster.run_remote(self, remote, self.host.settings.worker_reply_timeout_s)
            return
        launch(self, self.host, idle, secrets.token_bytes(32))

    # ---- LoRA adapters ---------------------------------------------------------------------
    async def change_lora(self, msg: P.AddLora | P.RemoveLora, timeout_s: float) -> P.LoraDone | None:
        """Send the engine a LoRA change and wait for its answer (None: the engine went away or
        did not answer in time). The answer's adapter list is the group's from then on."""
        return await self.lora_calls.call(lambda m: self.host.send_to_engine(self, m), msg, timeout_s)

    def on_lora_done(self, msg: P.LoraDone) -> None:
        """The engine's answer: its adapters are the group's from now on (even one that came after
        its caller gave up waiting), and the gateways learn them from the model's event."""
        if msg.incarnation != self.incarnation:
            return
        if msg.ok:
            self.loras = list(msg.loras)
            self.host.on_group_change(self)
        self.lora_calls.answered(msg)

    # ---- exits ------------------------------------------------------------------------
    def on_engine_failed(self, incarnation: str, reason: str) -> None:
        """The engine cannot load the model for a reason a restart cannot fix; it exits next."""
        if incarnation == self.incarnation and self.state is S.STARTING:
            self.permanent_failure = reason
            log.error("model %s: %s (a restart cannot fix this)", self.name, reason)

    def _permanent(self) -> str | None:
        """Why this incarnation must not be restarted, or None: the engine said so
        (EngineFailed), or at least exited with ExitCode.PERMANENT."""
        if self.permanent_failure is None and self.engine.exit_code != ExitCode.PERMANENT:
            return None
        why = self.permanent_failure or f"{self.engine.component} could not load the model"
        return f"{why}; not restarted: a restart cannot fix this (details: servectl logs {self.engine.component})"

    def on_remote_lost(self, incarnation: str, why: str) -> None:
        """A rank on another host exited, or its host's link was lost: the group's fate is one.
        Its engine is killed now (it would notice the closed connection too, but not while
        idle); its exit restarts the group, once every host it needs is back."""
        if incarnation != self.incarnation or self.lost_remote is not None or not self.engine.alive:
            return
        if self.state not in (S.STARTING, S.READY, S.DRAINING, S.RELEASING, S.ASLEEP):
            return
        self.lost_remote = why
        log.warning("model %s: %s: restarting the group", self.name, why)
        self.engine.signal(signal.SIGCONT)
        self.engine.signal(signal.SIGKILL)

    def on_member_exit(self, child: Child) -> None:
        self.lora_calls.fail_all()
        if self.spread and self.host.cluster:
            self.host.cluster.stop_remote(self)  # a hung remote rank goes too; a new start makes new ones
        if self.state in (S.STOPPING, S.STOPPED, S.RELEASED):
            return  # asked for
        was = self.state
        hung = " (killed as hung: a gateway saw no output in time)" if self.killed_hung else ""
        if self.lost_remote is not None and child is self.engine:
            hung = f" (killed: {self.lost_remote})"
        if self._swap({S.STARTING, S.READY, S.DRAINING, S.RELEASING, S.ASLEEP}, S.EXITED,
                      f"{child.component} {child.last_exit}{hung}"):
            self.exited_from = was
            child.set(ChildState.EXITED, child.last_exit or "")
            if self.drained is not None and not self.drained.done():
                self.drained.set_result(False)  # nothing is left to drain
            for other in (c for c in self.children if c.alive):
                other.signal(signal.SIGCONT)  # a frozen member must not keep its SIGKILL pending
                other.signal(signal.SIGKILL)
        if any(c.alive for c in self.children) or self.state is not S.EXITED:
            return  # wait until every member is gone, then decide
        permanent = self._permanent()
        if permanent is not None:
            self.host.standbys.release_model(self.name)
            self._enter(S.FAILED, permanent)
            log.error("model %s failed: %s", self.name, self.reason)
            return
        delay = self.policy.record_exit(time.monotonic())
        if delay is None:
            self.host.standbys.release_model(self.name)
            self._enter(S.FAILED, f"{self.reason}; {self.policy.crash_loop_count} exits within "
                                  f"{self.policy.window_s:g}s")
            log.error("model %s failed: %s", self.name, self.reason)
            return
        if self.exited_from in (S.RELEASING, S.ASLEEP):
            # It was giving its memory back: it stays released (its standbys kept) until a request wakes it.
            log.warning("model %s: %s while %s; released (a request starts it)", self.name, self.reason,
                        self.exited_from)
            self._enter(S.RELEASED, self.reason)
            if self.wake_wanted:
                self.wake()
            return
        log.warning("model %s: %s; restarting in %.1fs", self.name, self.reason, delay)
        self._enter(S.BACKOFF, self.reason)
        # event-proof: a one-shot backoff after a crash, cancelled by a stop.
        self.restart_timer = asyncio.get_running_loop().call_later(delay, self.start)

    def kill_hung(self, incarnation: str) -> bool:
        """A gateway saw the group hung: kill the engine (thawed first); the exit restarts the group."""
        if incarnation != self.incarnation or self.state is not S.READY:
            return False
        for c in self.children:
            c.signal(signal.SIGCONT)
        self.killed_hung = True  # said in its exit's events: gateways send its unstarted requests nowhere
        self.engine.signal(signal.SIGKILL)
        return True

    # ---- stopping ---------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> None:
        """Let the engine finish what it has (no new requests), up to timeout_s."""
        if self.state is not S.READY or not self.engine.alive:
            return
        self.drained = asyncio.get_running_loop().create_future()
        self._enter(S.DRAINING)  # gateways stop sending new requests
        self.host.send_to_engine(self, P.Drain())
        # event-proof: drain_timeout_s bounds the drain; the engine's GroupDrained settles it at once.
        await asyncio.wait([self.drained], timeout=timeout_s)

    def on_drained(self, incarnation: str) -> None:
        if incarnation == self.incarnation and self.drained is not None and not self.drained.done():
            self.drained.set_result(True)

    async def stop(self, grace_s: float, keep_standbys: bool = False, then: GroupState = S.STOPPED) -> None:
        """Stop every member (then: stopped, or released for an unload); one stop at a time."""
        self.host.start_gate.forget(self)  # a start it waited for must not happen now
        self.host.budget.forget(self)
        while self.stopping is not None:  # another stop is under way (an unload, say): after it
            await self.stopping
        if self.state is then or (self.state is S.STOPPED and then is S.RELEASED):
            return
        done = self.stopping = asyncio.get_running_loop().create_future()
        try:
            if self.restart_timer:
                self.restart_timer.cancel()
                self.restart_timer = None
            leaving = [] if keep_standbys else self.host.standbys.release_model(self.name)
            alive = [c for c in self.children if c.alive]
            if self.spread and self.host.cluster:
                self.host.cluster.stop_remote(self)
            self._enter(S.STOPPING)
            # Thaw first: a SIGTERM stays pending on a stopped process.
            for c in alive:
                c.signal(signal.SIGCONT)
                c.signal(signal.SIGTERM)
            if alive or leaving:
                await self.host.wait_exit(alive + leaving, grace_s)
            self._enter(then)
        finally:
            self.stopping = None
            done.set_result(None)

    def remove(self) -> None:
        """The last word on a stopped group: its model is no longer served."""
        self.host.start_gate.forget(self)
        self.host.budget.forget(self)
        self._enter(S.REMOVED)

    async def restart(self, drain_timeout_s: float, grace_s: float) -> None:
        if self.state is S.REMOVED:
            return  # unloaded: a removed group never starts again (its name may be a new group's)
        await self.drain(drain_timeout_s)
        await self.stop(grace_s, keep_standbys=True)  # same configuration: the standbys fit
        self.policy.reset()
        self.start()

