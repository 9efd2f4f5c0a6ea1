"""A gateway whose follow task keeps dying is replaced by the manager, and requests work
again (issue 39, item 2; the unit side is tests/test_task_owner_unit.py)."""

from __future__ import annotations

from conftest import ROOT, http, wait_for
from servectl.config import DEFAULT_MODEL_DIR

CONFIG = f"""
[gateway]
processes = 1

[manager]
backoff_initial_s = 0.3
backoff_max_s = 2

[[models]]
name = "m"
model = "{DEFAULT_MODEL_DIR}"
"""


def test_a_gateway_whose_follow_task_dies_is_replaced_and_serves_again(daemon_factory, tmp_path):
    count = tmp_path / "follow-fails"
    count.write_text("0")
    d = daemon_factory(CONFIG, env={"PYTHONPATH": str(ROOT / "tests" / "inject_follow"),
                                    "SERVECTL_TEST_FOLLOW_FAILS": str(count)})
    body = {"model": "m", "prompt": "x", "max_tokens": 2}
    assert http(d, "POST", "/v1/completions", body, timeout=120).status == 200
    before = d.child("gateway:0").pid
    # Its first failure and its three restarts' (each asks for a snapshot again): then it gives up.
    count.write_text("4")
    d.cli("restart", "m", check=True)  # model events: the follow task raises on the first
    wait_for(lambda: d.child("gateway:0").pid != before and d.child("gateway:0").state == "ready", 60,
             what="gateway 0 replaced", diagnose=lambda: f"count {count.read_text()}\n" + d.log_tails("gateway-0", "manager"))
    assert count.read_text() == "0"
    assert "69" in (d.child("gateway:0").last_exit or ""), d.child("gateway:0").last_exit
    assert "task 'follow the manager' died" in d.log("gateway-0")
    wait_for(lambda: http(d, "GET", "/health", timeout=10).status == 200, 120, what="m ready again")
    assert http(d, "POST", "/v1/completions", body, timeout=120).status == 200
