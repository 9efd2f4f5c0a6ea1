"""vLLM's KV-cache events from servectl's engine, on a publisher that sleeps while idle.

vLLM's ``ZmqEventPublisher`` hands each batch to a thread that waits on its
queue with a 0.1 s timeout: ten wake-ups a second on an idle engine, and it
binds ``tcp://*:5557`` unless told otherwise. This one is registered with
vLLM's ``EventPublisherFactory`` as ``servectl`` and speaks the same protocol
(a PUB socket sending ``(topic, seq, msgpack(KVEventBatch))``, and, with a
``replay_endpoint``, a ROUTER answering a start sequence number with the
batches buffered since and an end marker), but:

- ``publish`` sends on the PUB socket from the scheduler's thread: ZeroMQ
  queues the frames to its I/O thread, and a PUB socket never blocks (past
  its high-water mark it drops, as vLLM's does). Encoding a batch is on the
  step's path; batches come only when blocks are stored or freed.
- replay requests are answered by a thread blocked in ``poll()`` without a
  timeout, woken only by a request or by shutdown (an inproc doorbell).
- it always binds its endpoint (the manager gave each engine its own:
  servectl/kv_events.py; an ``ipc://`` socket file is made 0600), and reports
  the bound one (port 0 resolved) with ``publisher = "zmq"``, as ``vllm
  serve``'s /kv_event_sources shows it.
- unless the model has ``kv_events_token_ids = true``, each ``BlockStored`` goes
  out without what would give its prompt away: ``token_ids`` empty, no
  ``extra_keys`` (LoRA name, media ids, ``cache_salt``), no ``session_id``. The
  block hashes, parent hash, block size, medium and LoRA name stay: still
  vLLM's schema, every field a consumer decodes present.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import deque
from dataclasses import asdict
from typing import Any

import msgspec
import zmq

from servectl import kv_events

log = logging.getLogger("engine_core.kv_events")

PUBLISHER = "servectl"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    old = os.umask(0o177)  # an ipc:// socket file 0600: the service user's alone, as the engine's own
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def without_prompt(events: list) -> list:
    """The events with each ``BlockStored``'s token ids, extra keys and session id taken out
    (copies: vLLM's own objects are left as they are)."""
    from vllm.distributed.kv_events import BlockStored

    return [msgspec.structs.replace(e, token_ids=[], extra_keys=None, session_id=None)
            if isinstance(e, BlockStored) else e for e in events]


class SleepingZmqPublisher:
    """vLLM's ``EventPublisher`` surface: ``publish``, ``shutdown``, ``get_publisher_config``."""

    def __init__(self, data_parallel_rank: int = 0, endpoint: str = "", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000, topic: str = "",
                 rank: int | None = None, token_ids: bool = False) -> None:
        from vllm.config.kv_events import KVEventsConfig

        self.rank = data_parallel_rank if rank is None else rank
        self.token_ids = token_ids  # the model's kv_events_token_ids: BlockStored whole
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(hwm)
        bound = _bind(self.pub, endpoint)
        self.topic = topic.encode()
        self.encoder = msgspec.msgpack.Encoder()
        self.seqs = itertools.count()
        self.lock = threading.Lock()  # the replay buffer: appended by publish, read by the replay thread
        self.buffer: deque[tuple[int, bytes]] | None = None
        self.replay_thread: threading.Thread | None = None
        replay_bound = None
        if replay_endpoint:
            self.buffer = deque(maxlen=buffer_steps)
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.MAXMSGSIZE, 64)  # a request is one 8-byte sequence number
            replay_bound = _bind(self.replay, replay_endpoint)
            doorbell = f"inproc://servectl-kv-replay-{id(self):x}"
            self.wake_in = self.ctx.socket(zmq.PAIR)
            self.wake_in.bind(doorbell)
            self.wake_out = self.ctx.socket(zmq.PAIR)
            self.wake_out.connect(doorbell)
            self.replay_thread = threading.Thread(target=self._serve_replay, name="kv-events-replay", daemon=True)
            self.replay_thread.start()
        self.config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=bound,
                                     replay_endpoint=replay_bound, buffer_steps=buffer_steps, hwm=hwm,
                                     max_queue_size=max_queue_size, topic=topic)
        log.info("KV-cache events on %s%s", bound, f" (replay on {replay_bound})" if replay_bound else "")

    def get_publisher_config(self):
        return self.config

    def publish(self, events) -> None:
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self.rank
        if not self.token_ids:
            events = msgspec.structs.replace(events, events=without_prompt(events.events))
        seq = next(self.seqs)
        payload = self.encoder.encode(events)
        if self.buffer is not None:  # kept first: a replay asked for meanwhile includes it
            with self.lock:
                self.buffer.append((seq, payload))
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), copy=False)

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.replay, zmq.POLLIN)
        poller.register(self.wake_in, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())  # event-proof: no timeout; a replay request or shutdown wakes it
            if self.wake_in in ready:
                return
            try:
                self._answer_replay(self.replay.recv_multipart())
            except Exception:  # noqa: BLE001 - one bad request; replays go on
                log.exception("answering a KV-events replay request")

    def _answer_replay(self, frame: list[bytes]) -> None:
        if len(frame) != 3:
            log.warning("a replay request of %d frame(s), not 3: ignored", len(frame))
            return
        client, _, start = frame
        first = int.from_bytes(start, "big")
        with self.lock:
            batches = [item for item in self.buffer if item[0] >= first]
        for seq, payload in batches:
            self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def shutdown(self) -> None:
        if self.replay_thread is not None:
            self.wake_out.send(b"")
            self.replay_thread.join(timeout=1.0)
            if not self.replay_thread.is_alive():  # else its sockets are its own to the end (a daemon thread)
                for sock in (self.replay, self.wake_in):
                    sock.close(linger=0)
            self.wake_out.close(linger=0)
        self.pub.close(linger=0)


_publishers: list[SleepingZmqPublisher] = []  # the one this engine's scheduler made
# What vllm_config decided for it: the rank its batches carry (the group's slot), token ids or not.
_settings: dict[str, Any] = {"rank": 0, "token_ids": False}


def _made(**kwargs) -> SleepingZmqPublisher:
    publisher = SleepingZmqPublisher(**kwargs, **_settings)
    _publishers[:] = [publisher]
    return publisher


def published() -> tuple[dict[str, Any] | None, int]:
    """Where this engine publishes (vLLM's KVEventsConfig as /kv_event_sources shows it, or None)
    and the rank its batches carry."""
    return (asdict(_publishers[0].config), _publishers[0].rank) if _publishers else (None, 0)


def vllm_config(engine_args: dict[str, Any], runtime_dir: str, model: str, slot: int,
                token_ids: bool = False) -> dict[str, Any]:
    """The engine arguments with ``kv_events_config`` made vLLM's ``KVEventsConfig`` on this
    group's endpoints (the default's in ``runtime_dir``, named by ``model`` and ``slot``, the
    manager's) and servectl's publisher (registered here), where events are on. ``token_ids``:
    the model's ``kv_events_token_ids``."""
    cfg = kv_events.events_config(engine_args)
    if cfg is None:
        return engine_args
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory

    _settings.update(rank=max(slot, 0), token_ids=token_ids)
    try:
        EventPublisherFactory.register_publisher(PUBLISHER, _made)
    except KeyError:
        pass  # registered by an earlier build in this process
    fields = {key: value for key, value in kv_events.for_slot(cfg, slot, runtime_dir, model).items()
              if key in {f for f in asdict(KVEventsConfig())}}
    config = KVEventsConfig(**{**fields, "publisher": "zmq"})
    config.publisher = PUBLISHER  # KVEventsConfig's Literal knows only vLLM's names; the factory knows ours
    return {**engine_args, kv_events.KEY: config}
