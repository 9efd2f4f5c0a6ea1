"""Messages between gateways (DEALER) and an engine (ROUTER).

Gateway ⇄ engine: msgspec msgpack, one tagged union per direction. An engine
step's output for one gateway is one ``StepOutput`` carrying every request's
delta. The hello carries the protocol version, so a mismatched pair fails
loudly at connect, and the engine's incarnation id, so a gateway never mixes
the frames of two engine lifetimes.

(The engine ⇄ worker hop carries signed pickles, engine_core/workers/signing.py, and
a step's reply of sampled tokens only: servectl/wire/worker.py.)
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

PROTOCOL_VERSION = 4


class _Msg(msgspec.Struct, tag=True, tag_field="type", kw_only=True, omit_defaults=True):
    pass


# ---- gateway → engine ------------------------------------------------------

class Hello(_Msg, tag="hello"):
    version: int


class ReplayedDelta(msgspec.Struct, array_like=True):
    """One delta of a choice as the gateway passed it on: its raw text and token ids."""

    text: str
    token_ids: list[int]


class Resume(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Continue one choice of a request on a new engine (its engine restarted mid-request).

    The engine builds the request from ``body`` as usual, appends
    ``token_ids`` to its prompt, asks for what is left of ``max_tokens`` /
    ``min_tokens`` with n = 1, and sends deltas for choice ``index`` without
    prompt information (the client has it). ``text_chars`` of the output's
    text reached the client: the rest (held back while checking stop strings)
    comes first, and a stop string spanning the seam still stops.
    """

    index: int = 0
    token_ids: list[int] = []
    text_chars: int = 0
    # A Responses / Messages stream: the same output delta by delta as it came, which vLLM's
    # serving code is fed again so that its events go on where the client's stopped.
    deltas: list[ReplayedDelta] = []


# The vLLM priority of a batch's line (api_gateway/batch_runner.py): after every interactive
# request's (the fair share's tags count up from 0; clients' own default to 0). The engine
# yields to interactive requests what only such lines use (engine_core/batch_yield.py).
BATCH_PRIORITY = 1 << 30


class Generate(_Msg, tag="generate"):
    """One engine request: the client's fields for vLLM's own request class.

    ``kind`` names the class (``completion``: vLLM's ``CompletionRequest``,
    ``chat``: ``ChatCompletionRequest``, ``responses``: ``ResponsesRequest``,
    ``messages``: ``AnthropicMessagesRequest``, the last two answered by vLLM's
    serving classes in the engine); ``body`` holds the fields the client
    sent that servectl supports, as sent (a completion's ``prompt`` is one
    prompt: the gateway sends one request per prompt). The engine builds the
    request with vLLM's class, so defaults and validation are vLLM's.
    """

    request_id: str
    kind: str
    body: dict[str, Any]
    # Continue one choice of this request (its engine restarted mid-request).
    resume: Resume | None = None
    # Responses / Messages: the answer's own id, the same across restarts (the response id,
    # unless the body names one; what vLLM's ids for the answer's items are derived from).
    answer_id: str = ""
    # Tracing on: the W3C traceparent of the gateway's span for this engine lifetime of the
    # request; the engine's spans and vLLM's ``llm_request`` are its children.
    trace_parent: str = ""
    # The fair share's priority for a kind whose vLLM request class has no ``priority`` field
    # (Messages, speech): the engine gives it to the request it builds. None: the body's, or 0.
    priority: int | None = None
    # The key whose fair share gave the priority (its label; "" where none did): through several
    # gateways, each counting its own, a key's request can arrive better than its own running
    # ones, and the engine must not take it for another key's first (engine_core/batch_yield.py).
    tenant: str = ""


class Abort(_Msg, tag="abort"):
    request_ids: list[str]


class Stats(_Msg, tag="stats"):
    """Ask for the engine's counters (sent when /metrics is scraped), and whether it still
    holds ``request_ids`` (a request that waited long for output: queued, or lost?)."""

    request_ids: list[str] = []


class Tokenizer(_Msg, tag="tokenizer"):
    """A tokenizer endpoint's request, answered between steps with ``TokenizerReply``.

    ``kind``: ``tokenize`` (``body``: vLLM's TokenizeCompletionRequest or, with
    ``messages``, TokenizeChatRequest), ``detokenize`` (DetokenizeRequest) or
    ``tokenizer_info`` (no body).
    """

    request_id: str
    kind: str
    body: dict[str, Any] = {}


class MetricsRequest(_Msg, tag="metrics"):
    """Ask for vLLM's own Prometheus metrics (``vllm:*``) as exposition text (on a /metrics scrape)."""


FromGateway = Union[Hello, Generate, Abort, Stats, Tokenizer, MetricsRequest]


# ---- engine → gateway ------------------------------------------------------

class HelloReply(_Msg, tag="hello_reply"):
    version: int
    incarnation: str
    model: str
    max_model_len: int
    max_num_seqs: int = 0
    rejected_frames: int = 0
    # What the model does (vLLM's supported tasks: "generate", or pooling ones such as "embed",
    # "classify", "token_embed"): which endpoints it answers.
    tasks: list[str] = []
    # Where the engine publishes vLLM's KV-cache events (vLLM's KVEventsConfig as a dict, as
    # `vllm serve`'s /kv_event_sources answers it); None with events off.
    kv_events: dict[str, Any] | None = None
    kv_events_rank: int = 0  # the rank its event batches carry (its slot): the key /kv_event_sources uses
    # The most characters a prompt may have before vLLM refuses it untokenised: max_model_len ×
    # the tokenizer's max_chars_per_token (0: not told).
    max_prompt_chars: int = 0
    # Tracing on: the traceparent of this engine lifetime's start span (a request resumed on it
    # links to it); "" with tracing off.
    trace_parent: str = ""


class PromptInfo(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    """What a request's first delta says about its prompt (and the response's fixed parts)."""

    tokens: int
    token_ids: list[int] | None = None  # return_token_ids (and echo of a completion)
    # Echo: the text put before every choice (a completion's prompt, a chat's last
    # message) and, for a completion, the prompt's logprob entries.
    echo_text: str | None = None
    echo_logprobs: list[Any] | None = None
    # vLLM's prompt_logprobs, JSON-shaped: per prompt token None or {token id: {logprob, rank, decoded_token}}.
    prompt_logprobs: list[Any] | None = None
    role: str | None = None  # chat: the role the answer speaks as
    prompt_text: str | None = None  # chat return_prompt_text: the templated prompt
    # A chat its model's reasoning / tool-call parser parses: its deltas' ``message`` is what
    # the client is shown (vLLM's JSON), not their ``text``.
    parsed: bool = False
    reasoning_usage: bool = False  # usage counts reasoning tokens (the model has a reasoning parser)
    metadata_hidden: bool = False  # parsed with include_reasoning false: no token ids or logprobs shown
    constrained: bool = False  # a grammar constrains the output: not continued across a restart


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    """New output of one choice of one request since the last step."""

    request_id: str
    index: int = 0
    text: str = ""
    token_ids: list[int] = []
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Per new token: [token text, logprob or None, alternatives [[text, logprob], ...] or None,
    # UTF-8 bytes or None], already chosen and clamped the way vLLM's API does for this request.
    logprobs: list[Any] | None = None
    prompt: PromptInfo | None = None  # on the request's first delta
    # Parsed chats (PromptInfo.parsed): a stream's delta fields as vLLM streams them (None: vLLM
    # shows nothing for these tokens), or a whole answer's message fields on its last delta.
    # ``text`` is still the raw text (what a resumed choice continues from).
    message: dict[str, Any] | None = None
    reasoning_tokens: int | None = None  # the choice's reasoning tokens so far, where counted
    # Responses / Messages: what the client is sent for this output, already in the API's form
    # (vLLM's serving classes make it): a stream's SSE events, or a whole answer's JSON body on
    # its last delta.
    api_output: str = ""


class StepOutput(_Msg, tag="step"):
    incarnation: str
    deltas: list[Delta]


class RequestError(_Msg, tag="error"):
    incarnation: str
    request_id: str
    message: str
    status: int = 400
    param: str | None = None
    # The engine is giving its memory back (idle release): the request was not
    # started; the gateway holds it and sends it again once the model is woken.
    released: bool = False
    # The engine drains (a reload, an unload, a restart): the request was not started; the gateway
    # sends it to another replica, or to the next incarnation, as it would after a crash.
    draining: bool = False


class TokenizerReply(_Msg, tag="tokenizer_reply"):
    """The answer to ``Tokenizer``: vLLM's response body for that endpoint."""

    incarnation: str
    request_id: str
    body: dict[str, Any]


class StatsReply(_Msg, tag="stats_reply"):
    incarnation: str
    unfinished: int
    rejected_frames: int
    # Steps whose execute_model went to the workers before the previous step's
    # reply arrived (async scheduling's overlap); 0 when it is off.
    overlapped_steps: int = 0
    # Worker replies the engine took as sampled tokens only (servectl/wire/worker.py) and as
    # signed pickles (everything else).
    token_replies: int = 0
    signed_replies: int = 0
    # Those of the probe's request_ids the engine does not hold (never received, or finished).
    missing: list[str] = []
    # When the engine last stepped (wall clock): its requests' last progress.
    last_worked_at: float | None = None
    # The yield to interactive requests and newcomers (engine_core/batch_yield.py): steps run one
    # deep while only yielding requests ran, and steps those sat out for a newcomer's prompt.
    steps_one_deep: int = 0
    steps_sat_out: int = 0


class MetricsReply(_Msg, tag="metrics_reply"):
    """vLLM's stat logger registry in Prometheus text format, ``model_name`` = the served name."""

    incarnation: str
    text: str


ToGateway = Union[HelloReply, StepOutput, RequestError, StatsReply, TokenizerReply, MetricsReply]

from_gateway_decoder = msgspec.msgpack.Decoder(FromGateway)
to_gateway_decoder = msgspec.msgpack.Decoder(ToGateway)
encoder = msgspec.msgpack.Encoder()
