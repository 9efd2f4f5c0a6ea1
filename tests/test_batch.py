"""Batch jobs (issue 59), against a real daemon and the `openai` SDK: the Files and Batch APIs,
outputs equal to the same requests sent one by one, bad lines in the error file, cancel, the
bounds, ownership between two keys, and a batch that finishes across an engine SIGKILL, a
gateway SIGKILL, a manager SIGKILL followed by `servectl start` and a reload, each `custom_id`
answered once, and a batch for a model released when idle (the module's last test kills and
restarts the daemon).
"""

from __future__ import annotations

import io
import json
import os
import signal
import time

import openai
import pytest

from conftest import DEFAULT_MODEL_DIR, DaemonFactory, http, wait_for

ADMIN = "sk-admin-batch"
KEYS = {"alpha": "sk-alpha-batch-0123456789", "beta": "sk-beta-batch-0123456789"}
CONFIG = f"""[manager]
warm_standby = false
backoff_initial_s = 0.3
[gateway]
admin_keys = ["{ADMIN}"]
[gateway.batch]
concurrency = 4
max_file_bytes = 200000
max_lines = 120
max_in_progress_per_key = 2
""" + "".join(f'[[gateway.keys]]\nname = "{name}"\nkey = "{key}"\n' for name, key in KEYS.items()) + f"""[[models]]
name = "default"
model = "{DEFAULT_MODEL_DIR}"
[models.engine_args]
max_num_seqs = 8
[[models]]
name = "lazy"
model = "{DEFAULT_MODEL_DIR}"
autostart = false
idle_release_s = 1.5
"""
PROMPTS = ["def add(a, b):", "The capital of France is", "import numpy as", "for i in range(",
           "class Stack:", "# sort a list", "print(", "while True:"]


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    with DaemonFactory(tmp_path_factory, "batch") as make:
        yield make(CONFIG)


def client(d, who: str = "alpha") -> openai.OpenAI:
    return d.openai(api_key=ADMIN if who == "admin" else KEYS[who])


def chat_line(custom_id: str, prompt: str, max_tokens: int = 8, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                     "temperature": 0, **extra}}


def upload(c: openai.OpenAI, lines: list, name: str = "input.jsonl"):
    raw = b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)
    return c.files.create(file=(name, io.BytesIO(raw)), purpose="batch")


def wait_ended(c: openai.OpenAI, batch_id: str, timeout: float = 300):
    ended = {"completed", "failed", "cancelled", "expired"}
    return wait_for(lambda: (b := c.batches.retrieve(batch_id)).status in ended and b, timeout,
                    what=f"batch {batch_id} to end", diagnose=lambda: str(c.batches.retrieve(batch_id)))


def results(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in c.files.content(file_id).text.splitlines() if line]


def test_a_batch_answers_each_line_as_the_request_sent_alone(d):
    c = client(d)
    lines = [chat_line(f"chat-{i}", p) for i, p in enumerate(PROMPTS)]
    lines.append(b"{not json")
    lines.append({**chat_line("wrong-url", "x"), "url": "/v1/completions"})
    lines.append(chat_line("no-such-model", "x") | {"body": {"model": "nope", "messages": [{"role": "user",
                                                                                              "content": "x"}]}})
    f = upload(c, lines)
    assert (f.purpose, f.bytes, f.status) == ("batch", len(c.files.content(f.id).content), "processed")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"job": "eval"})
    assert b.status == "validating" and b.metadata == {"job": "eval"}
    b = wait_ended(c, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (len(PROMPTS) + 3,
                                                                                            len(PROMPTS), 3)
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.model == "default"
    out = {r["custom_id"]: r for r in results(c, b.output_file_id)}
    assert sorted(out) == sorted(f"chat-{i}" for i in range(len(PROMPTS)))
    for i, prompt in enumerate(PROMPTS):
        alone = c.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=8, temperature=0)
        got = out[f"chat-{i}"]
        assert got["error"] is None and got["response"]["status_code"] == 200 and got["id"].startswith("batch_req_")
        body = got["response"]["body"]
        assert body["choices"][0]["message"]["content"] == alone.choices[0].message.content
        assert body["usage"]["completion_tokens"] == alone.usage.completion_tokens
    errors = results(c, b.error_file_id)
    by_id = {e["custom_id"]: e for e in errors}
    assert len(errors) == 3 and by_id[None]["error"]["code"] == "invalid_json_line"
    assert by_id["wrong-url"]["error"]["code"] == "mismatched_url"
    assert by_id["no-such-model"]["response"]["status_code"] == 404
    assert c.files.retrieve(b.output_file_id).purpose == "batch_output"
    assert b.id in [x.id for x in c.batches.list()]


def test_completions_batch_and_usage_counted_under_its_key(d):
    c = client(d, "beta")
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "default", "prompt": p, "max_tokens": 5, "temperature": 0}}
             for i, p in enumerate(PROMPTS[:3])]
    b = c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/completions", completion_window="24h")
    b = wait_ended(c, b.id)
    assert b.status == "completed" and b.request_counts.completed == 3
    for r in results(c, b.output_file_id):
        alone = c.completions.create(model="default", prompt=PROMPTS[int(r["custom_id"][1:])], max_tokens=5,
                                     temperature=0)
        assert r["response"]["body"]["choices"][0]["text"] == alone.choices[0].text
    # The access log names the batch's key for its lines, as for the key's own requests.
    assert any("key=beta" in line and "/v1/completions" in line for line in d.log("gateway-0").splitlines())


def test_a_file_or_batch_is_its_keys_alone_and_an_admin_sees_all(d):
    alpha, beta, admin = client(d), client(d, "beta"), client(d, "admin")
    f = upload(alpha, [chat_line("own", "hi", 2)])
    b = wait_ended(alpha, alpha.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
    for call in (lambda: beta.files.retrieve(f.id), lambda: beta.files.content(f.id),
                 lambda: beta.batches.retrieve(b.id), lambda: beta.batches.cancel(b.id), lambda: beta.files.delete(f.id),
                 lambda: beta.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                             completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in [x.id for x in beta.files.list()] and b.id not in [x.id for x in beta.batches.list()]
    assert f.id in [x.id for x in admin.files.list()] and admin.batches.retrieve(b.id).status == "completed"
    assert alpha.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        alpha.files.retrieve(f.id)


def test_the_bounds_are_clear_errors(d):
    c = client(d)
    with pytest.raises(openai.APIStatusError) as big:
        c.files.create(file=("big.jsonl", io.BytesIO(b"x" * 200_001)), purpose="batch")
    assert big.value.status_code == 413 and "max_file_bytes" in big.value.message
    with pytest.raises(openai.BadRequestError) as purpose:
        c.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert "purpose" in purpose.value.message
    many = upload(c, [chat_line(f"m{i}", "x", 1) for i in range(121)])
    with pytest.raises(openai.BadRequestError) as lines:
        c.batches.create(input_file_id=many.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert "max_lines" in lines.value.message
    with pytest.raises(openai.BadRequestError):
        c.batches.create(input_file_id=many.id, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.BadRequestError):
        c.batches.create(input_file_id=many.id, endpoint="/v1/images", completion_window="24h")
    # Two batches not ended is this key's most: the third is a 429.
    slow = upload(c, [chat_line(f"s{i}", "x", 64, ignore_eos=True) for i in range(40)])
    started = [c.batches.create(input_file_id=slow.id, endpoint="/v1/chat/completions", completion_window="24h")
               for _ in range(2)]
    with pytest.raises(openai.RateLimitError):
        c.batches.create(input_file_id=slow.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.ConflictError):  # the input of a batch not ended
        c.files.delete(slow.id)
    for b in started:
        c.batches.cancel(b.id)
    for b in started:
        assert wait_ended(c, b.id).status == "cancelled"


def test_a_cancelled_batch_stops_and_keeps_what_finished(d):
    c = client(d)
    lines = [chat_line(f"k{i}", PROMPTS[i % len(PROMPTS)], 48, ignore_eos=True) for i in range(60)]
    b = c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: c.batches.retrieve(b.id).request_counts.completed >= 4, 120, what="a few lines answered")
    # Interactive requests while it runs (the engine switches its step queue for them and back,
    # engine_core/batch_yield.py): answered as when nothing else runs (below, once it has ended).
    during = [c.chat.completions.create(model="default", messages=[{"role": "user", "content": p}], max_tokens=12,
                                        temperature=0).choices[0].message.content for p in PROMPTS[:3]]
    assert c.batches.retrieve(b.id).status == "in_progress"
    # The engine yielded to them: the batch lines sat out their prompts' steps and ran one deep
    # (before this test no interactive request met a running batch on this daemon's engine).
    yielded = yield_steps(d)
    assert yielded["sat_out"] >= 1 and yielded["one_deep"] >= 1, yielded
    cancelling = c.batches.cancel(b.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    b = wait_ended(c, b.id)
    assert b.status == "cancelled" and b.cancelled_at
    out = results(c, b.output_file_id)
    ids = [r["custom_id"] for r in out]
    assert len(ids) == len(set(ids)) == b.request_counts.completed and 4 <= len(ids) < 60
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 48 for r in out)
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(b.id)
    assert during == [c.chat.completions.create(model="default", messages=[{"role": "user", "content": p}],
                                                max_tokens=12, temperature=0).choices[0].message.content
                      for p in PROMPTS[:3]]


def yield_steps(d) -> dict[str, float]:
    """The default model's ``servectl_engine_yield_steps`` from the gateway's /metrics, by kind."""
    text = http(d, "GET", "/metrics").text
    return {line.split('kind="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("servectl_engine_yield_steps{") and 'model="default"' in line}


def lazy_state(d) -> str:
    return next(m for m in d.status().models if m.name == "lazy").state


def test_a_batch_for_a_released_model_loads_it_and_finishes(d):
    """An idle release between two batches (and none loaded at the first): each line is held while
    the model comes back, as any request is."""
    c = client(d)
    for round_ in range(2):
        wait_for(lambda: lazy_state(d) == "released", 120, what="lazy released")
        lines = [chat_line(f"l{i}", PROMPTS[i], 6) | {"body": {**chat_line("", PROMPTS[i], 6)["body"], "model": "lazy"}}
                 for i in range(4)]
        b = wait_ended(c, c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/chat/completions",
                                           completion_window="24h").id)
        assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (4, 0), b
        assert sorted(r["custom_id"] for r in results(c, b.output_file_id)) == [f"l{i}" for i in range(4)]


def test_a_batch_finishes_across_every_kill_each_line_answered_once(d):
    """The module's last test: it kills the engine, the gateway and the manager mid-batch."""
    c = client(d)
    n = 48
    lines = [chat_line(f"x{i}", PROMPTS[i % len(PROMPTS)] + f" {i}", 160, ignore_eos=True) for i in range(n)]
    b = c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/chat/completions", completion_window="24h")

    def done_at_least(k: int) -> None:
        """k lines answered, and the batch not through: the next kill is mid-batch."""
        wait_for(lambda: client(d).batches.retrieve(b.id).request_counts.completed >= k, 180,
                 what=f"{k} lines answered")
        now = client(d).batches.retrieve(b.id)
        assert now.status == "in_progress" and now.request_counts.completed < n, now

    done_at_least(4)
    engine = d.child("engine_core:default")
    os.kill(engine.pid, signal.SIGKILL)
    done_at_least(12)
    gateway = d.child("gateway:0")
    os.kill(gateway.pid, signal.SIGKILL)
    wait_for(lambda: d.child("gateway:0").pid != gateway.pid and d.child("gateway:0").state == "ready", 60,
             what="gateway:0 replaced")
    done_at_least(20)
    os.kill(d.manager_pid, signal.SIGKILL)
    wait_for(lambda: not d.tree(), 120, what="the tree gone with its manager")
    d.start()
    c = client(d)
    done_at_least(28)
    d.cli("reload", check=True, timeout=120)
    b = wait_ended(c, b.id, timeout=600)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (n, 0), b
    out = results(c, b.output_file_id)
    ids = [r["custom_id"] for r in out]
    assert sorted(ids) == sorted(f"x{i}" for i in range(n))  # each once
    assert not results(c, b.error_file_id)
    for r in out[:: 8]:
        i = int(r["custom_id"][1:])
        alone = c.chat.completions.create(**{k: v for k, v in lines[i]["body"].items() if k != "ignore_eos"},
                                          extra_body={"ignore_eos": True})
        assert r["response"]["body"]["choices"][0]["message"]["content"] == alone.choices[0].message.content
