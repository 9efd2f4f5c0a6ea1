"""The gateway's connection to its manager: the events it follows and the control socket it reports on.

Events (SUB) say which models exist and what state each is in; they drive the
gateway's ``EngineLink``s, which this module creates and drops as models are
loaded and unloaded. The control socket (DEALER) carries the gateway's own
messages to the manager: its readiness, a model that looks hung, and a request
held for a released model (``WakeModel``); the manager sends it new API keys
there when a reload rotates them.
"""

from __future__ import annotations

import asyncio
import logging
import os

import msgspec
import zmq
import zmq.asyncio

from api_gateway.engines import EngineLink
from api_gateway.metrics import Metrics
from api_gateway.served import ServedModel
from servectl.paths import RuntimePaths
from servectl.tasks import Tasks
from servectl.wire import control as MP
from servectl.wire import status as WS
from servectl.wire.spawn import model_component, model_of
from servectl.wire.vocab import EventKind, ExitCode, ModelState

log = logging.getLogger("api_gateway.manager_link")

# The largest message the gateway takes from the manager (events, a status snapshot with many
# children and their last log lines, an answer): generous, so that only abuse reaches it; a
# larger one closes that connection (ZMQ_MAXMSGSIZE) before the gateway holds it.
MAX_MANAGER_MESSAGE_BYTES = 64 << 20


def _log_failure(sent: asyncio.Future) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.error("could not report to the manager: %s", sent.exception())


def exit_task_died(name: str, exc: BaseException) -> None:
    """Until a gateway says otherwise: a long-lived task that kept failing ends the process
    (TASK_DIED), so the manager replaces it instead of leaving it serving nothing."""
    log.critical("task %r died: %r; exiting %d", name, exc, ExitCode.TASK_DIED)
    logging.shutdown()
    os._exit(ExitCode.TASK_DIED)


class ManagerLink:
    """Events in, the gateway's reports out; owner of the engine group → ``EngineLink`` map and of
    the served model → ``ServedModel`` one (a replicated model's links are its replicas')."""

    def __init__(self, paths: RuntimePaths, identity: str, ctx: zmq.asyncio.Context, models: list[str],
                 metrics: Metrics, count_restarts: bool, send_timeout_s: float = 120.0):
        self.paths = paths
        self.identity = identity
        self.ctx = ctx
        self.metrics = metrics
        # Every gateway sees every event: one of them (index 0) counts restarts, so the
        # multiprocess sum of the counter is the number of restarts.
        self.count_restarts = count_restarts
        self.send_timeout_s = send_timeout_s
        # Called when a long-lived task (follow, an engine link's reader) failed past its
        # restarts: the gateway's Gateway.task_died (drain, exit TASK_DIED).
        self.on_task_died = exit_task_died
        self.links: dict[str, EngineLink] = {}  # by engine group name
        self.models: dict[str, ServedModel] = {}  # by the name requests use
        for name in models:
            self._new_link(name)
        self.tasks = Tasks(log)  # reports sent in the background (WakeModel, GroupHung)
        self.sub: zmq.asyncio.Socket | None = None
        self.control: zmq.asyncio.Socket | None = None
        self.component = ""  # ours in the manager's words (set by send_ready)
        self.on_api_keys = lambda keys: None  # a reload rotated the API or admin keys (MP.ApiKeys)
        self.on_event = lambda ev: None  # every manager event, as it comes (the status page's)
        # Set (and replaced) on each model event: an admin verb's answer waits on it until this
        # gateway's view shows the change the manager said is done (api_gateway/admin.py).
        self.changed = asyncio.Event()
        self.admits: dict[int, asyncio.Future] = {}  # Admit tickets waiting for the manager's Admitted

    def _new_link(self, group: str) -> EngineLink:
        link = EngineLink(group, str(self.paths.engine(group)), self.ctx, self.identity.encode(), wake=self.wake,
                          task_died=lambda name, exc: self.on_task_died(name, exc))
        link.send_timeout_s = self.send_timeout_s
        self.links[group] = link
        self.metrics.model_known(group)
        model = model_of(group)
        served = self.models.get(model)
        if served is None:
            served = self.models[model] = ServedModel(model)
        served.add(link)
        return link

    def connect(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.MAXMSGSIZE, MAX_MANAGER_MESSAGE_BYTES)
        self.sub.connect(RuntimePaths.ipc(self.paths.events))
        self.control = self.ctx.socket(zmq.DEALER)
        self.control.setsockopt(zmq.LINGER, 1000)
        self.control.setsockopt(zmq.IDENTITY, self.identity.encode())
        self.control.setsockopt(zmq.MAXMSGSIZE, MAX_MANAGER_MESSAGE_BYTES)
        self.control.connect(RuntimePaths.ipc(self.paths.control))

    async def follow(self) -> None:
        """Apply the manager's events (and one snapshot of its state) until cancelled."""
        sub = self.sub
        # Subscribed first, then ask for a snapshot: no state change falls between.
        await self.control.send(MP.encoder.encode(MP.StatusRequest()))
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        while True:
            for sock, _ in await poller.poll():
                body = await sock.recv()
                if sock is sub:
                    try:
                        ev = WS.event_decoder.decode(body)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue
                    self.on_event(ev)
                    if ev.kind is EventKind.MODEL and ev.model:
                        # (a word that is not a model's state is ignored there: EngineLink.on_model_state)
                        self.on_model_event(ev.model, ev.state, ev.incarnation, ev.detail, ev.hold_timeout_s,
                                            ev.start_s, ev.config_id, ev.loras, ev.detail if ev.unfit else None,
                                            ev.hung)
                    elif ev.kind is EventKind.DEADLINE and ev.model:
                        if ev.step_deadline_s is not None:
                            self.on_deadline(ev.model, ev.step_deadline_s, ev.incarnation)
                        continue
                    self.metrics.child_state(ev.component, ev.state)
                    if ev.kind is EventKind.MODEL:
                        if self.count_restarts:
                            self.metrics.model_event(ev.model, ev.state, ev.detail, ev.hung)
                    elif ev.kind is not EventKind.HOST:
                        self.metrics.child_restarts.labels(component=ev.component).set(ev.restarts)
                else:
                    try:
                        reply = MP.control_out_decoder.decode(body)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue
                    if isinstance(reply, MP.StatusReply):
                        # A gateway started after them (a restart) learns every state and count here.
                        for c in reply.children:
                            self.metrics.child_state(c.component, c.state)
                            self.metrics.child_restarts.labels(component=c.component).set(c.restarts)
                        for m in reply.models:
                            self.metrics.child_state(model_component(m.name), m.state)
                            self.on_model_event(m.name, m.state, m.incarnation, m.reason, m.hold_timeout_s,
                                                m.start_s, m.config_id, m.loras, m.unfit)
                            if m.step_deadline_s is not None:
                                self.on_deadline(m.name, m.step_deadline_s, m.incarnation)
                    elif isinstance(reply, MP.Admitted):
                        waiter = self.admits.pop(reply.ticket, None)
                        if waiter is not None and not waiter.done():
                            waiter.set_result(reply)
                    elif isinstance(reply, MP.ApiKeys):
                        self.on_api_keys(reply)
                        await self.control.send(MP.encoder.encode(MP.KeysApplied(component=self.component,
                                                                                 pid=os.getpid())))

    def on_model_event(self, model: str, state: ModelState, incarnation: str, reason: str | None,
                       hold_timeout_s: float | None = None, start_s: float | None = None,
                       config_id: str = "", loras: list[MP.LoraModule] | None = None,
                       unfit: str | None = None, hung: bool = False) -> None:
        """Models come and go at runtime (`servectl load/unload/reload`), and so do their LoRA adapters."""
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()
        link = self.links.get(model)
        if state == ModelState.REMOVED:
            if link is not None:
                del self.links[model]
                # Its engine's last scraped count is no longer running anywhere (every gateway sees this).
                self.metrics.running.labels(model=model).set(0)
                served = self.models[model_of(model)]
                served.drop(model)
                if not served.links:
                    del self.models[served.name]
            return
        if link is None:
            link = self._new_link(model)
        if loras is not None:
            link.loras = list(loras)
        link.set_unfit(unfit)
        link.on_model_state(state, incarnation, reason, hold_timeout_s, start_s, config_id, hung)

    def on_deadline(self, model: str, seconds: float, incarnation: str = "") -> None:
        """An engine published its step deadline: its link finds hangs by it, /metrics shows it."""
        link = self.links.get(model)
        if link is None or (incarnation and incarnation not in (link.incarnation, link.connecting_to)):
            return  # another engine lifetime's
        link.step_deadline_s = seconds
        self.metrics.step_deadline.labels(model=model).set(seconds)

    async def send_ready(self, component: str, pid: int) -> None:
        self.component = component
        await self.control.send(MP.encoder.encode(MP.ChildReady(component=component, pid=pid)))

    def wake(self, model: str) -> None:
        """A request waits for a released model: ask the manager to bring it back (idempotent there)."""
        self.tasks.start(self._report(MP.encoder.encode(MP.WakeModel(model=model))), f"wake {model}")

    def report_hang(self, link: EngineLink) -> None:
        """Tell the manager a model produced nothing and did not answer Stats: it restarts the group."""
        msg = MP.encoder.encode(MP.GroupHung(model=link.model, incarnation=link.incarnation))
        self.tasks.start(self._report(msg), f"report {link.model} hung")

    async def ask(self, msg, timeout_s: float = 10.0) -> MP.StatusReply | MP.Ack | MP.LoraReply | MP.LogLines | \
            MP.UsageReply:
        """One request to the manager and its answer, on a connection of its own (as the CLI's),
        so the answer cannot be confused with what the manager sends the gateway's own socket."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MANAGER_MESSAGE_BYTES)
        try:
            sock.connect(RuntimePaths.ipc(self.paths.control))
            # event-proof: the manager answers these at once (a LoRA change within LORA_CHANGE_TIMEOUT_S,
            # a model verb within its caller's wait); bounded so a stuck manager is a 503.
            async with asyncio.timeout(timeout_s):
                await sock.send(MP.encoder.encode(msg))
                reply = MP.control_out_decoder.decode(await sock.recv())
        finally:
            sock.close()
        if not isinstance(reply, (MP.StatusReply, MP.Ack, MP.LoraReply, MP.LogLines, MP.UsageReply)):
            raise ValueError(f"unexpected answer {type(reply).__name__}")
        return reply

    async def admit(self, msg: MP.Admit, timeout_s: float) -> MP.Admitted:
        """A limited key's request: may it start (the manager counts every gateway's)? On the
        gateway's own control socket, its answer paired by ticket in ``follow``."""
        waiter = self.admits[msg.ticket] = asyncio.get_running_loop().create_future()
        try:
            # event-proof: the manager answers an Admit at once; bounded so a stuck manager is a 503.
            async with asyncio.timeout(timeout_s):
                await self.control.send(MP.encoder.encode(msg))
                return await waiter
        finally:
            self.admits.pop(msg.ticket, None)

    def report_now(self, msg) -> None:
        """A message for the manager queued at once (not in a later task: a usage report goes
        before the answer's last bytes, so a gateway killed after them has sent it)."""
        if self.control is None:  # not connected (a gateway built without its manager: the unit tests')
            return
        try:
            sent = self.control.send(MP.encoder.encode(msg))
        except zmq.ZMQError as exc:
            log.error("could not report to the manager: %s", exc)
            return
        sent.add_done_callback(_log_failure)

    def report(self, msg) -> None:
        """A message for the manager that needs no answer (sent in the background, bounded)."""
        self.tasks.start(self._report(MP.encoder.encode(msg)), f"report {type(msg).__name__}")

    async def _report(self, body: bytes) -> None:
        try:
            # event-proof: the manager reads its control socket at once; bounded all the same.
            async with asyncio.timeout(10):
                await self.control.send(body)
        except (TimeoutError, zmq.ZMQError) as exc:
            log.error("could not report to the manager: %s", exc)
