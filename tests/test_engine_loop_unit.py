"""The engine loop's handling of requests, without vLLM: a scripted stand-in for LLMEngine.

One request's failure (refused by vLLM halfway, its output failing to build)
fails that request only; a step that raises leaves the engine's state unknown
(StepFailed: the process exits, the group restarts); Generates are added
between steps within a time budget; Stats says which requests are missing.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import zmq

import engine_core.core as core
from engine_core.core import EngineServer, StepFailed
from engine_core.request_types import Built, OutputSpec, is_request_error, refusal
from servectl.config import ModelConfig
from servectl.wire import engine as P
from servectl.wire.spawn import EngineSpec

pytestmark = pytest.mark.unit

PEER = b"gw-0-1"


class Tokenizer:
    def __len__(self):
        return 100

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(65 + i % 26) for i in ids)


class Engine:
    """LLMEngine's surface as the loop uses it; step() returns what the test queued.

    A step that runs the model waits for the workers as the real one does: ``wait``
    is the group's callback then (the engine's while_waiting)."""

    def __init__(self):
        self.model_config = SimpleNamespace(max_model_len=64)
        self.requests: dict[str, object] = {}
        self.aborted: list[str] = []
        self.outputs: list = []
        self.fail_add: set[str] = set()
        self.fail_step = False
        self.runs_model = True
        self.wait = lambda: None
        self.events: list[str] = []  # what happened, in order

    def get_tokenizer(self):
        return Tokenizer()

    def add_request(self, rid, prompt, params, **kw):
        self.events.append("added " + rid)
        self.requests[rid] = prompt  # registered before it fails, as vLLM can
        if rid in self.fail_add:
            raise RuntimeError("scheduler refused it")

    def abort_request(self, ids):
        for rid in ids:
            self.aborted.append(rid)
            self.requests.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def get_num_unfinished_requests(self):
        return len(self.requests)

    def step(self):
        if self.fail_step:
            raise RuntimeError("worker call execute_model failed: rank 0: CUDA error")
        out, self.outputs = self.outputs, []
        if self.runs_model:
            self.events.append("model starts")
            self.wait()
            self.events.append("model done")
        return out


class Halves:
    """StepHalves over the stand-in: the core step is its step(), processing passes outputs through."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.more = False  # whether the scheduler holds requests for another model step

    def core_step(self):
        return self.engine.step()

    def more_to_run(self):
        return self.more

    def process(self, outputs):
        self.engine.events.append("processed " + " ".join(o.request_id for o in outputs))
        return outputs


def output(rid: str, token: int, finished: bool = False, logprobs=None):
    comp = SimpleNamespace(index=0, text="x", token_ids=[token], finish_reason="length" if finished else None,
                           stop_reason=None, logprobs=logprobs)
    return SimpleNamespace(request_id=rid, outputs=[comp], finished=finished, prompt_token_ids=[1, 2],
                           prompt_logprobs=None)


@pytest.fixture
def server():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://frontend")  # the gateway's end: server.gateway
    spec = EngineSpec(model=ModelConfig(name="m", model="/m"), runtime_dir="/tmp", incarnation="inc",
                      freezing=False, freeze_grace_s=0, worker_reply_timeout_s=60)
    engine = Engine()
    group = SimpleNamespace(frozen=False, overlapped_steps=0, token_replies=0, signed_replies=0, waker=None, replies_in=False)
    group.wake_on = lambda sock: setattr(group, "waker", sock)
    group.reply_waiting = lambda: group.replies_in
    srv = EngineServer(spec, engine, group, a, b, halves=Halves(engine))
    srv.gateway = ctx.socket(zmq.PAIR)
    srv.gateway.connect("inproc://frontend")
    engine.wait = lambda: group.while_waiting()
    srv.sent = []
    srv._send = lambda peer, msg: (srv.sent.append(msg), engine.events.append(
        "sent " + " ".join(f"{d.request_id}:{d.token_ids[-1] if d.token_ids else ''}" for d in getattr(msg, "deltas", []))))
    # vLLM's request building is not under test (tests/test_engine_requests.py has it).
    srv._build = lambda msg: Built(msg.body["prompt"], SimpleNamespace(), 0, None, OutputSpec(chat=False, logprobs=0))
    yield srv
    srv.gateway.close(0)
    a.close(0)
    b.close(0)
    ctx.term()


def generate(srv, rid: str, stream: bool = True) -> None:
    srv._on_generate(PEER, P.Generate(request_id=rid, kind="completion", body={"prompt": "hi", "stream": stream}))


def test_a_request_vllm_refuses_halfway_is_dropped_from_vllm_and_answered(server):
    server.engine.fail_add.add("r1")
    generate(server, "r1")
    server._add_pending()
    assert server.engine.requests == {} and server.engine.aborted == ["r1"]
    assert server.sent == [P.RequestError(incarnation="inc", request_id="r1", status=400,
                                          message="invalid request: scheduler refused it")]
    assert "r1" not in server.requests


def test_one_requests_output_failing_fails_that_request_only(server):
    for rid in ("ok", "bad"):
        generate(server, rid)
    server._add_pending()
    server.engine.outputs = [output("ok", 5), output("bad", 6, logprobs=[object()])]
    server._step()
    error, step = sorted(server.sent, key=lambda m: type(m).__name__)
    assert error.request_id == "bad" and error.status == 500 and "building this request's output" in error.message
    assert [d.request_id for d in step.deltas] == ["ok"]
    assert server.engine.aborted == ["bad"] and set(server.requests) == {"ok"}
    # The engine goes on: the next step serves the other request to its end.
    server.sent.clear()
    server.engine.outputs = [output("ok", 7, finished=True)]
    server._step()
    assert [d.finish_reason for d in server.sent[0].deltas] == ["length"] and server.requests == {}


def test_a_step_that_raises_is_the_engines_state_unknown(server):
    generate(server, "r1")
    server._add_pending()
    server.engine.fail_step = True
    with pytest.raises(StepFailed, match="CUDA error"):
        server._step()


def test_a_hung_worker_is_not_wrapped(server):
    from engine_core.workers import WorkerHung

    def hung():
        raise WorkerHung("rank 0 gave no reply")

    server.engine.step = hung
    with pytest.raises(WorkerHung):
        server._step()


def test_generates_are_added_within_a_budget_while_requests_run(server, monkeypatch):
    clock = iter(range(1000))
    monkeypatch.setattr(core.time, "monotonic", lambda: next(clock) * 0.004)  # each add takes 4 ms
    # Idle: everything is added at once.
    for i in range(5):
        generate(server, f"a{i}")
    server._add_pending()
    assert len(server.engine.requests) == 5 and not server.pending
    # Busy: 10 ms of adding per gap between steps, at least one.
    for i in range(5):
        generate(server, f"b{i}")
    server._add_pending()
    assert len(server.engine.requests) == 8 and list(server.pending) == ["b3", "b4"]
    # An abort drops a request still waiting to be added; Stats counts and knows the waiting ones.
    server._on_abort(PEER, P.Abort(request_ids=["b4"]))
    server._on_stats(PEER, P.Stats(request_ids=["a0", "b3", "b4", "zz"]))
    reply = server.sent[-1]
    assert (reply.unfinished, reply.missing) == (9, ["b4", "zz"])


def test_a_duplicate_id_is_refused_whether_added_or_waiting(server):
    generate(server, "r1")
    generate(server, "r1")
    assert server.sent[-1].message == "duplicate request id r1"
    server._add_pending()
    generate(server, "r1")
    assert len(server.sent) == 2 and list(server.engine.requests) == ["r1"]


def test_requests_arriving_while_the_model_runs_are_taken_in_then_until_a_reply_is_in(server):
    """Off the step's path, as `vllm serve`'s API server prepares requests beside its engine core:
    the step's wait is woken by the gateway socket (the group's waker, set for the step only)."""
    generate(server, "r1")
    server._add_pending()
    server.halves.more = True
    arrivals = iter([["r2", "r3"], ["r4", "r5"]])

    def model_runs():
        assert server.group.waker is server.frontend  # a gateway message wakes this wait
        for rid in next(arrivals):
            server.gateway.send_multipart([PEER, P.encoder.encode(P.Generate(
                request_id=rid, kind="completion", body={"prompt": "hi", "stream": True}))])
        server.frontend.poll(1000)
        server.group.while_waiting()

    server.engine.wait = model_runs
    server.engine.outputs = [output("r1", 5)]
    server.engine.events.clear()
    server._step()
    assert server.engine.events == ["model starts", "added r2", "added r3", "model done"]
    assert server.group.waker is None and not server.pending and server.intake_while_waiting == 1
    # A reply is in: the step's turnaround comes first, the rest is added in the gap after it.
    server.group.replies_in = True
    server.engine.events.clear()
    server._step()
    assert server.engine.events == ["model starts", "processed r1", "sent r1:5", "model done"]
    assert list(server.pending) == ["r4", "r5"]
    server._add_pending()
    assert list(server.engine.requests) == ["r1", "r2", "r3", "r4", "r5"]


def send_generate(server, rid: str) -> None:
    server.gateway.send_multipart([PEER, P.encoder.encode(P.Generate(
        request_id=rid, kind="completion", body={"prompt": "hi", "stream": True}))])
    server.frontend.poll(1000)


def test_a_wait_for_the_workers_outside_a_step_takes_no_request_in(server):
    """The workers' other calls (loading, the calls of a release to sleep) wait without intake:
    a request taken in then would be added to an engine about to sleep."""
    send_generate(server, "r1")
    server.group.while_waiting()  # e.g. the wait of a collective_rpc made by a Release
    assert not server.engine.requests and not server.pending and server.frontend.poll(0)
    server._drain_frontend()
    assert list(server.pending) == ["r1"]


def test_a_gateway_handler_failing_mid_step_fails_after_the_step_and_not_as_the_model(server, monkeypatch):
    generate(server, "r1")
    server._add_pending()
    server.halves.more = True
    monkeypatch.setitem(server.on_gateway, P.Abort, lambda peer, msg: (_ for _ in ()).throw(KeyError("handler bug")))

    def model_runs():
        server.gateway.send_multipart([PEER, P.encoder.encode(P.Abort(request_ids=["r1"]))])
        server.frontend.poll(1000)
        server.group.while_waiting()
        assert server.group.waker is None  # woken by the reply alone from here on
        server.group.while_waiting()  # (woken again: nothing more is taken in)

    server.engine.wait = model_runs
    server.engine.events.clear()
    with pytest.raises(KeyError, match="handler bug"):
        server._step()
    assert server.engine.events == ["model starts", "model done"] and server.steps == 1
    assert server.intake_error is None and server.in_step is False


def step_kept(server) -> None:
    """Request r1 added and stepped once (token 5) while more steps follow: its output is kept."""
    generate(server, "r1")
    server._add_pending()
    server.halves.more = True
    server.engine.outputs = [output("r1", 5)]
    server._step()


def test_a_steps_outputs_are_processed_and_sent_while_the_next_step_runs_the_model(server):
    step_kept(server)
    assert server.sent == [] and server.kept is not None  # kept: the next step's model run hides it
    server.engine.outputs = [output("r1", 6)]
    server.engine.events.clear()
    server._step()
    assert server.engine.events == ["model starts", "processed r1", "sent r1:5", "model done"]
    # The last step: nothing follows it, so its outputs go at once.
    server.halves.more = False
    server.engine.outputs = [output("r1", 7, finished=True)]
    server.engine.events.clear()
    server._step()
    assert server.engine.events == ["model starts", "processed r1", "sent r1:6", "model done",
                                    "processed r1", "sent r1:7"]
    assert server.kept is None and server.requests == {}
    assert (server.steps, server.overlapped_outputs) == (3, 2)
    assert ("3 step(s), the outputs of 2 processed while the next one ran, requests taken in during 0 model run(s), "
            "0 tokenizer question(s) answered while requests ran" == server.counters())


def test_kept_outputs_go_out_when_the_next_step_runs_no_model(server):
    generate(server, "r1")
    server._add_pending()
    server.halves.more = True
    server.engine.outputs = [output("r1", 5, finished=True)]
    server._step()
    assert server.sent == []
    # A client's abort emptied the scheduler meanwhile: the next step returns at once, without a wait.
    server.engine.runs_model = False
    server.halves.more = False
    server._step()
    assert [d.token_ids for d in server.sent[0].deltas] == [[5]] and server.kept is None


def test_outputs_kept_for_a_request_aborted_meanwhile_are_dropped(server):
    for rid in ("r1", "r2"):
        generate(server, rid)
    server._add_pending()
    server.halves.more = True
    server.engine.outputs = [output("r1", 5), output("r2", 6)]
    server._step()
    server._on_abort(PEER, P.Abort(request_ids=["r1"]))
    server._step()
    assert [d.request_id for d in server.sent[0].deltas] == ["r2"]


def test_processing_that_fails_while_the_model_runs_is_a_failed_step(server):
    step_kept(server)

    def broken(outputs):
        raise RuntimeError("detokenizer state lost")

    server.halves.process = broken
    with pytest.raises(StepFailed, match="detokenizer state lost"):
        server._step()


def test_a_non_streaming_requests_output_goes_first_token_at_once_then_merged(server, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(core.time, "monotonic", lambda: clock[0])
    generate(server, "whole", stream=False)
    generate(server, "streamed")
    server._add_pending()

    def step(*outs):
        server.sent.clear()
        server.engine.outputs = list(outs)
        server._step()
        return [(x.request_id, x.token_ids) for m in server.sent for x in m.deltas]

    # The first token of each goes at once (it times the first token, carries the prompt).
    assert step(output("whole", 1), output("streamed", 1)) == [("whole", [1]), ("streamed", [1])]
    # Then the streamed one every step, the whole one held ...
    assert step(output("whole", 2), output("streamed", 2)) == [("streamed", [2])]
    clock[0] += 0.1
    assert step(output("whole", 3)) == []
    # ... until it finishes: one merged delta with everything held.
    assert step(output("whole", 4, finished=True)) == [("whole", [2, 3, 4])]
    assert [d.finish_reason for d in server.sent[0].deltas] == ["length"] and "whole" not in server.requests
    assert len(server.held) == 0


def test_a_long_non_streaming_request_reaches_its_gateway_every_hold_time(server, monkeypatch):
    from engine_core.coalesce import HOLD_S

    clock = [100.0]
    monkeypatch.setattr(core.time, "monotonic", lambda: clock[0])
    generate(server, "whole", stream=False)
    server._add_pending()
    sent_tokens = []
    for token in range(1, 41):
        server.sent.clear()
        server.engine.outputs = [output("whole", token)]
        server._step()
        sent_tokens += [t for m in server.sent for x in m.deltas for t in x.token_ids]
        clock[0] += HOLD_S / 10
    # Everything older than the hold time is with the gateway (what a crash could lose is bounded).
    assert sent_tokens == list(range(1, len(sent_tokens) + 1)) and len(sent_tokens) >= 40 - 10
    # Aborted: what was held is dropped with it.
    server._on_abort(PEER, P.Abort(request_ids=["whole"]))
    assert len(server.held) == 0


# ---- tokenizer questions: bounded (tokenizing.py), and never a stall of the steps (issue 39) ----------

def ask_tokenizer(server, rid: str) -> None:
    server._on_tokenizer(PEER, P.Tokenizer(request_id=rid, kind="tokenize", body={"prompt": rid}))


def answering(server):
    answered = []
    server.tokenizer_endpoints = SimpleNamespace(
        answer=lambda kind, body: (answered.append(body["prompt"]), server.engine.events.append(
            "tokenized " + body["prompt"]))[0] and {"count": 1})
    return answered


def test_tokenizer_questions_are_answered_all_at_once_only_when_nothing_runs(server):
    answered = answering(server)
    for i in range(3):
        ask_tokenizer(server, f"t{i}")
    assert not answered and len(server.tokenizing) == 3  # queued by the handler, not answered there
    server._answer_tokenizing()
    assert answered == ["t0", "t1", "t2"] and not server.tokenizing
    assert [type(m) for m in server.sent] == [P.TokenizerReply] * 3
    # While a request runs: one per gap between two steps.
    generate(server, "r1")
    server._add_pending()
    for i in range(3, 6):
        ask_tokenizer(server, f"t{i}")
    server._answer_tokenizing()
    assert answered[3:] == ["t3"] and len(server.tokenizing) == 2 and server.tokenizer_answers == 1


def test_tokenizer_questions_while_the_model_runs_go_one_at_a_time_until_its_reply_is_in(server):
    answered = answering(server)
    generate(server, "r1")
    server._add_pending()
    server.halves.more = True
    for i in range(3):
        ask_tokenizer(server, f"t{i}")
    calls = iter([False, True])

    def model_runs():
        server.group.while_waiting()  # no reply yet: one question answered
        server.group.replies_in = next(calls)
        server.group.while_waiting()  # (woken again) still none: another
        server.group.replies_in = next(calls)
        server.group.while_waiting()  # the reply is in: the step's turnaround comes first

    server.engine.wait = model_runs
    server.engine.outputs = [output("r1", 5)]
    server.engine.events.clear()
    server._step()
    assert server.engine.events == ["model starts", "tokenized t0", "sent ", "tokenized t1", "sent ", "model done"]
    assert answered == ["t0", "t1"] and len(server.tokenizing) == 1


def test_a_tokenizer_question_queued_keeps_the_loop_from_blocking(server, monkeypatch):
    """The loop's poll does not wait (timeout 0) while a question is queued."""
    answering(server)
    ask_tokenizer(server, "t0")
    timeouts = []

    def poll(timeout=None):
        timeouts.append(timeout)
        if len(timeouts) > 1:
            raise StopIteration  # out of the loop after its second turn
        return []

    monkeypatch.setattr(server.poller, "poll", poll)
    with pytest.raises(StopIteration):
        server.run()
    assert timeouts[0] == 0 and not server.tokenizing


class SlicedCall:
    """A pooling request's engine requests as pooling_apis.PoolingCall adds them (a double): an
    input rendered, or one added, per call of ``stop``; one answer once every one is out."""

    def __init__(self, rid: str, n: int, fail_at: int | None = None):
        self.request_id, self.n, self.fail_at = rid, n, fail_at
        self.rendered = self.added = 0
        self.complete = self.done = False
        self.outputs: set[str] = set()

    @property
    def ids(self) -> list[str]:
        return [f"{self.request_id}-{i}" for i in range(self.added)]

    def add_some(self, engine, stop) -> list[str]:
        new = []
        while self.rendered < self.n:
            if self.rendered == self.fail_at:
                raise ValueError("This model's maximum context length is 64 tokens")
            self.rendered += 1
            if stop():
                return new
        while self.added < self.n:
            self.added += 1
            engine.add_request(self.ids[-1], "p", None)
            new.append(self.ids[-1])
            if stop():
                return new
        self.complete = True
        return new

    def deltas(self, ro):
        self.outputs.add(ro.request_id)
        if not (self.complete and len(self.outputs) == self.n):
            return []
        self.done = True
        return [P.Delta(request_id=self.request_id, finish_reason="stop", api_output="{}")]


def pooled(srv, rid: str, call: SlicedCall) -> None:
    built = srv._build
    srv._build = lambda msg: SimpleNamespace(spec=OutputSpec(chat=False, pooling=call))
    srv._on_generate(PEER, P.Generate(request_id=rid, kind="embeddings", body={"input": ["x"] * call.n}))
    srv._add_pending()
    srv._build = built


def test_a_pooling_requests_inputs_are_added_by_slices_between_steps(server, monkeypatch):
    """Security issue 53, item 2: rendering and adding 6 inputs at 4 ms each takes three gaps of
    10 ms; a request arriving meanwhile is added at the next gap and steps in between."""
    clock = iter(range(10_000))
    monkeypatch.setattr(core.time, "monotonic", lambda: next(clock) * 0.004)
    call = SlicedCall("p", 6)
    pooled(server, "p", call)
    assert 0 < call.rendered < 6 and call.added == 0 and not server.engine.requests
    server._on_stats(PEER, P.Stats(request_ids=["p"]))
    assert server.sent[-1].missing == []  # held while its inputs go in
    generate(server, "g")
    server._add_pending()
    assert "g" in server.engine.requests and not call.complete  # the small one went in at once
    server.engine.outputs = [output("g", 5)]
    server._step()  # g's step, between two slices
    for _ in range(5):
        if call.complete:
            break
        server._add_pending()
    assert call.complete and set(server.engine.requests) == {"g", *call.ids}
    server.sent.clear()
    server.engine.outputs = [output(f"p-{i}", 1, finished=True) for i in range(6)]
    server._step()
    assert [(d.request_id, d.api_output) for d in server.sent[0].deltas] == [("p", "{}")]
    assert "p" not in server.requests and not server.pooled


def test_a_pooling_request_aborted_or_refused_while_sliced_is_dropped(server, monkeypatch):
    clock = iter(range(10_000))
    monkeypatch.setattr(core.time, "monotonic", lambda: next(clock) * 0.004)
    generate(server, "g")  # busy: the slices have their budget
    server._add_pending()
    call = SlicedCall("p", 8)
    pooled(server, "p", call)
    while call.added < 2:
        server._add_pending()
    server._on_abort(PEER, P.Abort(request_ids=["p"]))
    assert not server.slices and "p" not in server.requests
    assert set(call.ids) <= set(server.engine.aborted) and set(server.engine.requests) == {"g"}
    bad = SlicedCall("q", 4, fail_at=2)
    pooled(server, "q", bad)
    while server.slices:
        server._add_pending()
    error = server.sent[-1]
    assert isinstance(error, P.RequestError) and error.request_id == "q" and error.status == 400, error
    assert "q" not in server.requests and not server.slices


def test_a_sliced_pooling_request_goes_on_while_a_steps_model_runs(server, monkeypatch):
    clock = iter(range(10_000))
    monkeypatch.setattr(core.time, "monotonic", lambda: next(clock) * 0.004)
    generate(server, "g")
    server._add_pending()
    call = SlicedCall("p", 6)
    pooled(server, "p", call)
    assert not call.complete and not server.pending
    server.engine.outputs = [output("g", 5)]
    server._step()  # the model runs and no reply is in: the slices go on meanwhile
    assert call.complete and server.intake_while_waiting == 1


def test_a_librarys_panic_over_one_request_is_that_requests_400():
    """pyo3's PanicException derives from BaseException: one request's malformed part made
    pydantic-core panic inside vLLM's parser, and the engine died of it (tests/test_pooling.py)."""
    class PanicException(BaseException):  # pyo3 makes one such class per Rust extension
        pass

    panic = PanicException("called `Option::unwrap()` on a `None` value")
    assert is_request_error(panic) and is_request_error(ValueError("x"))
    assert not is_request_error(KeyboardInterrupt()) and not is_request_error(SystemExit(1))
    bad = refusal(panic)
    assert bad.status == 400 and "could not be parsed" in str(bad)


def test_a_generates_own_priority_is_the_requests_where_its_body_carries_none(server):
    """Messages and speech: vLLM's request classes have no ``priority``; the gateway's fair-share
    tag comes in ``Generate.priority`` and is what the request is added with. None: the body's."""
    added = {}
    server.engine.add_request = lambda rid, prompt, params, priority=0, **kw: added.__setitem__(rid, priority)
    del server._build  # the real one, over a builder that gives every request the body's priority 7
    server.builder = SimpleNamespace(build=lambda kind, body, rid, aid: Built(
        body["prompt"], SimpleNamespace(), 7, None, OutputSpec(chat=False, logprobs=0)))
    server._on_generate(PEER, P.Generate(request_id="tagged", kind="messages", body={"prompt": "hi"}, priority=3000))
    server._on_generate(PEER, P.Generate(request_id="plain", kind="completion", body={"prompt": "hi"}))
    server._add_pending()
    assert added == {"tagged": 3000, "plain": 7}
