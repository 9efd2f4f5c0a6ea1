"""CPU and I/O priority of a process's threads: the lowest the kernel offers while a warm standby
imports, and the serving priority back the moment it takes a role.

A standby lowers itself before it has a second thread (``lower``): every thread the import makes
(torch's, OpenMP's) inherits SCHED_IDLE and the idle I/O class. Scheduling policy, nice value and
I/O priority are per thread on Linux, so giving it back (``restore``) walks ``/proc/<pid>/task``;
the manager does that as it hands over a role (a standby still importing then finishes at serving
priority) and the standby again before it runs the role (a thread born meanwhile).

Leaving SCHED_IDLE, like lowering a nice value, needs CAP_SYS_NICE or an RLIMIT_NICE that allows
the serving nice value (systemd: ``LimitNICE=``); the I/O class needs nothing. Without that
permission (``may_raise_to``) a standby lowers its I/O only: a serving process left at idle CPU
priority would be far worse than a standby competing.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
from pathlib import Path
from typing import NamedTuple

# ioprio_set/ioprio_get: syscall numbers (no libc wrapper, nothing in os).
_IOPRIO_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31), "ppc64le": (273, 274), "s390x": (282, 283)}
IOPRIO_WHO_PROCESS = 1  # with a thread id: that thread
IOPRIO_CLASS_SHIFT = 13
IOPRIO_CLASS_IDLE = 3
IOPRIO_IDLE = IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT
CAP_SYS_NICE = 23
_libc = ctypes.CDLL(None, use_errno=True)


class Priority(NamedTuple):
    """One thread's: scheduling policy, nice value, I/O priority (class << 13 | level)."""

    policy: int
    nice: int
    ioprio: int

    @property
    def idle(self) -> bool:
        return self.policy == os.SCHED_IDLE


def _ioprio_call(index: int, *args: int) -> int:
    numbers = _IOPRIO_SYSCALLS.get(platform.machine())
    if numbers is None:
        return -1
    return _libc.syscall(numbers[index], *args)


def ioprio_of(tid: int = 0) -> int:
    """A thread's I/O priority; -1 where it cannot be read. 0 (no class set) is best effort by nice."""
    return _ioprio_call(1, IOPRIO_WHO_PROCESS, tid)


def set_ioprio(tid: int, value: int) -> bool:
    return _ioprio_call(0, IOPRIO_WHO_PROCESS, tid, value) == 0


def of(tid: int = 0) -> Priority:
    return Priority(os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid), ioprio_of(tid))


def may_raise_to(nice: int) -> bool:
    """Whether this process may leave SCHED_IDLE (or lower its nice value) back to ``nice``."""
    caps = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                caps = int(line.split()[1], 16)
    except OSError:
        pass
    return allows_nice(nice, resource.getrlimit(resource.RLIMIT_NICE)[0], caps)


def allows_nice(nice: int, rlimit_nice: int, effective_caps: int) -> bool:
    """The kernel's can_nice: CAP_SYS_NICE, or an RLIMIT_NICE of at least 20 - nice. Pure."""
    return (rlimit_nice == resource.RLIM_INFINITY or rlimit_nice >= 20 - nice
            or bool(effective_caps >> CAP_SYS_NICE & 1))


def lower() -> tuple[Priority, bool]:
    """The calling thread (so every thread it starts after) at the idle I/O class and, where it
    may come back, SCHED_IDLE. Returns the priority it had, and whether the CPU's was lowered."""
    before = of()
    cpu = may_raise_to(before.nice)
    if cpu:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    set_ioprio(0, IOPRIO_IDLE)
    return before, cpu


def threads(pid: int | str = "self") -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def restore(to: Priority, pid: int | str = "self") -> int:
    """Every thread of ``pid`` at ``to``; returns how many threads could not be set (gone ones
    are not counted). An I/O priority that could not be read (-1) is left as it is."""
    failed = 0
    for tid in threads(pid):
        try:
            if os.sched_getscheduler(tid) != to.policy:
                os.sched_setscheduler(tid, to.policy, os.sched_param(0))
            if os.getpriority(os.PRIO_PROCESS, tid) != to.nice:
                os.setpriority(os.PRIO_PROCESS, tid, to.nice)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError:
            failed += 1
            continue
        if to.ioprio >= 0 and ioprio_of(tid) != to.ioprio and not set_ioprio(tid, to.ioprio):
            failed += 1
    return failed
