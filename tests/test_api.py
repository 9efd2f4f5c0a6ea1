"""Issue 4: the OpenAI API — every parameter's effect, every error's shape."""

from __future__ import annotations

import json

import openai
import pytest

from conftest import Response, http


def assert_error(r: Response, code: int, param: str | None = None):
    assert r.status == code, r.body
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.fixture(scope="module")
def api(daemon):
    return daemon.openai()


def greedy(api, prompt="def ", ignore_eos=None, **kw):
    if ignore_eos is not None:
        kw["extra_body"] = {**(kw.get("extra_body") or {}), "ignore_eos": ignore_eos}
    return api.completions.create(model="default", prompt=prompt, temperature=0, **kw)


# ---- parameters and their effects ---------------------------------------------------

def test_max_tokens_default_is_16(api):
    r = api.completions.create(model="default", prompt="def ", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_ignore_eos_runs_to_max_tokens(api):
    r = greedy(api, max_tokens=60, ignore_eos=True)
    assert r.usage.completion_tokens == 60 and r.choices[0].finish_reason == "length"


def test_stop_string(api):
    base = greedy(api, max_tokens=40, ignore_eos=True).choices[0].text
    stop = base[8:11]
    assert stop and stop in base
    r = greedy(api, max_tokens=40, ignore_eos=True, stop=stop)
    assert stop not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    assert base.startswith(r.choices[0].text)
    r2 = greedy(api, max_tokens=40, ignore_eos=True, stop=["\u2603", stop])  # list form
    assert r2.choices[0].text == r.choices[0].text


def test_seed_reproduces_and_differs(api):
    kw = dict(model="default", prompt="import ", max_tokens=24, temperature=1.0, extra_body={"ignore_eos": True})
    a = api.completions.create(seed=1234, **kw).choices[0].text
    b = api.completions.create(seed=1234, **kw).choices[0].text
    c = api.completions.create(seed=4321, **kw).choices[0].text
    assert a == b
    assert a != c


@pytest.mark.parametrize("sampling", [{"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}])
def test_truncating_samplers_collapse_to_greedy(api, sampling):
    g = greedy(api, prompt="class ", max_tokens=16, ignore_eos=True).choices[0].text
    wide = [api.completions.create(model="default", prompt="class ", max_tokens=16, temperature=1.5, seed=s,
                                   extra_body={"ignore_eos": True}).choices[0].text for s in (1, 2)]
    assert any(w != g for w in wide)  # without the parameter, sampling wanders
    narrowed = api.completions.create(model="default", prompt="class ", max_tokens=16, temperature=1.5, seed=1,
                                      extra_body={"ignore_eos": True, **sampling}).choices[0].text
    assert narrowed == g


@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                                     {"repetition_penalty": 3.0}])
def test_penalties_change_greedy_output(api, penalty):
    prompt = "        self."
    base = greedy(api, prompt=prompt, max_tokens=48, ignore_eos=True).choices[0].text
    pen = greedy(api, prompt=prompt, max_tokens=48, ignore_eos=True, extra_body=dict(penalty)).choices[0].text
    assert pen != base


def test_logit_bias_bans_and_forces(api, tokenizer):
    base = greedy(api, max_tokens=1, logprobs=1)
    first_id = tokenizer.encode("def " + base.choices[0].text, add_special_tokens=False).ids[2]
    banned = greedy(api, max_tokens=1, logit_bias={str(first_id): -100})
    assert banned.choices[0].text != base.choices[0].text
    target = tokenizer.encode(" return", add_special_tokens=False).ids[0]
    forced = greedy(api, max_tokens=5, ignore_eos=True, logit_bias={str(target): 100})
    assert forced.choices[0].text == tokenizer.decode([target] * 5)


def test_n_choices_have_indices(api):
    r = api.completions.create(model="default", prompt="def ", max_tokens=5, n=3, temperature=1.0, seed=3,
                               extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    chunks = list(api.completions.create(model="default", prompt="def ", max_tokens=5, n=2, stream=True))
    assert {c.choices[0].index for c in chunks} == {0, 1}
    chat = api.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}], n=2,
                                       max_tokens=3)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_prompt_forms(api, tokenizer):
    ids = tokenizer.encode("def main", add_special_tokens=True).ids
    as_ids = greedy(api, prompt=ids, max_tokens=6, ignore_eos=True).choices[0].text
    as_text = greedy(api, prompt="def main", max_tokens=6, ignore_eos=True).choices[0].text
    assert as_ids == as_text
    many = greedy(api, prompt=["def ", "import "], max_tokens=3)
    assert [c.index for c in many.choices] == [0, 1]
    lists = greedy(api, prompt=[ids, ids], max_tokens=3)
    assert lists.choices[0].text == lists.choices[1].text


def test_echo_and_logprobs(api):
    r = greedy(api, prompt="import os", max_tokens=4, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text.startswith("import os")
    lp = c.logprobs
    assert lp.token_logprobs[0] is None  # the first prompt token has no context
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset)
    assert all(len(t) <= 3 for t in lp.top_logprobs[1:])  # vLLM lists logprobs + 1 alternatives
    plain = greedy(api, prompt="import os", max_tokens=4)
    assert plain.choices[0].logprobs is None and not plain.choices[0].text.startswith("import os")


def test_chat_logprobs_and_max_completion_tokens(api):
    r = api.chat.completions.create(model="default", messages=[{"role": "user", "content": "def"}],
                                    max_completion_tokens=5, logprobs=True, top_logprobs=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length"
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) <= 3 and t.logprob <= 0 for t in content)


def test_response_format_json_schema(api):
    import jsonschema

    # Every value is bounded, so even a looping greedy decoder must close the object.
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "size": {"type": "string", "enum": ["small", "large"]}},
              "required": ["name", "size"], "additionalProperties": False}
    r = api.chat.completions.create(model="default", messages=[{"role": "user", "content": "json please"}],
                                    max_tokens=60, temperature=0,
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "thing", "schema": schema}})
    doc = json.loads(r.choices[0].message.content)
    jsonschema.validate(doc, schema)
    plain = api.chat.completions.create(model="default", messages=[{"role": "user", "content": "json please"}],
                                        max_tokens=20, temperature=0)
    with pytest.raises(ValueError):
        json.loads(plain.choices[0].message.content)


def test_response_format_json_object(api):
    kw = dict(model="default", prompt="data = ", max_tokens=40, temperature=0)
    r = api.completions.create(**kw, extra_body={"response_format": {"type": "json_object"}})
    # Greedy decoding of a tiny model may not close the object within max_tokens;
    # the grammar still forces an object from the first token on.
    assert r.choices[0].text.lstrip().startswith("{"), r.choices[0].text
    assert not api.completions.create(**kw).choices[0].text.lstrip().startswith("{")


def test_stream_usage_and_user(api):
    chunks = list(api.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=4, stream=True, user="tester",
                                              stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []


def test_unknown_fields_are_ignored_and_unimplemented_ones_named(daemon, api):
    r = http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 2,
                                                  "some_vendor_field": {"a": 1}})
    assert r.status == 200, r.body
    with pytest.raises(openai.BadRequestError) as exc:
        api.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}],
                                    tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    # The default model has no tool-call parser: vLLM's own 400, as `vllm serve` without the flags.
    assert "--enable-auto-tool-choice" in str(exc.value)
    assert_error(http(daemon, "POST", "/v1/chat/completions", {"model": "default", "messages": [
        {"role": "user", "content": "x"}], "functions": [{"name": "f"}]}), 400, "functions")
    assert_error(http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "x", "suffix": "y"}), 400,
                 "suffix")


# ---- errors --------------------------------------------------------------------------

@pytest.mark.parametrize("body,param", [
    ({"model": "default", "prompt": "x", "temperature": -0.5}, "temperature"),
    ({"model": "default", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "default", "prompt": "x", "top_p": 1.5}, "top_p"),
    ({"model": "default", "prompt": "x", "n": 0}, "n"),
    ({"model": "default", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "default", "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"model": "default"}, "prompt"),
    ({"model": "default", "prompt": []}, "prompt"),
    ({"model": "default", "prompt": [1, "a"]}, "prompt"),
    ({"model": 7, "prompt": "x"}, "model"),
])
def test_bad_completion_requests_are_400_naming_the_field(daemon, body, param):
    assert_error(http(daemon, "POST", "/v1/completions", body), 400, param)


def test_bad_requests_vllm_refuses_without_naming_a_field(daemon):
    """vLLM's own message, status and (no) parameter, as `vllm serve` answers them."""
    err = assert_error(http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": [999999]}), 400)
    assert "999999" in err["message"]
    err = assert_error(http(daemon, "POST", "/v1/chat/completions", {"model": "default", "messages": []}), 400)
    assert "empty conversation" in err["message"]


def test_bad_chat_requests(daemon):
    for body in ({"model": "default"}, {"model": "default", "messages": "hi"},
                 {"model": "default", "messages": [{"content": "x"}]}):
        assert_error(http(daemon, "POST", "/v1/chat/completions", body), 400, "messages")


def test_model_may_be_left_out_when_one_is_served(daemon):
    """As `vllm serve`: without `model` the served model answers (several served: a 400 naming it)."""
    r = http(daemon, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert r.status == 200 and r.json()["model"] == "default"
    r = http(daemon, "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}],
                                                      "max_tokens": 1})
    assert r.status == 200, r.body  # any role: vLLM's chat template decides


def test_context_overflow_names_both_numbers(daemon):
    err = assert_error(http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "x",
                                                                 "max_tokens": 5000}), 400, "max_tokens")
    assert "512" in err["message"] and "5000" in err["message"]
    err = assert_error(http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "x " * 2000}), 400)
    assert "512" in err["message"]


def test_http_level_errors(daemon):
    assert_error(http(daemon, "POST", "/v1/completions", b"{not json"), 400)
    assert_error(http(daemon, "POST", "/v1/completions", b"[1, 2]"), 400)
    assert_error(http(daemon, "POST", "/v1/completions", b"x=1",
                      headers={"Content-Type": "application/x-www-form-urlencoded"}), 415)
    assert_error(http(daemon, "GET", "/v1/completions"), 405)
    assert_error(http(daemon, "POST", "/v1/completions", b"{" + b" " * (33 * 1024 * 1024) + b"}"), 413)
    err = assert_error(http(daemon, "POST", "/v1/completions", {"model": "nope", "prompt": "x"}), 404, "model")
    assert "default" in err["message"]
    assert_error(http(daemon, "GET", "/v1/models/nope"), 404)
    assert_error(http(daemon, "GET", "/no/such/path"), 404)


def test_auth(daemon):
    assert_error(http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "x"}, key=None), 401)
    assert_error(http(daemon, "GET", "/v1/models", key="wrong"), 401)
    # The documented policy: health, metrics and version stay open.
    for path in ("/health", "/metrics", "/version"):
        assert http(daemon, "GET", path, key=None).status == 200, path
    with pytest.raises(openai.AuthenticationError):
        daemon.openai(api_key="wrong").models.list()


def test_request_id_header(daemon):
    r = http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 1},
             headers={"X-Request-Id": "my-trace-42"})
    assert r.status == 200 and r.headers["X-Request-Id"] == "my-trace-42"
    assert http(daemon, "GET", "/v1/models").headers.get("X-Request-Id")
    assert "my-trace-42" in daemon.log("gateway:0")  # the access log line


def test_models_version_openapi(daemon, api):
    assert [m.id for m in api.models.list().data] == ["default"]
    assert api.models.retrieve("default").id == "default"
    r = http(daemon, "GET", "/version")
    assert r.status == 200 and r.json()["version"]
    spec = http(daemon, "GET", "/openapi.json").json()
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "temperature" in props and "prompt" in props
    assert "/v1/chat/completions" in spec["paths"]


def test_metrics_parse_and_move(daemon, api):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape():
        text = http(daemon, "GET", "/metrics").text
        values = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                values[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return values

    def total(values, name):
        return sum(v for (n, _), v in values.items() if n == name)

    before = scrape()
    api.completions.create(model="default", prompt="def ", max_tokens=7, extra_body={"ignore_eos": True})
    after = scrape()
    assert total(after, "servectl_generation_tokens_total") - total(before, "servectl_generation_tokens_total") == 7
    assert total(after, "servectl_prompt_tokens_total") > total(before, "servectl_prompt_tokens_total")
    assert total(after, "servectl_requests_total") > total(before, "servectl_requests_total")
    assert total(after, "servectl_time_to_first_token_seconds_count") > \
        total(before, "servectl_time_to_first_token_seconds_count")
    assert any(n == "servectl_child_state" for n, _ in after)


def test_whole_bodies_carry_vllms_fields_nulls_included(daemon):
    """Issue 51: strictly typed clients read every field `vllm serve` writes (its model_dump),
    `system_fingerprint` among them; streams the keys vLLM sets (tests/test_response_keys.py)."""
    from conftest import json_lines

    chat = http(daemon, "POST", "/v1/chat/completions", {"model": "default", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "hi"}]}).json()
    assert {"system_fingerprint", "service_tier", "prompt_logprobs", "prompt_token_ids", "kv_transfer_params",
            "metrics"} <= set(chat), chat
    assert {"refusal", "annotations", "audio", "function_call", "reasoning"} <= set(chat["choices"][0]["message"])
    assert {"token_ids", "routed_experts"} <= set(chat["choices"][0])
    assert {"prompt_tokens_details", "completion_tokens_details"} <= set(chat["usage"])
    done = http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "def ", "max_tokens": 2}).json()
    assert {"system_fingerprint", "service_tier", "kv_transfer_params"} <= set(done), done
    assert {"token_ids", "prompt_token_ids", "prompt_logprobs"} <= set(done["choices"][0])
    r = http(daemon, "POST", "/v1/chat/completions", {"model": "default", "max_tokens": 2, "stream": True,
                                                       "messages": [{"role": "user", "content": "hi"}]})
    role, *rest = json_lines(r.text)
    assert {"prompt_token_ids", "prompt_text"} <= set(role) and "token_ids" in rest[0]["choices"][0], r.text
