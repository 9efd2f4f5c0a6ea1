"""Issue 16: every vLLM field does what it says, through the official `openai` client.

Each test sends a request with the field and the same request without it (the
positive control), and checks a difference the field must make: a test that
passes with the field ignored is no test. vLLM's extensions go in
`extra_body`, as a client of `vllm serve` sends them. Greedy (temperature 0)
throughout, so the control's output is the reference.
"""

from __future__ import annotations

import json

import openai
import pytest

from conftest import http

CHAT = [{"role": "user", "content": "def"}]


@pytest.fixture(scope="module")
def api(daemon):
    return daemon.openai()


def complete(api, prompt="def ", **kw):
    extra = kw.pop("extra_body", {})
    return api.completions.create(model="default", prompt=prompt, temperature=0, extra_body=extra, **kw)


def chat(api, messages=CHAT, **kw):
    extra = kw.pop("extra_body", {})
    return api.chat.completions.create(model="default", messages=messages, temperature=0, extra_body=extra, **kw)


def extra(obj, name):
    """A vLLM field of a response object (the openai client keeps unknown fields as extras)."""
    return (obj.model_extra or {}).get(name)


# ---- defaults ------------------------------------------------------------------------------------

def test_chat_without_max_tokens_is_not_cut_at_16(api):
    """vLLM refuses min_tokens > max_tokens, so 24 minimum tokens without max_tokens proves a default
    above 16 (vLLM's: the rest of the context); with max_tokens 16 the same request is refused."""
    r = chat(api, extra_body={"min_tokens": 24}, stop=["\n"])
    assert r.usage.completion_tokens >= 24
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= 512
    with pytest.raises(openai.BadRequestError):
        chat(api, max_tokens=16, extra_body={"min_tokens": 24})
    # The completions default stays OpenAI's 16.
    assert complete(api, extra_body={"ignore_eos": True}).usage.completion_tokens == 16


# ---- structured outputs --------------------------------------------------------------------------

def test_structured_outputs_choice(api):
    choices = ["yes", "no"]
    free = complete(api, max_tokens=8).choices[0].text
    assert free not in choices
    r = complete(api, max_tokens=8, extra_body={"structured_outputs": {"choice": choices}})
    assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"


def json_with_int_k(text: str) -> bool:
    try:
        return isinstance(json.loads(text)["k"], int)
    except (ValueError, KeyError, TypeError):
        return False


@pytest.mark.parametrize("constraint, check", [
    ({"regex": "[a-z]{3}[0-9]{2}"}, lambda t: len(t) == 5 and t[:3].isalpha() and t[3:].isdigit()),
    ({"grammar": 'root ::= "x = " [0-9] [0-9]'}, lambda t: t.startswith("x = ") and t[4:].isdigit() and len(t) == 6),
    ({"json": {"type": "object", "properties": {"k": {"type": "integer", "maximum": 99}}, "required": ["k"],
               "additionalProperties": False}}, json_with_int_k),
])
def test_structured_outputs_regex_grammar_json(api, constraint, check):
    # "data = " because after "def " the tiny model spends every token on the whitespace JSON allows.
    free = complete(api, "data = ", max_tokens=12).choices[0].text
    assert not check(free)
    r = complete(api, "data = ", max_tokens=40, extra_body={"structured_outputs": constraint})
    assert check(r.choices[0].text), r.choices[0].text


# ---- stopping -------------------------------------------------------------------------------------

def test_stop_token_ids_finish_at_that_token(api):
    control = complete(api, max_tokens=12, extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    ids = extra(control, "token_ids")
    stop_id = ids[3]
    assert control.finish_reason == "length"
    r = complete(api, max_tokens=12, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                 "stop_token_ids": [stop_id]}).choices[0]
    assert r.finish_reason == "stop" and extra(r, "stop_reason") == stop_id
    assert extra(r, "token_ids") == ids[:ids.index(stop_id) + 1]
    assert control.text.startswith(r.text) and len(r.text) < len(control.text)


def test_min_tokens_holds_off_every_stop(api):
    control = complete(api, max_tokens=16, stop=["\n"], extra_body={"ignore_eos": True})
    assert control.choices[0].finish_reason == "stop" and control.usage.completion_tokens < 8
    r = complete(api, max_tokens=16, stop=["\n"], extra_body={"ignore_eos": True, "min_tokens": 8})
    assert r.usage.completion_tokens >= 8


def test_include_stop_str_in_output(api):
    control = complete(api, max_tokens=16, stop=["\n"], extra_body={"ignore_eos": True}).choices[0]
    assert control.finish_reason == "stop" and extra(control, "stop_reason") == "\n"
    assert not control.text.endswith("\n")
    r = complete(api, max_tokens=16, stop=["\n"],
                 extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert r.text == control.text + "\n" and extra(r, "stop_reason") == "\n"


# ---- what may be sampled ----------------------------------------------------------------------------

def test_bad_words_remove_a_word_the_control_produced(api):
    control = complete(api, max_tokens=12, extra_body={"ignore_eos": True}).choices[0].text
    word = control.split()[0].strip(".(\n")[:4]
    assert word and word in control
    r = complete(api, max_tokens=12, extra_body={"ignore_eos": True, "bad_words": [word]}).choices[0].text
    assert word not in r


def test_allowed_token_ids_limit_every_token(api):
    control = extra(complete(api, max_tokens=6, extra_body={"ignore_eos": True, "return_token_ids": True})
                    .choices[0], "token_ids")
    allowed = [5, 6, 7]
    assert not set(control) <= set(allowed)
    r = complete(api, max_tokens=6, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                "allowed_token_ids": allowed}).choices[0]
    assert set(extra(r, "token_ids")) <= set(allowed)


def test_skip_and_space_special_tokens(api):
    body = {"ignore_eos": True, "allowed_token_ids": [1, 2]}  # <|im_start|>, <|im_end|>
    assert complete(api, max_tokens=4, extra_body=body).choices[0].text == ""
    shown = complete(api, max_tokens=4, extra_body={**body, "skip_special_tokens": False}).choices[0].text
    assert "<|im_" in shown
    packed = complete(api, max_tokens=4, extra_body={**body, "skip_special_tokens": False,
                                                     "spaces_between_special_tokens": False}).choices[0].text
    assert packed.replace(" ", "") == shown.replace(" ", "") and " " not in packed


# ---- prompt handling -----------------------------------------------------------------------------

def test_truncate_prompt_tokens(api):
    prompt = "import os\nimport sys\n"
    assert complete(api, prompt, max_tokens=1).usage.prompt_tokens > 4
    assert complete(api, prompt, max_tokens=1, extra_body={"truncate_prompt_tokens": 4}).usage.prompt_tokens == 4


def test_echo_with_max_tokens_0_is_the_prompt_only(api):
    r = complete(api, "import os", max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == "import os" and c.logprobs.tokens[-2:] == ["import", " os"] and c.logprobs.token_logprobs[0] is None
    assert r.usage.prompt_tokens == len(c.logprobs.tokens)
    with pytest.raises(openai.BadRequestError):  # without echo, nothing to show: vLLM's 400
        complete(api, "import os", max_tokens=0)


def test_prompt_logprobs_and_return_token_ids(api, daemon):
    control = complete(api, "def f(x):", max_tokens=3).choices[0]
    assert extra(control, "prompt_logprobs") is None and extra(control, "token_ids") is None
    r = complete(api, "def f(x):", max_tokens=3, extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    c = r.choices[0]
    plp, prompt_ids = extra(c, "prompt_logprobs"), extra(c, "prompt_token_ids")
    assert len(plp) == len(prompt_ids) == r.usage.prompt_tokens and plp[0] is None
    assert all(str(t) in step for t, step in zip(prompt_ids[1:], plp[1:]))
    text = http(daemon, "POST", "/detokenize", {"model": "default", "tokens": extra(c, "token_ids")}).json()
    assert text["prompt"] == c.text


def test_logprob_options(api):
    control = complete(api, max_tokens=3, logprobs=1).choices[0].logprobs
    assert not control.tokens[0].startswith("token_id:")
    as_ids = complete(api, max_tokens=3, logprobs=1, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert all(t.startswith("token_id:") for t in as_ids.logprobs.tokens)
    picked = complete(api, max_tokens=3, logprobs=0, extra_body={"logprob_token_ids": [5, 6]}).choices[0]
    assert all(len(top) >= 2 for top in picked.logprobs.top_logprobs)
    assert all(len(top) == 1 for top in complete(api, max_tokens=3, logprobs=0).choices[0].logprobs.top_logprobs)


# ---- chat ------------------------------------------------------------------------------------------

def test_chat_echo_and_continue_final_message(api):
    msgs = [*CHAT, {"role": "assistant", "content": "def read"}]
    opened = chat(api, msgs, max_tokens=4)
    cont = chat(api, msgs, max_tokens=4, extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert cont.usage.prompt_tokens < opened.usage.prompt_tokens  # no closing tag, no new turn
    echoed = chat(api, msgs, max_tokens=4, extra_body={"add_generation_prompt": False,
                                                        "continue_final_message": True, "echo": True})
    assert echoed.choices[0].message.content == "def read" + cont.choices[0].message.content
    assert not cont.choices[0].message.content.startswith("def read")


def test_add_generation_prompt_and_return_prompt_text(api):
    r = chat(api, max_tokens=2, extra_body={"return_prompt_text": True})
    assert extra(r, "prompt_text").endswith("<|im_start|>assistant\n")
    closed = chat(api, max_tokens=2, extra_body={"return_prompt_text": True, "add_generation_prompt": False})
    assert not extra(closed, "prompt_text").endswith("assistant\n")
    assert closed.usage.prompt_tokens < r.usage.prompt_tokens


def test_untrusted_request_chat_template_is_refused_as_vllm_does(api):
    with pytest.raises(openai.BadRequestError) as info:
        chat(api, max_tokens=2, extra_body={"chat_template": "{{ messages[0].content }}"})
    assert "trust" in str(info.value)


def test_stream_options_continuous_usage_stats(api):
    def usages(**opts):
        stream = api.chat.completions.create(model="default", messages=CHAT, max_tokens=4, temperature=0,
                                             stream=True, stream_options=opts)
        return [c.usage for c in stream]
    assert all(u is None for u in usages(include_usage=True)[:-1])
    counted = usages(include_usage=True, continuous_usage_stats=True)
    assert all(u is not None for u in counted)
    assert [u.completion_tokens for u in counted[:-1]] == [0, 1, 2, 3, 4] and counted[-1].completion_tokens == 4


# ---- nothing silently ignored ------------------------------------------------------------------------

def test_unknown_fields_are_named_refused_ones_are_400_legacy_ones_name_structured_outputs(daemon):
    r = http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 1,
                                                  "my_vendor_flag": 1, "another": None})
    assert r.status == 200 and r.headers["x-servectl-ignored-fields"] == "another, my_vendor_flag"
    assert "my_vendor_flag" in daemon.log("gateway:0")
    stream = http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 1,
                                                       "stream": True, "zzz": 1})
    assert stream.status == 200 and stream.headers["x-servectl-ignored-fields"] == "zzz"
    assert "x-servectl-ignored-fields" not in http(daemon, "POST", "/v1/completions", {
        "model": "default", "prompt": "x", "max_tokens": 1}).headers
    for field, value in (("use_beam_search", True), ("prompt_embeds", "AAAA"), ("kv_transfer_params", {"a": 1})):
        r = http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "x", field: value})
        assert r.status == 400 and r.json()["error"]["param"] == field, r.body
    assert http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 1,
                                                    "use_beam_search": False}).status == 200
    r = http(daemon, "POST", "/v1/chat/completions", {"model": "default", "messages": CHAT,
                                                       "guided_choice": ["a", "b"]})
    assert r.status == 400 and "structured_outputs" in r.json()["error"]["message"]
    r = http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "x",
                                                  "structured_outputs": {"choices": ["a"]}})
    assert r.status == 400 and "choices" in r.json()["error"]["message"]


# ---- tokenizer endpoints ---------------------------------------------------------------------------

def test_tokenize_detokenize_and_tokenizer_info(daemon, api):
    tok = http(daemon, "POST", "/tokenize", {"model": "default", "prompt": "def f(x):", "return_token_strs": True})
    assert tok.status == 200, tok.body
    body = tok.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"} and body["max_model_len"] == 512
    assert body["count"] == len(body["tokens"]) == complete(api, "def f(x):", max_tokens=1).usage.prompt_tokens
    back = http(daemon, "POST", "/detokenize", {"model": "default", "tokens": body["tokens"]}).json()
    assert back["prompt"].endswith("def f(x):")
    chat_tok = http(daemon, "POST", "/tokenize", {"messages": CHAT}).json()  # one model: `model` may be left out
    assert chat_tok["count"] == chat(api, max_tokens=1).usage.prompt_tokens
    info = http(daemon, "GET", "/tokenizer_info")
    assert info.status == 200 and info.json()["eos_token"] == "<|endoftext|>"
    for method, path, payload in (("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
                                  ("GET", "/tokenizer_info", None)):
        assert http(daemon, method, path, payload, key=None).status == 401
    assert http(daemon, "POST", "/tokenize", {"model": "nope", "prompt": "x"}).status == 404
    assert http(daemon, "POST", "/detokenize", {"model": "default", "tokens": [-1]}).status == 400
