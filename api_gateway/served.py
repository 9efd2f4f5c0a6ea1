"""One served model in a gateway: its replicas' links, its admission, the replica each request goes to.

A model with ``replicas = N`` is N engine groups (``<model>@<i>``), each with
its own ``EngineLink``; clients see one name. ``ServedModel`` owns what is the
model's rather than one engine's: the sequences admitted and held for it (its
queue cap), the wait for a replica to be ready (bounded by its hold timeout),
the state /health and /v1/models report (``degraded`` while some replicas serve
and others do not), and the choice of replica (``pick``): the ready one with
the fewest sequences outstanding, ties going to the replica that last served
the same start of a prompt (``prefix_key``), so vLLM's prefix cache keeps
working. A model served by one group is the same with one link.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict

import msgspec

from api_gateway.engines import EngineLink, EngineUnavailable, LinkState
from servectl.wire.vocab import DEGRADED, ModelState

S = LinkState
M = ModelState

# The start of a prompt a tie is broken on: its first bytes as sent (JSON), about vLLM's
# first KV-cache block (16 tokens) with the chat framing around it.
PREFIX_BYTES = 128
# Prompt starts remembered per model (the oldest forgotten first).
AFFINITY_ENTRIES = 4096
# Which state a model that no replica serves reports: the one nearest to serving.
_NEAREST = (S.READY, S.CONNECTING, S.STARTING, S.DRAINING, S.RELEASED, S.DOWN, S.FAILED, S.REMOVED)
# Replicas in these states are not missing capacity: a model with others ready is not degraded
# (starting: a new one, or one coming back; draining: a reload's old one; released: idle).
_NOT_DEGRADING = frozenset({S.READY, S.RELEASED, S.STARTING, S.CONNECTING, S.DRAINING})


def prefix_key(body: dict) -> bytes | None:
    """A digest of the start of a request's prompt (chat messages, a completion prompt, a
    Responses input), or None when it has none."""
    for field in ("messages", "prompt", "input"):
        value = body.get(field)
        if value is not None:
            raw = value.encode() if isinstance(value, str) else msgspec.json.encode(value)
            return hashlib.blake2b(raw[:PREFIX_BYTES], digest_size=8).digest()
    return None


class ServedModel:
    def __init__(self, name: str):
        self.name = name
        self.links: dict[str, EngineLink] = {}  # by engine group name
        self.waiting = 0  # sequences held until a replica is ready
        self.admitted = 0  # sequences held or running, not finished
        # Pulsed (set, then replaced) whenever a replica's state changes: what waiters await.
        self.changed = asyncio.Event()
        self.affinity: OrderedDict[bytes, str] = OrderedDict()  # prompt start -> group that last served it

    @property
    def model(self) -> str:
        return self.name

    def add(self, link: EngineLink) -> None:
        link.on_change = self.on_change
        self.links[link.model] = link
        self.on_change(link)

    def drop(self, group: str) -> None:
        link = self.links.pop(group, None)
        if link is not None:
            link.remove()
            self.on_change(link)

    def on_change(self, link: EngineLink) -> None:
        if link.state is S.RELEASED and self.waiting and not link.unfit and not self.ready_links():
            link.wake(link.model)  # requests wait for this model: bring a released replica back
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    # ---- what the model is, from its replicas ----------------------------------------------
    def ready_links(self, config_id: str = "") -> list[EngineLink]:
        return [link for link in self.links.values()
                if link.state is S.READY and (not config_id or link.config_id == config_id)]

    def _first(self) -> EngineLink | None:
        return min(self.links.values(), key=lambda link: _NEAREST.index(link.state), default=None)

    @property
    def status(self) -> ModelState | str:
        """What /health and /v1/models say: one replica's word, or ``degraded`` while some
        serve and others are failed or down (crashed, in backoff)."""
        first = self._first()
        if first is None:
            return M.REMOVED
        if first.state is S.READY and any(link.state not in _NOT_DEGRADING for link in self.links.values()):
            return DEGRADED
        return first.status

    @property
    def reason(self) -> str | None:
        if self.status == DEGRADED:
            missing = [f"{link.model} {link.status}" + (f" ({link.reason})" if link.reason else "")
                       for link in self.links.values() if link.state not in _NOT_DEGRADING]
            return f"{len(self.ready_links())} of {len(self.links)} replicas serve; " + "; ".join(missing)
        first = self._first()
        return first.reason if first is not None else None

    def _answered(self) -> EngineLink | None:
        """A replica whose engine said what the model is (its Hello answered)."""
        return next((link for link in self.links.values() if link.incarnation), self._first())

    @property
    def max_model_len(self) -> int | None:
        link = self._answered()
        return link.max_model_len if link is not None else None

    @property
    def max_prompt_chars(self) -> int:
        link = self._answered()
        return link.max_prompt_chars if link is not None else 0

    @property
    def supported_tasks(self) -> list[str]:
        link = self._answered()
        return link.supported_tasks if link is not None else []

    @property
    def loras(self) -> list:
        link = self._first()
        return link.loras if link is not None else []

    @property
    def unfit(self) -> str | None:
        """Why no replica can ever load under the memory budget (all are unfit), else None."""
        unfit = [link.unfit for link in self.links.values()]
        return unfit[0] if unfit and all(unfit) else None

    @property
    def config_id(self) -> str:
        link = self._first()
        return link.config_id if link is not None else ""

    def hold_s(self, default_s: float) -> float:
        """How long a request may wait for the model: the longest any replica asks (EngineLink.hold_s)."""
        return max((link.hold_s(default_s) for link in self.links.values()), default=default_s)

    def queued(self, more: int = 0) -> int:
        """Sequences waiting (were ``more`` admitted now): held for readiness, or beyond what the
        ready replicas run at once."""
        ready = self.ready_links()
        held = self.waiting + (more if not ready else 0)
        return max(held, self.admitted + more - sum(link.max_num_seqs for link in ready))

    # ---- choosing and waiting ------------------------------------------------------------------
    def pick(self, key: bytes | None = None, config_id: str = "") -> EngineLink | None:
        """The ready replica (of ``config_id``, if given) a request goes to: fewest sequences
        outstanding; among those, the one that last served the same prompt start."""
        ready = self.ready_links(config_id)
        if not ready:
            return None
        if len(ready) == 1:
            link = ready[0]
        else:
            least = min(link.outstanding for link in ready)
            tied = [link for link in ready if link.outstanding == least]
            last = self.affinity.get(key) if key is not None else None
            link = next((link for link in tied if link.model == last), tied[0])
        if link.max_num_seqs and link.outstanding * 2 >= link.max_num_seqs:
            self._wake_one()  # the ready replicas are half full or more: one released for idleness comes back
        if key is not None and len(self.links) > 1:
            self.affinity[key] = link.model
            self.affinity.move_to_end(key)
            if len(self.affinity) > AFFINITY_ENTRIES:
                self.affinity.popitem(last=False)
        return link

    def _wake_one(self) -> None:
        released = next((link for link in self.links.values() if link.state is S.RELEASED and not link.unfit), None)
        if released is not None:
            released.wake(released.model)

    async def wait_ready(self, timeout_s: float, sequences: int = 1, config_id: str = "") -> None:
        """Until a replica (of ``config_id``, if given) is ready (``sequences`` count as held
        meanwhile); every replica failed, unloaded, unfit or of another configuration, and the
        timeout, raise ``EngineUnavailable``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self.waiting += sequences
        if not self.ready_links(config_id):
            for link in self.links.values():  # each request that starts waiting asks (idempotent there)
                if link.state is S.RELEASED and not link.unfit:
                    link.wake(link.model)
        try:
            while True:
                if self.ready_links(config_id):
                    return
                links = list(self.links.values())
                if config_id and links and not any(link.config_id == config_id for link in links):
                    raise EngineUnavailable(
                        f"model {self.name!r} was replaced by a changed configuration (a reload) while this "
                        "request ran; it cannot go on on the new one: send it again", retry_after=1)
                if links and all(link.unfit for link in links):
                    raise EngineUnavailable(links[0].unfit, retry_after=None)
                if not links or all(link.state is S.REMOVED for link in links):
                    raise EngineUnavailable(f"model {self.name!r} was unloaded", retry_after=None)
                if all(link.state in (S.FAILED, S.REMOVED) or link.unfit for link in links):
                    failed = next(link for link in links if link.state is S.FAILED)
                    raise EngineUnavailable(f"model {self.name!r} failed: {failed.reason or 'crash loop'}; an "
                                            f"operator must run `servectl restart {self.name}`", retry_after=None)
                left = deadline - loop.time()
                if left <= 0:
                    raise EngineUnavailable(f"model {self.name!r} is not available ({self.status}) after "
                                            f"waiting {timeout_s:g}s", retry_after=10)
                try:
                    # event-proof: the hold timeout, armed only while a request waits for its engine.
                    await asyncio.wait_for(self.changed.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.waiting -= sequences
