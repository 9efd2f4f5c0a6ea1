"""Issue 33: embeddings, scores, reranking and classification beside a generating model — real daemon.

The `pooling_daemon` serves the bundled default model three times: generating
(`default`), as an embedding model (`default-embed`: `runner = "pooling"`,
`convert = "embed"`) and with a trained head as a classifier (`classify`:
servectl/model/classify, `runner = "pooling"`). Clients: the `openai` SDK's `embeddings.create` and plain HTTP for
vLLM's own routes. Parity with `vllm serve` is in test_pooling_parity.py, a
worker kill in test_pooling_resume.py.
"""

from __future__ import annotations

import base64
import struct

import pytest

from conftest import http

EMB, CLS = "default-embed", "classify"


@pytest.fixture(scope="module")
def api(pooling_daemon):
    return pooling_daemon.openai()


def post(d, path: str, body: dict):
    r = http(d, "POST", path, body)
    assert r.status == 200, (path, body, r.status, r.body[:300])
    return r.json()


def test_the_openai_sdk_gets_vllms_vectors(api):
    e = api.embeddings.create(model=EMB, input=["def foo():", "import os"])
    assert [d.index for d in e.data] == [0, 1] and len(e.data[0].embedding) == 128, e
    assert e.usage.prompt_tokens > 0 and e.model == EMB
    assert e.data[0].embedding != e.data[1].embedding
    norm = sum(x * x for x in e.data[0].embedding) ** 0.5
    assert abs(norm - 1) < 1e-4  # vLLM's embed pooler normalises
    # base64: the same vector, as little-endian float32
    b = api.embeddings.create(model=EMB, input="def foo():", encoding_format="base64")
    raw = base64.b64decode(b.data[0].embedding) if isinstance(b.data[0].embedding, str) else None
    vec = list(struct.unpack(f"<{len(raw) // 4}f", raw)) if raw is not None else b.data[0].embedding
    assert max(abs(x - y) for x, y in zip(vec, e.data[0].embedding)) < 1e-6
    # token ids are a prompt too
    t = api.embeddings.create(model=EMB, input=[[1, 2, 3, 4]])
    assert len(t.data[0].embedding) == 128


def test_score_rerank_pooling_and_classify(pooling_daemon):
    d = pooling_daemon
    score = post(d, "/score", {"model": EMB, "text_1": "def", "text_2": ["def x", "import y"]})
    assert [s["index"] for s in score["data"]] == [0, 1] and all(-1 <= s["score"] <= 1 for s in score["data"])
    assert post(d, "/v1/score", {"model": EMB, "text_1": "def", "text_2": ["def x", "import y"]})["data"] == score["data"]
    rerank = post(d, "/rerank", {"model": EMB, "query": "def", "documents": ["def x", "import y"], "top_n": 1})
    assert len(rerank["results"]) == 1
    assert rerank["results"][0]["relevance_score"] == max(s["score"] for s in score["data"])
    for path in ("/v1/rerank", "/v2/rerank"):
        assert post(d, path, {"model": EMB, "query": "def", "documents": ["def x", "import y"]})["results"]
    pooled = post(d, "/pooling", {"model": EMB, "input": "def"})
    assert len(pooled["data"][0]["data"]) == 128
    classes = post(d, "/classify", {"model": CLS, "input": ["def load(path):", "import os"]})
    assert [c["label"] for c in classes["data"]] == ["definition", "other"], classes
    assert all(abs(sum(c["probs"]) - 1) < 1e-5 for c in classes["data"])
    v2 = post(d, "/v2/embed", {"model": EMB, "texts": ["def"], "embedding_types": ["float"]})
    assert len(v2["embeddings"]["float"][0]) == 128


def test_models_say_what_each_does_and_the_wrong_kind_is_a_400_naming_what_fits(pooling_daemon):
    d = pooling_daemon
    tasks = {m["id"]: m["tasks"] for m in http(d, "GET", "/v1/models").json()["data"]}
    assert {k: set(v) for k, v in tasks.items()} == {"default": {"generate"}, EMB: {"embed", "token_embed"},
                                                      CLS: {"classify", "token_classify"}}
    wrong = http(d, "POST", "/v1/embeddings", {"model": "default", "input": "def"})
    assert wrong.status == 400 and "/v1/completions" in wrong.json()["error"]["message"], wrong.body
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/completions", {"prompt": "def"}), ("/v1/responses", {"input": "x"})):
        r = http(d, "POST", path, {"model": EMB, **body})
        assert r.status == 400 and "/v1/embeddings" in r.json()["error"]["message"], (path, r.body)
    r = http(d, "POST", "/classify", {"model": EMB, "input": "def"})
    assert r.status == 400 and "/v1/embeddings" in r.json()["error"]["message"], r.body
    # and the generating model still generates
    assert http(d, "POST", "/v1/completions", {"model": "default", "prompt": "def ", "max_tokens": 2}).status == 200


BAD = [
    ("/v1/embeddings", {"model": EMB}),
    ("/v1/embeddings", {"model": EMB, "input": []}),
    ("/v1/embeddings", {"model": EMB, "input": 5}),
    ("/v1/embeddings", {"model": EMB, "input": [[-1]]}),
    ("/v1/embeddings", {"model": EMB, "input": "x", "dimensions": 8}),
    ("/v1/embeddings", {"model": EMB, "input": "x", "encoding_format": "bytes"}),
    ("/v1/embeddings", {"model": EMB, "input": "x", "encoding_format": "hex"}),
    ("/v1/embeddings", {"model": EMB, "input": "ab " * 3000}),
    ("/v1/embeddings", {"model": EMB, "input": "x", "truncate_prompt_tokens": 10**6}),
    ("/v1/embeddings", {"model": EMB, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/embeddings", {"model": "nope", "input": "x"}),
    ("/score", {"model": EMB, "text_1": "x"}),
    ("/score", {"model": EMB, "text_1": [], "text_2": []}),
    ("/rerank", {"model": EMB, "query": "x"}),
    ("/rerank", {"model": EMB, "query": "x", "documents": "y", "top_n": -1}),
    ("/classify", {"model": CLS}),
    ("/classify", {"model": CLS, "input": [[2**40]]}),
    ("/classify", {"model": CLS, "input": "ab " * 3000}),
    ("/pooling", {"model": EMB, "input": "x", "task": "classify"}),
    ("/pooling", {"model": EMB, "data": {"x": 1}}),
    ("/v2/embed", {"model": EMB, "images": ["data:image/png;base64,AAAA"]}),
]


def test_bad_input_is_a_4xx_and_loses_nothing(pooling_daemon):
    for path, body in BAD:
        r = http(pooling_daemon, "POST", path, body)
        assert 400 <= r.status < 500 and r.json()["error"]["message"], (path, body, r.status, r.body[:300])
    assert post(pooling_daemon, "/v1/embeddings", {"model": EMB, "input": "def"})["data"]
