"""A request's key at admission and at its end (docs/tenancy.md).

``KeyGate``: the models a named key may use (a 403 on every API route that names a model),
its limits asked of the manager, which counts every gateway's requests (a 429 in OpenAI's
shape with ``Retry-After`` and the ``x-ratelimit-*`` headers), its fair-share tag sent as the
request's ``priority`` (fair_share.py), and at the end its usage told to the manager
(``Finished``, sent before the answer's last bytes are written), which keeps it.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

from aiohttp import web

from api_gateway.errors import HttpError
from api_gateway.fair_share import FairShare
from api_gateway.keys import OPEN, RequestKey
from servectl.wire import control as MP
from servectl.wire.engine import BATCH_PRIORITY

# Routes whose vLLM request class takes a `priority` (the fair share's); Messages and speech do not.
PRIORITY_KINDS = frozenset({"chat", "completion", "responses", "embeddings", "embed", "pooling", "classify", "score",
                            "rerank"})


class ManagerAsk(Protocol):
    async def admit(self, msg: MP.Admit, timeout_s: float) -> MP.Admitted: ...
    def report_now(self, msg) -> None: ...


class Counted(NamedTuple):
    """What the end of a request reports: the model it used, its Admit ticket, its fair-share tag."""

    model: str
    ticket: int = 0
    tag: int | None = None  # its priority, given back to the fair share at its end
    sequences: int = 1


def seconds(value: float) -> str:
    """A reset time as OpenAI writes it (``1s``, ``6m0s``, ``250ms``)."""
    if value <= 0:
        return "0s"
    if value < 1:
        return f"{max(1, math.ceil(value * 1000))}ms"
    whole = math.ceil(value)
    return f"{whole // 60}m{whole % 60}s" if whole >= 60 else f"{whole}s"


def rate_headers(w: MP.Window) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for the limits a key has."""
    out = {}
    if w.limit_requests is not None:
        out.update({"x-ratelimit-limit-requests": str(w.limit_requests),
                    "x-ratelimit-remaining-requests": str(w.remaining_requests),
                    "x-ratelimit-reset-requests": seconds(w.reset_requests_s)})
    if w.limit_tokens is not None:
        out.update({"x-ratelimit-limit-tokens": str(w.limit_tokens),
                    "x-ratelimit-remaining-tokens": str(w.remaining_tokens),
                    "x-ratelimit-reset-tokens": seconds(w.reset_tokens_s)})
    return out


class KeyGate:
    def __init__(self, manager: ManagerAsk, fair_share: bool, timeout_s: float = 10.0):
        self.manager = manager
        self.fair = FairShare() if fair_share else None
        self.timeout_s = timeout_s
        self.tickets = 0

    @staticmethod
    def key_of(request: web.Request) -> RequestKey | None:
        return request.get("key")

    def models_of(self, request: web.Request) -> list[str] | None:
        """The models this request's key may use (None: every one)."""
        key = self.key_of(request)
        return key.named.models if key is not None and key.named is not None else None

    def check_model(self, request: web.Request, model: str, base: str) -> None:
        """A named key with a ``models`` list uses those (an adapter by its name or its model's)."""
        key = self.key_of(request)
        if key is None:
            return
        request["counted"] = Counted(model)  # a served model: its usage is counted (not a 404's name)
        allowed = self.models_of(request)
        if allowed is not None and model not in allowed and base not in allowed:
            raise HttpError(403, f"key {key.label!r} may not use model {model!r} (it may use: "
                                 f"{', '.join(allowed) or 'none'})", "permission_error", param="model",
                            code="model_not_allowed")

    async def admit(self, request: web.Request, model: str) -> None:
        """A key with limits: the manager says whether it starts now (counted for every gateway)."""
        key = self.key_of(request)
        if key is None or key.named is None or not key.named.limited or request.get("batch"):
            return  # (a batch's lines go at the lowest priority instead: prioritise)
        self.tickets += 1
        ticket = self.tickets
        # Counted before the round trip: a timeout or the client going away during it still gives
        # the slot back at the request's end (the manager may take the Admit all the same).
        request["counted"] = Counted(model, ticket)
        try:
            answer = await self.manager.admit(MP.Admit(ticket=ticket, key=key.label, model=model), self.timeout_s)
        except TimeoutError:
            raise HttpError(503, "the key's limits could not be checked (the manager did not answer); try again",
                            "service_unavailable", headers={"Retry-After": "1"}) from None
        headers = rate_headers(answer.window)
        if not answer.ok:
            headers["Retry-After"] = str(max(1, math.ceil(answer.retry_after_s)))
            raise HttpError(429, answer.message, "tokens" if answer.limit == "tokens" else "requests",
                            code="rate_limit_exceeded", headers=headers)
        if headers:
            request.setdefault("extra_headers", {}).update(headers)

    def prioritise(self, request: web.Request, kind: str, forward: dict, seqs: int) -> int | None:
        """The fair share's tag as the request's ``priority``: in the body for a kind whose vLLM
        request class takes one (a client's own ``priority`` may put its request further back,
        never ahead of its key's turn); returned for the others (Messages, speech: the engine
        sets it, ``Generate.priority``). None: no tag (the fair share off, no model counted).

        With the fair share off, a keyed client's ``priority`` is still never below 0: a better
        priority takes a running request's slot (engine_core/slot_preemption.py), and one key
        must not take another's that way (a server without keys passes it on as vLLM would)."""
        key, counted = self.key_of(request), request.get("counted")
        if request.get("batch"):  # a batch's line: after every interactive request (batch_runner.py)
            if kind not in PRIORITY_KINDS:
                return BATCH_PRIORITY
            forward["priority"] = BATCH_PRIORITY
            return None
        asked = forward.get("priority")
        asked = asked if isinstance(asked, int) and not isinstance(asked, bool) else None
        if self.fair is None or key is None or counted is None:
            if asked is not None and asked < 0 and key is not None and key != OPEN:
                forward["priority"] = 0
            return None
        weight = key.named.weight if key.named is not None else 1.0
        tag = self.fair.start(counted.model, key.label, weight, seqs)
        request["counted"] = counted._replace(tag=tag, sequences=seqs)
        if kind not in PRIORITY_KINDS:
            return tag
        forward["priority"] = max(asked, tag) if asked is not None else tag
        return None

    def tenant(self, request: web.Request) -> str:
        """The key whose fair share tagged this request ("" if none did): ``Generate.tenant``."""
        counted, key = request.get("counted"), self.key_of(request)
        return key.label if key is not None and counted is not None and counted.tag is not None else ""

    def finished(self, request: web.Request, status: int) -> None:
        """The end of a request that named a served model: its usage and slot to the manager."""
        counted: Counted | None = request.pop("counted", None)
        key = self.key_of(request)
        if counted is None or key is None:
            return
        if counted.tag is not None and self.fair is not None:
            self.fair.done(counted.model, key.label, counted.tag, counted.sequences)
        info = request["log"]
        prompt, completion = info.get("prompt_tokens"), info.get("completion_tokens")
        tally = request.get("tally")
        if prompt is None and tally is not None:  # ended early (the client gone, an error): what it used
            prompt, completion = tally()
        self.manager.report_now(MP.Finished(key=key.label, model=counted.model, ticket=counted.ticket,
                                            prompt_tokens=prompt or 0, completion_tokens=completion or 0,
                                            error=status >= 400, batch=bool(request.get("batch"))))
