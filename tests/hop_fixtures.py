"""Fixtures for the engine ⇄ worker hop's unit tests (no vLLM, no torch).

Used by test_executor_unit.py, test_tokens_reply_unit.py and test_worker_link_unit.py
(a test module imports the fixtures it uses by name from here):

- ``ctx``: the ZeroMQ context of a test (the real worker loop's output thread and the
  waker sockets use it). At its end every group ``make_group`` made is closed and the
  context is terminated, which ends every worker loop ``start_worker`` started; a socket
  left open fails the test.
- ``make_group(ctx, tmp_path, ...)``: the engine's ``WorkerGroup`` on ``tmp_path/w<rank>``.
- ``doubles``: makes ``WorkerDouble``s (tests/worker_double.py), closed at the test's end.
- ``start_worker(ctx, path, wrapper, ...)``: the real worker loop (``serve``) on a thread,
  with a stand-in for vLLM's worker.
- ``SimClock``: the group's time in a test. No test of the hop compares a wall-clock
  difference with a constant: a group given a ``SimClock`` waits in simulated time (each
  of its polls that finds nothing moves the clock on by the poll's timeout, one turn of a
  spin by ``turn_s``) and the replies a test schedules on that clock are sent when the
  clock reaches them, synchronously, so what the group saw by then is deterministic on a
  machine however loaded.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from engine_core.workers.group import WorkerGroup
from engine_core.workers.link import listen_private
from engine_core.workers.signing import Signer
from engine_core.workers.tokens_reply import TokensReplyCodec
from worker_double import WorkerDouble

KEY = b"k" * 32

_GROUPS: list[WorkerGroup] = []


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    # Each socket is closed by the thread that uses it: the groups' here, the doubles' and
    # the worker loop's on their own threads (the doubles on close(), the loop on ETERM).
    while _GROUPS:
        _GROUPS.pop().close()
    t = threading.Thread(target=c.term, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "a socket was left open"


def make_group(ctx: zmq.Context, tmp_path: Path, ranks: int = 1, timeout: float = 5.0, pidfds=None,
               paths: list[Path] | None = None, codec: TokensReplyCodec | None = None,
               clock: "SimClock | None" = None, **kw: Any) -> WorkerGroup:
    """A connected group (closed at the test's end); ``clock``: installed on it."""
    g = WorkerGroup(worker_paths=[str(p) for p in paths or [tmp_path / f"w{r}" for r in range(ranks)]],
                    pidfds=pidfds or [], signer=Signer(KEY), reply_timeout_s=timeout,
                    distributed_init_method="unused", **kw)
    g.tokens_codec = codec
    g.connect()
    _GROUPS.append(g)
    if clock is not None:
        clock.install(g)
    return g


@pytest.fixture
def doubles(ctx, tmp_path):
    made = []

    def make(mode: str = "auto", rank: int = 0, **kw) -> WorkerDouble:
        d = WorkerDouble(tmp_path / f"w{rank}", Signer(KEY), mode=mode, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def call_method(wrapper: Any, method: str, args: tuple, kwargs: dict) -> Any:
    """vLLM's ``run_method`` for a stand-in worker: the method of that name."""
    return getattr(wrapper, method)(*args, **kwargs)


def start_worker(ctx: zmq.Context, path: Path, wrapper: Any, name: str = "worker-main",
                 before: Callable[[], None] = lambda: None, **serve_kw: Any) -> threading.Thread:
    """The real worker loop on ``path`` with ``wrapper`` for vLLM's worker; it ends with ``ctx``.

    ``before`` runs on the thread first (the socket is bound after it: a worker still starting)."""
    from engine_core.workers.worker import serve

    def run() -> None:
        before()
        serve(listen_private(path), ctx, Signer(KEY), 0, logging.getLogger("test-worker"), wrapper=wrapper,
              **{"run_method": call_method, **serve_kw})

    t = threading.Thread(target=run, daemon=True, name=name)
    t.start()
    return t


class SimClock:
    """A ``WorkerGroup``'s clock that moves only when the group waits.

    ``install(group)`` makes it the group's ``clock`` and ``sleep`` and wraps the group's two
    pollers. A poll that finds nothing ready moves the clock on by its timeout instead of
    blocking (a non-blocking one, a turn of a spin, by ``turn_s``), firing on the way what
    ``at`` / ``after`` scheduled for that time (a double's ``reply_now``: sent before the
    poll looks again); a blocking poll with nothing scheduled and no timeout fails the test
    instead of hanging it. ``polls`` lists the timeouts the group asked for.
    """

    def __init__(self, turn_s: float = 1e-3):
        self.now = 0.0
        self.turn_s = turn_s
        self.polls: list[int | None] = []
        self.sleeps: list[float] = []
        self._events: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = itertools.count()

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.advance(seconds)

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def advance(self, dt: float) -> None:
        """Move on by ``dt``, firing what falls due meanwhile."""
        target = self.now + dt
        while self._events and self._events[0][0] <= target:
            self._fire()
        self.now = target

    def _fire(self) -> None:
        t, _, fn, args = heapq.heappop(self._events)
        self.now = max(self.now, t)
        fn(*args)

    def install(self, group: WorkerGroup) -> "SimClock":
        group.clock = self
        group.sleep = self.sleep
        for poller in (group.poller, group.wake_poller):
            poller.poll = self._wrap(poller.poll)
        return self

    def _wrap(self, real: Callable[..., list]) -> Callable[..., list]:
        def poll(timeout: int | None = None) -> list:
            self.polls.append(timeout)
            ready = real(0)
            if ready:
                return ready
            step = self.turn_s if timeout == 0 else math.inf if timeout is None or timeout < 0 else timeout / 1000
            target = self.now + step
            while self._events and self._events[0][0] <= target:
                self._fire()  # what it sends is in the socket when the call returns
                ready = real(0)
                if ready:
                    return ready
            if step == math.inf:
                raise AssertionError("the group would wait forever: nothing is scheduled to answer it")
            self.now = target
            return []

        return poll
