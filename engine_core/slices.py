"""Pooling requests taken in by slices: their inputs rendered and added a few at a time between steps.

A pooling request is one engine request per input (pooling_apis.py). Rendering
and adding them all in one go held the engine's only thread while a request of
many inputs went in (security issue 53: minutes, and gigabytes). ``Slicing``
keeps the pooling requests not wholly added yet and adds the next slice of
each whenever the engine takes requests in (intake.py: between two steps for
``ADD_BUDGET_S``, or while a step's model runs, until its reply is in), as
Generates are: the requests already running get their steps in between. A
slice is at least one input, so each call makes progress.
"""

from __future__ import annotations

from typing import Any, Callable

from engine_core.request_types import is_request_error


class Slicing:
    def __init__(self, engine, added: Callable[[str, list[str]], None], failed: Callable[[str, Exception], None]):
        self.engine = engine
        self.added = added  # (request id, the engine requests just added): routes their outputs
        self.failed = failed  # (request id, why): the request fails, what it added is dropped
        self.calls: dict[str, Any] = {}  # request id -> its PoolingCall, in arrival order

    def __bool__(self) -> bool:
        return bool(self.calls)

    def start(self, rid: str, call) -> None:
        self.calls[rid] = call

    def drop(self, rid: str) -> None:
        self.calls.pop(rid, None)

    def run(self, stop: Callable[[], bool]) -> None:
        """The next slice of each, oldest first, until ``stop()`` says so."""
        for rid, call in list(self.calls.items()):
            try:
                new = call.add_some(self.engine, stop)
            except BaseException as exc:  # noqa: BLE001 - vLLM's refusal of one input fails that request only
                if not is_request_error(exc):
                    raise
                self.calls.pop(rid, None)
                self.failed(rid, exc)
                continue
            self.added(rid, new)
            if call.complete:
                self.calls.pop(rid, None)
            if stop():
                return
