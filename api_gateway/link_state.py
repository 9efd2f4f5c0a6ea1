"""The states of a gateway's link to one model's engine, and where each may go. Pure."""

from __future__ import annotations

import enum

from servectl.wire.vocab import ModelState


class LinkState(enum.Enum):
    # No engine to talk to yet: the manager is starting one. New requests wait.
    STARTING = "starting"
    # The manager announced an incarnation ready: our socket is open, our Hello sent. New requests wait.
    CONNECTING = "connecting"
    # The engine answered our Hello: requests are sent to it.
    READY = "ready"
    # The manager drains or stops the engine: requests in flight run on, new ones wait
    # for the next incarnation (a restart) or are refused (an unload).
    DRAINING = "draining"
    # The engine exited (backoff, stopped): socket closed, requests in flight failed, new ones wait.
    DOWN = "down"
    # A crash loop (the manager gave up) or a protocol mismatch: new requests are refused at once.
    FAILED = "failed"
    # The model was unloaded: requests in flight failed, waiters woken and refused. Terminal.
    REMOVED = "removed"
    # Idle release: the model gave its memory back (or, autostart = false, was never started).
    # New requests wait, and each one that starts waiting asks the manager to wake it (WakeModel).
    # Entered on the manager's "released"/"asleep", or at once when the engine bounces a request
    # (RequestError.released: it agreed to release, so nothing more is sent to it).
    RELEASED = "released"


S = LinkState
LIVE = frozenset(S) - {S.REMOVED}
# Our Hello may be unanswered in these: STARTING and DRAINING keep the socket they were entered with.
HELLO_PENDING = frozenset({S.CONNECTING, S.STARTING, S.DRAINING})

# Where each state may go. The manager's word moves a live link almost anywhere; what the
# table forbids is READY without an answered Hello (DOWN and FAILED have no socket, READY
# has had its answer) and anything after REMOVED.
TRANSITIONS: dict[LinkState, frozenset[LinkState]] = {
    # STARTING, DRAINING → READY: the gateway's snapshot (a StatusReply) and the events are two
    # sockets, so a "starting" or "stopping" older than the "ready" that made us connect can
    # arrive after it; the engine answering our Hello is the fresher fact.
    # STARTING → READY also when a sleeping engine woke: its Hello was answered before it slept.
    S.STARTING: frozenset({S.STARTING, S.CONNECTING, S.READY, S.DRAINING, S.DOWN, S.FAILED, S.REMOVED,
                           S.RELEASED}),
    # CONNECTING → CONNECTING: another incarnation was announced before the Hello was answered.
    S.CONNECTING: frozenset({S.CONNECTING, S.READY, S.STARTING, S.DRAINING, S.DOWN, S.FAILED, S.REMOVED,
                             S.RELEASED}),
    S.READY: frozenset({S.CONNECTING, S.STARTING, S.DRAINING, S.DOWN, S.FAILED, S.REMOVED, S.RELEASED}),
    S.DRAINING: frozenset({S.DRAINING, S.READY, S.CONNECTING, S.STARTING, S.DOWN, S.FAILED, S.REMOVED,
                           S.RELEASED}),
    S.DOWN: frozenset({S.DOWN, S.STARTING, S.CONNECTING, S.DRAINING, S.FAILED, S.REMOVED, S.RELEASED}),
    S.FAILED: frozenset({S.FAILED, S.STARTING, S.CONNECTING, S.DRAINING, S.DOWN, S.REMOVED, S.RELEASED}),
    # RELEASED → READY: "ready" for the incarnation whose Hello was answered (woken from sleep).
    S.RELEASED: frozenset({S.RELEASED, S.STARTING, S.CONNECTING, S.READY, S.DRAINING, S.DOWN, S.FAILED,
                           S.REMOVED}),
    S.REMOVED: frozenset(),
}

# The manager's states for a model (READY connects, REMOVED is EngineLink.remove;
# RELEASING changes nothing: the engine, which may still refuse, answers requests itself).
M = ModelState
MANAGER_STATES: dict[ModelState, LinkState] = {
    M.STARTING: S.STARTING,
    M.DRAINING: S.DRAINING,
    M.STOPPING: S.DRAINING,
    M.EXITED: S.DOWN,
    M.BACKOFF: S.DOWN,
    M.STOPPED: S.DOWN,
    M.FAILED: S.FAILED,
    M.RELEASED: S.RELEASED,  # unloaded: no engine (the socket is closed)
    M.ASLEEP: S.RELEASED,  # vLLM's sleep mode: the engine lives (the socket stays)
}

# What /health and /v1/models say for each state, in the manager's words. Where one link state
# stands for several of the manager's (DOWN, DRAINING, RELEASED), the manager's own word that
# put the link there is said instead (EngineLink.status). CONNECTING: the engine has not
# answered our Hello yet, so for the gateway it is still starting.
WORDS: dict[LinkState, ModelState] = {
    S.STARTING: M.STARTING,
    S.CONNECTING: M.STARTING,
    S.READY: M.READY,
    S.DRAINING: M.DRAINING,
    S.DOWN: M.STOPPED,
    S.FAILED: M.FAILED,
    S.REMOVED: M.REMOVED,
    S.RELEASED: M.RELEASED,
}
