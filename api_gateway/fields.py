"""Which request fields servectl honours, refuses or does not know: nothing is silently ignored.

Every field of a request body is one of:

- **supported**: a field of the msgspec request type (openai_types), i.e. a
  field of vLLM's request class that servectl honours. It goes to the engine
  as sent, where vLLM's own class gives it its meaning and validation.
- **refused**: a field of vLLM's class (``REFUSED``) or of OpenAI's API that
  vLLM does not define (``OPENAI_ONLY``) which servectl does not implement:
  400 naming the field and why, unless its value asks for nothing (``None``
  or the listed no-op values, e.g. ``use_beam_search: false``).
- **accepted without effect**: OpenAI fields that ask for nothing a server
  could do differently (``NO_EFFECT``, like vLLM's own ``user``).
- **legacy** ``guided_*``: removed from vLLM (0.32 ignores them with a
  warning, leaving the output unconstrained); a 400 naming ``structured_outputs``.
- **unknown**: anything else. Accepted (clients send extras), but named in a
  warning log line and the ``x-servectl-ignored-fields`` response header.

The Responses and Messages endpoints take vLLM's class whole in the engine
(``API_FIELDS``: every field not refused); a field vLLM itself ignores there
(``VLLM_IGNORES``: ``store``) is forwarded and named in that header too.

docs/api.md lists every field of vLLM's classes with its class here;
tests/test_api_fields_unit.py holds this module, the docs and
docs/vllm_fields.json (generated from vLLM) to each other.
"""

from __future__ import annotations

from typing import Any

import msgspec

from api_gateway import openai_types as H
from api_gateway.errors import HttpError

IGNORED_HEADER = "x-servectl-ignored-fields"

_BEAM = "beam search is not supported (it needs vLLM's beam-search driver, which servectl does not run)"
_RENDER = "only vLLM's /render endpoints use it, and servectl does not serve them"
_DISAGG = "disaggregated serving (KV / encoder-cache transfer between servers) is not supported"
_FUNCTIONS = ("the deprecated function-calling API is not supported (vLLM would ignore it silently); use "
              "`tools` and `tool_choice`")

# field -> (why it is refused, values that ask for nothing and so are accepted; None always is)
_GENERATION_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "use_beam_search": (_BEAM, (False,)),
    "length_penalty": ("only beam search uses it; " + _BEAM, (1.0,)),
    "routed_experts_prompt_start": ("servectl does not return routed-expert data", (0,)),
    "return_token_offsets": (_RENDER, (False,)),
    "mm_payload": (_RENDER, ("tensors",)),
    "return_mm_kwargs": (_RENDER, ()),
    "kv_transfer_params": (_DISAGG, ()),
    "ec_transfer_params": (_DISAGG, ()),
}
REFUSED: dict[str, dict[str, tuple[str, tuple[Any, ...]]]] = {
    "completion": {
        **_GENERATION_REFUSED,
        "prompt_embeds": ("prompt embeddings are not supported (the engine would load tensors sent by clients)",
                          ()),
    },
    "chat": {
        **_GENERATION_REFUSED,
    },
    "tokenize": {
    },
    "detokenize": {},
    "responses": {
        "background": ("background responses need vLLM's response store, which servectl does not keep (`vllm "
                       "serve` refuses them too, unless VLLM_ENABLE_RESPONSES_API_STORE is set)", (False,)),
        "kv_transfer_params": (_DISAGG, ()),
        "ec_transfer_params": (_DISAGG, ()),
        "mm_payload": (_RENDER, ("tensors",)),
        "return_mm_kwargs": (_RENDER, ()),
    },
    "messages": {
        "kv_transfer_params": (_DISAGG, ()),
        "ec_transfer_params": (_DISAGG, ()),
        "mm_payload": (_RENDER, ("tensors",)),
        "return_mm_kwargs": (_RENDER, ()),
    },
    "count_tokens": {},
    # the pooling routes (each the union of its request classes' variants)
    "embeddings": {},
    "embed": {},
    "pooling": {"data": ("vLLM's IO processor plugins are not supported", ())},
    "score": {},
    "rerank": {},
    "classify": {},
}

# OpenAI API fields that vLLM's classes do not define.
OPENAI_ONLY: dict[str, dict[str, tuple[str, tuple[Any, ...]]]] = {
    "completion": {
        "best_of": ("best_of is not supported (vLLM 0.32 removed it)", (1,)),
    },
    "chat": {
        "functions": (_FUNCTIONS, ([],)),
        "function_call": (_FUNCTIONS, ("none",)),
        "audio": ("audio output is not supported", ()),
        "modalities": ("only text output is supported", (["text"],)),
        "prediction": ("predicted outputs are not supported", ()),
        "web_search_options": ("web search is not supported", ()),
        "store": ("stored completions are not supported", (False,)),
        "service_tier": ("service tiers are not supported", ("auto", "default")),
        "verbosity": ("verbosity is not supported", ()),
    },
}
# OpenAI fields accepted with no effect: identifiers and hints (as vLLM treats `user`).
NO_EFFECT: dict[str, dict[str, str]] = {
    "completion": {},
    "chat": {
        "metadata": "tags for stored completions; nothing is stored",
        "safety_identifier": "an end-user identifier, like `user`",
        "prompt_cache_key": "a caching hint; vLLM caches prompt prefixes on its own",
    },
}

# Removed from vLLM's API (vllm/entrypoints/serve/engine/protocol.py: _REMOVED_GUIDED_FIELDS).
LEGACY_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                 "guided_whitespace_pattern")

TYPES: dict[str, type] = {"completion": H.CompletionRequest, "chat": H.ChatCompletionRequest,
                          "detokenize": H.DetokenizeRequest}
# /tokenize takes vLLM's TokenizeCompletionRequest, or with `messages` its TokenizeChatRequest.
TOKENIZE_FIELDS = {
    "prompt": ("model", "prompt", "add_special_tokens", "return_token_strs"),
    "messages": ("model", "messages", "add_generation_prompt", "return_token_strs", "continue_final_message",
                 "add_special_tokens", "chat_template", "chat_template_kwargs", "media_io_kwargs",
                 "mm_processor_kwargs", "tools"),
}


# Requests that vLLM's own serving classes take whole, in the engine (engine_core/serving_apis.py):
# every field of the class that is not refused is forwarded as sent, and vLLM validates it.
API_FIELDS = {
    "responses": (
        "include", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model", "logit_bias",
        "parallel_tool_calls", "previous_response_id", "prompt", "reasoning", "include_reasoning", "service_tier",
        "store", "stream", "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "top_k", "min_p",
        "truncation", "user", "skip_special_tokens", "include_stop_str_in_output", "presence_penalty",
        "frequency_penalty", "prompt_cache_key", "watermarking", "request_id", "session_id", "priority",
        "cache_salt", "enable_response_messages", "previous_input_messages", "structured_outputs",
        "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "vllm_xargs", "chat_template_kwargs",
        "media_io_kwargs", "mm_processor_kwargs",
    ),
    "messages": (
        "model", "messages", "max_tokens", "metadata", "output_config", "thinking", "stop_sequences", "stream",
        "system", "temperature", "tool_choice", "tools", "top_k", "top_p", "cache_salt", "watermarking",
        "vllm_xargs", "chat_template_kwargs",
    ),
    "count_tokens": (
        "model", "messages", "output_config", "system", "thinking", "tool_choice", "tools", "chat_template_kwargs",
    ),
    # the pooling routes, vLLM's pooling serving classes (engine_core/pooling_apis.py)
    "embeddings": (
        "add_special_tokens", "padding", "encoding_format", "embed_dtype", "endianness", "dimensions",
        "use_activation", "input", "model", "user", "truncate_prompt_tokens", "truncation_side", "request_id",
        "priority", "cache_salt", "add_generation_prompt", "continue_final_message", "chat_template",
        "chat_template_kwargs", "messages", "media_io_kwargs", "mm_processor_kwargs",
    ),
    "embed": (
        "model", "input_type", "texts", "inputs", "output_dimension", "embedding_types", "truncate", "max_tokens",
        "priority", "images",
    ),
    "pooling": (
        "add_special_tokens", "use_activation", "encoding_format", "embed_dtype", "endianness", "dimensions",
        "input", "model", "user", "truncate_prompt_tokens", "padding", "truncation_side", "request_id", "priority",
        "cache_salt", "task", "add_generation_prompt", "continue_final_message", "chat_template",
        "chat_template_kwargs", "messages", "media_io_kwargs", "mm_processor_kwargs",
    ),
    "score": (
        "use_activation", "model", "user", "truncate_prompt_tokens", "padding", "truncation_side", "request_id",
        "priority", "cache_salt", "max_tokens_per_query", "max_tokens_per_doc", "instruction",
        "chat_template_kwargs", "queries", "documents", "items", "data_1", "data_2", "text_1", "text_2",
        "mm_processor_kwargs",
    ),
    "rerank": (
        "use_activation", "model", "user", "truncate_prompt_tokens", "padding", "truncation_side", "request_id",
        "priority", "cache_salt", "max_tokens_per_query", "max_tokens_per_doc", "instruction",
        "chat_template_kwargs", "query", "documents", "top_n", "mm_processor_kwargs",
    ),
    "classify": (
        "add_special_tokens", "use_activation", "input", "model", "user", "truncate_prompt_tokens", "padding",
        "truncation_side", "request_id", "priority", "cache_salt", "add_generation_prompt", "continue_final_message",
        "chat_template", "chat_template_kwargs", "messages", "media_io_kwargs", "mm_processor_kwargs",
    ),
}
# Forwarded, and named in the ignored-fields header where set: vLLM ignores them itself.
VLLM_IGNORES: dict[str, dict[str, tuple[str, tuple[Any, ...]]]] = {
    "responses": {
        "store": ("vLLM keeps no responses (VLLM_ENABLE_RESPONSES_API_STORE is off): nothing is stored", (False,)),
    },
}


_SUPPORTED = {
    **{endpoint: frozenset(f.encode_name for f in msgspec.structs.fields(typ)) for endpoint, typ in TYPES.items()},
    **{f"tokenize:{variant}": frozenset(names) for variant, names in TOKENIZE_FIELDS.items()},
    **{endpoint: frozenset(names) for endpoint, names in API_FIELDS.items()},
}


def supported(endpoint: str, raw: dict[str, Any] | None = None) -> frozenset[str]:
    """The names of the fields servectl honours on ``endpoint`` (for /tokenize: on ``raw``'s variant)."""
    if endpoint == "tokenize":
        return _SUPPORTED["tokenize:messages" if raw is not None and "messages" in raw else "tokenize:prompt"]
    return _SUPPORTED[endpoint]


def _asks_for_nothing(value: Any, no_ops: tuple[Any, ...]) -> bool:
    # 1 == 1.0 may match, but a bool never stands in for a number (True == 1 in Python).
    return value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in no_ops)


def classify(endpoint: str, raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the supported fields to forward, the unknown field names) of a request body.

    Raises ``HttpError`` 400 for a refused field that asks for something and for a legacy
    ``guided_*`` field; both name the field.
    """
    names = supported(endpoint, raw)
    refused = REFUSED.get(endpoint, {})
    openai_only = OPENAI_ONLY.get(endpoint, {})
    no_effect = NO_EFFECT.get(endpoint, {})
    forward: dict[str, Any] = {}
    unknown: list[str] = []
    ignores = VLLM_IGNORES.get(endpoint, {})
    for key, value in raw.items():
        if key in names:
            forward[key] = value
            if key in ignores and not _asks_for_nothing(value, ignores[key][1]):
                unknown.append(key)
        elif key in LEGACY_GUIDED:
            if value is not None:
                raise HttpError(400, f"`{key}` was removed from vLLM's API and would leave the output "
                                     "unconstrained; use `structured_outputs` (e.g. {\"structured_outputs\": "
                                     "{\"json\": <schema>}}, also `regex`, `choice`, `grammar`) or `response_format`",
                                param=key, code="unsupported_parameter")
        elif key in refused or key in openai_only:
            why, no_ops = refused.get(key) or openai_only[key]
            if not _asks_for_nothing(value, no_ops):
                raise HttpError(400, f"`{key}` is not supported by servectl: {why}", param=key,
                                code="unsupported_parameter")
        elif key not in no_effect:
            unknown.append(key)
    return forward, unknown
