"""Requests into the engine: Generates queued, added, refused; each added one's record, forgotten in one place.

``Intake`` is a part of ``EngineServer`` (engine_core/core.py), as
``ManagerMessages`` is. A ``Generate`` waits in ``pending`` until the loop
adds it: all of them when the engine is idle, else for ``ADD_BUDGET_S``
between steps, or while a step's model runs until its reply is in. Adding
builds vLLM's request (requests.py), or starts a pooling request's slices
(slices.py), or continues a choice (resume.py); a request vLLM refuses is
answered with vLLM's classification (request_types.py ``refusal``) and dropped
from vLLM. Each added request has one ``InFlight`` record until ``_forget``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine_core.request_types import Built, is_request_error, refusal
from engine_core.resume import add_continued
from servectl.wire import engine as P

log = logging.getLogger("engine_core")
# While requests run, adding new ones (tokenising, chat templates) gets this much time
# between two steps; the rest wait for the next gap, so a large batch arriving does not
# stall the tokens of requests already running. An idle engine adds everything at once.
ADD_BUDGET_S = 0.01


@dataclass(eq=False, slots=True)
class InFlight:
    """One engine request added to vLLM and not finished: everything the engine keeps for it
    (its held output aside: ``HeldOutput``), dropped in one place, ``Intake._forget``."""

    peer: bytes  # the gateway that sent it (its identity on the frontend)
    spec: Any  # its OutputSpec: what its responses show
    resumed: int | None = None  # the choice it continues (engine_core/resume.py), or None
    tenant: str = ""  # the key its fair-share priority is from (Generate.tenant), for its later calls


class Intake:
    """Uses ``EngineServer``'s spec, engine, tokenizer, group, builder, idle release, held outputs,
    slices, pending, requests, by_peer, pooled, draining, tracing, the step halves' yield and its
    ``_send`` / ``_fail``."""

    def _on_generate(self, peer: bytes, msg: P.Generate) -> None:
        rid = msg.request_id
        if self.idle.released:
            # Idle release under way: the gateway holds the request and sends it again after the wake.
            self._send(peer, P.RequestError(incarnation=self.spec.incarnation, request_id=rid, released=True,
                                            message=f"model {self.spec.model.name!r} is released", status=503))
            return
        if rid in self.requests or rid in self.pending:
            self._refuse(peer, rid, f"duplicate request id {rid}", 400)
            return
        self.pending[rid] = (peer, msg)

    def _add_pending(self) -> None:
        """Add what arrived, all of it when idle, else for ADD_BUDGET_S (at least one); then a
        slice of the pooling requests being added, for ADD_BUDGET_S even when idle (a request
        arriving meanwhile is taken in at the next gap)."""
        budget = None if not self.engine.has_unfinished_requests() else time.monotonic() + ADD_BUDGET_S
        while self.pending:
            self._add(*self.pending.pop(next(iter(self.pending))))
            if budget is not None and time.monotonic() >= budget:
                return
        if self.slices:
            deadline = time.monotonic() + ADD_BUDGET_S
            self.slices.run(lambda: time.monotonic() >= deadline)

    def _add_pending_until_reply(self) -> None:
        """Add what arrived while the workers run a step, until a reply is in (then the step's
        turnaround comes first; the rest waits for the next wait or gap)."""
        while self.pending and not self.group.reply_waiting():
            self._add(*self.pending.pop(next(iter(self.pending))))
        if self.slices and not self.group.reply_waiting():
            self.slices.run(self.group.reply_waiting)

    def _refuse(self, peer: bytes, rid: str, message: str, status: int, param: str | None = None) -> None:
        self._send(peer, P.RequestError(incarnation=self.spec.incarnation, request_id=rid, message=message,
                                        status=status, param=param))

    def _add(self, peer: bytes, msg: P.Generate) -> None:
        rid = msg.request_id
        if self.draining:
            self._send(peer, P.RequestError(incarnation=self.spec.incarnation, request_id=rid, draining=True,
                                            message=f"model {self.spec.model.name!r} is being stopped", status=503))
            return
        built = None
        try:
            built = self._build(msg)
            if msg.trace_parent and self.tracing is not None:  # vLLM's llm_request joins the trace
                built.trace_headers = self.tracing.added(rid, msg.trace_parent)
            if built.spec.pooling is not None:  # its inputs rendered and added by slices (slices.py)
                self.slices.start(rid, built.spec.pooling)
            elif msg.resume is None:
                with self._adding(msg.tenant):
                    built.add_to(self.engine, rid)
            else:
                with self._adding(msg.tenant):
                    add_continued(self.engine, self.tokenizer, rid, built, msg.resume)
        except BaseException as exc:  # one request's failure never takes the engine down
            if not is_request_error(exc):
                raise
            # vLLM may have registered part of it before refusing: drop whatever it holds.
            self._drop(rid)
            if self.tracing is not None:
                self.tracing.forget(rid)
            if built is not None:
                self._forget_media(built)
            # Admission only looks at the request itself, so whatever it rejects is bad input:
            # vLLM's classification (status, message, parameter), never a 5xx.
            bad = refusal(exc)
            if bad.unexpected:  # not its message: vLLM's may quote the prompt
                log.warning("request %s refused at admission: %s (param %s)", rid, type(exc).__name__, bad.param)
            self._refuse(peer, rid, str(bad), bad.status, bad.param)
            return
        built.spec.whole = not msg.body.get("stream") and built.spec.pooling is None
        self.requests[rid] = InFlight(peer, built.spec, msg.resume.index if msg.resume is not None else None,
                                      msg.tenant)
        self.by_peer[peer].add(rid)

    def _add_next(self, peer: bytes, rid: str, built: Built) -> None:
        """A request's next call to vLLM, under its id, once the one before it finished."""
        if self.tracing is not None:
            built.trace_headers = self.tracing.headers(rid)
        req = self.requests.get(rid)
        try:
            with self._adding(req.tenant if req is not None else ""):
                built.add_to(self.engine, rid)
        except BaseException as exc:  # noqa: BLE001 - as at admission: vLLM's classification
            if not is_request_error(exc):
                raise
            bad = refusal(exc)
            self._fail(peer, rid, str(bad), bad.status, bad.param)

    def _forget_media(self, built: Built) -> None:
        """A request rendered but never added to vLLM: its media leave the renderer's sender
        cache, which took them for sent to the engine core's receiver (vLLM's ``lru`` cache). Kept,
        the next request with the same media would go without it and fail as "cache drift"."""
        hashes = built.engine_input.get("mm_hashes") if isinstance(built.engine_input, dict) else None
        cache = getattr(getattr(self.engine, "renderer", None), "mm_processor_cache", None)
        if hashes and cache is not None:
            for mm_hash in (h for per_modality in hashes.values() for h in per_modality):
                cache.invalidate(mm_hash)

    def _slice_added(self, rid: str, ids: list[str]) -> None:
        self.pooled.update((sub, rid) for sub in ids)

    def _slice_failed(self, rid: str, exc: Exception) -> None:
        """vLLM refused one of a pooling request's inputs: the request fails (a 4xx, as at admission)."""
        req = self.requests.get(rid)
        if req is None:
            return
        bad = refusal(exc)
        if bad.unexpected:
            log.warning("request %s refused while added: %s (param %s)", rid, type(exc).__name__, bad.param)
        self._fail(req.peer, rid, str(bad), bad.status, bad.param)

    def _drop(self, rid: str) -> None:
        """Remove a request from vLLM whatever state it is in (an unknown id is a no-op there)."""
        try:
            self.engine.abort_request(self._vllm_ids([rid]))
        except Exception:  # noqa: BLE001 - nothing more can be done for it
            log.exception("dropping request %s", rid)

    @contextlib.contextmanager
    def _adding(self, tenant: str) -> Iterator[None]:
        """While vLLM adds a request (synchronously, on this thread): its key, for the engine's
        yield to put on each Request vLLM makes of it (batch_yield.py: a key's own request through
        another gateway is not another key's first). Cleared after, whatever happens."""
        yielding = getattr(self.halves, "batches", None)
        if yielding is None or not tenant:
            yield
            return
        yielding.arriving = tenant
        try:
            yield
        finally:
            yielding.arriving = ""

    def _build(self, msg: P.Generate) -> Built:
        built = self.builder.build(msg.kind, msg.body, msg.request_id, msg.answer_id)
        if msg.priority is not None:  # the fair share's, for a kind whose body carries none
            built.priority = msg.priority
        if built.spec.api is not None:  # a speech request's later calls keep it (serving_apis.py)
            built.spec.api.priority = built.priority
        return built

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            self.pending.pop(rid, None)
        live = [i for i in ids if i in self.requests]
        if live:
            self.engine.abort_request(self._vllm_ids(live))
            log.info("aborted %d request(s): %s", len(live), " ".join(live[:8]))
        for rid in live:
            self._forget(rid)

    def _vllm_ids(self, ids: list[str]) -> list[str]:
        """The ids vLLM knows these requests by (a pooling request: one per prompt)."""
        pooled = [getattr(r.spec, "pooling", None) if (r := self.requests.get(i)) else None for i in ids]
        return [v for i, p in zip(ids, pooled) for v in (p.ids if p is not None else [i])]

    def _forget(self, rid: str) -> None:
        """The one place a request's state goes: its record, its gateway's index entry, its held output."""
        req = self.requests.pop(rid, None)
        if req is not None:
            api = getattr(req.spec, "api", None)
            if api is not None:  # a Responses / Messages request's serving code (serving_apis.py)
                api.close()
            for sub in getattr(req.spec, "pooling", None) and req.spec.pooling.ids or ():
                self.pooled.pop(sub, None)
            self.slices.drop(rid)
            mine = self.by_peer.get(req.peer)
            if mine is not None:
                mine.discard(rid)
                if not mine:
                    del self.by_peer[req.peer]
        self.held.drop(rid)
        if self.tracing is not None:
            self.tracing.forget(rid)
