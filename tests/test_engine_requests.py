"""The engine's request building and output showing, with vLLM's real classes and no daemon.

RequestBuilder gets the model config and renderer the engine's LLMEngine would
have (built here from the same engine arguments, without workers), so these
tests see what a request becomes inside the engine: the SamplingParams vLLM
gets, the defaults from generation_config.json and the config's overrides, the
chat template's trust rule, vLLM's refusals. Imports vLLM: not in the unit tier.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servectl.config import DEFAULT_ENGINE_ARGS, DEFAULT_MODEL_DIR, ModelConfig

pytestmark = pytest.mark.vllm_unit  # vLLM's classes, no daemon

MAX_MODEL_LEN = 512


def builder(model_dir: Path = DEFAULT_MODEL_DIR, **model_keys):
    """A RequestBuilder for ``model_dir`` configured as servectl would (engine_core.core.engine_args)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers import renderer_from_config

    from engine_core.main import engine_args
    from engine_core.requests import request_builder

    model_keys.setdefault("engine_args", {**DEFAULT_ENGINE_ARGS, "dtype": "float32"})
    model = ModelConfig(name="m", model=str(model_dir), **model_keys)
    config = EngineArgs(model=model.model, **engine_args(model)).create_engine_config()
    return request_builder(config, renderer_from_config(config), model)


@pytest.fixture(scope="module")
def plain():
    return builder()


@pytest.fixture(scope="module")
def tuned_model(tmp_path_factory) -> Path:
    """The default model with a generation_config.json that sets sampling defaults."""
    d = tmp_path_factory.mktemp("tuned")
    for f in DEFAULT_MODEL_DIR.iterdir():
        if f.is_file():
            (d / f.name).symlink_to(f)
    (d / "generation_config.json").unlink()
    cfg = json.loads((DEFAULT_MODEL_DIR / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**cfg, "temperature": 0.25, "top_k": 7,
                                                          "repetition_penalty": 1.3}))
    return d


CHAT = [{"role": "user", "content": "hi"}]


def prompt_len(built) -> int:
    return len(built.engine_input["prompt_token_ids"])


# ---- max_tokens ------------------------------------------------------------------------------

def test_chat_without_max_tokens_gets_the_rest_of_the_context(plain):
    built = plain.build("chat", {"messages": CHAT})
    assert built.params.max_tokens == MAX_MODEL_LEN - prompt_len(built)
    assert plain.build("chat", {"messages": CHAT, "max_tokens": 7}).params.max_tokens == 7
    assert plain.build("chat", {"messages": CHAT, "max_tokens": 7, "max_completion_tokens": 5}).params.max_tokens == 5


def test_completion_without_max_tokens_gets_16(plain):
    assert plain.build("completion", {"prompt": "def "}).params.max_tokens == 16


# ---- sampling defaults: generation_config.json, then the config's overrides, then the client ------

def test_defaults_come_from_generation_config_and_the_client_wins(tuned_model):
    b = builder(tuned_model)
    p = b.build("completion", {"prompt": "def "}).params
    assert (p.temperature, p.top_k, p.repetition_penalty) == (0.25, 7, 1.3)
    p = b.build("chat", {"messages": CHAT, "temperature": 0.9, "top_k": 3}).params
    assert (p.temperature, p.top_k, p.repetition_penalty) == (0.9, 3, 1.3)


def test_the_model_without_sampling_defaults_gets_vllms_neutral_ones(plain):
    assert plain.defaults == {}
    p = plain.build("completion", {"prompt": "def "}).params
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 1.0, 0, 1.0)


def test_override_generation_config_beats_the_file_and_caps_max_tokens(tuned_model):
    b = builder(tuned_model, override_generation_config={"temperature": 0.5, "max_new_tokens": 40})
    built = b.build("chat", {"messages": CHAT})
    assert (built.params.temperature, built.params.top_k, built.params.max_tokens) == (0.5, 7, 40)
    assert b.build("completion", {"prompt": "x", "temperature": 0.0}).params.temperature == 0.0
    # max_new_tokens caps even a client's max_tokens (vLLM's get_max_tokens takes the minimum).
    assert b.build("completion", {"prompt": "x", "max_tokens": 100}).params.max_tokens == 40


def test_engine_args_merge_the_override_into_vllms_argument():
    from engine_core.main import engine_args

    model = ModelConfig(name="m", model="x", engine_args={"override_generation_config": {"top_p": 0.5, "top_k": 2}},
                        override_generation_config={"top_k": 9})
    assert engine_args(model)["override_generation_config"] == {"top_p": 0.5, "top_k": 9}
    assert "override_generation_config" not in engine_args(ModelConfig(name="m", model="x"))


# ---- chat templates ---------------------------------------------------------------------------

TEMPLATE = ("{% for d in documents or [] %}[{{ d.title }}]{% endfor %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ suffix or '' }}")


def test_a_requests_chat_template_needs_trust(plain):
    from engine_core.request_types import BadRequest

    for body in ({"chat_template": TEMPLATE}, {"chat_template_kwargs": {"chat_template": TEMPLATE}}):
        with pytest.raises(BadRequest) as info:
            plain.build("chat", {"messages": CHAT, **body})
        assert info.value.status == 400 and "trust_request_chat_template" in str(info.value)


def test_a_trusted_chat_template_sees_documents_and_kwargs():
    b = builder(trust_request_chat_template=True)
    built = b.build("chat", {"messages": CHAT, "chat_template": TEMPLATE, "documents": [{"title": "T", "text": "x"}],
                             "chat_template_kwargs": {"suffix": "!"}})
    assert built.engine_input["prompt"] == "[T]<user>hi!"


def test_generation_prompt_and_continuing_the_last_message(plain):
    msgs = [*CHAT, {"role": "assistant", "content": "def f"}]
    opened = plain.build("chat", {"messages": CHAT}).engine_input["prompt"]
    assert opened.endswith("<|im_start|>assistant\n")
    closed = plain.build("chat", {"messages": CHAT, "add_generation_prompt": False}).engine_input["prompt"]
    assert not closed.endswith("assistant\n")
    cont = plain.build("chat", {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True,
                                "echo": True})
    assert cont.engine_input["prompt"].endswith("assistant\ndef f")
    assert (cont.spec.role, cont.spec.echo_text) == ("assistant", "def f")


# ---- vLLM's fields reach SamplingParams --------------------------------------------------------

def test_vllm_sampling_fields_reach_sampling_params(plain):
    p = plain.build("completion", {
        "prompt": "def ", "stop_token_ids": [5], "min_tokens": 3, "bad_words": ["import"], "allowed_token_ids": [5, 6],
        "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
        "prompt_logprobs": 2, "logprobs": 1, "structured_outputs": {"regex": "a+"}, "seed": 3, "ignore_eos": True,
        "logit_bias": {"5": 1.0}}).params
    assert (p.stop_token_ids, p.min_tokens, p.bad_words, p.allowed_token_ids) == ([5], 3, ["import"], [5, 6])
    assert (p.include_stop_str_in_output, p.skip_special_tokens, p.spaces_between_special_tokens) == (True, False, False)
    assert (p.prompt_logprobs, p.logprobs, p.structured_outputs.regex, p.seed, p.ignore_eos) == (2, 1, "a+", 3, True)
    from vllm.sampling_params import RequestOutputKind

    assert p.output_kind == RequestOutputKind.DELTA  # the gateway assembles whole responses itself


def test_truncation_and_echo_with_max_tokens_0(plain):
    built = plain.build("completion", {"prompt": "x " * 100, "truncate_prompt_tokens": 5})
    assert prompt_len(built) == 5
    echo = plain.build("completion", {"prompt": "import os", "echo": True, "max_tokens": 0, "logprobs": 1})
    assert (echo.spec.echo_only, echo.params.max_tokens, echo.params.prompt_logprobs) == (True, 1, 1)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ({"prompt": "x", "structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "n": "two"}, "n"),
])
def test_vllms_refusals_keep_their_status_and_parameter(plain, body, param):
    from engine_core.request_types import BadRequest

    with pytest.raises(BadRequest) as info:
        plain.build("completion", body)
    assert (info.value.status, info.value.param) == (400, param), str(info.value)


# ---- outputs: logprobs chosen as vLLM's serving classes do -----------------------------------

def test_alternatives_completions_list_k_plus_1_chat_k():
    from vllm.logprobs import Logprob

    from engine_core.outputs import OutputFormatter
    from engine_core.request_types import OutputSpec

    class Tok:
        def decode(self, ids):
            return f"<{ids}>"

    # vLLM's per-token dict: the sampled token first, then the top-k by rank.
    step = {7: Logprob(-2.0, 3, "s"), 1: Logprob(-0.5, 1, "a"), 2: Logprob(float("-inf"), 2, "b")}
    f = OutputFormatter(Tok())
    [cmpl] = f.entries([7], [step], OutputSpec(chat=False, logprobs=1))
    assert cmpl == ["s", -2.0, [["s", -2.0], ["a", -0.5]], None]
    [chat] = f.entries([7], [step], OutputSpec(chat=True, logprobs=1))
    assert chat == ["s", -2.0, [["s", -2.0]], [115]]
    [every] = f.entries([7], [step], OutputSpec(chat=True, logprobs=0, all_alternatives=True))
    assert every[2] == [["s", -2.0], ["a", -0.5], ["b", -9999.0]]
    [ids] = f.entries([7], [step], OutputSpec(chat=False, logprobs=0, as_token_ids=True))
    assert ids[0] == "token_id:7" and ids[2] == [["token_id:7", -2.0]]
    [first] = f.entries([9], [None], OutputSpec(chat=True, logprobs=0))
    assert first == ["<9>", None, None, list(b"<9>")]


# ---- tokenizer endpoints ----------------------------------------------------------------------

def test_tokenizer_endpoints_answer_in_vllms_shapes(plain):
    from engine_core.tokenizing import TokenizerEndpoints

    t = TokenizerEndpoints(plain)
    tok = t.answer("tokenize", {"prompt": "def f", "return_token_strs": True})
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == MAX_MODEL_LEN
    chat = t.answer("tokenize", {"messages": CHAT})
    assert chat["tokens"] == plain.build("chat", {"messages": CHAT}).engine_input["prompt_token_ids"]
    assert t.answer("detokenize", {"tokens": tok["tokens"]})["prompt"].endswith("def f")
    assert t.answer("tokenizer_info", {})["tokenizer_class"]


# ---- a forced tool call's arguments (issue 51) -------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def hermes():
    from conftest import TOOLS_MODEL_DIR

    return builder(TOOLS_MODEL_DIR, enable_auto_tool_choice=True, tool_call_parser="hermes",
                   engine_args={**DEFAULT_ENGINE_ARGS, "dtype": "float32", "reasoning_parser": "qwen3"})


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_of_a_non_strict_tool_is_held_to_its_schema(hermes, choice):
    """vLLM's structural tag for hermes leaves a non-strict tool's arguments free (`"json_schema":
    true`) under `required` / a named choice; servectl's holds them to the tool's parameters."""
    params = hermes.build("chat", {"messages": CHAT, "tools": [WEATHER], "tool_choice": choice}).params
    tag = json.loads(params.structured_outputs.structural_tag)
    tags = [t for t in tag["format"]["tags"] if t["begin"].startswith('<tool_call>\n{"name": "get_weather"')]
    assert tags and all(t["content"]["json_schema"] == WEATHER["function"]["parameters"] for t in tags), tag


def test_auto_keeps_vllms_constraint(hermes):
    """`auto` with a non-strict tool: no grammar, as under `vllm serve`."""
    params = hermes.build("chat", {"messages": CHAT, "tools": [WEATHER], "tool_choice": "auto"}).params
    assert params.structured_outputs is None
