"""Issue 35: a memory budget per device; the least recently used model evicted to make room;
a model too large for its budget refused with its reason; held streams kept alive.

One daemon, three copies of the bundled model (`a` loads at start, `b` and `c` on first use)
and `big`, whose configured expected_memory is beyond the budget. The daemon starts with a
generous `cpu` budget, so `a` loads and its engine measures its footprint (the group's RSS);
a reload then sets the budget to 2.5 footprints, and `c` expects one: two fit, three do not.
Alternating traffic then evicts the least recently used model each time (memory alone: no
max_loaded_models), every answer is the one `a` gives, and no request fails. A stream for a
released model is held while it loads and gets keep-alive comments before its first chunk.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import urllib.parse

import pytest

from conftest import DEFAULT_MODEL_DIR, ROOT, SERVECTL, DaemonFactory, http as request, json_lines

ADMIN = "sk-admin-budget"
BODY = {"prompt": "def ", "max_tokens": 12, "temperature": 0}


def config(budget: str, c_expects: str = "") -> str:
    return ("[gateway]\nhold_timeout_s = 180\nsse_keep_alive_interval = 0.5\n"
            f'admin_keys = ["{ADMIN}"]\n'
            "[manager]\nwarm_standby = false\nfreeze_grace_s = 0.5\n"
            f'memory_budget = {{ cpu = {budget} }}\n'
            f'[[models]]\nname = "a"\nmodel = "{DEFAULT_MODEL_DIR}"\n'
            f'[[models]]\nname = "b"\nmodel = "{DEFAULT_MODEL_DIR}"\nautostart = false\n'
            f'[[models]]\nname = "c"\nmodel = "{DEFAULT_MODEL_DIR}"\nautostart = false\n{c_expects}'
            f'[[models]]\nname = "big"\nmodel = "{DEFAULT_MODEL_DIR}"\nautostart = false\nexpected_memory = "1TiB"\n')


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    with DaemonFactory(tmp_path_factory, "budget") as make:
        yield make(config('"512GiB"'))


def models(d) -> dict:
    return {m.name: m for m in d.status().models}


def states(d) -> dict[str, str]:
    return {name: str(m.state) for name, m in models(d).items() if name != "big"}


def ask(d, model: str) -> str:
    r = request(d, "POST", "/v1/completions", {**BODY, "model": model}, timeout=300)
    assert r.status == 200, (model, r.status, r.text)
    return r.json()["choices"][0]["text"]


def test_footprints_are_measured_once_loaded_and_estimated_before(d):
    m = models(d)
    assert str(m["a"].state) == "ready" and m["a"].footprint_measured
    assert m["a"].footprint_source.startswith("RSS") and m["a"].footprint_bytes > 50 << 20
    assert m["a"].device_labels == ["cpu"]
    b = m["b"]
    assert str(b.state) == "released" and not b.footprint_measured
    assert b.footprint_source == "checkpoint + KV cache" and b.footprint_bytes >= 256 << 20  # the KV cache
    st = d.status()
    (cpu,) = st.budget.devices
    assert cpu.label == "cpu" and cpu.budget_bytes == 512 << 30 and cpu.models == ["a"]
    assert cpu.used_bytes == m["a"].footprint_bytes
    shown = d.cli("status").stdout
    assert "measured" in shown and "estimated" in shown and "loaded models: 1 (no cap)" in shown


def test_a_model_larger_than_the_budget_alone_is_a_503_saying_why(d, tmp_path):
    big = models(d)["big"]
    assert str(big.state) == "released" and big.unfit and "does not fit the memory budget even alone" in big.unfit
    for stream in (False, True):
        r = request(d, "POST", "/v1/completions", {**BODY, "model": "big", "stream": stream}, timeout=60)
        assert r.status == 503, (stream, r.status, r.text)
        assert r.headers["Content-Type"].startswith("application/json")  # decided before any header
        message = r.json()["error"]["message"]
        assert "needs 1.0 TiB on device cpu, whose memory_budget is 512.0 GiB" in message, message
        assert "expected_memory" in message
    assert "Retry-After" not in r.headers  # waiting does not help
    assert str(models(d)["big"].state) == "released"
    # `servectl config check` says so beforehand.
    path = tmp_path / "servectl.toml"
    path.write_text(config('"512GiB"'))
    check = subprocess.run([*SERVECTL, "config", "check", str(path)], capture_output=True, text=True, cwd=ROOT)
    assert check.returncode == 0, check.stderr
    assert "warning: model big: needs 1.0 TiB on device cpu" in check.stderr, check.stderr
    assert "model a:" not in check.stderr


def test_the_least_recently_used_is_evicted_when_memory_alone_is_short(d):
    footprint = models(d)["a"].footprint_bytes
    d.config_path.write_text(config(str(int(2.5 * footprint)), f"expected_memory = {footprint}\n"))
    reload = d.cli("reload")
    assert reload.returncode == 0, reload.stderr
    expected = ask(d, "a")
    assert ask(d, "b") == expected  # a and b fit
    assert states(d) == {"a": "ready", "b": "ready", "c": "released"}
    assert ask(d, "c") == expected  # a, used least recently, makes room
    assert states(d) == {"a": "released", "b": "ready", "c": "ready"}
    assert ask(d, "a") == expected  # then b
    assert states(d) == {"a": "ready", "b": "released", "c": "ready"}
    log = d.log("manager")
    assert "model a: evicted: model c needs room (memory_budget cpu:" in log
    assert "model b: evicted: model a needs room (memory_budget cpu:" in log
    assert "max_loaded_models" not in log
    admin = request(d, "GET", "/servectl/v1/models", key=ADMIN).json()
    last = admin["budget"]["last_eviction"]
    assert last["model"] == "b" and last["needed_by"] == "a"
    entries = {e["name"]: e for e in admin["data"]}
    assert entries["c"]["footprint"]["measured"] and entries["c"]["footprint"]["devices"] == ["cpu"]
    assert admin["budget"]["devices"][0]["used_bytes"] <= int(2.5 * footprint)


def raw_stream(d, model: str) -> list[str]:
    """A completion streamed over a plain connection: every line as it came, comments included."""
    url = urllib.parse.urlsplit(d.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**BODY, "model": model, "stream": True}),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {d.api_key}"})
        resp = conn.getresponse()
        assert resp.status == 200
        return resp.read().decode().split("\n")
    finally:
        conn.close()


def test_a_stream_held_while_its_model_loads_gets_keep_alive_comments(d):
    assert states(d)["b"] == "released"
    lines = raw_stream(d, "b")  # b loads (c is evicted) while the stream waits
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert ": keep-alive" in lines[:first_data], lines[:first_data + 1]
    text = "".join(chunk["choices"][0]["text"] for chunk in json_lines("\n".join(lines)))
    assert lines[-3] == "data: [DONE]" and text == ask(d, "a")
    # The SDK ignores the comments: a stream for a released model completes.
    assert states(d)["c"] == "released"
    client = d.openai()
    chunks = list(client.completions.create(model="c", stream=True, **BODY))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ask(d, "a")
    swaps = d.log("manager").count("needs room")
    assert swaps <= 6, swaps
