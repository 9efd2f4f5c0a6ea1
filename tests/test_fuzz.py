"""Issue 4: property-based fuzzing of both generation endpoints.

Arbitrary JSON values, request-shaped objects with arbitrary field values, and
arbitrary bytes: never a 5xx, always OpenAI's error shape, and the gateway
answers a valid request afterwards.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import http, wait_for

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
FIELDS = ("model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop",
          "seed", "logprobs", "top_logprobs", "echo", "stream", "stream_options", "logit_bias", "response_format",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "user", "suffix", "tools")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
small = st.none() | st.booleans() | st.integers(-5, 40) | st.floats(-3, 3, allow_nan=False) | st.text(max_size=8) \
    | st.lists(st.integers(-2, 3000), max_size=4) | st.lists(st.text(max_size=5), max_size=3) \
    | st.dictionaries(st.text(max_size=6), st.integers(-200, 200) | st.text(max_size=4), max_size=2)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                           "content": st.text(max_size=20) | st.none() | st.integers()}),
                    max_size=3)
shaped = st.fixed_dictionaries({"model": st.sampled_from(["default", "nope", ""])},
                               optional={**{f: small for f in FIELDS if f not in ("model", "stream", "messages")},
                                         "messages": messages | small, "prompt": st.text(max_size=30) | small})


def assert_no_5xx(daemon, path: str, body: bytes) -> None:
    status, _, body = http(daemon, "POST", path, body)
    assert status < 500, (status, body[:500])
    if status >= 400:
        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and err["message"] and "type" in err and "param" in err


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@SETTINGS
@given(value=json_values, endpoint=st.sampled_from(ENDPOINTS))
def test_arbitrary_json(daemon, value, endpoint):
    assert_no_5xx(daemon, endpoint, json.dumps(value).encode())


@SETTINGS
@given(value=shaped, endpoint=st.sampled_from(ENDPOINTS))
def test_request_shaped_objects(daemon, value, endpoint):
    value["max_tokens"] = value.get("max_tokens") if not isinstance(value.get("max_tokens"), int) else \
        min(value["max_tokens"], 8)
    assert_no_5xx(daemon, endpoint, json.dumps(value).encode())


@SETTINGS
@given(body=st.binary(max_size=200), endpoint=st.sampled_from(ENDPOINTS))
def test_arbitrary_bytes(daemon, body, endpoint):
    assert_no_5xx(daemon, endpoint, body)


def test_still_serving_after_fuzzing(daemon):
    r = http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "def ", "max_tokens": 3,
                                                  "ignore_eos": True})
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 3
    # Idle again: past the freeze grace the worker is frozen, everything else ready.
    daemon.wait_standbys_warm(2)
    wait_for(lambda: daemon.child("worker:default:0").state == "idle (frozen)", 30, what="the worker frozen")
    children = daemon.status().children
    expected = {"gateway:0": "ready", "engine_core:default": "ready", "worker:default:0": "idle (frozen)",
                "standby:engine_core:default": "ready", "standby:worker:default:0": "ready"}
    assert {c.component: c.state for c in children} == expected
    assert {c.component: c.restarts for c in children} == dict.fromkeys(expected, 0)
