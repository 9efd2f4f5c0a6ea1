"""Security issue 53, items 2 and 4, against a real daemon (the `pooling_daemon`).

Item 4: two pooling requests sending one ``request_id`` at once each get their own vectors
(the engine's ids are the gateway's; the client's id is only echoed). Item 2: a pooling
request's inputs, documents and pairs count as sequences for admission, so a request of more
than ``max_sequences_per_request`` of them is a 400 at the gateway, before the engine renders
any of it.
"""

from __future__ import annotations

import concurrent.futures

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
