"""The words the processes share: states, modes, event kinds and exit codes, each an enum.

msgspec encodes a member as its value and decodes only a value its enum has, so
a frame carrying a state no process knows is rejected at decode instead of
being compared later. The values are the words `servectl status --json`, the
events and the logs show. Product code compares members, never their spellings
(tests/test_wire_unit.py parses it and fails on a literal).
"""

from __future__ import annotations

import enum
from typing import Literal


class ModelState(enum.StrEnum):
    """A model's state: its engine group's (manager/group.py owns it and its transitions)."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"  # no new requests; in-flight ones finish (then stopping)
    STOPPING = "stopping"  # asked to exit: member exits are not crashes
    EXITED = "exited"  # a member died; the others are being killed
    BACKOFF = "backoff"  # all gone; a restart is scheduled
    FAILED = "failed"  # crash loop: stays until an operator's restart
    REMOVED = "removed"  # unloaded, or replaced by a reload: the group is gone for good
    # Idle release (docs/supervision.md). The engine said it has been idle for
    # idle_release_s and was asked to give its memory back; it may refuse (a
    # request came meanwhile: back to ready).
    RELEASING = "releasing"
    # Memory given back by stopping the group ("unload"; also a model with
    # autostart = false before its first request): no engine or worker
    # process, the warm standbys kept. A gateway's WakeModel starts it.
    RELEASED = "released"
    # Memory given back with vLLM's sleep mode ("sleep"): engine and workers
    # alive, weights offloaded or discarded. A gateway's WakeModel wakes it.
    ASLEEP = "asleep"


# A model's states in which its requests are served: ready, and idle-released ones,
# whose requests are held while the model is woken. `servectl start` and `status`
# count them as up, and so does the gateway's /health.
IDLE_RELEASED = frozenset({ModelState.RELEASED, ModelState.ASLEEP})
AVAILABLE = frozenset({ModelState.READY, *IDLE_RELEASED})


class ChildState(enum.StrEnum):
    """One supervised process's state (manager/children.py: ``Child.set``)."""

    STARTING = "starting"
    READY = "ready"
    FROZEN = "idle (frozen)"  # a worker its idle engine has SIGSTOPped
    ASLEEP = "asleep"  # a member of a group in vLLM's sleep mode (idle release)
    STOPPING = "stopping"  # asked to exit: its exit is not a crash
    STOPPED = "stopped"
    EXITED = "exited"
    BACKOFF = "backoff"
    FAILED = "failed"


# A child that is not running as it should: `servectl status` shows its last log lines.
CHILD_DOWN = frozenset({ChildState.FAILED, ChildState.BACKOFF, ChildState.EXITED})


class ManagerState(enum.StrEnum):
    STARTING = "starting"  # until every model and gateway is settled
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class IdleMode(enum.StrEnum):
    """How an idle model gives its memory back."""

    UNLOAD = "unload"  # stop the engine group (its warm standbys stay)
    SLEEP = "sleep"  # vLLM's sleep mode (engine and workers stay; weights offloaded or discarded)


# ModelStatus.release_mode: the mode in force, or "" where the model is never released.
ReleaseMode = Literal["unload", "sleep", ""]


class EventKind(enum.StrEnum):
    """``Event.kind`` and ``ChildStatus.kind``: a process kind, a model, or a published step deadline.

    The process kinds are also the first part of their component names (wire/spawn.py)."""

    ENGINE = "engine_core"
    WORKER = "worker"
    GATEWAY = "gateway"
    STANDBY = "standby"
    MODEL = "model"
    DEADLINE = "deadline"  # an engine's published step deadline (Event.step_deadline_s)
    HOST = "host"  # another host joined or left (a model spread over hosts; Event.host)


# Event.state of a DEADLINE event.
ARMED = "armed"
# Event.state: a child's state, a model's, or ARMED.
EventState = Literal[tuple(sorted({*(s.value for s in ModelState), *(s.value for s in ChildState), ARMED}))]


class ExitCode(enum.IntEnum):
    """Every exit status a servectl process gives on purpose, in one table."""

    OK = 0
    FAILURE = 1  # the CLI: what was asked did not happen (a model failed, a refusal)
    USAGE = 2  # the CLI and the manager: a usage or configuration error
    NOT_RUNNING = 3  # the CLI: no daemon (as systemctl, LSB)
    NO_PERMISSION = 4  # the CLI: the user may not do that (as systemctl, LSB)
    # The manager or a gateway: a long-lived task (following events, reading an engine, the
    # control loop) failed past its restarts (servectl/tasks.py Tasks.keep); its supervisor
    # (systemd, the manager) replaces the process.
    TASK_DIED = 69
    STEP_FAILED = 70  # the engine: a step failed; its state is unknown, the manager restarts the group
    HUNG = 75  # the engine: its worker group is hung; the manager restarts the group
    # The engine: a load failure a restart cannot fix (sysexits' EX_CONFIG); the
    # manager fails its group at once even if EngineFailed never arrived.
    PERMANENT = 78


# What the gateways say for a model with replicas (one engine group each) some of which serve
# while others do not (failed, down, restarting); it serves. No engine group is ever in it.
DEGRADED = "degraded"

# A model's name, as a regular expression: config (``NAME_PATTERN``) checks it, and file and
# socket names are built of it (servectl/paths.py), so it never holds ":" (component names:
# servectl/wire/spawn.py) or REPLICA_MARK.
MODEL_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}"

# Between a model's name and a replica's number in an engine group's name (``<model>@<n>``);
# never in a model's name (servectl.config.NAME_PATTERN).
REPLICA_MARK = "@"
