"""Every field of vLLM's request classes is classified, documented and handled as documented.

docs/vllm_fields.json is what vLLM 0.32 defines (generated from its classes by
tools/vllm_fields.py; tests/test_vllm_fields.py checks it against the installed
vLLM). Here, without vLLM: the gateway's types and refusal tables cover exactly
those fields, docs/api.md says of each what the gateway does, and the gateway's
classification does it (supported fields forwarded as sent, refused ones a 400
naming them, unknown ones named, legacy guided_* a 400 naming structured_outputs).
"""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import msgspec
import pytest

from api_gateway import fields as F
from api_gateway import openai_types as H
from api_gateway.errors import HttpError
from servectl.config import GenerationKey

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
VLLM = json.loads((ROOT / "docs" / "vllm_fields.json").read_text())["classes"]
API_MD = (ROOT / "docs" / "api.md").read_text()

# vLLM class -> (gateway endpoint, a body of that variant)
ENDPOINTS = {
    "CompletionRequest": ("completion", {}),
    "ChatCompletionRequest": ("chat", {}),
    "TokenizeCompletionRequest": ("tokenize", {"prompt": "x"}),
    "TokenizeChatRequest": ("tokenize", {"messages": []}),
    "DetokenizeRequest": ("detokenize", {}),
    "ResponsesRequest": ("responses", {}),
    "AnthropicMessagesRequest": ("messages", {}),
    "AnthropicCountTokensRequest": ("count_tokens", {}),
}
# The pooling routes take the union of their request classes' variants (one table each in docs/api.md).
POOLING_CLASSES = {
    "embeddings": ["EmbeddingCompletionRequest", "EmbeddingChatRequest", "EmbeddingBatchChatRequest",
                   "EmbeddingChatInputRequest", "EmbeddingBatchChatInputRequest"],
    "embed": ["CohereEmbedRequest"], "pooling": ["PoolingCompletionRequest", "PoolingChatRequest", "IOProcessorRequest"],
    "score": ["ScoreQueriesDocumentsRequest", "ScoreQueriesItemsRequest", "ScoreDataRequest", "ScoreTextRequest"],
    "rerank": ["RerankRequest"], "classify": ["ClassificationCompletionRequest", "ClassificationChatRequest"],
}


@pytest.mark.parametrize("endpoint", list(POOLING_CLASSES))
def test_every_field_of_a_pooling_route_is_supported_or_refused_and_documented(endpoint):
    vllm = {f for cls in POOLING_CLASSES[endpoint] for f in VLLM[cls]}
    supported, refused = F.supported(endpoint), set(F.REFUSED[endpoint])
    assert not supported & refused and supported | refused == vllm, sorted(vllm ^ (supported | refused))
    for cls in POOLING_CLASSES[endpoint]:
        for field, (status, note) in md_table(cls).items():
            assert status == ("supported" if field in supported else "refused"), (cls, field, status)
NESTED = {"StreamOptions": H.StreamOptions, "StructuredOutputsParams": H.StructuredOutputs}


def md_table(heading: str) -> dict[str, tuple[str, str]]:
    """{field: (status, note)} of the table under ``### <heading>`` in docs/api.md."""
    m = re.search(rf"^### {re.escape(heading)}\b.*?\n\n((?:\|.*\n)+)", API_MD, re.M)
    assert m, f"docs/api.md has no table under '### {heading}'"
    rows = {}
    for line in m.group(1).splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def names(typ) -> list[str]:
    return [f.encode_name for f in msgspec.structs.fields(typ)]


@pytest.mark.parametrize("cls", list(ENDPOINTS))
def test_every_vllm_field_is_supported_or_refused_and_nothing_else(cls):
    endpoint, raw = ENDPOINTS[cls]
    vllm = set(VLLM[cls])
    supported = F.supported(endpoint, raw)
    refused = set(F.REFUSED[endpoint])
    if endpoint == "tokenize":  # one refusal table for both variants: only the variant's own fields
        refused &= vllm
    assert supported <= vllm, f"the gateway accepts fields vLLM's {cls} lacks: {sorted(supported - vllm)}"
    assert not supported & refused, sorted(supported & refused)
    assert supported | refused == vllm, f"unclassified: {sorted(vllm - supported - refused)}"


@pytest.mark.parametrize("endpoint,cls", [("completion", "CompletionRequest"), ("chat", "ChatCompletionRequest"),
                                          ("detokenize", "DetokenizeRequest")])
def test_the_gateway_type_has_exactly_the_supported_fields(endpoint, cls):
    assert set(names(F.TYPES[endpoint])) == F.supported(endpoint)
    refusals = set(F.REFUSED[endpoint])
    assert refusals <= set(VLLM[cls]), f"refusing fields vLLM's {cls} lacks: {sorted(refusals - set(VLLM[cls]))}"


def test_the_tokenize_type_covers_both_variants():
    both = set(F.TOKENIZE_FIELDS["prompt"]) | set(F.TOKENIZE_FIELDS["messages"])
    assert set(names(H.TokenizeRequest)) == both
    assert set(F.REFUSED["tokenize"]) <= set(VLLM["TokenizeChatRequest"])


@pytest.mark.parametrize("cls", list(NESTED))
def test_nested_objects_have_vllms_fields(cls):
    assert names(NESTED[cls]) == list(VLLM[cls])


# Where the gateway's default differs from vLLM's, and why that is harmless: the gateway
# forwards only the fields a client sent, so vLLM applies its own defaults.
DEFAULT_EXCEPTIONS = {
    "add_special_tokens",  # vLLM: true for completions, false for chat; the gateway never reads it
    "request_id",  # vLLM generates one
    "stop", "stop_token_ids",  # vLLM: []; the gateway's None means the same (nothing)
    "messages", "prompt", "tokens",  # required
}


@pytest.mark.parametrize("cls", ["CompletionRequest", "ChatCompletionRequest", "StreamOptions",
                                 "StructuredOutputsParams", "DetokenizeRequest"])
def test_the_gateways_defaults_are_vllms(cls):
    """The gateway reads some fields itself (n, stream, echo, logprobs, max_tokens for echo): same defaults."""
    typ = NESTED.get(cls) or F.TYPES[ENDPOINTS[cls][0]]
    for f in msgspec.structs.fields(typ):
        if f.encode_name in DEFAULT_EXCEPTIONS or f.encode_name == "model":
            continue
        spec = VLLM[cls][f.encode_name]
        default = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
        assert default == spec.get("default"), f"{cls}.{f.encode_name}: gateway {default!r}, vLLM {spec}"


# ---- docs/api.md --------------------------------------------------------------------------

@pytest.mark.parametrize("cls", list(VLLM))
def test_api_md_lists_every_field_in_vllms_order(cls):
    assert list(md_table(cls)) == list(VLLM[cls])


@pytest.mark.parametrize("cls", list(ENDPOINTS))
def test_api_md_says_what_the_gateway_does(cls):
    endpoint, raw = ENDPOINTS[cls]
    supported = F.supported(endpoint, raw)
    for field, (status, note) in md_table(cls).items():
        assert status == ("supported" if field in supported else "refused"), (cls, field, status)
        if status == "refused":
            why, _ = F.REFUSED[endpoint][field]
            assert why in note, (cls, field, note)


@pytest.mark.parametrize("endpoint,heading", [("completion", "/v1/completions"), ("chat", "/v1/chat/completions")])
def test_api_md_lists_the_openai_only_fields(endpoint, heading):
    table = md_table(heading)
    expected = {**{k: "refused" for k in F.OPENAI_ONLY[endpoint]}, **{k: "no effect" for k in F.NO_EFFECT[endpoint]}}
    assert {k: status for k, (status, _) in table.items()} == expected
    assert not set(expected) & set(VLLM["CompletionRequest" if endpoint == "completion" else "ChatCompletionRequest"])


def test_api_md_names_the_legacy_fields():
    for field in F.LEGACY_GUIDED:
        assert f"`{field}`" in API_MD


def test_config_generation_keys_are_documented():
    for key in typing.get_args(GenerationKey):
        assert f"`{key}`" in API_MD


# ---- the gateway does what the tables say -------------------------------------------------

def refused_with(endpoint: str, raw: dict) -> HttpError:
    with pytest.raises(HttpError) as info:
        F.classify(endpoint, raw)
    return info.value


@pytest.mark.parametrize("endpoint", ["completion", "chat", "tokenize", "responses", "messages"])
def test_refused_fields_are_a_400_naming_them_unless_they_ask_for_nothing(endpoint):
    base = {"messages": [{"role": "user", "content": "x"}]} if endpoint != "completion" else {"prompt": "x"}
    for field, (why, no_ops) in {**F.REFUSED[endpoint], **F.OPENAI_ONLY.get(endpoint, {})}.items():
        err = refused_with(endpoint, {**base, field: {"something": 1}})
        assert (err.status, err.param, err.code) == (400, field, "unsupported_parameter")
        assert field in err.message and why in err.message
        for value in (None, *no_ops):
            forward, unknown = F.classify(endpoint, {**base, field: value})
            assert field not in forward and field not in unknown


def test_a_bool_does_not_pass_for_a_number():
    err = refused_with("completion", {"prompt": "x", "routed_experts_prompt_start": False, "best_of": True})
    assert err.param in ("routed_experts_prompt_start", "best_of")
    F.classify("completion", {"prompt": "x", "length_penalty": 1, "best_of": 1.0})  # 1 == 1.0 asks for nothing


@pytest.mark.parametrize("field", F.LEGACY_GUIDED)
def test_legacy_guided_fields_name_structured_outputs(field):
    err = refused_with("chat", {"messages": [], field: ["a", "b"]})
    assert err.status == 400 and err.param == field and "structured_outputs" in err.message


def test_supported_fields_are_forwarded_as_sent_and_unknown_ones_named():
    raw = {"prompt": [1, 2], "stop_token_ids": [7], "structured_outputs": {"choice": ["a"]}, "min_tokens": 3,
           "my_vendor_flag": True, "x": None, "metadata": {"a": "b"}}
    forward, unknown = F.classify("completion", raw)
    assert forward == {"prompt": [1, 2], "stop_token_ids": [7], "structured_outputs": {"choice": ["a"]},
                       "min_tokens": 3}
    # `metadata` is an OpenAI chat field accepted with no effect there, but unknown to completions.
    assert sorted(unknown) == ["metadata", "my_vendor_flag", "x"]
    forward, unknown = F.classify("chat", {"messages": [], "metadata": {"a": "b"}, "safety_identifier": "u"})
    assert (forward, unknown) == ({"messages": []}, [])


def test_tokenize_fields_depend_on_the_variant():
    assert F.classify("tokenize", {"prompt": "x", "add_generation_prompt": True}) == (
        {"prompt": "x"}, ["add_generation_prompt"])
    assert F.classify("tokenize", {"messages": [], "add_generation_prompt": False, "return_token_strs": True}) == (
        {"messages": [], "add_generation_prompt": False, "return_token_strs": True}, [])


def test_structured_outputs_refuses_unknown_keys():
    """vLLM's dataclass drops a misspelt key, which leaves the output unconstrained."""
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.convert({"prompt": "x", "structured_outputs": {"choices": ["a"]}}, H.CompletionRequest)
    assert "choices" in str(info.value)


def test_passthrough_endpoints_forward_vllms_fields_and_name_the_ones_vllm_ignores():
    """Responses / Messages: vLLM's class takes the body whole in the engine; `store`, which
    vLLM ignores without its store, is forwarded (its own background check needs it) and named."""
    forward, unknown = F.classify("responses", {"input": "hi", "store": True, "tools": [], "vendor": 1})
    assert forward == {"input": "hi", "store": True, "tools": []} and sorted(unknown) == ["store", "vendor"]
    assert F.classify("responses", {"input": "hi", "store": False}) == ({"input": "hi", "store": False}, [])
    err = refused_with("responses", {"input": "hi", "background": True})
    assert err.param == "background" and "store" in err.message
    assert F.classify("messages", {"model": "m", "max_tokens": 5, "messages": [], "system": "s"})[1] == []
    assert set(F.API_FIELDS["count_tokens"]) == set(VLLM["AnthropicCountTokensRequest"])
