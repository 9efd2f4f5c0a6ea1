"""Security issue 53, item 2, on a real daemon: the engine thread stops answering (SIGSTOP of
the engine process, as a request whose rendering never ends would hold it), the gateway finds it
hung and the manager kills it. A request sent to it that had produced nothing is refused with an
error naming why and is never sent to the next engine (it may be what hung it); a stream whose
output had begun goes on there, whole and without an error."""

from __future__ import annotations

import json
import os
import signal
from http.client import HTTPConnection

from conftest import http, json_lines, wait_for

CONFIG = ("[gateway]\noutput_timeout_s = 3\nhold_timeout_s = 120\n"
          "[manager]\nwarm_standby = false\nfreeze_grace_s = 0\nbackoff_initial_s = 0.3\n")


def test_a_request_in_an_engine_killed_as_hung_is_not_sent_again_and_streams_go_on(daemon_factory):
    d = daemon_factory(CONFIG)
    engine = d.child("engine_core:default").pid
    conn = HTTPConnection("127.0.0.1", d.port, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps({"model": "default", "prompt": "def ", "max_tokens": 400,
                                                        "ignore_eos": True, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = resp.readline()
    assert resp.status == 200 and first.startswith(b"data: {"), first
    os.kill(engine, signal.SIGSTOP)  # the engine thread holds: nothing more comes out of it
    try:
        r = http(d, "POST", "/v1/completions", {"model": "default", "prompt": "import ", "max_tokens": 4},
                 timeout=180)
    finally:
        if os.path.exists(f"/proc/{engine}"):
            os.kill(engine, signal.SIGCONT)
    assert r.status == 503 and r.json()["error"]["code"] == "engine_hung", r.body[:400]
    assert "killed as hung" in r.json()["error"]["message"]
    body = (first + resp.read()).decode()
    conn.close()
    chunks = json_lines(body)
    assert not any("error" in c for c in chunks) and body.rstrip().endswith("data: [DONE]"), body[-400:]
    assert sum(1 for c in chunks if c.get("choices")) >= 100  # it went on on the new engine
    wait_for(lambda: d.child("engine_core:default").pid != engine, 60, what="a new engine")
    ok = http(d, "POST", "/v1/completions", {"model": "default", "prompt": "import ", "max_tokens": 4})
    assert ok.status == 200, ok.body[:300]
