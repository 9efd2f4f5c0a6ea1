"""A call in flight to an engine group's workers: ``PendingCall``, and how it fails (vLLM-free).

``WorkerGroup.send`` (group.py) makes one per call and settles it
when every rank has answered, first in, first out. It quacks like the
``concurrent.futures.Future`` vLLM's engine core expects from an executor,
without a Future's locks (docs/decisions.md, "The step's path does as
little Python as it can").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("engine_core.executor")


class WorkerHung(RuntimeError):
    """A worker is hung or gone: every call in flight fails with it, and the engine exits so
    the manager restarts the group."""


class WorkerCallFailed(RuntimeError):
    """A call failed in one or more workers; ``permanent`` is the one-line reason
    if a worker judged its failure one a restart cannot fix (engine_core/load_errors.py)."""

    def __init__(self, message: str, permanent: str | None = None):
        super().__init__(message)
        self.permanent = permanent


class Waits(Protocol):
    """What a call needs of its group (``WorkerGroup``): one wait for the workers' replies,
    which settles the calls whose replies are all in."""

    def wait_once(self) -> None: ...


class PendingCall:
    """One call to every worker of the group; its result is the list of per-rank values.

    ``pick`` (a rank) makes the result that rank's value alone. ``result()``
    waits through the group (on the caller's thread) until this call settles;
    a timeout other than None is not supported (the group's deadline rules).

    It has the surface of a ``concurrent.futures.Future`` that vLLM's engine
    core uses (``result``, ``done``, ``exception``, ``add_done_callback``) but
    none of its locking: a group and its calls belong to the engine's one
    thread, and a Future's condition variable, made with every call and
    notified with every reply, is per-step work on the step's path.
    """

    _NOT_SET = object()

    def __init__(self, group: Waits, call_id: int, method: str, ranks: int, timeout_s: float,
                 pick: int | None, tokens: int | None = None, kinds: frozenset[str] = frozenset()):
        self.group = group
        self.call_id = call_id
        self.method = method
        self.timeout_s = timeout_s
        self.pick = pick
        self.values: list[Any] = [None] * ranks
        self.waiting = set(range(ranks))
        self.errors: list[str] = []
        self.permanent: str | None = None  # the first worker failure a restart cannot fix
        self.deadline: float | None = None  # armed when this call is the oldest outstanding
        self.armed_at = 0.0
        self.tokens = tokens  # a step's scheduled tokens; None for any other call
        self.kinds = kinds  # what the step's batch needs of the sampler (step_deadline.StepKinds)
        self._value: Any = self._NOT_SET
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["PendingCall"], Any]] = []

    @property
    def complete(self) -> bool:
        """Every rank has answered (it settles once every older call has too)."""
        return not self.waiting

    # ---- the Future surface ------------------------------------------------------
    def done(self) -> bool:
        return self._error is not None or self._value is not self._NOT_SET

    def running(self) -> bool:
        return not self.done()

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False  # a call sent to the workers cannot be taken back

    def result(self, timeout: float | None = None) -> Any:
        if timeout is not None:
            raise RuntimeError("PendingCall.result: the group's reply deadline applies, not a timeout")
        while not self.done():
            self.group.wait_once()
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except Exception as exc:  # noqa: BLE001 - what result() raises is the answer
            return exc
        return None

    def add_done_callback(self, fn: Callable[["PendingCall"], Any]) -> None:
        if self.done():
            self._call(fn)
        else:
            self._callbacks.append(fn)

    def set_result(self, value: Any) -> None:
        self._finish(value, None)

    def set_exception(self, exc: BaseException) -> None:
        self._finish(self._NOT_SET, exc)

    def _finish(self, value: Any, exc: BaseException | None) -> None:
        if self.done():
            raise RuntimeError(f"{self!r} settled twice")
        self._value, self._error = value, exc
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self._call(fn)

    def _call(self, fn: Callable[["PendingCall"], Any]) -> None:
        try:
            fn(self)
        except Exception:  # as concurrent.futures does: a callback's failure is logged, not raised
            log.exception("a callback of %r failed", self)

    # ---- the group's side -------------------------------------------------------------
    def _settle(self) -> None:
        if self.errors:
            self.set_exception(WorkerCallFailed(f"worker call {self.method} failed: " + "\n".join(self.errors),
                                                self.permanent))
        else:
            self.set_result(self.values[self.pick] if self.pick is not None else self.values)

    def __repr__(self) -> str:
        return f"<PendingCall {self.call_id} {self.method} waiting on ranks {sorted(self.waiting)}>"
