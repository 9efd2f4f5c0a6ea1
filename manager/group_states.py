"""An engine group's states: the transition table its one setter checks, and its members' states.

``GroupState`` is the wire's ``ModelState`` (a model's state is its group's); ``EngineGroup._enter``
(manager/group.py) allows only the changes ``TRANSITIONS`` lists and sets its members to
``MEMBER_STATE``'s. Pure tables: tests read them (tests/test_manager_unit.py).
"""

from __future__ import annotations

from manager.children import ChildState
from servectl.wire.vocab import ModelState

# The model's state is the group's: the wire's one spelling of it.
GroupState = ModelState


S = GroupState
TRANSITIONS: dict[GroupState, frozenset[GroupState]] = {
    S.STOPPED: frozenset({S.STARTING, S.RELEASED, S.REMOVED}),  # → released: autostart = false
    S.STARTING: frozenset({S.READY, S.EXITED, S.STOPPING}),
    S.READY: frozenset({S.DRAINING, S.STOPPING, S.EXITED, S.RELEASING}),
    S.DRAINING: frozenset({S.STOPPING, S.EXITED}),
    # → ready: the engine refused (busy); → stopping: it agreed to unload; → asleep: it slept.
    S.RELEASING: frozenset({S.READY, S.STOPPING, S.ASLEEP, S.EXITED}),
    S.STOPPING: frozenset({S.STOPPED, S.RELEASED}),  # → released: the stop of an unload
    S.RELEASED: frozenset({S.STARTING, S.STOPPING}),
    S.ASLEEP: frozenset({S.STARTING, S.STOPPING, S.EXITED}),  # → starting: woken (the same engine)
    # → released: a member of a releasing or sleeping group died; it comes back released, not awake.
    S.EXITED: frozenset({S.BACKOFF, S.FAILED, S.STOPPING, S.RELEASED}),
    # → released: it no longer fits its memory budget (refuse_if_unfit).
    S.BACKOFF: frozenset({S.STARTING, S.STOPPING, S.RELEASED}),
    S.FAILED: frozenset({S.STARTING, S.STOPPING, S.RELEASED}),
    S.REMOVED: frozenset(),
}
# What the members' own states become when the group enters a state (None: leave them).
MEMBER_STATE: dict[GroupState, ChildState | None] = {
    S.STOPPED: ChildState.STOPPED, S.STARTING: ChildState.STARTING, S.READY: ChildState.READY,
    S.DRAINING: None, S.STOPPING: ChildState.STOPPING, S.EXITED: None, S.BACKOFF: ChildState.BACKOFF,
    S.FAILED: ChildState.FAILED, S.REMOVED: None, S.RELEASING: None, S.RELEASED: ChildState.STOPPED,
    S.ASLEEP: ChildState.ASLEEP,
}
# IDLE_RELEASED (wire/vocab.py): where a model serves no request now but one will be served
# (held, then the model woken): settled for `servectl start`, available for /health.


class BadTransition(RuntimeError):
    pass
