"""Issue 39, item 1: ``/tokenize`` is bounded like a prompt and never stalls the steps.

Before, ``/tokenize`` tokenised whatever it was sent on the engine's only thread (vLLM's
tokenize requests set no length limit): one 4 MB prompt took 22.8 s, and four in parallel
stalled another client's stream long enough for the gateway to call the engine hung and
the manager to kill it. Now it gets the limits vLLM puts on a completion's prompt (its
character cap before tokenising, the context length in tokens: engine_core/tokenizing.py),
and the engine answers at most one tokenizer question per gap between steps while
requests run (engine_core/core.py), so the stream goes on and nothing is restarted.
"""

from __future__ import annotations

import threading

from conftest import http

FOUR_MB = "a" * 4_000_000  # under the gateway's 4 MiB body limit with its JSON around it


def max_model_len(daemon) -> int:
    r = http(daemon, "POST", "/tokenize", {"model": "default", "prompt": "def f(x):"})
    assert r.status == 200, r.body
    return r.json()["max_model_len"]


def allowed_prompt(daemon, tokenizer) -> str:
    """As long a prompt as the model's context takes, nearly: its tokens under max_model_len."""
    limit = max_model_len(daemon)
    unit = "def f(x):\n    return x * 2\n"
    per_unit = len(tokenizer.encode(unit, add_special_tokens=False).ids)
    text = unit * max(1, (limit - 16) // per_unit)
    assert len(tokenizer.encode(text, add_special_tokens=True).ids) < limit
    return text


def test_an_over_long_prompt_is_refused_with_vllms_message(daemon):
    limit = max_model_len(daemon)
    r = http(daemon, "POST", "/tokenize", {"model": "default", "prompt": FOUR_MB})
    assert r.status == 400, r.body[:500]
    err = r.json()["error"]
    assert err["message"].startswith(f"This model's maximum context length is {limit} tokens. However, your "
                                     f"prompt contains {len(FOUR_MB)} characters"), err
    # A chat's rendered prompt gets the same cap.
    r = http(daemon, "POST", "/tokenize", {"model": "default", "messages": [{"role": "user", "content": FOUR_MB}]})
    assert r.status == 400 and "maximum context length" in r.json()["error"]["message"], r.body[:500]
    # Under the character cap but over the context in tokens: vLLM's token limit, as for a completion.
    r = http(daemon, "POST", "/tokenize", {"model": "default", "prompt": " a b" * (2 * limit)})
    assert r.status == 400, r.body[:500]
    assert f"maximum context length is {limit} tokens" in r.json()["error"]["message"]
    assert "input tokens" in r.json()["error"]["message"]
    # The same prompt is refused the same way by /v1/completions (the limits are vLLM's for prompts).
    c = http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": " a b" * (2 * limit), "max_tokens": 1})
    assert c.status == 400 and f"maximum context length is {limit} tokens" in c.json()["error"]["message"]


def test_tokenize_calls_in_parallel_do_not_stall_a_stream_or_restart_the_engine(daemon, tokenizer):
    engine = daemon.child("engine_core:default")
    hangs = daemon.log("gateway:0").count(": hung")  # (the shared daemon's earlier tests may have had some)
    prompt = allowed_prompt(daemon, tokenizer)
    api = daemon.openai()
    params = dict(model="default", prompt="def ", max_tokens=300, temperature=0, extra_body={"ignore_eos": True})
    expected = api.completions.create(**params).choices[0].text

    results: list[tuple[str, int, dict]] = []

    def tokenize(kind: str, text: str) -> None:
        r = http(daemon, "POST", "/tokenize", {"model": "default", "prompt": text})
        results.append((kind, r.status, r.json()))

    stream = api.completions.create(**params, stream=True, stream_options={"include_usage": True})
    chunks = iter(stream)
    first = next(chunks)
    text = "".join(c.text for c in first.choices)
    threads = [threading.Thread(target=tokenize, args=(kind, p)) for kind, p in
               [("big", prompt)] * 4 + [("over", FOUR_MB)] * 4]
    for t in threads:
        t.start()
    usage = None
    finish = None
    for chunk in chunks:
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
        usage = chunk.usage or usage
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    # The stream has every token: the same answer as unloaded, to its end.
    assert (text, finish, usage.completion_tokens) == (expected, "length", 300)
    big = [(s, b) for kind, s, b in results if kind == "big"]
    over = [(s, b) for kind, s, b in results if kind == "over"]
    assert len(big) == 4 and all(s == 200 and 0 < b["count"] < b["max_model_len"] for s, b in big), big
    assert len(over) == 4 and all(s == 400 and "maximum context length" in b["error"]["message"]
                                  for s, b in over), [s for s, _ in over]
    # Not called hung, not restarted.
    after = daemon.child("engine_core:default")
    assert (after.pid, after.restarts) == (engine.pid, engine.restarts)
    assert daemon.log("gateway:0").count(": hung") == hangs
