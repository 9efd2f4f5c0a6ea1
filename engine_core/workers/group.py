"""The engine's handle on its workers: calls in flight, their replies and the reply deadline.

No vLLM and no torch here (``WorkerGroupExecutor`` in ``executor.py`` is the vLLM
side), so the call logic is tested on its own against a worker double
(tests/test_executor_unit.py).

Calls. ``send`` signs one call per worker, all before any reply is awaited
(``init_device`` is a rendezvous between ranks), and returns a
``PendingCall``, a lock-free stand-in for a ``concurrent.futures.Future``. Several calls may be in
flight at once (vLLM's batch queue keeps two steps outstanding under async
scheduling). Workers answer in the order they were called, and the futures
settle in that order too: a reply that arrives for another outstanding call
than the one being waited for is kept in that call (never dropped); a call
whose replies are all in settles only once every older call has settled.
Replies for a call id that is not outstanding (an abandoned call) are dropped
and logged.

The deadline. Waiting is done by whoever asks a future for its result (the
engine's one thread). The only deadline in the engine process is the one of
the oldest outstanding call, armed when that call becomes the oldest (at its
send if nothing was outstanding, else when its predecessor settled): a worker
starts a call only after finishing the previous one, so a younger call's
clock does not run while an older one holds the worker. Its length comes
from ``StepDeadline`` (step_deadline.py): a multiple of the recent step
times once the engine is warm, the generous ``reply_timeout_s`` where a call
can legitimately be slow; each step that settles feeds it, and a changed
deadline is published (``on_deadline``). Past the deadline the group is
hung: every outstanding call fails with ``WorkerHung`` and the engine exits
so the manager restarts the group. Nothing waits while nothing is in flight.

The connection to each rank (its peer checked against the rank's pidfd) and
freezing are ``WorkerProcesses``, a part of ``WorkerGroup`` (processes.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from engine_core.workers.link import FrameError, FrameReader, read_available, send_frames
from engine_core.workers.pending_call import PendingCall, WorkerHung
from engine_core.workers.processes import WorkerProcesses
from engine_core.workers.signing import BadSignature, Signer
from engine_core.workers.spin import ENGINE_SPIN_ENV, QUEUED_SPIN_LEAD_S, spin_seconds
from engine_core.workers.step_deadline import StepDeadline
from engine_core.workers.tokens_reply import BadTokensReply, TokensReplyCodec
from servectl.wire.worker import STEP_METHODS

log = logging.getLogger("engine_core.executor")

def method_name(method: Any) -> str:
    return method if isinstance(method, str) else "<callable>"


@dataclass
class WorkerGroup(WorkerProcesses):
    """The engine's handle on its workers; set before LLMEngine is built. Its connections to
    the ranks and their freezing are ``WorkerProcesses`` (processes.py)."""

    worker_paths: list[str]
    pidfds: list[int]
    signer: Signer
    reply_timeout_s: float
    distributed_init_method: str
    on_freeze_change: Callable[[bool], None] = lambda frozen: None
    # The step deadline, when it changed (by a fifth or more) once the engine is warm.
    on_deadline: Callable[[float], None] = lambda seconds: None
    # Called before each wait for a reply: the engine processes the last step's outputs
    # while the workers run this one (engine_core/step_halves.py), and takes in the
    # requests that came meanwhile.
    while_waiting: Callable[[], None] = lambda: None
    # While set (wake_on), a message on this socket ends a wait for the workers early, so
    # that while_waiting runs again: the engine's gateway socket during a step.
    waker: Any = None
    _registered_waker: Any = None  # the waker kept registered with wake_poller
    step_floor_s: float = 5.0
    step_multiple: float = 20.0
    # Spin (poll without blocking) this long for a reply before blocking in the kernel:
    # SERVECTL_ENGINE_SPIN_US (spin.py); 0 blocks at once.
    spin_s: float = field(default_factory=lambda: spin_seconds(ENGINE_SPIN_ENV))
    frozen: bool = False
    # Connect only to the process behind each rank's pidfd (where one is given): SO_PEERCRED.
    check_peers: bool = True
    refused_peers: int = 0  # connections refused: their peer was not that rank's worker
    _refusals_logged: set = field(default_factory=set)  # (rank, pid) already logged
    # Ranks on other hosts (a model spread over hosts): they dial ``remote_listener`` (TCP,
    # bound by the manager) and prove the group key (remote.py); every reply of theirs signed.
    remote_ranks: frozenset[int] = frozenset()
    remote_listener: socket.socket | None = None
    dead_after_s: float = 6.0  # how soon the kernel gives up on a silent host (TCP keepalive)
    # Each rank's index among its host's ranks (vLLM's local_rank); None: the rank itself.
    local_ranks: list[int] | None = None
    # Each rank's rendezvous where they differ (a spread group: one URL, a per-host tail that
    # keeps vLLM's CPU shared-memory all-reduce within a host); None: distributed_init_method.
    init_methods: list[str] | None = None
    # The group's time (its deadlines, spins and step times) and its start-up retry's sleep:
    # the real ones; tests give a simulated clock (tests/hop_fixtures.py) so that no wait of
    # theirs is measured against the wall clock.
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    # One Unix stream socket per rank (link.py), connected at the first call.
    sockets: list[socket.socket | None] = field(default_factory=list)
    readers: list[FrameReader] = field(default_factory=list)
    # Outstanding calls by id, oldest first.
    outstanding: "OrderedDict[int, PendingCall]" = field(default_factory=OrderedDict)
    # Steps (execute_model calls) sent, and those sent while an earlier call was
    # still unanswered: the overlap async scheduling buys.
    steps: int = 0
    overlapped_steps: int = 0
    dropped_replies: int = 0
    # Replies that came as sampled tokens only (tokens_reply.py) and as signed pickles.
    token_replies: int = 0
    signed_replies: int = 0
    # Decodes unsigned TokensReply frames into vLLM's ModelRunnerOutput (set by the executor,
    # which imports vLLM); while None, an unsigned reply is rejected like a bad signature.
    tokens_codec: TokensReplyCodec | None = None
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    deadlines: StepDeadline | None = None
    published_deadline: float | None = None

    def __post_init__(self) -> None:
        if self.deadlines is None:
            self.deadlines = StepDeadline(self.reply_timeout_s, self.step_floor_s, self.step_multiple)

    @property
    def ranks(self) -> int:
        return len(self.worker_paths)

    def wake_on(self, sock: Any) -> None:
        """While ``sock`` is set, a message on it ends a wait for the workers early (None: only
        replies, the deadline and signals do), so that ``while_waiting`` runs again and takes it in.

        The engine sets its gateway socket for the length of a step only: requests that arrive
        while the model runs are taken in then, off the step's path, and never while the
        workers are busy with a call that is not a step (loading, sleeping). The socket stays
        registered with ``wake_poller`` (used only while a waker is set), so setting and
        clearing it each step costs no poller change."""
        if sock is not None and sock is not self._registered_waker:
            if self._registered_waker is not None:
                self.wake_poller.unregister(self._registered_waker)
            self.wake_poller.register(sock, zmq.POLLIN)
            self._registered_waker = sock
        self.waker = sock

    def reply_waiting(self) -> bool:
        """Whether a worker has sent something not read yet (a reply is in): no blocking."""
        return bool(self.poller.poll(0))

    # ---- calls ----------------------------------------------------------------
    def call(self, method: str | bytes, args: tuple, kwargs: dict | None,
             per_rank_args: list[tuple] | None = None, output_rank: int | None = None,
             timeout: float | None = None) -> list[Any]:
        """Send and wait: the per-rank values (FIFO behind anything already in flight)."""
        return self.send(method, args, kwargs, per_rank_args, output_rank, timeout).result()

    def send(self, method: str | bytes, args: tuple, kwargs: dict | None,
             per_rank_args: list[tuple] | None = None, output_rank: int | None = None,
             timeout: float | None = None, pick: int | None = None, tokens: int | None = None,
             kinds: frozenset[str] = frozenset()) -> PendingCall:
        """Send a call to every worker (all before any reply: TP calls are rendezvous).

        ``tokens`` and ``kinds``: the step's scheduled tokens and what its batch needs of the
        sampler (a step call), which size its deadline."""
        self.thaw()
        name = method_name(method)
        if name in STEP_METHODS:
            self.steps += 1
            if self.outstanding:
                self.overlapped_steps += 1
        call_id = next(self._ids)
        timeout_s = timeout if timeout is not None else self.deadlines.timeout_for(tokens, kinds)
        send_by = self.clock() + timeout_s
        for rank in range(self.ranks):
            sock = self.sockets[rank] or self._connect_rank(rank, send_by)
            rank_args = per_rank_args[rank] if per_rank_args is not None else args
            frames = self.signer.dumps((call_id, method, rank_args, kwargs, output_rank))
            try:
                # Normally buffered at once; a big message waits for the worker to read it, not
                # past this call's deadline (a worker that reads nothing that long is hung).
                send_frames(sock, frames, timeout=max(0.0, send_by - self.clock()))
            except TimeoutError:
                self._lost(f"worker rank {rank} took no call {name} within {timeout_s:g}s")
            except OSError as exc:
                self._lost(f"worker rank {rank}'s connection failed sending {name}: {exc}")
        call = PendingCall(self, call_id, name, self.ranks, timeout_s, pick, tokens, kinds)
        if not self.outstanding:
            self._arm(call)
        self.outstanding[call_id] = call
        return call

    def _arm(self, call: PendingCall) -> None:
        """The call is the oldest in flight: its clock starts."""
        call.armed_at = self.clock()
        call.deadline = call.armed_at + call.timeout_s
        if call.tokens is not None and self.deadlines.warm:
            last = self.published_deadline
            if last is None or abs(call.timeout_s - last) >= 0.2 * last:
                self.published_deadline = call.timeout_s
                self.on_deadline(call.timeout_s)

    def wait_once(self) -> None:
        """Receive what the workers have sent, waiting no later than the oldest call's deadline.

        Returns early, having read nothing, when the waker has a message (wake_on) or a
        signal came: the caller (``PendingCall.result``) calls again, ``while_waiting`` first."""
        if not self.outstanding:
            raise RuntimeError("nothing is in flight")
        self.while_waiting()
        self.deadlines.refresh()  # the step deadline's percentiles, off the step's path
        head = next(iter(self.outstanding.values()))
        poller = self.poller if self.waker is None else self.wake_poller
        ready: dict = {}
        spin_from = self._spin_from(head)
        if spin_from is not None:
            now = self.clock()
            if now < spin_from:
                # event-proof: a wait in the kernel until the reply is due, while a call is in flight;
                # the spin below starts then (a long step is not spun through from its start).
                ready = dict(poller.poll(int((min(spin_from, head.deadline) - now) * 1000)))
            end = self.clock() + self.spin_s
            while not ready and self.clock() < end:
                # event-proof: a bounded spin only while a call is in flight (its reply is due
                # now); after spin_s it blocks below, and nothing spins while idle.
                ready = dict(poller.poll(0))
                if not ready:
                    os.sched_yield()  # whatever else is runnable gets the core (as vLLM's shm ring reader)
        if not ready:
            remaining_ms = max(0, int((head.deadline - self.clock()) * 1000 + 0.999))
            # event-proof: a wait in the kernel for a worker's reply, bounded by the
            # deadline of the oldest call in flight (armed only while one is).
            ready = dict(poller.poll(remaining_ms))
        if self.waker is not None:
            ready.pop(self.waker, None)
        if not ready:
            if self.clock() >= head.deadline:  # (a waker that never falls silent included)
                self._hung(head)
            return  # woken early (the waker, a signal): wait again
        for fd in ready:
            rank = self.rank_of[fd]
            try:
                replies, hung_up = read_available(self.sockets[rank], self.readers[rank])
            except FrameError as exc:
                self._lost(f"worker rank {rank} sent what is not a reply ({exc})")
            for frames in replies:
                self._on_reply(rank, frames)
            if hung_up:
                self._settle_in_order()  # what it answered before it went still counts
                if self.outstanding:
                    self._lost(f"worker rank {rank} closed its connection")
                self._drop_rank(rank)
        self._settle_in_order()

    def _spin_from(self, head: PendingCall) -> float | None:
        """When to start spinning for ``head``'s reply (monotonic), or None: no spin.

        A step whose size has a history is spun for from a little before its usual earliest
        reply (the 10th percentile): a short step from about its start, a long one (a big
        batch, a GPU's larger model) only around its end. How far ahead depends on what the
        reply holds up. With no call behind it the workers idle until the engine answers, so
        the spin starts half of it ahead. With another call already sent behind it (the next
        step, in async scheduling's batch queue) the workers go straight on to that one and the
        engine has a whole step to send the one after: a wake-up in the kernel costs nothing
        there, and spinning through the step only takes the core the gateway and its clients
        share with the engine, so the spin starts just ahead (QUEUED_SPIN_LEAD_S). Other
        calls, and steps of a size not seen often yet, from now."""
        if not self.spin_s:
            return None
        if head.tokens is None:
            return self.clock()
        earliest = self.deadlines.earliest(head.tokens)
        if earliest is None:
            return self.clock()
        lead = self.spin_s / 2 if len(self.outstanding) < 2 else min(self.spin_s / 2, QUEUED_SPIN_LEAD_S)
        return head.armed_at + max(0.0, earliest - lead)

    def _hung(self, head: PendingCall) -> None:
        self._lost(f"worker rank(s) {sorted(head.waiting)} gave no reply to {head.method} "
                   f"within {head.timeout_s:g}s ({len(self.outstanding)} call(s) in flight)")

    def _lost(self, why: str) -> None:
        """A worker is hung or gone: every call in flight fails and the engine exits (the manager restarts the group)."""
        exc = WorkerHung(why)
        calls = list(self.outstanding.values())
        self.outstanding.clear()
        for call in calls:
            call.set_exception(exc)
        self.close()
        raise exc

    def _on_reply(self, rank: int, frames: list[bytes]) -> None:
        try:
            # Signed; an unsigned one without a codec, or from another host (no peer check), is rejected.
            if frames[0] or self.tokens_codec is None or rank in self.remote_ranks:
                reply_id, ok, value = self.signer.loads(frames)
                self.signed_replies += 1
            else:
                reply_id, ok, value = self.tokens_codec.decode(frames[1])
                self.token_replies += 1
        except BadSignature as exc:
            log.warning("rejected reply from rank %d: %s", rank, exc)
            return
        except BadTokensReply as exc:
            self.signer.rejected += 1
            log.warning("rejected reply from rank %d: %s (%d rejected so far)", rank, exc, self.signer.rejected)
            return
        call = self.outstanding.get(reply_id)
        if call is None or rank not in call.waiting:
            self.dropped_replies += 1
            log.warning("dropped a reply from rank %d to call %r, which is not in flight", rank, reply_id)
            return
        call.waiting.discard(rank)
        if ok:
            call.values[rank] = value
        else:
            call.errors.append(f"rank {rank}: {value}")
            call.permanent = call.permanent or getattr(value, "permanent", None)

    def _settle_in_order(self) -> None:
        settled = False
        while self.outstanding:
            head = next(iter(self.outstanding.values()))
            if not head.complete:
                if settled:  # the next call's clock starts now that the worker is free for it
                    self._arm(head)
                return
            del self.outstanding[head.call_id]
            # A call whose reply came with its elder's (both read at once, as under async
            # scheduling while the engine was busy) was never the oldest: its time is unknown.
            if head.tokens is not None and not head.errors and head.deadline is not None:
                self.deadlines.observe(self.clock() - head.armed_at, head.tokens, head.kinds)
            head._settle()
            settled = True

    # ---- counters --------------------------------------------------------------
    def counters(self) -> str:
        return (f"{self.steps} step(s) sent, {self.overlapped_steps} sent before the previous reply arrived "
                f"(async scheduling overlap), {self.dropped_replies} stray repl(ies) dropped, "
                f"{self.token_replies} repl(ies) as sampled tokens, {self.signed_replies} as signed pickles, "
                f"{self.refused_peers} connection(s) refused (not the worker's process)")
