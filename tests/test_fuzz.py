"""Issue 4: property-based fuzzing of both generation endpoints.

Arbitrary JSON values, request-shaped objects with arbitrary field values, and
arbitrary bytes: never a 5xx, always OpenAI's error shape, and the gateway
answers a valid request afterwards.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


def send(daemon, path: str, body: bytes, ctype: str = "application/json"):
    req = urllib.request.Request(f"{daemon.base_url}{path}", data=body, method="POST",
                                 headers={"Content-Type": ctype, "Authorization": f"Bearer {daemon.api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def check(status: int, body: bytes) -> None:
    assert status < 500, (status, body[:500])
    if status >= 400:
        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and err["message"] and "type" in err and "param" in err


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@SETTINGS
@given(value=json_values, endpoint=st.sampled_from(ENDPOINTS))
def test_arbitrary_json(daemon, value, endpoint):
    check(*send(daemon, endpoint, json.dumps(value).encode()))


@SETTINGS
@given(value=shaped, endpoint=st.sampled_from(ENDPOINTS))
def test_request_shaped_objects(daemon, value, endpoint):
    value["max_tokens"] = value.get("max_tokens") if not isinstance(value.get("max_tokens"), int) else \
        min(value["max_tokens"], 8)
    check(*send(daemon, endpoint, json.dumps(value).encode()))


@SETTINGS
@given(body=st.binary(max_size=200), endpoint=st.sampled_from(ENDPOINTS))
def test_arbitrary_bytes(daemon, body, endpoint):
    check(*send(daemon, endpoint, body))


def test_still_serving_after_fuzzing(daemon):
    status, body = send(daemon, "/v1/completions", json.dumps({"model": "default", "prompt": "def ",
                                                               "max_tokens": 3}).encode())
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
    assert all(c.state in ("ready", "idle (frozen)") for c in daemon.status().children)
    assert all(c.restarts == 0 for c in daemon.status().children)
