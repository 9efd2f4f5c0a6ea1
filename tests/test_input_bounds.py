"""Security issue 53, items 2, 4 and 5, against a real daemon (the `pooling_daemon`).

Item 4: two pooling requests sending one ``request_id`` at once each get their own vectors
(the engine's ids are the gateway's; the client's id is only echoed). Item 2: a pooling
request's inputs, documents and pairs count as sequences for admission, so a request of more
than ``max_sequences_per_request`` of them is a 400 at the gateway, before the engine renders
any of it. Item 5: a Responses input of more items than the model's context, or more
characters than vLLM lets a prompt have, is a 400 at the gateway; the engine renders none.
"""

from __future__ import annotations

import concurrent.futures
import time

from conftest import http

EMB = "default-embed"
TEXTS = ["def foo():", "import os", "class A:", "return x", "while True:", "print(1)", "for i in y:", "x = 1"]


def embed(d, text: str, request_id: str | None = None) -> dict:
    body = {"model": EMB, "input": text, **({"request_id": request_id} if request_id else {})}
    r = http(d, "POST", "/v1/embeddings", body, timeout=60)
    assert r.status == 200, (text, r.status, r.body[:300])
    return r.json()


def test_requests_sharing_a_request_id_each_get_their_own_vectors(pooling_daemon):
    d = pooling_daemon
    want = {t: embed(d, t)["data"][0]["embedding"] for t in TEXTS}
    for round_ in range(3):
        with concurrent.futures.ThreadPoolExecutor(len(TEXTS)) as pool:
            got = dict(zip(TEXTS, pool.map(lambda t: embed(d, t, request_id="shared"), TEXTS)))
        for t in TEXTS:
            vec = got[t]["data"][0]["embedding"]
            assert max(abs(a - b) for a, b in zip(vec, want[t])) < 1e-5, (round_, t)
            assert "shared" in got[t]["id"]  # the client's id is echoed


def test_a_pooling_request_of_more_inputs_than_the_cap_is_refused_at_once(pooling_daemon):
    d = pooling_daemon
    started = time.monotonic()
    r = http(d, "POST", "/v1/embeddings", {"model": EMB, "input": [[5, 6, 7]] * 200_000})
    assert r.status == 400 and r.json()["error"]["code"] == "too_many_sequences", r.body[:300]
    assert "200000 inputs" in r.json()["error"]["message"]
    r = http(d, "POST", "/rerank", {"model": EMB, "query": "q", "documents": ["d"] * 256})  # 257 texts
    assert r.status == 400 and r.json()["error"]["param"] == "documents", r.body[:300]
    assert time.monotonic() - started < 10
    assert len(embed(d, "def")["data"]) == 1
    many = http(d, "POST", "/v1/embeddings", {"model": EMB, "input": ["x"] * 256})  # at the cap: served
    assert many.status == 200 and len(many.json()["data"]) == 256


def test_a_responses_input_past_the_models_limits_is_refused_before_the_engine_renders_it(pooling_daemon):
    d = pooling_daemon
    item = {"type": "message", "role": "user", "content": "hi"}
    started = time.monotonic()
    tiny = {"role": "user", "content": "x"}
    r = http(d, "POST", "/v1/responses", {"model": "default", "input": [tiny] * 100_000})  # < 4 MiB
    assert r.status == 400 and r.json()["error"]["code"] == "too_many_items", r.body[:300]
    assert "512" in r.json()["error"]["message"]  # the model's context
    r = http(d, "POST", "/v1/responses", {"model": "default", "input": "ab " * 10_000})
    assert r.status == 400 and r.json()["error"]["code"] == "input_too_long", r.body[:300]
    r = http(d, "POST", "/v1/messages", {"model": "default", "max_tokens": 2, "messages": [item] * 1000})
    assert r.status == 400 and r.json()["type"] == "error", r.body[:300]
    assert time.monotonic() - started < 10
    ok = http(d, "POST", "/v1/responses", {"model": "default", "input": [item] * 3, "max_output_tokens": 4})
    assert ok.status == 200, ok.body[:300]
