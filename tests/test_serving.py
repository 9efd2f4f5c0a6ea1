"""Issue 2: a model served end to end, manager → engine group → gateway."""

from __future__ import annotations

import json
import time
from pathlib import Path


from conftest import context_switches, http, read_stat, wait_for


def prompt_len(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text).ids)  # the tokenizer's post-processor adds BOS, as the engine's does


def test_completion_with_openai_client(daemon, tokenizer):
    client = daemon.openai()
    r = client.completions.create(model="default", prompt="def ", max_tokens=12, extra_body={"ignore_eos": True})
    assert r.choices[0].text.strip()
    assert r.usage.prompt_tokens == prompt_len(tokenizer, "def ")
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_usage_counts_generated_tokens(daemon, tokenizer):
    client = daemon.openai()
    r = client.completions.create(model="default", prompt="import os\n", max_tokens=20, logprobs=0)
    # Every generated token is listed once in logprobs: usage must agree with it.
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.tokens)
    assert r.usage.prompt_tokens == prompt_len(tokenizer, "import os\n")


def test_completion_stream(daemon):
    client = daemon.openai()
    chunks = list(client.completions.create(model="default", prompt="class ", max_tokens=10, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]


def test_chat_completion(daemon, tokenizer, model_dir):
    client = daemon.openai()
    messages = [{"role": "user", "content": "write a function"}]
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=10,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content.strip()
    # The chat template, applied the way the engine does (no BOS added after templating).
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = hf(text, add_special_tokens=False)["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 10


def test_chat_stream(daemon):
    client = daemon.openai()
    chunks = list(client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text.strip()
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sse_ends_with_done(daemon):
    r = http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 3, "stream": True},
             timeout=60)
    assert r.status == 200 and r.headers.get_content_type() == "text/event-stream"
    assert r.text.rstrip().endswith("data: [DONE]")


def test_models_and_health(daemon):
    r = http(daemon, "GET", "/v1/models", timeout=10)
    assert r.status == 200 and [m["id"] for m in r.json()["data"]] == ["default"]
    health = http(daemon, "GET", "/health", key=None, timeout=10)
    assert health.status == 200 and health.json()["models"]["default"]["state"] == "ready"


def test_status_lists_every_kind_as_children_of_the_manager(daemon):
    daemon.wait_standbys_warm(2)
    proc = daemon.cli("status", "--json")
    assert proc.returncode == 0, proc.stderr
    st = json.loads(proc.stdout)
    kinds = {c["kind"] for c in st["children"]}
    assert kinds == {"gateway", "engine_core", "worker", "standby"}
    standbys = sorted(c["component"] for c in st["children"] if c["kind"] == "standby")
    assert standbys == ["standby:engine_core:default", "standby:worker:default:0"]
    manager = st["manager_pid"]
    assert Path(f"/proc/{manager}").exists()
    for c in st["children"]:
        assert c["pid"] and Path(f"/proc/{c['pid']}").exists(), c
        assert int(read_stat(c["pid"])[1]) == manager, c
    assert daemon.cli("status").returncode == 0


def test_manager_imports_no_torch_or_vllm(daemon):
    # While it serves: a request first, so everything is loaded that will be.
    daemon.openai().completions.create(model="default", prompt="a", max_tokens=2)
    maps = Path(f"/proc/{daemon.manager_pid}/maps").read_text()
    assert "libtorch" not in maps
    assert "vllm" not in maps
    # Positive control: the engine's maps do hold them.
    engine = daemon.child("engine_core:default").pid
    assert "libtorch" in Path(f"/proc/{engine}/maps").read_text()


def test_sockets_are_private(daemon):
    root = daemon.runtime_dir
    assert root.stat().st_mode & 0o777 == 0o700
    for name in ("control", "events", "engine-default", "worker-default-0"):
        assert (root / name).stat().st_mode & 0o077 == 0, name


def tree_switches(daemon) -> tuple[int, list[int]]:
    pids = [daemon.manager_pid] + [c.pid for c in daemon.status().children]
    return context_switches(pids), pids


def idle_window(daemon, seconds: float = 5.0) -> int:
    before, pids = tree_switches(daemon)
    time.sleep(seconds)  # the measurement itself: what the idle tree does over a fixed window
    after = context_switches(pids)
    return after - before


def test_idle_tree_sleeps(daemon):
    """The headline property: an idle tree makes (almost) no context switches."""
    client = daemon.openai()
    for _ in range(4):
        client.completions.create(model="default", prompt="def f(", max_tokens=16)
    # The standbys, part of the tree, sleep too once they have imported vLLM.
    daemon.wait_standbys_warm(2)
    # Past the freeze grace (1 s here): the engine has frozen its workers.
    wait_for(lambda: all(c.state == "idle (frozen)" for c in daemon.status().children if c.kind == "worker"),
             30, what="workers frozen")
    quiet = idle_window(daemon)
    assert quiet <= 25, f"{quiet} context switches in 5 s of idle"

    # Negative control: the same window with freezing off counts the gloo threads.
    assert daemon.cli("freeze", "default", "off").returncode == 0
    try:
        wait_for(lambda: all(c.state == "ready" for c in daemon.status().children if c.kind == "worker"), 30,
                 what="workers thawed")
        noisy = idle_window(daemon)
        assert noisy > 1000, f"only {noisy} switches with freezing off: the measurement is not sensitive"
    finally:
        assert daemon.cli("freeze", "default", "on").returncode == 0
    # And the tree still serves after all that.
    r = client.completions.create(model="default", prompt="def g(", max_tokens=4, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4


def thread_names(pid: int) -> list[str]:
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return names


def omp_threads(pid: int) -> int:
    """The OpenMP team size a process was started with (its threads carry the interpreter's name)."""
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
    return int(env.get("OMP_NUM_THREADS") or 1)


def test_no_helper_threads_beyond_the_known(daemon):
    """No process of a serving tree keeps a Python helper thread that wakes on a timer while idle
    (tqdm's monitor, started by vLLM's weight-loading bar and waking every 10 s, is off in the
    workers). Python threads carry the interpreter's name in /proc, as do a worker's OpenMP threads
    (its main thread is one of them); ZeroMQ's and gloo's name theirs. So every process has one
    such thread, and a worker its OpenMP team plus, with async scheduling, its output thread. The
    engine is left out: vLLM starts threads there on demand that block without a timer (structured
    outputs compile grammars on a thread pool)."""
    daemon.openai().completions.create(model="default", prompt="def f(", max_tokens=2)
    children = [c for c in daemon.status().children if c.kind not in ("standby", "engine_core")]
    worker = daemon.child("worker:default:0").pid
    assert "gloo_tcp_loop" in thread_names(worker)  # the reading sees a loaded worker's threads
    python = Path(f"/proc/{daemon.manager_pid}/comm").read_text().strip()
    counts, allowed = {"manager": thread_names(daemon.manager_pid).count(python)}, {"manager": 1}
    for c in children:
        counts[c.component] = thread_names(c.pid).count(python)
        allowed[c.component] = 1
        if c.kind == "worker":
            output_thread = "async model outputs are resolved on an output thread" in daemon.log(c.component)
            allowed[c.component] = omp_threads(c.pid) + output_thread
    assert len(counts) >= 3 and all(counts[k] <= allowed[k] for k in counts), (counts, allowed)


def worker_replies(daemon) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = http(daemon, "GET", "/metrics", key=None, timeout=10).text
    return {s.labels["encoding"]: s.value for fam in text_string_to_metric_families(text)
            if fam.name == "servectl_engine_worker_replies" for s in fam.samples if s.labels.get("model") == "default"}


def test_a_steps_tokens_come_back_unsigned_and_logprobs_as_a_signed_pickle(daemon):
    """The worker's reply of sampled tokens only skips the pickle and its MACs (engine_core/workers/tokens_reply.py);
    a step that carries logprobs is still a signed pickle. Both reach the client the same way."""
    client = daemon.openai()
    before = worker_replies(daemon)
    r = client.completions.create(model="default", prompt="def ", max_tokens=12, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12
    plain = worker_replies(daemon)
    assert plain["tokens"] - before["tokens"] >= 12  # one reply per step: the prefill's and each decode's
    r = client.completions.create(model="default", prompt="def ", max_tokens=8, logprobs=2,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices[0].logprobs.top_logprobs) == 8
    after = worker_replies(daemon)
    assert after["signed_pickle"] - plain["signed_pickle"] >= 8  # each step with logprobs


def test_client_disconnect_aborts_engine_request(daemon):
    import socket

    body = json.dumps({"model": "default", "prompt": "def ", "max_tokens": 400, "stream": True,
                       "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", daemon.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + daemon.api_key.encode() + b"\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    received = b""
    while b"data:" not in received:
        chunk = s.recv(4096)
        assert chunk, "connection closed before any event"
        received += chunk
    s.close()  # the client walks away mid-stream

    def unfinished() -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = http(daemon, "GET", "/metrics", key=None, timeout=10).text
        for fam in text_string_to_metric_families(text):
            if fam.name == "servectl_requests_running":
                return sum(s.value for s in fam.samples if s.labels.get("model") == "default")
        return -1

    wait_for(lambda: unfinished() == 0, 30, what="the engine to drop the abandoned request")
    # It was dropped, not finished: 400 tokens take this engine far longer than the abort.
    wait_for(lambda: "aborted 1 request(s)" in daemon.log("engine_core:default"), 10, what="the abort log line")
