"""The gateway's link to each engine: one owner of a model's availability.

A link follows the manager's events for its model. When the manager says the
engine is ready (with an incarnation id), the link opens a fresh DEALER to the
engine's socket and says hello; frames of an older incarnation are dropped.
When the engine exits, every in-flight request of that model is failed at once
and new requests wait (bounded) for the next incarnation instead of failing.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from api_gateway.errors import EngineRequestError, EngineUnavailable
from servectl.wire import engine as EP

log = logging.getLogger("api_gateway.engines")


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
        self.state = "starting"
        self.reason: str | None = None
        self.incarnation = ""  # set once the engine answered our Hello
        self.connecting_to = ""  # the incarnation our socket was opened for
        self.max_model_len: int | None = None
        self.ready = asyncio.Event()
        self.sock: zmq.asyncio.Socket | None = None
        self.reader: asyncio.Task | None = None
        self.streams: dict[str, RequestStream] = {}
        self.waiting = 0  # held until the engine is ready
        self.admitted = 0  # held or running in the engine, not finished
        self.max_num_seqs = 0
        self.stats_waiters: list[asyncio.Future] = []

    @property
    def status(self) -> str:
        """"ready", or why not in the manager's words (what /health and /v1/models report)."""
        return "ready" if self.ready.is_set() else self.state

    # ---- following the manager --------------------------------------------------
    def on_model_state(self, state: str, incarnation: str, reason: str | None) -> None:
        self.reason = reason or None
        if state == "ready":
            # The same incarnation is announced again on every freeze/thaw and
            # in the snapshot: reconnect only for a new engine lifetime.
            if incarnation != self.connecting_to or self.sock is None:
                self._connect(incarnation)
            return
        self.state = state
        if state == "stopping":
            # Draining: in-flight requests run to the end; new ones wait for
            # the next incarnation (a restart) or are refused (an unload).
            self.ready.clear()
        elif state in ("exited", "backoff", "failed", "stopped", "starting"):
            if self.sock is not None and state != "starting":
                self._disconnect(f"the engine for model {self.model!r} {'failed' if state == 'failed' else 'exited'}"
                                 + (f" ({reason})" if reason else ""))
            self.ready.clear()

    def remove(self) -> None:
        """The model was unloaded: fail what is left and wake whoever waits."""
        self._disconnect(f"model {self.model!r} was unloaded")
        self.state = "removed"
        self.ready.set()

    def _connect(self, incarnation: str) -> None:
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
        if self.reader is not None:
            self.reader.cancel()
            self.reader = None
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self.incarnation = self.connecting_to = ""
        self.ready.clear()
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
            if isinstance(msg, EP.HelloReply):
                if msg.version != EP.PROTOCOL_VERSION:
                    log.error("engine %s speaks protocol %d, this gateway %d", self.model, msg.version,
                              EP.PROTOCOL_VERSION)
                    self.state, self.reason = "failed", "protocol version mismatch"
                    continue
                if msg.incarnation != incarnation:
                    continue  # hello of a different lifetime of the engine
                self.incarnation = msg.incarnation
                self.max_model_len = msg.max_model_len
                self.max_num_seqs = msg.max_num_seqs
                self.state = "ready"
                self.ready.set()
                log.info("engine %s ready (incarnation %s)", self.model, incarnation)
            elif msg.incarnation != self.incarnation:
                continue
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

    # ---- requests --------------------------------------------------------------
    async def wait_ready(self, timeout_s: float) -> None:
        if self.ready.is_set():
            return
        if self.state == "failed":
            raise EngineUnavailable(f"model {self.model!r} failed: {self.reason or 'crash loop'}; "
                                    f"an operator must run `servectl restart {self.model}`", retry_after=None)
        self.waiting += 1
        try:
            await asyncio.wait_for(self.ready.wait(), timeout_s)
            if self.state == "removed":
                raise EngineUnavailable(f"model {self.model!r} was unloaded", retry_after=None)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"model {self.model!r} is not available ({self.state}) after waiting "
                                    f"{timeout_s:g}s", retry_after=10) from None
        finally:
            self.waiting -= 1

    def submit(self, gen: EP.Generate, choices: int) -> RequestStream:
        if self.sock is None or not self.ready.is_set():
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
