"""The manager's spans (tracing on): each model's restarts, evictions, releases, wakes and rolls.

``GroupSpans`` reads the engine groups' state changes (the one stream every transition already
goes through: ``ManagerDaemon.on_group_change``) and makes an episode of each: a span opened by
the state that begins it and ended by the one that ends it, named for what it was. No tracer, no
instance: the daemon keeps None with tracing off. ``Rollout`` times a rolling reload with
``roll``. Pure logic over a tracer (a test gives it its own; tests/test_manager_spans_unit.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

from servectl.wire.vocab import ModelState as S

# An episode's end: the states that close it, and whether each is its success.
_ENDS = {
    "servectl.restart": {S.READY: True, S.FAILED: False, S.STOPPED: True, S.RELEASED: True, S.REMOVED: True},
    "servectl.evict": {S.RELEASED: True, S.ASLEEP: True, S.STOPPED: True, S.REMOVED: True, S.READY: False,
                       S.EXITED: False},
    "servectl.release": {S.RELEASED: True, S.ASLEEP: True, S.STOPPED: True, S.REMOVED: True, S.READY: True,
                         S.EXITED: False},
    "servectl.wake": {S.READY: True, S.EXITED: False, S.STOPPING: False},
    "servectl.start": {S.READY: True, S.EXITED: False, S.STOPPING: False},
    "servectl.stop": {S.STOPPED: True, S.RELEASED: True, S.REMOVED: True, S.EXITED: True},
}


def episode(was: S | None, now: S, reason: str | None, open_: str | None) -> str | None:
    """The span a change begins, or None (it begins none, or one is open that it belongs to)."""
    if now is S.EXITED and open_ in (None, "servectl.start", "servectl.wake"):
        return "servectl.restart"  # a member died (an open start or wake ends with it, in error)
    if open_ is not None:
        return None
    if now is S.RELEASING:
        return "servectl.evict" if (reason or "").startswith("evicted") else "servectl.release"
    if now is S.STARTING:
        return "servectl.wake" if was in (S.RELEASED, S.ASLEEP) else "servectl.start"
    if now in (S.DRAINING, S.STOPPING) and was is S.READY:
        return "servectl.stop"
    return None


class GroupSpans:
    def __init__(self, tracer: Any):
        self.tracer = tracer
        self.states: dict[str, S] = {}  # group -> its last state seen
        self.open: dict[str, tuple[str, Any]] = {}  # group -> (span name, span)

    def changed(self, group: str, model: str, state: S, reason: str | None, incarnation: str) -> None:
        was = self.states.get(group)
        self.states[group] = state
        if state is S.REMOVED:
            self.states.pop(group, None)
        name, span = self.open.get(group, (None, None))
        if span is not None:
            span.add_event(str(state), {"servectl.reason": reason or ""})
            ends = _ENDS[name]
            if state in ends:
                self._end(group, state, ends[state], reason, incarnation)
                name = None
        begins = episode(was, state, reason, name)
        if begins is not None:
            if name is not None:  # a start or a wake that a member's death ends
                self._end(group, state, False, reason, incarnation)
            self.open[group] = (begins, self.tracer.start_span(begins, attributes={
                "gen_ai.request.model": model, "servectl.replica": group, "servectl.reason": reason or "",
                "servectl.incarnation": incarnation}))

    def _end(self, group: str, state: S, ok: bool, reason: str | None, incarnation: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        _, span = self.open.pop(group)
        span.set_attribute("servectl.end_state", str(state))
        if incarnation:
            span.set_attribute("servectl.new_incarnation", incarnation)
        if not ok:
            span.set_status(Status(StatusCode.ERROR, f"{state}: {reason or ''}"[:200]))
        span.end()

    def roll(self, model: str):
        """A span around a rolling reload of one model."""
        return self.tracer.start_as_current_span("servectl.roll", attributes={"gen_ai.request.model": model})


def roll_span(spans: GroupSpans | None, model: str):
    return spans.roll(model) if spans is not None else contextlib.nullcontext()
