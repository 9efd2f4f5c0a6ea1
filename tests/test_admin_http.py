"""Models managed over HTTP behind admin keys (issue 30), against a real daemon and engine.

One daemon with an API key and an admin key serves the bundled model; the
tests list it, refuse callers without the admin key, unload and load it,
restart it under streaming load (0 client errors: a supervised restart),
freeze and thaw it, rotate the admin key by reload and read the audit log.
The shared daemon (an API key, no admin key) shows the routes do not exist
without one.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from api_gateway.keys import fingerprint
from conftest import DaemonFactory, http, wait_for

API = "sk-api-e2e"
ADMIN = "sk-admin-e2e"
ADMIN2 = "sk-admin-rotated"
MODELS = "/servectl/v1/models"


def config(admin: str, model: str = "") -> str:
    # drain_timeout_s: a reload's replacement stops the old engine under a long stream
    return (f'[gateway]\napi_keys = ["{API}"]\nadmin_keys = ["{admin}"]\nhold_timeout_s = 120\n'
            "[manager]\nfreeze_grace_s = 1.0\nwarm_standby = false\nbackoff_initial_s = 0.3\n"
            f"drain_timeout_s = 1\nstop_grace_s = 2\n{model}")


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    with DaemonFactory(tmp_path_factory, "admin") as make:
        yield make(config(ADMIN), api_key=API)


def audit(d) -> list[dict]:
    """Accepted commands and refusals (these in a file of their own: issue 53)."""
    paths = (d.runtime_dir / "state" / "audit.log", d.runtime_dir / "state" / "audit-denied.log")
    return [json.loads(line) for path in paths if path.exists() for line in path.read_text().splitlines()]


def entry(d, name: str = "default", key: str = ADMIN) -> dict:
    r = http(d, "GET", MODELS, key=key)
    assert r.status == 200, r.text
    return next(m for m in r.json()["data"] if m["model"] == name)  # its group: `name`, or `name@<n>` once rolled


def completion(d, key: str = API):
    return http(d, "POST", "/v1/completions", {"model": "default", "prompt": "def ", "max_tokens": 4,
                                                "temperature": 0}, key=key)


def test_the_routes_need_an_admin_key(d):
    assert http(d, "GET", MODELS, key=None).status == 401
    assert http(d, "GET", MODELS, key="sk-wrong").status == 401
    refused = http(d, "GET", MODELS, key=API)
    assert refused.status == 403 and refused.json()["error"]["code"] == "admin_key_required", refused.text
    for verb in ("load", "unload", "restart"):
        assert http(d, "POST", f"{MODELS}/default/{verb}", key=None).status == 401
        assert http(d, "POST", f"{MODELS}/default/{verb}", key=API).status == 403
    assert http(d, "POST", f"{MODELS}/default/freeze", {"enabled": False}, key=API).status == 403
    assert entry(d)["state"] == "ready"  # nothing refused changed anything


def test_the_list_says_what_each_model_holds(d):
    assert completion(d).status == 200
    m = entry(d)
    assert m["served"] is True and m["state"] == "ready"
    assert m["memory_bytes"] > 100 << 20  # an engine and a worker with torch and vLLM imported
    assert m["requests_running"] == 0 and m["requests_waiting"] == 0
    assert m["restarts"] >= 0 and m["incarnation"]
    assert time.time() - 600 < m["last_used"] <= time.time() + 1
    assert 0 < m["start_s"] < 600  # its cold start, as the manager measured it
    assert {"devices", "device_memory_bytes", "idle_since", "released_since", "frozen", "reason"} <= set(m)


def test_an_admin_key_is_an_api_key_too_and_lower_case_bearer_works(d):
    assert completion(d, key=ADMIN).status == 200
    r = http(d, "GET", MODELS, key=None, headers={"Authorization": f"bearer {ADMIN}"})
    assert r.status == 200, r.text
    assert http(d, "GET", "/v1/models", key=None, headers={"Authorization": f"bearer {API}"}).status == 200


def test_unknown_models_and_bad_bodies_are_clear_errors(d):
    r = http(d, "POST", f"{MODELS}/nope/restart", key=ADMIN)
    assert r.status == 404 and "nope" in r.json()["error"]["message"], r.text
    r = http(d, "POST", f"{MODELS}/default/load", key=ADMIN)
    assert r.status == 409 and "already served" in r.json()["error"]["message"], r.text
    for body in ("", "{", '{"enabled": "yes"}', '{"on": true}'):
        r = http(d, "POST", f"{MODELS}/default/freeze", body, key=ADMIN)
        assert r.status == 400 and "enabled" in r.json()["error"]["message"], (body, r.text)
    assert http(d, "GET", f"{MODELS}/default/restart", key=ADMIN).status == 405


def test_freezing_turns_off_and_on(d):
    r = http(d, "POST", f"{MODELS}/default/freeze", {"enabled": False}, key=ADMIN)
    assert r.status == 200 and r.json()["action"] == "thaw", r.text
    assert "off" in r.json()["message"]
    r = http(d, "POST", f"{MODELS}/default/freeze", {"enabled": True}, key=ADMIN)
    assert r.status == 200 and r.json()["done"] is True and "on" in r.json()["message"], r.text


def test_unload_then_load_brings_the_model_back_and_it_answers(d):
    r = http(d, "POST", f"{MODELS}/default/unload", key=ADMIN)
    assert r.status == 200 and r.json() == {"model": "default", "action": "unload", "done": True,
                                            "message": "unloaded default"}, r.text
    # Done means done: no wait for it after the answer.
    assert entry(d) == {"name": "default", "model": "default", "state": "unloaded", "served": False}
    assert http(d, "GET", "/v1/models").json()["data"] == []
    gone = completion(d)
    assert gone.status == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text
    r = http(d, "POST", f"{MODELS}/default/load", key=ADMIN)
    assert r.status == 200 and r.json() == {"model": "default", "action": "load", "done": True,
                                            "message": "loaded default: ready"}, r.text
    assert entry(d)["state"] == "ready"
    answer = completion(d)
    assert answer.status == 200 and answer.json()["usage"]["completion_tokens"] == 4, answer.text


def test_unload_and_load_back_to_back_over_http_leave_the_model_serving(d):
    """The operator script of issue 51: an unload that answers before the drain is over, then a
    load at once — the load waits for the unload and loads (it was a 409, and the model stayed
    unloaded)."""
    r = http(d, "POST", f"{MODELS}/default/unload?wait=0", key=ADMIN)
    assert r.status == 202 and r.json()["done"] is False and "under way" in r.json()["message"], r.text
    r = http(d, "POST", f"{MODELS}/default/load", key=ADMIN)
    assert r.status == 200 and r.json()["done"] is True and r.json()["message"] == "loaded default: ready", r.text
    assert entry(d)["state"] == "ready"
    assert completion(d).status == 200
    # A load that is not waited for, then the same call again: it waits for the one under way.
    assert http(d, "POST", f"{MODELS}/default/unload", key=ADMIN).json()["done"] is True
    r = http(d, "POST", f"{MODELS}/default/load?wait=0", key=ADMIN)
    assert r.status == 202 and r.json()["done"] is False, r.text
    r = http(d, "POST", f"{MODELS}/default/load", key=ADMIN)
    assert r.status == 200 and r.json()["done"] is True, r.text
    assert completion(d).status == 200


def test_the_cli_loads_a_configured_model_by_its_name(d):
    r = d.cli("unload", "default")
    assert r.returncode == 0 and "unloaded default" in r.stdout, r.stdout + r.stderr
    assert entry(d)["state"] == "unloaded"
    r = d.cli("load", "default")
    assert r.returncode == 0 and "loaded default: ready" in r.stdout, r.stdout + r.stderr
    assert entry(d)["state"] == "ready"
    assert d.cli("load", "nope").returncode == 1
    assert completion(d).status == 200


def test_cli_unload_and_load_back_to_back_leave_the_model_serving(d):
    """`servectl unload default && servectl load default`, and the same with --no-wait first."""
    for first in (["unload", "default"], ["unload", "default", "--no-wait"]):
        r = d.cli(*first)
        assert r.returncode == 0, r.stdout + r.stderr
        assert ("under way" if "--no-wait" in first else "unloaded default") in r.stdout, r.stdout
        r = d.cli("load", "default")
        assert r.returncode == 0 and "loaded default: ready" in r.stdout, r.stdout + r.stderr
        assert entry(d)["state"] == "ready"
        assert completion(d).status == 200


class Stream(threading.Thread):
    def __init__(self, d, i: int, max_tokens: int = 400):
        super().__init__(daemon=True)
        self.client = d.openai(timeout=300)
        self.i = i
        self.max_tokens = max_tokens
        self.chunks = 0
        self.usage = None
        self.error: BaseException | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            stream = self.client.completions.create(
                model="default", prompt=f"def f{self.i}(", max_tokens=self.max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    self.chunks += 1
                    if self.chunks >= 3:
                        self.started.set()
                if chunk.usage is not None:
                    self.usage = chunk.usage
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.started.set()


def test_a_restart_under_load_costs_no_client_errors(d):
    before = entry(d)
    streams = [Stream(d, i) for i in range(4)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(120)
    r = http(d, "POST", f"{MODELS}/default/restart", key=ADMIN)
    assert r.status == 200 and r.json()["message"] == "restarted default: ready", r.text
    assert entry(d)["state"] == "ready"  # answered once serving again
    for s in streams:
        s.join(300)
    assert [s.error for s in streams] == [None] * 4
    assert [s.usage.completion_tokens for s in streams] == [400] * 4
    wait_for(lambda: entry(d)["state"] == "ready", 120, what="ready after the restart")
    after = entry(d)
    assert after["incarnation"] != before["incarnation"] and after["restarts"] == before["restarts"] + 1


def test_every_call_and_refusal_is_audited_by_key_id_and_address(d):
    records = audit(d)
    text = json.dumps(records)
    assert ADMIN not in text and API not in text
    http_records = [r for r in records if r.get("via") == "http"]
    done = {(r["command"], r["outcome"]) for r in http_records if r["admin_key"] == fingerprint(ADMIN)}
    assert {("restart", "accepted"), ("unload", "accepted"), ("load_configured", "accepted"),
            ("set_freezing", "accepted")} <= done, http_records
    refused = [r for r in http_records if r["command"] == "http_refused"]
    assert any(r["admin_key"] is None and r["args"]["status"] == 401 for r in refused), refused
    assert any(r["admin_key"] == fingerprint(API) and r["args"]["status"] == 403 for r in refused), refused
    assert all(r["client"] == "127.0.0.1" and r["gateway"] == "gateway:0" for r in http_records), http_records
    assert all(r["route"].startswith(("GET /servectl/v1/", "POST /servectl/v1/")) for r in http_records)


def test_the_routes_are_in_openapi(d):
    paths = http(d, "GET", "/openapi.json").json()["paths"]
    assert {MODELS, f"{MODELS}/{{model}}/load", f"{MODELS}/{{model}}/unload", f"{MODELS}/{{model}}/restart",
            f"{MODELS}/{{model}}/freeze"} <= set(paths)


def test_a_reload_rotates_the_admin_key_without_restarting_the_gateway(d):
    gateway = d.child("gateway:0").pid
    d.config_path.write_text(config(ADMIN2))
    r = d.cli("reload")
    assert r.returncode == 0, r.stdout + r.stderr
    assert http(d, "GET", MODELS, key=ADMIN).status == 401
    assert http(d, "GET", MODELS, key=ADMIN2).status == 200
    assert d.child("gateway:0").pid == gateway
    assert completion(d).status == 200  # the API key is unchanged
    d.config_path.write_text(config(ADMIN))
    assert d.cli("reload").returncode == 0


def test_a_stream_is_never_resumed_onto_a_model_a_reload_changed(d):
    from servectl.config import DEFAULT_MODEL_DIR

    before = entry(d)
    # max_loaded_models = 1 (in [manager]): no room for a second copy, so the reload restarts the
    # model in place (a rolled one would let the stream finish on the old group).
    changed = ('max_loaded_models = 1\n'
               f'[[models]]\nname = "default"\nmodel = "{DEFAULT_MODEL_DIR}"\nengine_args = {{ max_num_seqs = 32 }}\n')
    stream = Stream(d, 9, max_tokens=500)
    stream.start()
    assert stream.started.wait(120)
    # The stream cannot finish on the old engine, whatever this machine's speed: its worker is
    # stopped, so the drain times out and the old group is killed under it.
    os.kill(d.child("worker:default:0").pid, signal.SIGSTOP)
    d.config_path.write_text(config(ADMIN, changed))
    r = d.cli("reload")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "default restarted" in r.stdout, r.stdout
    stream.join(300)
    assert stream.error is not None and "changed configuration" in str(stream.error), \
        (stream.error, stream.usage, stream.chunks, r.stdout, d.log_tails("manager"))
    assert stream.usage is None  # it ended there: no other model's tokens after the change
    after = entry(d)
    assert after["config_id"] != before["config_id"] and len(after["config_id"]) == 16
    assert completion(d).status == 200  # the new model serves
    d.config_path.write_text(config(ADMIN))
    assert d.cli("reload").returncode == 0
    wait_for(lambda: entry(d)["state"] == "ready", 180, what="ready again after the reload")


def test_without_an_admin_key_the_routes_do_not_exist(daemon):
    for method, path in (("GET", MODELS), ("POST", f"{MODELS}/default/unload"),
                         ("POST", f"{MODELS}/default/restart")):
        r = http(daemon, method, path)  # with the shared daemon's API key
        assert r.status == 404 and "no route" in r.json()["error"]["message"], (path, r.text)
        assert http(daemon, method, path, key=None).status == 404
    assert http(daemon, "GET", "/v1/models").status == 200
