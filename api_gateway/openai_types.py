"""The OpenAI HTTP API as msgspec types: requests are validated by them and
/openapi.json is generated from them (no hand-written schema)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

# Integers travel to the engine as msgpack, which holds 64 bits: every integer a
# client sends is bounded here, so an out-of-range one is a 400 naming its field
# (vLLM bounds `seed` to int64 the same way).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
# vLLM's SamplingParams: temperature in [0, 2] (it answers 400 beyond).
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
MaxTokens = Annotated[int, Meta(ge=1, le=INT64_MAX)]
N = Annotated[int, Meta(ge=1, le=64)]


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class JsonSchemaFormat(Struct, kw_only=True):
    name: str = "schema"
    schema_: dict[str, Any] = msgspec.field(name="schema", default_factory=dict)
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(Struct, kw_only=True):
    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: Int64 | None = None
    n: N = 1
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # A string, a list of strings, token ids, or lists of token ids (checked
    # by the gateway: msgspec unions hold one array type).
    prompt: str | list[Any]
    max_tokens: MaxTokens | None = 16
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None


# Fields that belong to the OpenAI API but servectl does not implement: a
# request that sets one gets a 400 naming it, never silent ignoring.
UNSUPPORTED_COMPLETION = ("suffix", "best_of")
UNSUPPORTED_CHAT = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "audio",
                    "modalities", "prediction", "web_search_options")


# ---- responses ---------------------------------------------------------------

class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(Struct, kw_only=True):
    content: list[ChatTokenLogprob]


class ResponseMessage(Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(Struct, kw_only=True):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "servectl"
    root: str | None = None
    max_model_len: int | None = None
    state: str | None = None


class ModelList(Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class ErrorBody(Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(Struct, kw_only=True):
    error: ErrorBody

encoder = msgspec.json.Encoder()
