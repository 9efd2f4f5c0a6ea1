"""JSON logs under systemd reach the journal as fields (issue 56, item 2), with a real journald.

journald runs in a mount namespace of its own (a tmpfs over /run: the host's /run is untouched) and
the daemon is started inside it with ``JOURNAL_STREAM`` set, as systemd starts the unit; its
runtime directory is outside /run, so the test's client and CLI reach it as usual. ``journalctl -o
json`` in that namespace then shows every component's lines as entries whose fields are the JSON
object's: the access line with REQUEST_ID and the access fields, vLLM's own loggers in the engine,
the manager's own records.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import SERVECTL, http, wait_for

# Debian's systemd package (python -m servectl.doctor --tests installs it) and util-linux.
JOURNALD = next((p for p in ("/lib/systemd/systemd-journald", "/usr/lib/systemd/systemd-journald")
                 if Path(p).exists()), "systemd-journald: not installed")


@pytest.fixture
def journald():
    """journald alone in a new mount namespace; yields the command prefix that enters it."""
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             "mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/journal /run/log/journal && "
                             f"exec {JOURNALD}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    enter = ["nsenter", "-t", str(proc.pid), "-m", "--"]
    try:
        wait_for(lambda: subprocess.run([*enter, "test", "-S", "/run/systemd/journal/socket"]).returncode == 0,
                 30, what="journald's socket")
        yield enter
    finally:
        proc.terminate()
        proc.wait(10)


def entries(enter: list[str]) -> list[dict]:
    out = subprocess.run([*enter, "journalctl", "-o", "json", "--no-pager", "SYSLOG_IDENTIFIER=servectl"],
                         capture_output=True, text=True, timeout=60)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_json_logs_reach_the_journal_as_its_own_fields(journald, daemon_factory):
    # (journald first: it outlives the daemon, whose stop enters its namespace)
    d = daemon_factory('[manager]\nlog_format = "json"\nwarm_standby = false\n', command=[*journald, *SERVECTL],
                       env={"JOURNAL_STREAM": "8:1234"})
    r = http(d, "POST", "/v1/completions", {"model": "default", "prompt": "def ", "max_tokens": 4,
                                             "ignore_eos": True}, timeout=300)
    assert r.status == 200, r.body[:300]
    rid = r.headers["X-Request-Id"]

    def access():
        return next((e for e in entries(journald) if e.get("REQUEST_ID") == rid
                     and e.get("SERVECTL_LOGGER") == "api_gateway.access"), None)

    line = wait_for(access, 30, what="the access entry in the journal")
    assert (line["SERVECTL_COMPONENT"], line["SERVECTL_MODEL"], line["SERVECTL_METHOD"], line["SERVECTL_PATH"],
            line["SERVECTL_STATUS"], line["SERVECTL_COMPLETION_TOKENS"]) == \
        ("gateway:0", "default", "POST", "/v1/completions", "200", "4")
    assert line["PRIORITY"] == "6" and line["MESSAGE"].startswith("POST /v1/completions 200")
    assert line["SERVECTL_PID"] == str(d.child("gateway:0").pid)
    assert line["_TRANSPORT"] == "journal"  # the native protocol, not a stream's text line
    everything = entries(journald)
    components = {e.get("SERVECTL_COMPONENT") for e in everything}
    assert {"manager", "gateway:0", "engine_core:default", "worker:default:0"} <= components, components
    assert any(e.get("SERVECTL_LOGGER", "").startswith("vllm") and e["SERVECTL_COMPONENT"] == "engine_core:default"
               for e in everything), "no entry from vLLM's own loggers in the engine"
    assert any(e["SERVECTL_COMPONENT"] == "manager" and e.get("SERVECTL_LOGGER") == "manager" for e in everything)
