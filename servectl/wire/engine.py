"""Messages between gateways (DEALER) and an engine (ROUTER).

Gateway ⇄ engine: msgspec msgpack, one tagged union per direction. An engine
step's output for one gateway is one ``StepOutput`` carrying every request's
delta. The hello carries the protocol version, so a mismatched pair fails
loudly at connect, and the engine's incarnation id, so a gateway never mixes
the frames of two engine lifetimes.

(The engine ⇄ worker hop carries signed pickles: engine_core/signing.py.)
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

PROTOCOL_VERSION = 1


class _Msg(msgspec.Struct, tag=True, tag_field="type", kw_only=True, omit_defaults=True):
    pass


# ---- gateway → engine ------------------------------------------------------

class Hello(_Msg, tag="hello"):
    version: int


class Generate(_Msg, tag="generate"):
    request_id: str
    # Exactly one of prompt, prompt_token_ids or messages is set.
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = {}
    # Structured output: {"json": schema} or {"json_object": True}.
    structured: dict[str, Any] | None = None
    echo: bool = False


class Abort(_Msg, tag="abort"):
    request_ids: list[str]


class Stats(_Msg, tag="stats"):
    """Ask for the engine's counters (sent when /metrics is scraped), and whether it still
    holds ``request_ids`` (a request that waited long for output: queued, or lost?)."""

    request_ids: list[str] = []


FromGateway = Union[Hello, Generate, Abort, Stats]


# ---- engine → gateway ------------------------------------------------------

class HelloReply(_Msg, tag="hello_reply"):
    version: int
    incarnation: str
    model: str
    max_model_len: int
    max_num_seqs: int = 0
    rejected_frames: int = 0


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    """New output of one choice of one request since the last step."""

    request_id: str
    index: int = 0
    text: str = ""
    token_ids: list[int] = []
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int | None = None
    # Per new token: (logprob, [(token text, logprob), ...] top alternatives), text.
    logprobs: list[Any] | None = None
    # Echo: prompt token texts and their logprobs (first is None).
    prompt_logprobs: list[Any] | None = None
    prompt_text: str | None = None


class StepOutput(_Msg, tag="step"):
    incarnation: str
    deltas: list[Delta]


class RequestError(_Msg, tag="error"):
    incarnation: str
    request_id: str
    message: str
    status: int = 400
    param: str | None = None


class StatsReply(_Msg, tag="stats_reply"):
    incarnation: str
    unfinished: int
    rejected_frames: int
    # Steps whose execute_model went to the workers before the previous step's
    # reply arrived (async scheduling's overlap); 0 when it is off.
    overlapped_steps: int = 0
    # Those of the probe's request_ids the engine does not hold (never received, or finished).
    missing: list[str] = []


ToGateway = Union[HelloReply, StepOutput, RequestError, StatsReply]

from_gateway_decoder = msgspec.msgpack.Decoder(FromGateway)
to_gateway_decoder = msgspec.msgpack.Decoder(ToGateway)
encoder = msgspec.msgpack.Encoder()
