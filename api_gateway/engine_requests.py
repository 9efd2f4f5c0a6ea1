"""The requests sent on an engine link: their streams, awaited and bounded sends, ordered aborts.

``EngineRequests`` is a part of ``EngineLink`` (engines.py, which owns the link's state and
socket): what goes to the engine on that socket (``Generate`` frames, tokenizer questions,
``Stats`` probes, metrics requests, aborts in order) and the handlers of the engine's answers
to them (step outputs to each request's sink, stats, metrics, tokenizer replies).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio

from api_gateway.errors import EngineStalled, EngineUnavailable
from api_gateway.link_state import LinkState
from servectl.wire import engine as EP

log = logging.getLogger("api_gateway.engines")
S = LinkState


@dataclass(eq=False)
class RequestStream:
    """One engine request in flight: its deltas go to ``sink`` as (request id, Delta or exception).

    Every engine request of one HTTP request shares that request's sink, so
    its reader awaits one queue however many prompts it sent.
    """

    request_id: str
    sink: asyncio.Queue
    unfinished: int = 1


# Sends of one large batch hand the event loop back this often (other clients' tokens go out between).
YIELD_EVERY = 32


class EngineRequests:
    """The request side of ``EngineLink``: its fields (``streams``, ``sock``, ``replies``...) are
    the link's, set in ``EngineLink.__init__``."""

    # ---- the engine's answers ---------------------------------------------------------
    def _on_step_output(self, msg: EP.StepOutput) -> None:
        for delta in msg.deltas:
            stream = self.streams.get(delta.request_id)
            if stream is not None:
                stream.sink.put_nowait((delta.request_id, delta))
                if delta.finish_reason is not None:
                    stream.unfinished -= 1
                    self.outstanding -= 1
                    if stream.unfinished <= 0:
                        self.streams.pop(delta.request_id, None)

    def _on_stats_reply(self, msg: EP.StatsReply) -> None:
        waiters, self.stats_waiters = self.stats_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(msg)

    def _on_metrics_reply(self, msg: EP.MetricsReply) -> None:
        waiters, self.metrics_waiters = self.metrics_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(msg.text)

    def _on_tokenizer_reply(self, msg: EP.TokenizerReply) -> None:
        fut = self.replies.pop(msg.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg.body)

    # ---- requests --------------------------------------------------------------
    async def submit(self, frames: list[tuple[str, bytes]], sink: asyncio.Queue, choices: dict[str, int]) -> None:
        """Register and send encoded ``Generate`` frames ((request id, frame) pairs), in order;
        ``choices`` says how many finishes end each (its n, or 1 for a resumed choice).

        Every frame is on the engine's socket when this returns. Otherwise (the engine went
        away, a send found the engine not taking frames for ``send_timeout_s``, the caller
        was cancelled) what was sent is aborted, nothing stays registered, and it raises
        (``EngineUnavailable``, or the cancellation).
        """
        if self.state is not S.READY:
            raise EngineUnavailable(f"model {self.model!r} is restarting")
        sock = self.sock
        rids = [rid for rid, _ in frames]
        for rid in rids:
            self.streams[rid] = RequestStream(rid, sink, unfinished=choices[rid])
            self.outstanding += choices[rid]
        try:
            for i, (_, frame) in enumerate(frames):
                await self._send(sock, frame, "a request")
                if i % YIELD_EVERY == YIELD_EVERY - 1:
                    # A cooperative yield, not a timed wait: a large batch lets other
                    # requests' tokens out between its sends.
                    await asyncio.sleep(0)  # event-proof: yields once to the loop, waits for no time
        except BaseException:
            self.abort(rids)
            raise

    async def _send(self, sock: zmq.asyncio.Socket, frame: bytes, what: str) -> None:
        """One awaited send on ``sock``: taken by the socket, or ``EngineUnavailable``."""
        if sock is None or sock is not self.sock:
            raise EngineUnavailable(f"model {self.model!r} is restarting")
        try:
            # event-proof: the send completes as soon as the engine reads its socket (between
            # steps); only a hung engine lets this deadline pass.
            async with asyncio.timeout(timeout := self.output_timeout(self.send_timeout_s)):
                await sock.send(frame)
        except TimeoutError:
            raise EngineStalled(f"model {self.model!r} did not take {what} for {timeout:g}s",
                                retry_after=10) from None
        except asyncio.CancelledError:
            # Closing the socket (the engine went away) cancels the send's future, not us.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise EngineUnavailable(f"model {self.model!r} is restarting") from None
        except zmq.ZMQError as exc:
            raise EngineUnavailable(f"model {self.model!r} is not reachable: {exc}") from None

    async def tokenizer(self, msg: EP.Tokenizer, timeout_s: float) -> dict:
        """Ask the engine a tokenizer question; its answer (vLLM's response body), or the
        engine's refusal (``EngineRequestError``), or ``EngineUnavailable``."""
        if self.state is not S.READY:
            raise EngineUnavailable(f"model {self.model!r} is restarting")
        fut = asyncio.get_running_loop().create_future()
        self.replies[msg.request_id] = fut
        try:
            await self._send(self.sock, EP.encoder.encode(msg), "a tokenizer request")
            # event-proof: the engine answers between two steps; only a hung engine lets this pass.
            async with asyncio.timeout(timeout_s):
                return await fut
        except TimeoutError:
            raise EngineStalled(f"model {self.model!r} did not answer within {timeout_s:g}s",
                                retry_after=10) from None
        finally:
            self.replies.pop(msg.request_id, None)

    async def stats(self, timeout_s: float = 2.0, request_ids: list[str] | None = None) -> EP.StatsReply | None:
        """The engine's own counters (and which of ``request_ids`` it does not know), or None
        when it does not answer now."""
        if self.sock is None or not self.incarnation:  # no engine lifetime has answered our Hello
            return None
        fut = asyncio.get_running_loop().create_future()
        self.stats_waiters.append(fut)
        try:
            await self._send(self.sock, EP.encoder.encode(EP.Stats(request_ids=request_ids or [])), "a probe")
            # event-proof: the engine answers between steps; a bounded wait for that answer.
            return await asyncio.wait_for(fut, timeout_s)
        except (EngineUnavailable, asyncio.TimeoutError):
            return None
        finally:
            if fut in self.stats_waiters:
                self.stats_waiters.remove(fut)

    async def engine_metrics(self, timeout_s: float = 2.0) -> str:
        """vLLM's own metrics as the engine renders them; "" when no engine lifetime answers (released)."""
        if self.sock is None or not self.incarnation:
            return ""
        fut = asyncio.get_running_loop().create_future()
        self.metrics_waiters.append(fut)
        try:
            await self._send(self.sock, EP.encoder.encode(EP.MetricsRequest()), "a metrics request")
            # event-proof: the engine answers between steps; a bounded wait for that answer.
            return await asyncio.wait_for(fut, timeout_s)
        except (EngineUnavailable, asyncio.TimeoutError):
            return ""
        finally:
            if fut in self.metrics_waiters:
                self.metrics_waiters.remove(fut)

    def _forget(self, request_id: str) -> RequestStream | None:
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            self.outstanding -= stream.unfinished
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Forget these requests and tell the engine to drop those still registered (in order,
        after anything already sent for them)."""
        ids = [rid for rid in request_ids if self._forget(rid) is not None]
        if not ids or self.sock is None:
            return
        self._abort_ids.extend(ids)
        if self._abort_task is None:
            self._abort_task = asyncio.get_running_loop().create_task(self._flush_aborts(self.sock))

    async def _flush_aborts(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while self._abort_ids and sock is self.sock:
                ids, self._abort_ids = self._abort_ids, []
                try:
                    await self._send(sock, EP.encoder.encode(EP.Abort(request_ids=ids)), "an abort")
                except EngineUnavailable as exc:
                    # Not taken: that engine is gone or hung, and its restart drops them anyway.
                    log.warning("%d abort(s) not delivered: %s", len(ids), exc)
                    return
        finally:
            if self._abort_task is asyncio.current_task():
                self._abort_task = None
