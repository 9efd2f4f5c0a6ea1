"""Issue 33: embeddings, scores, reranking, pooling and classification equal `vllm serve`'s.

`vllm serve` runs once per pooling configuration (module-scoped, one at a time:
the fixture is parametrised over POOLING_MODELS) from the same venv with the same
engine arguments; servectl's `pooling_daemon` serves both. Every number (each
vector element, score, probability) is compared within 1e-5, everything else
(ids and times aside) exactly; a set of bad inputs gets the same status.
"""

from __future__ import annotations

import pytest

from bench.run import VllmServe
from conftest import POOLING_MODELS, http, vllm_serving

CASES = {
    "default-embed": [
        ("/v1/embeddings", {"input": "def foo():"}),
        ("/v1/embeddings", {"input": ["def foo():", "import os", "x = 1"]}),
        ("/v1/embeddings", {"input": [[1, 2, 3], [4, 5]]}),
        ("/v1/embeddings", {"input": "def foo():", "encoding_format": "base64"}),
        ("/v1/embeddings", {"input": "def foo():", "use_activation": False}),
        ("/v1/embeddings", {"messages": [{"role": "user", "content": "def foo():"}]}),
        ("/v1/embeddings", {"input": "def foo(): return 1", "truncate_prompt_tokens": 3}),
        ("/v2/embed", {"texts": ["def", "import"], "embedding_types": ["float"]}),
        ("/pooling", {"input": ["def foo():", "import os"]}),
        ("/score", {"text_1": "def", "text_2": ["def x", "import y"]}),
        ("/v1/score", {"queries": ["def", "import"], "documents": ["def x", "import y"]}),
        ("/rerank", {"query": "def", "documents": ["def x", "import y", "class Z"], "top_n": 2}),
        ("/v2/rerank", {"query": "def", "documents": ["def x", "import y"]}),
    ],
    "classify": [
        ("/classify", {"input": ["def foo():", "import os"]}),
        ("/classify", {"input": [[1, 2, 3]]}),
        ("/classify", {"messages": [{"role": "user", "content": "def foo():"}]}),
        ("/pooling", {"input": "def foo():"}),
    ],
}
ERRORS = {
    "default-embed": [
        ("/v1/embeddings", {}),
        ("/v1/embeddings", {"input": []}),
        ("/v1/embeddings", {"input": "x", "dimensions": 8}),
        ("/v1/embeddings", {"input": "ab " * 3000}),
        ("/score", {"text_1": "x"}),
        ("/rerank", {"query": "x"}),
        ("/pooling", {"input": "x", "task": "classify"}),
    ],
    "classify": [
        ("/classify", {}),
        ("/classify", {"input": "ab " * 3000}),
    ],
}


@pytest.fixture(scope="module", params=list(POOLING_MODELS))
def vllm_pooling(request, tmp_path_factory):
    name = request.param
    model, args = POOLING_MODELS[name]
    flags = [x for k, v in args.items() for x in (f"--{k}", v)]
    server = VllmServe(tmp_path_factory.mktemp(f"vllm-{name}"), model=model, served=name,
                       flags=tuple(flags), max_model_len=512)
    with vllm_serving(server, name) as base:
        yield name, base


def close(a, b, where="$") -> list[str]:
    """Where two answers differ: numbers beyond 1e-5, anything else at all (ids, times masked)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a if k not in ("id", "created") for d in close(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in close(x, y, f"{where}[{i}]")]
    if isinstance(a, float) or isinstance(b, float):
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 1e-5
        return [] if ok else [f"{where}: {a!r} vs {b!r}"]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def decoded(body: dict) -> dict:
    """base64 vectors as floats (their bytes may differ in the last bit's rounding, not in value)."""
    import base64
    import struct

    for item in body.get("data", ()):
        if isinstance(item.get("embedding"), str):
            raw = base64.b64decode(item["embedding"])
            item["embedding"] = [float(x) for x in struct.unpack(f"<{len(raw) // 4}f", raw)]
    return body


def test_pooling_answers_equal_vllm_serves(vllm_pooling, pooling_daemon):
    name, base = vllm_pooling
    differ = []
    for path, body in CASES[name]:
        theirs = http(base, "POST", path, {"model": name, **body}, key=None, timeout=120)
        ours = http(pooling_daemon, "POST", path, {"model": name, **body})
        assert theirs.status == 200, (path, body, theirs.body[:300])
        assert ours.status == 200, (path, body, ours.body[:300])
        where = close(decoded(theirs.json()), decoded(ours.json()))
        if where:
            differ.append((path, body, where[:5]))
    assert not differ, "\n".join(map(str, differ))


def test_pooling_refusals_equal_vllm_serves(vllm_pooling, pooling_daemon):
    name, base = vllm_pooling
    for path, body in ERRORS[name]:
        theirs = http(base, "POST", path, {"model": name, **body}, key=None, timeout=120)
        ours = http(pooling_daemon, "POST", path, {"model": name, **body})
        assert theirs.status >= 400 and ours.status == theirs.status, (path, body, theirs.status, ours.status,
                                                                        theirs.body[:300], ours.body[:300])
