"""The warm standby pool: the sole owner of every standby interpreter.

Once a group serves, each member gets one ``python -m engine_core.standby``
exec'd with that member's exact environment; it says ``L`` (it dies with the manager now),
imports vLLM, says ``W`` on a SOCK_SEQPACKET channel and sleeps. A restart ``take``s the member's standby
and ``hand_over``s the role (descriptors attached); the member ``adopt``s the
process. A standby made for another environment, or of a model being
unloaded, is released. One that dies is replaced after the restart policy's
backoff, never while its group is starting.

Standbys import at the lowest CPU and I/O priority (servectl/priority.py), and only while no
model serves (``pace``: a warming standby is stopped while any group that freezes is busy, and
goes on once every one is idle, frozen: even at SCHED_IDLE an import beside a serving model slowed
it ~15 % on 2 cores). ``hand_over`` continues the standby and gives every thread the manager's own
priority back before the role is sent. A roll passes the replaced group's standbys on to its
successor (``pass_on``): a standby is a warm interpreter, and the new group's members take them
where their environments match.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Protocol

import msgspec

from manager.children import Child, ChildState, RestartPolicy, Standby
from servectl import config as C
from servectl import priority
from servectl.wire.spawn import Role, log_file_name, standby_component
from servectl.wire.vocab import ModelState

log = logging.getLogger("manager")


class Staffed(Protocol):
    """What the pool reads of one engine group (manager/group.py's EngineGroup): its members
    and their environments."""

    name: str
    state: ModelState
    engine: Child
    workers: list[Child]

    @property
    def children(self) -> list[Child]: ...
    def member_envs(self) -> tuple[dict[str, str], list[dict[str, str]]]: ...


class PoolHost(Protocol):
    settings: C.ManagerConfig
    log_dir: Path
    shutting_down: bool

    def watch(self, child: Child) -> None: ...
    def unwatch(self, child: Child) -> None: ...
    def on_child_change(self, child: Child, detail: str) -> None: ...
    def group(self, model: str) -> Staffed | None: ...


class StandbyPool:
    def __init__(self, host: PoolHost):
        self.host = host
        self.waiting: dict[str, Standby] = {}  # member component -> its standby
        self.released: set[Standby] = set()  # told to go, not yet reaped
        self.timers: dict[str, asyncio.TimerHandle] = {}  # model -> pending refill
        self.policies: dict[str, RestartPolicy] = {}  # model -> standby deaths
        self.paused: set[Standby] = set()  # stopped mid-import while a model serves
        self.busy = False  # some model serves (pace)
        self.serving = priority.of()  # what a standby taking a role gets back: the manager's own
        if host.settings.warm_standby and not priority.may_raise_to(self.serving.nice):
            log.warning("standbys import at normal CPU priority (idle I/O only): leaving SCHED_IDLE needs "
                        "CAP_SYS_NICE or RLIMIT_NICE >= %d (systemd: LimitNICE=%+d)",
                        20 - self.serving.nice, self.serving.nice)

    # ---- queries -----------------------------------------------------------------
    def of_model(self, model: str) -> list[Standby]:
        return [s for s in self.waiting.values() if s.model == model]

    def pids(self) -> set[int]:
        return {s.popen.pid for s in [*self.waiting.values(), *self.released] if s.popen}

    # ---- filling ------------------------------------------------------------------
    def refill(self, group: Staffed) -> None:
        """One standby per member, exec'd once the group serves (never competing with its start)."""
        timer = self.timers.pop(group.name, None)
        if timer:
            timer.cancel()  # called early (the group became ready): this call does its work
        if not self.host.settings.warm_standby or group.state is not ModelState.READY or self.host.shutting_down:
            return
        engine_env, worker_envs = group.member_envs()
        for member in group.children:
            if member.component in self.waiting:
                continue
            component = standby_component(member.component)
            standby = Standby(member, self.host.log_dir / log_file_name(component), self.host.on_child_change,
                              self.on_exit)
            # A worker's standby loads torch, and with it OpenMP, for that rank: its rank's binding.
            env = engine_env if member is group.engine else worker_envs[group.workers.index(member)]
            standby.spawn_standby(env)
            self.waiting[member.component] = standby
            self.host.watch(standby)
            asyncio.get_running_loop().add_reader(standby.channel.fileno(), self._on_says, standby)

    def pace(self, busy: bool) -> None:
        """Some model serves (busy) or every one is idle: warming standbys wait, or go on."""
        if busy == self.busy:
            return
        self.busy = busy
        if busy:
            for standby in self.waiting.values():
                self._pause(standby)
        else:
            for standby in list(self.paused):
                self._go_on(standby)

    def _pause(self, standby: Standby) -> None:
        # Only once it said "L": stopped before its die_with_parent, it would outlive a killed manager.
        if standby.alive and standby.importing and standby.state is ChildState.STARTING and \
                standby not in self.paused:
            standby.signal(signal.SIGSTOP)
            self.paused.add(standby)

    def _go_on(self, standby: Standby) -> None:
        if standby in self.paused:
            self.paused.discard(standby)
            standby.signal(signal.SIGCONT)

    def _on_says(self, standby: Standby) -> None:
        try:
            said = standby.channel.recv(16)
        except BlockingIOError:
            return
        except OSError:
            said = b""
        if said == b"L":
            standby.importing = True
            if self.busy:
                self._pause(standby)  # (exec'd as its group became ready: it imports once all are idle)
        elif said == b"W":
            standby.set(ChildState.READY)
        else:  # it is going; its pidfd tells the rest
            self._hang_up(standby)

    def _hang_up(self, standby: Standby) -> None:
        """Stop listening to a standby's channel and close our end (it reads EOF if it still waits)."""
        channel, standby.channel = standby.channel, None
        if channel is not None:
            asyncio.get_running_loop().remove_reader(channel.fileno())
            channel.close()

    # ---- using ----------------------------------------------------------------------
    def take(self, member: str, env: dict[str, str]) -> Standby | None:
        """The member's standby if it was made for exactly this environment; else none (and it goes)."""
        standby = self.waiting.pop(member, None)
        if standby is None:
            return None
        if standby.env != env or not standby.alive:
            self._release(standby)  # made for another configuration, or gone
            return None
        return standby

    def hand_over(self, standby: Standby, member: Child, role: Role, fds: list[int]) -> bool:
        """Make a taken standby the member: send it the role, then watch it as the member."""
        self._go_on(standby)  # (a role is worth finishing the import for, at serving priority)
        if standby.alive and (failed := priority.restore(self.serving, standby.pid)):
            log.warning("%s: %d threads of its standby kept their standby priority", member.component, failed)
        sent = standby.alive and standby.send_role(msgspec.json.encode(role), fds)
        self._hang_up(standby)
        if not sent:
            self._release(standby)
            return False
        self.host.unwatch(standby)
        standby.read_output()  # what it said while warming stays in its own log
        standby.sink.close()
        member.adopt(standby)
        self.host.watch(member)
        log.info("%s: handed to its warm standby (pid %d)", member.component, member.pid)
        return True

    def pass_on(self, old: Staffed, new: Staffed) -> int:
        """A roll: the standbys of the group being replaced become its successor's, member by member
        (engine to engine, rank to rank); ``take`` still checks each one's environment. Returns how
        many passed. The old group serves on without standbys: it is drained once the new one is
        ready (if the new one fails, ``refill`` gives the old its own again)."""
        passed = 0
        for was, successor in [(old.engine, new.engine), *zip(old.workers, new.workers)]:
            standby = self.waiting.pop(was.component, None)
            if standby is None:
                continue
            if successor.component in self.waiting:  # (a new group has none; never two for one member)
                self._release(standby)
                continue
            standby.member, standby.model = successor.component, successor.model
            standby.component = standby_component(successor.component)
            self.waiting[successor.component] = standby
            passed += 1
        return passed

    # ---- letting go ---------------------------------------------------------------------
    def release_model(self, model: str) -> list[Child]:
        """Release a model's standbys; returns those still alive (to wait for)."""
        timer = self.timers.pop(model, None)
        if timer:
            timer.cancel()
        leaving = [self.waiting.pop(s.member) for s in self.of_model(model)]
        for standby in leaving:
            self._release(standby)
        return [s for s in leaving if s.alive]

    def _release(self, standby: Standby) -> None:
        self._hang_up(standby)
        standby.release()
        self._go_on(standby)  # a stopped process acts on its SIGTERM once continued
        if standby.alive:
            self.released.add(standby)

    def on_exit(self, standby: Child) -> None:
        assert isinstance(standby, Standby)
        self._hang_up(standby)
        self.paused.discard(standby)
        if standby in self.released:
            self.released.discard(standby)
            standby.set(ChildState.STOPPED, standby.last_exit or "")
            return
        if self.waiting.get(standby.member) is not standby:
            return
        del self.waiting[standby.member]
        standby.set(ChildState.EXITED, standby.last_exit or "")
        m = self.host.settings
        policy = self.policies.setdefault(standby.model, RestartPolicy(
            m.backoff_initial_s, m.backoff_max_s, m.crash_loop_count, m.crash_loop_window_s))
        delay = policy.record_exit(asyncio.get_running_loop().time())
        if delay is None:
            log.error("model %s: standbys keep dying (%s); restarts will be cold", standby.model, standby.last_exit)
            return
        log.warning("model %s: %s %s; a new one in %.1fs", standby.model, standby.component, standby.last_exit, delay)
        group = self.host.group(standby.model)
        if group is not None and standby.model not in self.timers:
            # event-proof: a one-shot backoff after a standby died, before its replacement.
            self.timers[standby.model] = asyncio.get_running_loop().call_later(delay, self.refill, group)

    def forget_model(self, model: str) -> None:
        """The model is gone for good (unloaded, or its configuration replaced)."""
        self.policies.pop(model, None)
