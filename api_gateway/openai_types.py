"""The OpenAI HTTP API as msgspec types: requests are validated by them and
/openapi.json is generated from them (no hand-written schema)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

# Shapes and sizes only: the values are judged by vLLM's own request classes in
# the engine (the same validation as `vllm serve`). Field for field these are
# the fields of vLLM 0.32's CompletionRequest and ChatCompletionRequest that
# servectl supports (docs/api.md; api_gateway/fields.py has the rest).

# Integers travel to the engine as msgpack, which holds 64 bits: every integer a
# client sends is bounded here, so an out-of-range one is a 400 naming its field
# (vLLM bounds `seed` and `priority` to int64 the same way).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
N = Annotated[int, Meta(ge=1, le=64)]  # servectl's cap on choices per prompt (vLLM has none)


class StreamOptions(Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(Struct, kw_only=True):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(name="schema", default=None)
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag (vLLM): `format`, or the legacy `structures` + `triggers`.
    format: Any = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class StructuredOutputs(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's StructuredOutputsParams. An unknown key here is a 400 (a misspelt
    constraint would otherwise leave the output unconstrained)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class _Request(Struct, kw_only=True):
    """Fields both generation endpoints share (vLLM's names, types and defaults)."""

    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: N | None = 1
    presence_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Int64 | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[Int64] | None = None
    prompt_logprobs: Int64 | None = None
    logprob_token_ids: list[Int64] | None = None
    bad_words: list[str] = []
    add_special_tokens: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    priority: Int64 = 0
    request_id: str | None = None
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: Int64 | None = None
    stream_interval: Int64 | None = None


class CompletionRequest(_Request, kw_only=True):
    # A string, a list of strings, token ids, or lists of token ids (told apart
    # by translate.normalize_prompts: msgspec unions hold one array type).
    prompt: str | list[Any]
    echo: bool | None = False
    logprobs: Int64 | None = None
    max_tokens: Int64 | None = 16
    suffix: str | None = None


class ChatMessage(Struct, kw_only=True):
    """A message's shape; the message itself goes to the engine as sent (vLLM validates it)."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a `tool` message: the call it answers
    reasoning: str | None = None  # an assistant's reasoning, as vLLM returned it


class FunctionDefinition(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_Request, kw_only=True):
    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: Int64 | None = 0
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = "none"
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None


class TokenizeRequest(Struct, kw_only=True):
    """vLLM's TokenizeCompletionRequest, or with `messages` its TokenizeChatRequest."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[Annotated[int, Meta(ge=0, le=INT64_MAX)]]


# ---- responses ---------------------------------------------------------------

# Fields without a default are always written (OpenAI's shape, and vLLM's
# `stop_reason`); vLLM's optional extras are written only when asked for.

class CompletionTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # A whole body writes both (null unless known), as vLLM's model_dump; a stream's usage only
    # what vLLM sets: completion_tokens_details for a model with a reasoning parser.
    prompt_tokens_details: None | msgspec.UnsetType = msgspec.UNSET
    completion_tokens_details: CompletionTokensDetails | None | msgspec.UnsetType = msgspec.UNSET


class CompletionLogprobs(Struct, kw_only=True):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(Struct, kw_only=True):
    """A choice as vLLM writes it: its ids null or not (a stream chunk's too: vLLM sets them)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    # A whole body's (written, null or not, as vLLM's model_dump); a stream chunk leaves them out.
    prompt_logprobs: list[Any] | None | msgspec.UnsetType = msgspec.UNSET
    routed_experts: None | msgspec.UnsetType = msgspec.UNSET


class CompletionResponse(Struct, kw_only=True, omit_defaults=True):
    id: str
    object: str  # always written: omit_defaults would drop a default
    created: int
    model: str
    choices: list[CompletionChoice]
    # A whole body writes these as null (vLLM's model_dump; servectl computes no fingerprint,
    # as `vllm serve --fingerprint-mode none`); a stream chunk leaves them out.
    service_tier: None | msgspec.UnsetType = msgspec.UNSET
    system_fingerprint: None | msgspec.UnsetType = msgspec.UNSET
    usage: Usage | None = None
    kv_transfer_params: None | msgspec.UnsetType = msgspec.UNSET
    ec_transfer_params: None | msgspec.UnsetType = msgspec.UNSET
    metrics: None | msgspec.UnsetType = msgspec.UNSET


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


class ToolCallFunction(Struct, kw_only=True):
    name: str
    arguments: str


class ToolCall(Struct, kw_only=True):
    id: str
    type: str = "function"
    function: ToolCallFunction


class ResponseMessage(Struct, kw_only=True):
    """vLLM's ChatMessage as its model_dump writes it: every field, tool_calls only when there are some."""

    role: str = "assistant"
    content: str | None = None
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET
    reasoning: str | None = None


class ChatChoice(Struct, kw_only=True):
    """A whole answer's choice: every field vLLM's model_dump writes, nulls included."""

    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: list[int] | None = None
    routed_experts: None = None


class ChatCompletionResponse(Struct, kw_only=True):
    """A whole chat answer: every field vLLM's model_dump writes, nulls included (servectl
    computes no fingerprint, as `vllm serve --fingerprint-mode none`)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    service_tier: None = None
    system_fingerprint: None = None
    usage: Usage | None = None
    prompt_logprobs: list[Any] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    kv_transfer_params: None = None
    ec_transfer_params: None = None
    metrics: None = None


class DeltaFunctionCall(Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Struct, kw_only=True, omit_defaults=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None | msgspec.UnsetType = msgspec.UNSET  # written on a choice's last chunk
    token_ids: list[int] | None | msgspec.UnsetType = msgspec.UNSET  # an output chunk's, null or not (vLLM's)


class ChatCompletionChunk(Struct, kw_only=True, omit_defaults=True):
    id: str
    object: str  # always written: omit_defaults would drop a default
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    # The role chunk's, null or not (vLLM sets them on it), no other's.
    prompt_token_ids: list[int] | None | msgspec.UnsetType = msgspec.UNSET
    prompt_text: str | None | msgspec.UnsetType = msgspec.UNSET


class PassthroughRequest(Struct, kw_only=True):
    """What the gateway reads of a request vLLM's serving classes take whole in the engine
    (Responses, Messages, count_tokens; api_gateway/passthrough.py): vLLM checks the rest."""

    model: str | None = None
    stream: bool | None = False


class ModelCard(Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "servectl"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)
    max_model_len: int | None = None
    state: str | None = None
    # servectl: what the model does (vLLM's tasks: ["generate"], or pooling ones such as
    # ["embed", "token_embed"]), once its engine has said so
    tasks: list[str] | None = None


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
