"""JSON logs (issue 56, item 2) on a real daemon: with `[manager] log_format = "json"` every line
of every component's log file is one JSON object with the common fields, the access log line of a
request carries its request id (the X-Request-Id it was answered with), vLLM's own loggers inside
the engine and the worker come out as JSON too, and `servectl logs` prints them. With warm
standbys, a standby logs JSON under its own name and, once a crash hands it a role, under the
role's."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from conftest import http, wait_for

BASE = '[manager]\nlog_format = "json"\nfreeze_grace_s = 0\n'
REQUIRED = {"time", "level", "component", "model", "logger", "message", "pid"}


def objects(path: Path) -> list[dict]:
    """Every line of a log file as an object (failing on the first that is not one)."""
    out = []
    for n, line in enumerate(path.read_text().split("\n")[:-1], 1):  # "\n" only: the files' one separator
        try:
            obj = json.loads(line)
        except ValueError:
            raise AssertionError(f"{path.name}:{n} is not JSON: {line[:300]!r}") from None
        assert isinstance(obj, dict) and REQUIRED <= obj.keys(), f"{path.name}:{n}: {line[:300]}"
        assert obj["time"].endswith("Z") and len(obj["time"]) == 24 and obj["time"][10] == "T", obj["time"]
        out.append(obj)
    assert out, f"{path.name} is empty"
    return out


def all_logs(d) -> dict[str, list[dict]]:
    return {p.name: objects(p) for p in sorted((d.runtime_dir / "state" / "logs").glob("*.log"))}


def access_line(d, rid: str) -> dict:
    def find():
        return next((o for o in objects(d.runtime_dir / "state" / "logs" / "gateway-0.log")
                     if o.get("request_id") == rid and o["logger"] == "api_gateway.access"), None)
    return wait_for(find, 30, what=f"the access log line of {rid}",
                    diagnose=lambda: d.log_tails("gateway:0", lines=5))


def complete(d, prompt: str) -> str:
    r = http(d, "POST", "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 4,
                                             "ignore_eos": True}, timeout=300)
    assert r.status == 200, r.body[:300]
    return r.headers["X-Request-Id"]


def test_every_component_logs_json_lines_with_the_request_id_and_vllms_own(daemon_factory):
    d = daemon_factory(BASE + "warm_standby = false\n")
    rid = complete(d, "def ")
    line = access_line(d, rid)
    assert (line["component"], line["model"], line["method"], line["path"], line["status"]) == \
        ("gateway:0", "default", "POST", "/v1/completions", 200)
    assert line["completion_tokens"] == 4 and line["prompt_tokens"] >= 1 and line["duration_ms"] > 0
    assert line["pid"] == d.child("gateway:0").pid

    logs = all_logs(d)
    assert {"manager.log", "gateway-0.log", "engine_core-default.log", "worker-default-0.log"} <= logs.keys()
    components = {"manager.log": "manager", "gateway-0.log": "gateway:0",
                  "engine_core-default.log": "engine_core:default", "worker-default-0.log": "worker:default:0"}
    for name, component in components.items():
        assert {o["component"] for o in logs[name]} == {component}, name
    for name in ("engine_core-default.log", "worker-default-0.log"):
        assert {o["model"] for o in logs[name]} == {"default"}, name
        vllm_lines = [o for o in logs[name] if o["logger"].startswith("vllm")]
        assert vllm_lines, f"no line from vLLM's own loggers in {name}"
    assert any(o["level"] == "INFO" and o["logger"] == "manager" for o in logs["manager.log"])
    assert {o["pid"] for o in logs["engine_core-default.log"] if o["logger"] != "output"} == \
        {d.child("engine_core:default").pid}

    # `servectl logs` prints them as they are: one object a line.
    out = d.cli("logs", "gateway-0", "-n", "200", check=True).stdout
    printed = [json.loads(x) for x in out.split("\n") if x]
    assert any(o.get("request_id") == rid for o in printed)


def test_a_standby_logs_json_and_switches_to_its_roles_name(daemon_factory):
    d = daemon_factory(BASE + "warm_standby = true\nbackoff_initial_s = 0.3\n")
    warm = d.wait_standbys_warm(2)
    logs = all_logs(d)
    for member in ("engine_core:default", "worker:default:0"):
        name = f"standby-{member.replace(':', '-')}.log"
        assert {o["component"] for o in logs[name]} == {f"standby:{member}"}, name
        assert {o["model"] for o in logs[name]} == {"default"}, name

    os.kill(d.child("worker:default:0").pid, signal.SIGKILL)  # the group restarts on the standbys
    wait_for(lambda: d.child("worker:default:0").pid == warm["worker:default:0"].pid
             and d.child("engine_core:default").state == "ready", 300, interval=0.5,
             what="the group back on its standbys", diagnose=lambda: str(d.status().children))
    rid = complete(d, "import ")
    assert access_line(d, rid)["status"] == 200
    logs = all_logs(d)  # every line still JSON
    for member, name in (("engine_core:default", "engine_core-default.log"),
                         ("worker:default:0", "worker-default-0.log")):
        pid = warm[member].pid
        # The former standby's lines in the role's log carry the role's name, vLLM's among them.
        mine = [o for o in logs[name] if o["pid"] == pid]
        assert mine and {o["component"] for o in mine} == {member}, name
        assert any(o["logger"].startswith("vllm") for o in mine), name
