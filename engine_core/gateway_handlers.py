"""The engine's side of the gateways' small questions: one handler per gateway message but Generate.

``GatewayMessages`` is a part of ``EngineServer`` (engine_core/core.py), as
``ManagerMessages`` is: Hello, Abort, Stats, MetricsRequest and the tokenizer
questions (queued, then answered between steps or while a model step runs,
one at a time while requests run). It uses the server's state and its
``_send``; requests themselves are intake.py's.
"""

from __future__ import annotations

from engine_core import metrics as engine_metrics
from engine_core.kv_events import published
from engine_core.request_types import BadRequest
from servectl.wire import engine as P


class GatewayMessages:
    """Uses ``EngineServer``'s spec, engine, group, clock, idle release, requests, pending, tokenizing
    and its ``_send`` / ``_refuse`` / ``_abort``."""

    def _on_hello(self, peer: bytes, msg: P.Hello) -> None:
        kv_events, rank = published()
        self._send(peer, P.HelloReply(version=P.PROTOCOL_VERSION, incarnation=self.spec.incarnation,
                                      model=self.spec.model.name, max_model_len=self.max_model_len,
                                      max_num_seqs=self.max_num_seqs, rejected_frames=self.rejected,
                                      tasks=list(self.tasks), kv_events=kv_events, kv_events_rank=rank,
                                      max_prompt_chars=self.max_model_len * getattr(self.tokenizer,
                                                                                    "max_chars_per_token", 0),
                                      trace_parent=self.trace_parent))

    def _on_abort(self, peer: bytes, msg: P.Abort) -> None:
        self._abort(msg.request_ids)

    def _on_metrics(self, peer: bytes, msg: P.MetricsRequest) -> None:
        text = "" if self.idle.released and not self.idle.asleep else engine_metrics.render(asleep=self.idle.asleep, engine=self.spec.replica)
        self._send(peer, P.MetricsReply(incarnation=self.spec.incarnation, text=text))

    def _on_stats(self, peer: bytes, msg: P.Stats) -> None:
        missing = [rid for rid in msg.request_ids if rid not in self.requests and rid not in self.pending]
        yielding = getattr(self.halves, "batches", None)
        self._send(peer, P.StatsReply(incarnation=self.spec.incarnation,
                                      unfinished=self.engine.get_num_unfinished_requests() + len(self.pending),
                                      overlapped_steps=self.group.overlapped_steps,
                                      token_replies=self.group.token_replies,
                                      signed_replies=self.group.signed_replies,
                                      rejected_frames=self.rejected, missing=missing,
                                      last_worked_at=self.clock.since_wall,
                                      steps_one_deep=yielding.shallow_steps if yielding is not None else 0,
                                      steps_sat_out=yielding.sat_out if yielding is not None else 0))

    def _on_tokenizer(self, peer: bytes, msg: P.Tokenizer) -> None:
        """Queued; answered by ``_answer_tokenizing`` (tokenising needs no worker)."""
        self.tokenizing.append((peer, msg))

    def _answer_tokenizing(self) -> None:
        """Answer the queued tokenizer questions: all of them when nothing runs, else one per gap
        between steps, so that questions arriving together cannot stall the steps of running
        requests (each is bounded like a prompt: tokenizing.py)."""
        if not (self.engine.has_unfinished_requests() or self.in_flight or self.kept is not None):
            while self.tokenizing:
                self._answer_tokenizer(*self.tokenizing.popleft())
            return
        self.tokenizer_answers += 1
        self._answer_tokenizer(*self.tokenizing.popleft())

    def _answer_tokenizer(self, peer: bytes, msg: P.Tokenizer) -> None:
        try:
            body = self.tokenizer_endpoints.answer(msg.kind, msg.body)
        except BadRequest as exc:
            self._refuse(peer, msg.request_id, str(exc), exc.status, exc.param)
            return
        self._send(peer, P.TokenizerReply(incarnation=self.spec.incarnation, request_id=msg.request_id, body=body))
