"""The gateway's link to each engine: one owner of a model's availability.

A link follows the manager's events for its model. When the manager says the
engine is ready (with an incarnation id), the link opens a fresh DEALER to the
engine's socket and says hello; frames of an older incarnation are dropped.
When the engine exits, every in-flight request of that model is failed at once
and new requests wait (bounded) for the next incarnation instead of failing.

The link's state is a ``LinkState``, changed only by ``EngineLink._swap``
along ``TRANSITIONS``; the ``ready`` event follows it there.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from api_gateway.errors import EngineRequestError, EngineUnavailable
from servectl.wire import engine as EP

__all__ = ["EngineLink", "EngineRequestError", "EngineUnavailable", "LinkState", "RequestStream", "TRANSITIONS"]

log = logging.getLogger("api_gateway.engines")


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
    S.STARTING: frozenset({S.STARTING, S.CONNECTING, S.READY, S.DRAINING, S.DOWN, S.FAILED, S.REMOVED}),
    # CONNECTING → CONNECTING: another incarnation was announced before the Hello was answered.
    S.CONNECTING: frozenset({S.CONNECTING, S.READY, S.STARTING, S.DRAINING, S.DOWN, S.FAILED, S.REMOVED}),
    S.READY: frozenset({S.CONNECTING, S.STARTING, S.DRAINING, S.DOWN, S.FAILED, S.REMOVED}),
    S.DRAINING: frozenset({S.DRAINING, S.READY, S.CONNECTING, S.STARTING, S.DOWN, S.FAILED, S.REMOVED}),
    S.DOWN: frozenset({S.DOWN, S.STARTING, S.CONNECTING, S.DRAINING, S.FAILED, S.REMOVED}),
    S.FAILED: frozenset({S.FAILED, S.STARTING, S.CONNECTING, S.DRAINING, S.DOWN, S.REMOVED}),
    S.REMOVED: frozenset(),
}

# The manager's states for a model ("ready" connects, "removed" is EngineLink.remove).
MANAGER_STATES = {
    "starting": S.STARTING,
    "draining": S.DRAINING,
    "stopping": S.DRAINING,
    "exited": S.DOWN,
    "backoff": S.DOWN,
    "stopped": S.DOWN,
    "failed": S.FAILED,
}


@dataclass
class RequestStream:
    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    unfinished: int = 1


class EngineLink:
    def __init__(self, model: str, socket_path: str, ctx: zmq.asyncio.Context, identity: bytes):
        self.model = model
        self.socket_path = socket_path
        self.ctx = ctx
        self.identity = identity
        self.state = S.STARTING
        # Set exactly while READY or REMOVED: either way, waiting for the engine is over.
        self.ready = asyncio.Event()
        # What /health and /v1/models say while not READY: the manager's word for the model
        # ("starting", "stopping", "backoff", ...), or "failed"/"removed" when the link decided.
        self.word = "starting"
        self.reason: str | None = None
        self.incarnation = ""  # set once the engine answered our Hello
        self.connecting_to = ""  # the incarnation our socket was opened for
        self.max_model_len: int | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self.reader: asyncio.Task | None = None
        self.streams: dict[str, RequestStream] = {}
        self.waiting = 0  # held until the engine is ready
        self.admitted = 0  # held or running in the engine, not finished
        self.max_num_seqs = 0
        self.stats_waiters: list[asyncio.Future] = []

    @property
    def is_ready(self) -> bool:
        return self.state is S.READY

    @property
    def status(self) -> str:
        """"ready", or why not in the manager's words (what /health and /v1/models report)."""
        return "ready" if self.state is S.READY else self.word

    def _swap(self, expected: frozenset[LinkState], new: LinkState) -> bool:
        """The one place the state changes: only from an expected state, only along TRANSITIONS."""
        old = self.state
        if old not in expected or new not in TRANSITIONS[old]:
            log.warning("engine link %s: %s -> %s refused", self.model, old.value, new.value)
            return False
        self.state = new
        if new is S.READY or new is S.REMOVED:
            self.ready.set()
        else:
            self.ready.clear()
        return True

    # ---- following the manager --------------------------------------------------
    def on_model_state(self, state: str, incarnation: str, reason: str | None) -> None:
        self.reason = reason or None
        if state == "ready":
            # The same incarnation is announced again on every freeze/thaw and
            # in the snapshot: reconnect only for a new engine lifetime.
            if incarnation != self.connecting_to or self.sock is None:
                self._connect(incarnation)
            return
        new = MANAGER_STATES.get(state)
        if new is None:
            log.warning("engine link %s: unknown model state %r ignored", self.model, state)
            return
        if new in (S.DOWN, S.FAILED) and self.sock is not None:
            self._disconnect(f"the engine for model {self.model!r} {'failed' if state == 'failed' else 'exited'}"
                             + (f" ({reason})" if reason else ""))
        # STARTING and DRAINING keep the socket: a draining engine finishes what it has, and
        # a new incarnation's "ready" replaces the socket (failing what is left on it).
        if self._swap(LIVE, new):
            self.word = state

    def remove(self) -> None:
        """The model was unloaded: fail what is left and wake whoever waits."""
        self._disconnect(f"model {self.model!r} was unloaded")
        if self._swap(LIVE, S.REMOVED):
            self.word = "removed"

    def _connect(self, incarnation: str) -> None:
        if not self._swap(LIVE, S.CONNECTING):
            return
        log.info("connecting to engine %s (incarnation %s)", self.model, incarnation)
        self._disconnect("the engine restarted")
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        # Never queue frames for a peer that is not connected (DESIGN.md).
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(f"ipc://{self.socket_path}")
        self.sock = sock
        self.connecting_to = incarnation
        self.reader = asyncio.get_running_loop().create_task(self._handshake_then_read(sock, incarnation))

    def _disconnect(self, why: str) -> None:
        """Close the socket and fail every request in flight on it (the state is the caller's)."""
        if self.reader is not None:
            self.reader.cancel()
            self.reader = None
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self.incarnation = self.connecting_to = ""
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream.queue.put_nowait(EngineUnavailable(why, retry_after=5))

    async def _handshake_then_read(self, sock: zmq.asyncio.Socket, incarnation: str) -> None:
        await sock.send(EP.encoder.encode(EP.Hello(version=EP.PROTOCOL_VERSION)))
        while True:
            body = await sock.recv()
            try:
                msg = EP.to_gateway_decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("rejected frame from engine %s: %s", self.model, exc)
                continue
            self.on_engine_message(msg, incarnation)

    def on_engine_message(self, msg, incarnation: str) -> None:
        """One frame from the engine our socket was opened for (``incarnation``)."""
        if isinstance(msg, EP.HelloReply):
            self._on_hello(msg, incarnation)
        elif msg.incarnation != self.incarnation:
            return
        elif isinstance(msg, EP.StepOutput):
            for delta in msg.deltas:
                stream = self.streams.get(delta.request_id)
                if stream is not None:
                    stream.queue.put_nowait(delta)
                    if delta.finish_reason is not None:
                        stream.unfinished -= 1
                        if stream.unfinished <= 0:
                            self.streams.pop(delta.request_id, None)
        elif isinstance(msg, EP.StatsReply):
            waiters, self.stats_waiters = self.stats_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(msg)
        elif isinstance(msg, EP.RequestError):
            stream = self.streams.pop(msg.request_id, None)
            if stream is not None:
                stream.queue.put_nowait(EngineRequestError(msg.message, msg.status, msg.param))

    def _on_hello(self, msg: EP.HelloReply, incarnation: str) -> None:
        if msg.version != EP.PROTOCOL_VERSION:
            log.error("engine %s speaks protocol %d, this gateway %d", self.model, msg.version, EP.PROTOCOL_VERSION)
            if self._swap(HELLO_PENDING, S.FAILED):
                self.word, self.reason = "failed", "protocol version mismatch"
            return
        if msg.incarnation != incarnation:
            return  # hello of a different lifetime of the engine
        self.incarnation = msg.incarnation
        self.max_model_len = msg.max_model_len
        self.max_num_seqs = msg.max_num_seqs
        if self._swap(HELLO_PENDING, S.READY):
            log.info("engine %s ready (incarnation %s)", self.model, incarnation)

    # ---- requests --------------------------------------------------------------
    async def wait_ready(self, timeout_s: float) -> None:
        if self.state is S.READY:
            return
        if self.state is S.FAILED:
            raise EngineUnavailable(f"model {self.model!r} failed: {self.reason or 'crash loop'}; "
                                    f"an operator must run `servectl restart {self.model}`", retry_after=None)
        if self.state is S.REMOVED:
            raise EngineUnavailable(f"model {self.model!r} was unloaded", retry_after=None)
        self.waiting += 1
        try:
            await asyncio.wait_for(self.ready.wait(), timeout_s)
            if self.state is S.REMOVED:
                raise EngineUnavailable(f"model {self.model!r} was unloaded", retry_after=None)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"model {self.model!r} is not available ({self.status}) after waiting "
                                    f"{timeout_s:g}s", retry_after=10) from None
        finally:
            self.waiting -= 1

    def submit(self, gen: EP.Generate, choices: int) -> RequestStream:
        if self.state is not S.READY:
            raise EngineUnavailable(f"model {self.model!r} is restarting")
        stream = RequestStream(gen.request_id, unfinished=choices)
        self.streams[gen.request_id] = stream
        try:
            self.sock.send(EP.encoder.encode(gen), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.streams.pop(gen.request_id, None)
            raise EngineUnavailable(f"model {self.model!r} is not reachable: {exc}") from None
        return stream

    def queued(self) -> int:
        """Requests waiting: held for readiness, or beyond what the engine runs at once."""
        return max(self.waiting, self.admitted - self.max_num_seqs)

    async def stats(self, timeout_s: float = 2.0) -> EP.StatsReply | None:
        """The engine's own counters, or None when it is not reachable now."""
        if self.sock is None or not self.incarnation:  # no engine lifetime has answered our Hello
            return None
        fut = asyncio.get_running_loop().create_future()
        self.stats_waiters.append(fut)
        try:
            await self.sock.send(EP.encoder.encode(EP.Stats()), zmq.NOBLOCK)
            return await asyncio.wait_for(fut, timeout_s)
        except (zmq.ZMQError, asyncio.TimeoutError):
            return None

    def abort(self, request_id: str) -> None:
        if self.streams.pop(request_id, None) is None:
            return
        if self.sock is not None:
            try:
                self.sock.send(EP.encoder.encode(EP.Abort(request_ids=[request_id])), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
