"""Issue 34: LoRA adapters, configured and loaded at run time, served under their own names.

One daemon (module-scoped, standbys off) serves the bundled model with `enable_lora` and the
bundled adapter (servectl/model/lora/vllm-code, trained on vLLM's own sources) configured; one
`vllm serve` with the same flags (`--enable-lora --lora-modules vllm-code=...`) is the
reference. On a prompt from the adapter's held-out corpus the adapter's greedy output differs
from the base model's and equals `vllm serve`'s, in completions and chat, whole and streamed,
with logprobs. Then at run time: load and unload over HTTP (admin key) and the CLI, bad adapters
(missing, rank too high, wrong modules) a 400 with the reason, an engine SIGKILL in the middle of
an adapter's stream (the stream ends as unkilled, the adapters loaded at run time still served),
and a reload that keeps the model keeps them too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading

import pytest

from bench.run import VllmServe
from conftest import DEFAULT_MODEL_DIR, DaemonFactory, assert_nothing_running, http, json_lines, vllm_serving, \
    wait_for

LORA_DIR = DEFAULT_MODEL_DIR.parent / "lora" / "vllm-code"
STATS = json.loads((LORA_DIR / "training_stats.json").read_text())
PROMPT = STATS["prompt"]  # from a held-out file of the adapter's corpus (vLLM's sources)
ADMIN = "lora-admin-key-0123456789"
LORA_ARGS = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
FLAGS = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules", f"vllm-code={LORA_DIR}")


def config(extra_models: str = "", roots: tuple = ()) -> str:
    return (f'[gateway]\nadmin_keys = ["{ADMIN}"]\nhold_timeout_s = 120\n'
            "[manager]\nwarm_standby = false\nbackoff_initial_s = 0.3\n"
            f"lora_roots = {json.dumps([str(r) for r in roots])}\n"
            f'[[models]]\nname = "default"\nmodel = "{DEFAULT_MODEL_DIR}"\n'
            f'lora_modules = {{ "vllm-code" = "{LORA_DIR}" }}\n'
            '[models.engine_args]\ndtype = "float32"\nenable_lora = true\nmax_lora_rank = 8\nmax_loras = 2\n'
            + extra_models)


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    adapters = tmp_path_factory.mktemp("adapters")  # the HTTP route's second root (issue 53)
    with DaemonFactory(tmp_path_factory, "lora") as make:
        daemon = make(config(roots=(LORA_DIR.parent, adapters)))
        daemon.adapters = adapters
        yield daemon


@pytest.fixture(scope="module")
def vllm_lora(tmp_path_factory):
    server = VllmServe(tmp_path_factory.mktemp("vllm-lora"), flags=FLAGS, max_model_len=512)
    with vllm_serving(server, "lora") as base:
        yield base


def complete(target, model: str, **kw) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 32, "temperature": 0, **kw}
    r = http(target, "POST", "/v1/completions", body, key=None)
    assert r.status == 200, r.text
    return r.json()


def text_of(target, model: str, **kw) -> str:
    return complete(target, model, **kw)["choices"][0]["text"]


def admin(d, path: str, body: dict, key: str | None = ADMIN):
    return http(d, "POST", path, body, key=key)


def load(d, name: str, path, key: str | None = ADMIN):
    return admin(d, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, key)


def unload(d, name: str):
    return admin(d, "/v1/unload_lora_adapter", {"lora_name": name})


def served(d) -> dict[str, dict]:
    return {m["id"]: m for m in http(d, "GET", "/v1/models", key=None).json()["data"]}


# ---- configured ------------------------------------------------------------------------------

def test_the_adapter_is_listed_with_its_parent(d):
    models = served(d)
    assert models["vllm-code"]["parent"] == "default"
    assert models["vllm-code"].get("root") is None and str(LORA_DIR) not in json.dumps(models)  # no paths
    assert models["vllm-code"]["state"] == "ready" and models["default"].get("parent") is None
    one = http(d, "GET", "/v1/models/vllm-code", key=None)
    assert one.status == 200 and one.json()["parent"] == "default"


def test_the_adapter_changes_the_output_on_its_corpus(d):
    base, adapted = text_of(d, "default"), text_of(d, "vllm-code")
    assert base != adapted, (base, adapted)
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24, "temperature": 0}
    answers = [http(d, "POST", "/v1/chat/completions", {**chat, "model": m}, key=None).json()
               ["choices"][0]["message"]["content"] for m in ("default", "vllm-code")]
    assert answers[0] != answers[1], answers


def test_the_adapter_scores_its_corpus_better_than_the_base_model(d):
    """The held-out passage's log-likelihood through the served model (echo + logprobs): the
    adapter's is higher, as its card says of the whole held-out corpus."""
    passage = STATS["probe"]["text"]

    def logprob(model: str) -> float:
        r = http(d, "POST", "/v1/completions", {"model": model, "prompt": passage, "max_tokens": 0, "echo": True,
                                                 "logprobs": 0}, key=None)
        assert r.status == 200, r.text
        return sum(x for x in r.json()["choices"][0]["logprobs"]["token_logprobs"] if x is not None)

    assert logprob("vllm-code") > logprob("default")


PARITY = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 32}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "logprobs": 2}),
    ("/v1/completions", {"prompt": [PROMPT, "import "], "max_tokens": 12, "n": 2, "temperature": 0.8, "seed": 7}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
                              "logprobs": True, "top_logprobs": 2}),
]


def masked(body):
    if isinstance(body, dict):
        return {k: masked(v) for k, v in body.items() if k not in ("id", "created", "system_fingerprint")}
    if isinstance(body, list):
        return [masked(x) for x in body]
    return body


@pytest.mark.parametrize("model", ["vllm-code", "default"])
def test_outputs_equal_vllm_serve_with_the_same_adapter(d, vllm_lora, model):
    for path, body in PARITY:
        body = {"temperature": 0, **body, "model": model}
        ours, theirs = (http(t, "POST", path, body, key=None) for t in (d, vllm_lora))
        assert ours.status == theirs.status == 200, (path, ours.text, theirs.text)
        ours, theirs = masked(ours.json()), masked(theirs.json())
        for answer in (ours, theirs):
            answer.pop("usage", None)
            answer.pop("kv_transfer_params", None)
            answer.pop("service_tier", None)
            answer.pop("prompt_logprobs", None)
            answer.pop("prompt_token_ids", None)
        def said(answer):
            return [c["text"] if "text" in c else c["message"]["content"] for c in answer["choices"]]

        assert said(ours) == said(theirs), (path, body)
        assert [c.get("logprobs") for c in ours["choices"]] == [c.get("logprobs") for c in theirs["choices"]]
        assert ours["model"] == theirs["model"] == model
    # streamed: the same text, chunk by chunk joined
    body = {"model": model, "prompt": PROMPT, "max_tokens": 32, "temperature": 0, "stream": True}
    texts = ["".join(c["choices"][0]["text"] for c in json_lines(http(t, "POST", "/v1/completions", body,
                                                                        key=None).text) if c.get("choices"))
             for t in (d, vllm_lora)]
    assert texts[0] == texts[1] == text_of(d, model)


def test_responses_and_messages_through_the_adapter_equal_vllm_serve(d, vllm_lora):
    """vLLM's Responses and Messages serving code, run in servectl's engine, finds the adapter as
    `vllm serve`'s does: the same text, and not the base model's."""
    def responses(target, model):
        r = http(target, "POST", "/v1/responses", {"model": model, "input": PROMPT, "max_output_tokens": 24,
                                                    "temperature": 0}, key=None)
        assert r.status == 200, r.text
        return [c["text"] for item in r.json()["output"] for c in item.get("content") or ()]

    def messages(target, model):
        r = http(target, "POST", "/v1/messages", {"model": model, "max_tokens": 24, "temperature": 0,
                                                   "messages": [{"role": "user", "content": PROMPT}]}, key=None)
        assert r.status == 200, r.text
        return [b.get("text") for b in r.json()["content"]]

    for ask in (responses, messages):
        ours, theirs = ask(d, "vllm-code"), ask(vllm_lora, "vllm-code")
        assert ours == theirs and ours != ask(d, "default"), (ask.__name__, ours, theirs)


def test_the_model_list_matches_vllm_serve(d, vllm_lora):
    ours, theirs = served(d)["vllm-code"], served(vllm_lora)["vllm-code"]
    assert {k: ours[k] for k in ("id", "object", "parent")} == {k: theirs[k] for k in ("id", "object", "parent")}
    assert theirs["root"] == str(LORA_DIR) and ours.get("root") is None  # vLLM shows the path; servectl not


# ---- at run time -----------------------------------------------------------------------------

def test_load_and_unload_at_run_time(d):
    assert "again" not in served(d)
    r = load(d, "again", LORA_DIR)
    assert r.status == 200 and r.text == "Success: LoRA adapter 'again' added successfully.", r.text
    assert served(d)["again"]["parent"] == "default"
    assert text_of(d, "again") == text_of(d, "vllm-code") != text_of(d, "default")
    # the same name twice: vLLM's refusal; a model's name: too
    twice = load(d, "again", LORA_DIR)
    assert twice.status == 400 and "already been loaded" in twice.json()["error"]["message"]
    assert load(d, "default", LORA_DIR).status == 400
    r = unload(d, "again")
    assert r.status == 200 and "removed" in r.text, r.text
    assert "again" not in served(d)
    gone = http(d, "POST", "/v1/completions", {"model": "again", "prompt": "def ", "max_tokens": 2}, key=None)
    assert gone.status == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert unload(d, "again").status == 404


def test_the_routes_need_the_admin_key(d, daemon):
    assert load(d, "nokey", LORA_DIR, key=None).status == 401
    assert load(d, "nokey", LORA_DIR, key="not-a-key").status == 401
    assert "nokey" not in served(d)
    # no admin key configured (the shared daemon): the routes do not exist
    r = http(daemon, "POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(LORA_DIR)})
    assert r.status == 404, r.text


def test_the_cli_loads_lists_and_unloads(d):
    r = d.cli("lora", "load", "from-cli", str(LORA_DIR))
    assert r.returncode == 0 and "added successfully" in r.stdout, r.stdout + r.stderr
    listed = json.loads(d.cli("lora", "list", "--json", check=True).stdout)
    (model,) = listed["models"]
    assert model["name"] == "default" and {a["name"] for a in model["loras"]} >= {"vllm-code", "from-cli"}
    assert text_of(d, "from-cli") == text_of(d, "vllm-code")
    r = d.cli("lora", "unload", "from-cli")
    assert r.returncode == 0, r.stdout + r.stderr
    r = d.cli("lora", "unload", "from-cli")
    assert r.returncode == 1 and "cannot be found" in r.stderr, r.stdout + r.stderr


def bad_adapters(tmp_path):
    """A missing path, an adapter of rank 16 (max_lora_rank is 8), one whose weights are for a
    module the model does not have."""
    rank = tmp_path / "rank16"
    shutil.copytree(LORA_DIR, rank)
    cfg = json.loads((rank / "adapter_config.json").read_text())
    (rank / "adapter_config.json").write_text(json.dumps({**cfg, "r": 16}))
    modules = tmp_path / "modules"
    shutil.copytree(LORA_DIR, modules)
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(LORA_DIR / "adapter_model.safetensors"))
    save_file({k.replace("q_proj", "qkv_fused"): v for k, v in weights.items()},
              str(modules / "adapter_model.safetensors"))
    return {"missing": (tmp_path / "nowhere", "No adapter found"),
            "rank16": (rank, "greater than max_lora_rank 8"),
            "modules": (modules, "expected target modules")}


def test_a_bad_adapter_is_a_400_the_cli_says_why_and_http_does_not(d):
    """Over HTTP a missing path and a bad adapter get the same words (issue 53): nothing says
    what is at a path; the owner's CLI and the log have the reason."""
    seen = set()
    for name, (path, words) in bad_adapters(d.adapters).items():
        r = load(d, name, path)
        assert r.status == 400, (name, r.status, r.text)
        message = r.json()["error"]["message"]
        assert words not in message and str(path) not in message and "Traceback" not in message, (name, message)
        seen.add(message.replace(repr(name), "NAME"))
        cli = d.cli("lora", "load", name, str(path))
        assert cli.returncode == 1 and words in cli.stderr and "Traceback" not in cli.stderr, (name, cli.stderr)
        assert name not in served(d)
    assert len(seen) == 1, seen
    assert text_of(d, "vllm-code") != text_of(d, "default")  # the daemon serves on
    again = load(d, "vllm-code", LORA_DIR)  # vLLM's own check, with its reason (not the last failure's)
    assert again.status == 400 and "already been loaded" in again.json()["error"]["message"], again.text
    # a refusal naming the model leaves the gateway's routes to its adapters as they were
    refused = admin(d, "/v1/unload_lora_adapter", {"lora_name": "no-such", "model": "default"})
    assert refused.status == 404 and "vllm-code" in served(d)
    (model,) = d.status().models
    assert model.state == "ready" and model.restarts == 0


def test_over_http_an_adapter_path_must_be_inside_the_configured_roots(d):
    link = d.adapters / "link-out"
    link.symlink_to(DEFAULT_MODEL_DIR)
    for path in (DEFAULT_MODEL_DIR, "/etc", "/no/such/dir", LORA_DIR / ".." / ".." / "default", link,
                 "some-org/some-hub-adapter"):
        r = load(d, "outside", path)
        assert r.status == 400 and "lora_roots" in r.json()["error"]["message"], (path, r.text)
        assert str(path) not in r.text
    assert "outside" not in served(d)


def test_an_engine_sigkill_keeps_the_adapters_and_the_adapter_s_stream(d):
    """A stream through an adapter loaded at run time; the engine is SIGKILLed midway: the
    stream ends with the text an unkilled run gives, and the adapter is served after."""
    assert load(d, "runtime", LORA_DIR).status == 200
    body = {"model": "runtime", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    reference = text_of(d, "runtime", max_tokens=200, ignore_eos=True)
    assert text_of(d, "default", max_tokens=200, ignore_eos=True) != reference
    engine = d.child("engine_core:default").pid
    got: list[str] = []
    chunks = threading.Event()
    errors: list[str] = []

    def stream() -> None:
        from http.client import HTTPConnection

        conn = HTTPConnection("127.0.0.1", d.port, timeout=300)
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                      {"Content-Type": "application/json"})
        resp = conn.getresponse()
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(line)
                continue
            got.append(event["choices"][0]["text"])
            if len(got) >= 5:
                chunks.set()
        conn.close()

    t = threading.Thread(target=stream)
    t.start()
    assert chunks.wait(120), "the stream never started"
    os.kill(engine, signal.SIGKILL)
    at_kill = len(got)
    t.join(300)
    assert not errors, errors
    assert at_kill < 200 and len(got) > at_kill, (at_kill, len(got))  # killed midway, then continued
    assert "".join(got) == reference
    wait_for(lambda: d.child("engine_core:default").pid not in (None, engine) and
             d.status().models[0].state == "ready", 180, what="the engine back")
    assert {"vllm-code", "runtime"} <= set(served(d))
    assert text_of(d, "runtime") == text_of(d, "vllm-code")
    assert_nothing_running(d)


def test_a_model_may_not_take_an_adapter_s_name(d):
    if "runtime" not in served(d):
        assert load(d, "runtime", LORA_DIR).status == 200
    r = d.cli("load", "runtime", "--model", str(DEFAULT_MODEL_DIR))
    assert r.returncode == 1 and "LoRA adapter of model 'default'" in r.stderr + r.stdout, r.stdout + r.stderr
    assert served(d)["runtime"]["parent"] == "default"


def test_a_reload_that_keeps_the_model_keeps_the_adapters(d):
    """The reload changes [gateway] (new gateway processes, which learn the adapters from the
    manager's snapshot) and keeps the model: its engine and its adapters stay."""
    if "runtime" not in served(d):
        assert load(d, "runtime", LORA_DIR).status == 200
    engine, gateway = d.child("engine_core:default").pid, d.child("gateway:0").pid
    d.config_path.write_text(d.config_path.read_text().replace("hold_timeout_s = 120", "hold_timeout_s = 121"))
    r = d.cli("reload")
    assert r.returncode == 0, r.stdout + r.stderr
    assert d.child("engine_core:default").pid == engine and d.child("gateway:0").pid != gateway
    assert {"vllm-code", "runtime"} <= set(served(d))
    assert text_of(d, "runtime") == text_of(d, "vllm-code")


def test_an_idle_release_and_the_wake_keep_the_adapters(daemon_factory):
    """A model released when idle (its engine and workers stopped) comes back on the next request
    with its adapters, those loaded at run time included; while released it holds no memory."""
    idle = daemon_factory(config(roots=(LORA_DIR.parent,)).replace("[manager]\n", "[manager]\nidle_release_s = 2\nfreeze_grace_s = 0.5\n"))
    assert load(idle, "runtime", LORA_DIR).status == 200
    expected = text_of(idle, "vllm-code")
    wait_for(lambda: idle.status().models[0].state == "released", 120, what="the model released")
    busy = load(idle, "while-released", LORA_DIR)
    assert busy.status == 409 and "released" in busy.json()["error"]["message"], busy.text
    (model,) = idle.status().models
    assert model.memory_bytes == 0 and {lora.name for lora in model.loras} == {"vllm-code", "runtime"}
    assert {"vllm-code", "runtime"} <= set(served(idle))
    assert text_of(idle, "runtime") == expected  # held, the model woken, answered through the adapter
    (model,) = idle.status().models
    assert model.state == "ready" and model.memory_bytes > 0
