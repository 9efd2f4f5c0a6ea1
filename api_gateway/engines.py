"""The gateway's link to each engine: one owner of a model's availability.

A link follows the manager's events for its model. When the manager says the
engine is ready (with an incarnation id), the link opens a fresh DEALER to the
engine's socket and says hello; frames of an older incarnation are dropped.
When the engine exits, every in-flight request of that model hears of it at
once (and goes on with the next incarnation: sequences.py) and new requests
wait (bounded) for it instead of failing.

The link's state is a ``LinkState`` (link_state.py), changed only by
``EngineLink._swap`` along ``TRANSITIONS``, which tells its model
(``on_change``: api_gateway/served.py, where requests wait for a replica).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from api_gateway.engine_requests import EngineRequests, RequestStream
from api_gateway.errors import EngineRequestError, EngineUnavailable
from api_gateway.link_state import HELLO_PENDING, LIVE, MANAGER_STATES, TRANSITIONS, WORDS, LinkState
from servectl.config import LoraModule
from servectl.tasks import Tasks
from servectl.wire import engine as EP
from servectl.wire.vocab import ModelState

__all__ = ["EngineLink", "EngineRequestError", "EngineUnavailable", "LinkState", "TRANSITIONS"]

log = logging.getLogger("api_gateway.engines")
S = LinkState
M = ModelState


# A warm engine's silence is probed this long after its published step deadline (a step's
# outputs still on their way); tests scale it down to see a probe in milliseconds.
PROBE_MARGIN_S = 2.0


# The largest message a gateway takes from an engine: a step's output for many requests with
# prompt logprobs, a tokenizer's answer to a long prompt, vLLM's metrics text. Generous, so only
# abuse reaches it; a larger one closes that connection (ZMQ_MAXMSGSIZE) before it is held.
MAX_ENGINE_MESSAGE_BYTES = 256 << 20

# A held request waits out this multiple of the model's longest measured start.
START_MARGIN = 1.5


class EngineLink(EngineRequests):
    """One engine group's link (a model's, or one replica's: ``model`` is the group's name); the
    requests sent on it and the engine's answers to them are ``EngineRequests`` (engine_requests.py)."""

    def __init__(self, model: str, socket_path: str, ctx: zmq.asyncio.Context, identity: bytes,
                 wake: Callable[[str], None] = lambda model: None,
                 task_died: Callable[[str, BaseException], None] | None = None):
        self.model = model
        # The reader's owner: it restarts a reader that raised, and past its restarts calls
        # task_died (the gateway exits TASK_DIED and the manager replaces it).
        self.tasks = Tasks(log)
        self.task_died = task_died or (lambda name, exc: None)
        self.wake = wake  # asks the manager to bring a released model back (WakeModel)
        self.hold_timeout_s: float | None = None  # the model's own, else the gateway's
        self.start_s: float | None = None  # the model's longest start, as the manager measured it
        self.config_id = ""  # what the model's outputs depend on (servectl.config.output_identity)
        self.socket_path = socket_path
        self.ctx = ctx
        self.identity = identity
        self.state = S.STARTING
        # Set exactly while READY or REMOVED: either way, waiting for this engine is over.
        self.ready = asyncio.Event()
        # Set when the socket in use is closed (its engine lifetime is over): a fresh one per socket.
        self.gone = asyncio.Event()
        self.ended_hung = False  # the last engine lifetime was killed as hung (_disconnect)
        # The engine's step deadline as it last published it (None until it is warm): hangs are
        # then found in that many seconds, not in the configured cold ones.
        self.step_deadline_s: float | None = None
        # The manager's word for the model that put the link in its state (``status`` says it
        # where the state alone cannot: DOWN after backoff or exited, DRAINING after stopping).
        self.manager_word: ModelState | None = None
        self.reason: str | None = None
        self.incarnation = ""  # set once the engine answered our Hello
        self.start_span = ""  # its start span's traceparent (tracing on): what a resumed request links to
        self.connecting_to = ""  # the incarnation our socket was opened for
        self.max_model_len: int | None = None
        self.max_prompt_chars = 0  # the engine's HelloReply: its prompts' character cap (0: not told)
        self.supported_tasks: list[str] = []  # what the model does (vLLM's tasks), from the engine's hello
        self.kv_events: dict | None = None  # where its engine publishes KV-cache events (vLLM's KVEventsConfig)
        self.kv_events_rank = 0  # the rank its event batches carry
        # The LoRA adapters the model serves (the manager's word, in its events): requests may
        # name one of them instead of the model.
        self.loras: list[LoraModule] = []
        # Why the model cannot be loaded under the memory budget even alone (the manager's word):
        # its requests are refused at once (a 503 saying why, before any header) instead of held.
        self.unfit: str | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self.reader: asyncio.Task | None = None
        self.streams: dict[str, RequestStream] = {}
        self.outstanding = 0  # sequences sent to this engine and not finished (served.py picks by it)
        # Called after every change of state or fitness (its ServedModel: waiters, wakes).
        self.on_change: Callable[[EngineLink], None] = lambda link: None
        self.max_num_seqs = 0
        self.stats_waiters: list[asyncio.Future] = []
        # Messages from the engine lifetime that answered our Hello: a probe that gets no answer
        # while this moves (outputs, tokenizer answers) found the engine busy, not hung.
        self.heard = 0
        self.metrics_waiters: list[asyncio.Future] = []
        # A send waits this long for the engine to take it (only a hung engine leaves its queue
        # full); Gateway sets it from the config.
        self.send_timeout_s = 120.0
        self.sndhwm: int | None = None  # zmq's default (1000 frames) unless a test makes it small
        self._abort_ids: list[str] = []  # aborts not yet on the socket, sent in order by one task
        self._abort_task: asyncio.Task | None = None
        self.replies: dict[str, asyncio.Future] = {}  # tokenizer requests awaiting their answer
        self.on_engine = {EP.StepOutput: self._on_step_output, EP.StatsReply: self._on_stats_reply,
                          EP.MetricsReply: self._on_metrics_reply, EP.RequestError: self._on_request_error,
                          EP.TokenizerReply: self._on_tokenizer_reply}

    @property
    def is_ready(self) -> bool:
        return self.state is S.READY

    @property
    def status(self) -> ModelState:
        """"ready", or why not in the manager's words (what /health and /v1/models report)."""
        said = self.manager_word
        return said if said is not None and MANAGER_STATES.get(said) is self.state else WORDS[self.state]

    def _swap(self, expected: frozenset[LinkState], new: LinkState) -> bool:
        """The one place the state changes: only from an expected state, only along TRANSITIONS."""
        old = self.state
        if old not in expected or new not in TRANSITIONS[old]:
            log.warning("engine link %s: %s -> %s refused", self.model, old.value, new.value)
            return False
        self.state = new
        self.manager_word = None  # on_model_state sets it when the manager's word made this change
        if new is S.READY or new is S.REMOVED:
            self.ready.set()
        else:
            self.ready.clear()
        self.on_change(self)
        return True

    # ---- following the manager --------------------------------------------------
    def on_model_state(self, state: ModelState, incarnation: str, reason: str | None,
                       hold_timeout_s: float | None = None, start_s: float | None = None,
                       config_id: str = "", hung: bool = False) -> None:
        try:
            state = ModelState(state)
        except ValueError:
            log.warning("engine link %s: unknown model state %r ignored", self.model, state)
            return
        self.reason = reason or None
        self.hold_timeout_s = hold_timeout_s
        if start_s is not None:
            self.start_s = start_s
        if config_id:
            self.config_id = config_id
        if state is M.READY:
            if incarnation and incarnation == self.incarnation and self.sock is not None:
                # The engine that answered our Hello serves again (woken from sleep); the same
                # incarnation is also announced again on every freeze/thaw and in the snapshot.
                if self.state in (S.STARTING, S.RELEASED):
                    self._swap(frozenset({S.STARTING, S.RELEASED}), S.READY)
                return
            # Reconnect only for a new engine lifetime.
            if incarnation != self.connecting_to or self.sock is None:
                self._connect(incarnation)
            return
        new = MANAGER_STATES.get(state)
        if new is None:  # RELEASING: the engine decides (it serves what it gets, or bounces it once it agreed);
            return  # REMOVED: ManagerLink removes the link
        if (new in (S.DOWN, S.FAILED) or state is M.RELEASED) and self.sock is not None:
            why = {M.FAILED: "failed", M.RELEASED: "was released"}.get(state, "exited")
            self._disconnect(f"the engine for model {self.model!r} {why}" + (f" ({reason})" if reason else ""),
                             hung)
        # STARTING and DRAINING keep the socket: a draining engine finishes what it has, and
        # a new incarnation's "ready" replaces the socket (failing what is left on it).
        if self._swap(LIVE, new):
            self.manager_word = state

    def set_unfit(self, unfit: str | None) -> None:
        was, self.unfit = self.unfit, unfit
        if bool(was) != bool(unfit):
            self.on_change(self)  # held requests learn it now

    def remove(self) -> None:
        """The model was unloaded: fail what is left and wake whoever waits."""
        self._disconnect(f"model {self.model!r} was unloaded")
        self._swap(LIVE, S.REMOVED)

    def _connect(self, incarnation: str) -> None:
        if not self._swap(LIVE, S.CONNECTING):
            return
        log.info("connecting to engine %s (incarnation %s)", self.model, incarnation)
        self._disconnect("the engine restarted")
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        # Never queue frames for a peer that is not connected (../shared/DESIGN.md).
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_ENGINE_MESSAGE_BYTES)
        if self.sndhwm is not None:
            sock.setsockopt(zmq.SNDHWM, self.sndhwm)
        sock.connect(f"ipc://{self.socket_path}")
        self.sock = sock
        self.gone = asyncio.Event()
        self.step_deadline_s = None  # a new engine lifetime publishes its own once warm
        self.connecting_to = incarnation
        # Restarted on the same socket when it raises (a handler's bug, a frame it could not
        # take): the other requests go on, and one whose output was lost with the failing frame
        # is found by its probe (Stats). Failing again and again, it ends the gateway instead.
        self.reader = self.tasks.keep(lambda: self._handshake_then_read(sock, incarnation),
                                      f"read engine {self.model}", give_up=self.task_died)

    def _disconnect(self, why: str, hung: bool = False) -> None:
        """Close the socket and fail every request in flight on it (the state is the caller's);
        ``hung``: that engine lifetime was killed as hung (said in each failure, and in
        ``ended_hung`` for whoever awaited ``gone``)."""
        if self.reader is not None:
            self.reader.cancel()
            self.reader = None
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
            self.ended_hung = hung
            self.gone.set()
        self.incarnation = self.connecting_to = ""
        # Aborts for a closed socket are moot: that engine lifetime is over.
        self._abort_ids.clear()
        if self._abort_task is not None:
            self._abort_task.cancel()
            self._abort_task = None
        streams, self.streams = self.streams, {}
        self.outstanding = 0
        for stream in streams.values():
            stream.sink.put_nowait((stream.request_id, EngineUnavailable(why, retry_after=5, hung=hung)))
        replies, self.replies = self.replies, {}
        for fut in replies.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable(why, retry_after=5))

    async def _handshake_then_read(self, sock: zmq.asyncio.Socket, incarnation: str) -> None:
        if not self.incarnation:  # not answered yet (a restarted reader of an answered one reads on)
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
        """One frame from the engine our socket was opened for (``incarnation``): the Hello's
        answer, or a message of the engine lifetime that answered it (any other is dropped)."""
        if isinstance(msg, EP.HelloReply):
            self._on_hello(msg, incarnation)
        elif msg.incarnation == self.incarnation:
            self.heard += 1
            self.on_engine[type(msg)](msg)

    # ---- one handler per engine message (HelloReply: _on_hello; the others: engine_requests.py) ----
    def _on_request_error(self, msg: EP.RequestError) -> None:
        if msg.released:
            # The engine agreed to give its memory back: nothing more goes to it, and the
            # request (not started) waits for the wake like any other (sequences.py sends it again).
            # (later bounces, from requests sent meanwhile, change nothing)
            if self.state is S.READY:
                self._swap(frozenset({S.READY}), S.RELEASED)
            stream = self._forget(msg.request_id)
            if stream is not None:
                stream.sink.put_nowait((msg.request_id, EngineUnavailable(f"model {self.model!r} is being released",
                                                                          retry_after=5)))
            return
        if msg.draining:
            # It took nothing more (a reload, an unload, a restart under way): the request goes to
            # another replica, or waits for the next incarnation, as after a crash; so do the next.
            if self.state is S.READY:
                self._swap(frozenset({S.READY}), S.DRAINING)
            stream = self._forget(msg.request_id)
            if stream is not None:
                stream.sink.put_nowait((msg.request_id, EngineUnavailable(msg.message, retry_after=5)))
            return
        stream = self._forget(msg.request_id)
        if stream is not None:
            stream.sink.put_nowait((msg.request_id, EngineRequestError(msg.message, msg.status, msg.param)))
        fut = self.replies.pop(msg.request_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(EngineRequestError(msg.message, msg.status, msg.param))

    def _on_hello(self, msg: EP.HelloReply, incarnation: str) -> None:
        if msg.version != EP.PROTOCOL_VERSION:
            log.error("engine %s speaks protocol %d, this gateway %d", self.model, msg.version, EP.PROTOCOL_VERSION)
            if self._swap(HELLO_PENDING, S.FAILED):
                self.reason = "protocol version mismatch"
            return
        if msg.incarnation != incarnation:
            return  # hello of a different lifetime of the engine
        self.incarnation = msg.incarnation
        self.start_span = msg.trace_parent
        self.max_model_len, self.max_num_seqs = msg.max_model_len, msg.max_num_seqs
        self.max_prompt_chars = msg.max_prompt_chars
        # Sorted: vLLM builds a pooling model's tasks from a set, whose order changes from start to start.
        self.supported_tasks = sorted(msg.tasks)
        self.kv_events, self.kv_events_rank = msg.kv_events, msg.kv_events_rank
        if self._swap(HELLO_PENDING, S.READY):
            log.info("engine %s ready (incarnation %s)", self.model, incarnation)

    # ---- how long a request waits ------------------------------------------------
    def hold_s(self, default_s: float) -> float:
        """How long a request may wait for this model: its own hold_timeout_s if configured; else
        the gateway's, or longer where the model's measured start is (a cold start on a loaded
        host may take more than the default; it is waited out, with a margin)."""
        if self.hold_timeout_s:
            return self.hold_timeout_s
        return max(default_s, START_MARGIN * self.start_s) if self.start_s else default_s

    def output_timeout(self, cold_s: float) -> float:
        """How long a request may see no output before the engine is probed (and as long again
        before it is called hung): the engine's published step deadline, plus a margin, once it
        is warm; ``cold_s`` (gateway.output_timeout_s) before that."""
        if self.step_deadline_s is None:
            return cold_s
        return min(cold_s, self.step_deadline_s + PROBE_MARGIN_S)
