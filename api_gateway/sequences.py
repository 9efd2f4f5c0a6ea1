"""The engine side of one admitted request: its engine requests submitted, read, continued and aborted.

A ``RequestRun`` owns the engine requests one HTTP request became (one per
prompt, each with the request's ``n`` choices). ``deltas()`` submits them and
yields (prompt index, Delta) until every choice finished; leaving it in any
way (the end, an error, the client gone) aborts whatever the engine still runs
for them.

Each run goes to one replica of the model (``ServedModel.pick``: the one with
the fewest sequences outstanding). A crash costs latency, not errors: when the
engine goes away mid-request (a crash, a hang the group was restarted for),
the request goes on at once on another ready replica of the same
configuration, else waits for one (the next incarnation), at most
``hold_timeout_s`` from the moment it learned of it, and each unfinished
choice goes on there (``resume.plan``): the same response, the next token,
nothing repeated or missing. The wait covers the model's longest measured
start (``EngineLink.hold_s``). A model that failed, one a reload changed
(``config_id``: its tokens would go on another model's answer), a
choice vLLM cannot continue exactly that the client has seen part of, or more
than ``MAX_RESTARTS`` restarts in one request end it with today's errors. So
does an engine the manager killed as hung, for a request whose output had not
begun (``_not_again``: it may be what hung it; it is never sent again).

Nothing waits without a deadline: sends are bounded (``EngineLink.submit``),
the wait for the engine by the hold timeout, output by the engine's step
deadline (``EngineLink.output_timeout``), past which the engine is asked
whether it still holds the requests: queued behind others waits on, not
holding them is a lost request (503), not answering is a hang, reported to the
manager, whose restart the request then waits for (as long again) to go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator, Callable

import msgspec

from api_gateway import tracing as T
from api_gateway.engines import EngineLink
from api_gateway.errors import (EngineRequestError, EngineStalled, EngineUnavailable, HttpError, refused_by_engine,
                                unavailable)
from api_gateway.resume import CannotContinue, Choice, plan
from api_gateway.served import ServedModel
from servectl.config import GatewayConfig
from servectl.wire import engine as EP

log = logging.getLogger("api_gateway")

# Engine restarts one request rides through; beyond, it fails (a request that brings its
# engine down each time must not keep the model in a crash loop).
MAX_RESTARTS = 3
_NO_SPAN = contextlib.nullcontext()


def encode_generate(gen: EP.Generate) -> bytes:
    """The frame of one engine request; a value msgpack cannot carry is the client's 400."""
    try:
        return EP.encoder.encode(gen)
    except OverflowError:
        raise HttpError(400, "an integer in the request is outside the 64-bit range the engine accepts") from None


class EngineGone(Exception):
    """This engine lifetime ended under the request (the link's socket closed, or it hung);
    ``hung``: the manager killed it as hung."""

    def __init__(self, why: str, hung: bool = False):
        super().__init__(why)
        self.hung = hung


class RequestRun:
    def __init__(self, model: ServedModel, gens: list[EP.Generate], n: int, cfg: GatewayConfig,
                 new_request_id: Callable[[], str], report_hang: Callable[[EngineLink], None],
                 whole_answer: bool = True, restart: Callable[[int, int], None] = lambda pi, c: None,
                 key: bytes | None = None):
        self.model = model
        self.key = key  # the start of its prompt (served.prefix_key): which replica it prefers
        self.link: EngineLink | None = None  # the replica it runs on now
        self.gens = gens
        self.n = n
        self.cfg = cfg
        self.new_request_id = new_request_id
        self.report_hang = report_hang
        # True while nothing of the answer reached the client (a whole answer; a stream
        # before its first event): a choice may then run again from its start.
        self.whole_answer = whole_answer
        self.restart = restart  # the response forgets a choice that runs again from its start
        self.choices = [[Choice() for _ in range(n)] for _ in gens]
        self.constrained = [False] * len(gens)  # the engine said a grammar constrains the prompt's output
        self.keep_deltas = False  # Responses / Messages: each choice's deltas are kept (Choice.deltas)
        self.restarts = 0
        # Encoded now, before anything is registered: a request that cannot be sent is a 400.
        self.frames = [encode_generate(g) for g in gens]
        self.trace = T.RunTrace() if T.tracer is not None else None  # its spans (tracing on)

    async def deltas(self) -> AsyncIterator[tuple[int, EP.Delta]]:
        """Yield (prompt index, Delta) for every prompt's request until every choice finished."""
        model = self.model
        batch = [(pi, g, f) for pi, (g, f) in enumerate(zip(self.gens, self.frames))]
        began_on = ""  # the configuration its first replica runs: it never goes on on another
        while True:
            link = model.pick(self.key, began_on)
            if link is None:  # taken out of service between the hold and now: wait again
                await self._wait(model.hold_s(self.cfg.hold_timeout_s), began_on)
                continue
            self.link = link
            began_on = began_on or link.config_id
            if self.trace is not None:
                batch = self._traced(link, batch)
            try:
                async for item in self._run(link, batch):
                    if self.trace is not None:
                        self.trace.token()
                    yield item
                if self.trace is not None:
                    self.trace.end()
                return
            except EngineGone as exc:
                why = str(exc)
                if self.trace is not None:
                    self.trace.gone(why, exc.hung)
                if exc.hung:
                    self._not_again(link, why)
            except BaseException as exc:  # an error, the client gone: this lifetime's span ends with it
                if self.trace is not None:
                    self.trace.end(exc)
                raise
            # The hold clock starts now: another replica, or this one's restart, has this long.
            deadline = time.monotonic() + model.hold_s(self.cfg.hold_timeout_s)
            self.restarts += 1
            if self.restarts > MAX_RESTARTS:
                raise unavailable(EngineUnavailable(f"model {model.name!r} restarted {MAX_RESTARTS} times during "
                                                    f"this request ({why})", retry_after=5))
            if not any(c.started for choices in self.choices for c in choices):
                began_on = ""  # nothing produced yet: any configuration may run it (a reload's new one)
            # A reload that changed the model (weights, engine arguments, ...) ends it: its tokens
            # would go on another model's answer (ServedModel.wait_ready says so).
            with T.hold(model.name, str(model.status), why) if self.trace is not None else _NO_SPAN:
                await self._wait(deadline - time.monotonic(), began_on)
            try:
                sends = plan(self.gens, self.choices, self.new_request_id, self.whole_answer, self.restart,
                             self.constrained)
            except CannotContinue as exc:
                raise unavailable(EngineUnavailable(
                    f"the engine of model {link.model!r} restarted ({why}) and this stream cannot be continued "
                    f"exactly: {exc}", retry_after=5)) from None
            log.info("model %s restarted (%s): going on with %d engine request(s) (restart %d of this request)",
                     link.model, why, len(sends), self.restarts)
            batch = [(pi, g, encode_generate(g)) for pi, g in sends]

    def _traced(self, link: EngineLink,
                batch: list[tuple[int, EP.Generate, bytes]]) -> list[tuple[int, EP.Generate, bytes]]:
        """Tracing on: this engine lifetime's span (after a restart, the resume on the request's
        span first), and the requests that carry it to the engine."""
        if self.restarts:
            self.trace.resumed(self.model.name, link.model, link.incarnation, link.start_span, self.restarts,
                               len(batch))
        parent = self.trace.attempt(self.model.name, link.incarnation, link.model, link.start_span,
                                    resumed=self.restarts > 0)
        gens = [(pi, msgspec.structs.replace(g, trace_parent=parent)) for pi, g, _ in batch]
        return [(pi, g, encode_generate(g)) for pi, g in gens]

    def _not_again(self, link: EngineLink, why: str) -> None:
        """Its engine was killed as hung: a request with a prompt whose output had not begun may
        be what hung it (a poison pill) and is never sent again; one whose every prompt had
        output the engine got past, and goes on (docs/decisions.md)."""
        if all(any(c.started for c in choices) for choices in self.choices):
            return
        log.warning("model %s was killed as hung with this request's prompt unstarted: not sending it again",
                    link.model)
        raise HttpError(503, f"the engine of model {link.model!r} was killed as hung while this request was in it, "
                             "before its output began; servectl does not send such a request again, as it may be "
                             f"what hung the engine ({why})", "service_unavailable", code="engine_hung")

    async def _wait(self, timeout_s: float, config_id: str) -> None:
        try:
            await self.model.wait_ready(timeout_s, config_id=config_id)
        except EngineUnavailable as exc:  # past the hold timeout, failed, unloaded, reloaded
            raise unavailable(exc) from None

    async def _run(self, link: EngineLink,
                   batch: list[tuple[int, EP.Generate, bytes]]) -> AsyncIterator[tuple[int, EP.Delta]]:
        """One engine lifetime: submit ``batch``, pass its deltas on; ``EngineGone`` when it ends under us."""
        sink: asyncio.Queue = asyncio.Queue()
        prompt_of = {g.request_id: pi for pi, g, _ in batch}
        remaining = {g.request_id: (1 if g.resume is not None else self.n) for _, g, _ in batch}
        resumed = {g.request_id for _, g, _ in batch if g.resume is not None}
        gone = link.gone
        try:
            try:
                await link.submit([(g.request_id, f) for _, g, f in batch], sink, dict(remaining))
            except EngineStalled as exc:
                await self._hung(link, gone, str(exc))
            except EngineUnavailable as exc:
                raise EngineGone(str(exc)) from None
            hung = False
            while remaining:
                timeout = link.output_timeout(self.cfg.output_timeout_s)
                try:
                    # A deadline only while this request waits for output; asyncio.timeout
                    # costs a timer handle per token where wait_for would cost a task.
                    # event-proof: armed only while sequences of this request are in flight.
                    async with asyncio.timeout(timeout):
                        rid, item = await sink.get()
                except TimeoutError:
                    if hung:  # reported, and its restart did not come: give up
                        raise unavailable(EngineUnavailable(f"model {link.model!r} produced no output for "
                                                            f"{timeout:g}s and was not restarted", 10)) from None
                    hung = await self._probe(link, sink, remaining, timeout)
                    continue
                hung = False  # it answers after all (a slow step, not a hang)
                if rid not in remaining:
                    continue  # after that request's error
                if isinstance(item, EngineUnavailable):
                    raise EngineGone(str(item), item.hung)
                if isinstance(item, EngineRequestError):
                    raise refused_by_engine(item)
                if rid in resumed:
                    item.prompt = None  # the client has its prompt; this one holds the output too
                self._passed(prompt_of[rid], item)
                if item.finish_reason is not None:
                    remaining[rid] -= 1
                    if remaining[rid] <= 0:
                        del remaining[rid]
                yield prompt_of[rid], item
        finally:
            link.abort(list(prompt_of))  # no-op for finished ones

    def _passed(self, pi: int, d: EP.Delta) -> None:
        """What the client is given (or will be: a whole answer) of one choice."""
        c = self.choices[pi][d.index]
        if d.prompt is not None and d.prompt.constrained:
            self.constrained[pi] = True
        c.started = True
        c.tokens.extend(d.token_ids)
        c.text_chars += len(d.text)
        if self.keep_deltas:
            if c.deltas is None:
                c.deltas = []
            c.deltas.append(EP.ReplayedDelta(d.text, list(d.token_ids)))
        if d.finish_reason is not None:
            c.finished = True

    async def _hung(self, link: EngineLink, gone: asyncio.Event, why: str) -> None:
        """The engine takes nothing: reported hung; its restart is awaited (bounded), then gone."""
        self.report_hang(link)
        timeout = link.output_timeout(self.cfg.output_timeout_s)
        try:
            # event-proof: the manager's restart of a group reported hung; bounded.
            await asyncio.wait_for(gone.wait(), timeout)
        except asyncio.TimeoutError:
            raise unavailable(EngineUnavailable(f"{why}, and it was not restarted", retry_after=10)) from None
        raise EngineGone(why, link.ended_hung)

    async def _probe(self, link: EngineLink, sink: asyncio.Queue, remaining: dict[str, int], timeout: float) -> bool:
        """No output for a while: queued behind other requests, hung, or lost? True if hung.

        The engine answers Stats between steps; a step stuck on a hung worker keeps it
        from answering at all. A request it no longer holds while we wait for it was lost
        (never delivered, or dropped): it fails rather than waiting forever.
        """
        heard = link.heard
        reply = await link.stats(timeout, request_ids=list(remaining))
        if reply is None and link.output_timeout(self.cfg.output_timeout_s) > timeout:
            # The engine published a longer deadline meanwhile: a step it knows may be slow
            # (the first to need a sampler path vLLM compiles), so it is given that long.
            log.info("model %s: no output for %gs, but its engine expects a slow step: waiting on",
                     link.model, timeout)
            return False
        if reply is None and link.heard != heard:
            # It answered other work meanwhile (other requests' outputs, tokenizer questions): a
            # busy engine whose answer to Stats waits behind that work is not hung.
            log.warning("model %s: no output for %gs and no answer to a probe yet, but its engine answers "
                        "other work: busy, waiting on", link.model, timeout)
            return False
        if reply is None:
            log.error("model %s: no output for %gs and no answer to a probe: hung", link.model, timeout)
            self.report_hang(link)  # the manager restarts the group; our sink hears of it
            return True
        # Output that came in with the reply is read first (the engine sent it before).
        lost = [rid for rid in reply.missing if rid in remaining]
        if lost and sink.empty():
            log.error("engine %s does not hold request(s) %s that wait for output", link.model, lost[:4])
            raise HttpError(503, f"model {link.model!r} lost this request; send it again", "service_unavailable",
                            code="engine_unavailable", headers={"Retry-After": "1"})
        return False
