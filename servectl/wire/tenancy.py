"""Messages of many teams on one server (docs/tenancy.md), on the manager's control socket:
a gateway asks whether a limited key's request may start (``Admit`` / ``Admitted``) and says
when a request ended (``Finished``: its usage, its slot back); a client asks for usage per key
and model (``UsageRequest`` / ``UsageReply``). They belong to servectl/wire/control.py's
unions (its decoders read them); here so the control socket's vocabulary stays readable.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class _Msg(msgspec.Struct, tag=True, tag_field="type", kw_only=True):
    pass  # tagged as control.py's, so that they share its unions


# A key's limit that refused a request (docs/tenancy.md).
LimitKind = Literal["concurrency", "requests", "tokens"]


class Admit(_Msg, tag="admit"):
    """Gateway → manager: may a request of this named key, which has limits, start now? The
    manager counts every gateway's (the limits are the server's); answered with ``Admitted``
    on the gateway's own control socket, paired by ``ticket``."""

    ticket: int
    key: str  # the key's name
    model: str


class Finished(_Msg, tag="finished"):
    """Gateway → manager: a request that named a model ended; its usage is counted (and kept
    in the state directory) under its key's name, and its ``Admit`` slot (``ticket``) given back."""

    key: str  # a named key's name, an unnamed key's fingerprint, or "(none)" (the API needs no key)
    model: str
    ticket: int = 0  # its Admit's, 0: it held none
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Answered with a 4xx or 5xx (499: the client went away), or a stream cut by one after its 200.
    error: bool = False
    # A batch's line (api_gateway/batch_runner.py): in the key's usage, not in its rate limits' window.
    batch: bool = False


class UsageRequest(_Msg, tag="usage"):
    """Usage per key and model since a time (unix seconds; None: all that is kept). The owner's
    (``servectl usage``) or a gateway's for an admin key (``GET /servectl/v1/usage``)."""

    since: float | None = None


class Window(msgspec.Struct, kw_only=True):
    """A key's rate limits now, as OpenAI's ``x-ratelimit-*`` headers say them (None: no such limit)."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float = 0.0
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float = 0.0


class Admitted(_Msg, tag="admitted"):
    """The answer to ``Admit``: started (its concurrency slot held until ``Finished``), or
    refused by ``limit`` (a 429 with ``Retry-After``)."""

    ticket: int
    ok: bool
    limit: LimitKind | None = None
    retry_after_s: float = 0.0
    message: str = ""
    window: Window = msgspec.field(default_factory=Window)


class UsageRow(msgspec.Struct, kw_only=True):
    key: str
    model: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0


class UsageReply(_Msg, tag="usage_reply"):
    """Usage per key and model from ``since`` (rounded down to the ledger's minute) to ``until``."""

    since: float
    until: float
    rows: list[UsageRow] = []
