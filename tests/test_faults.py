"""Faults and attacks on a real daemon that must change nothing (issue 39): a same-uid process
faking a child's report, an oversized message on the read-only socket. The shared daemon: each
attack is refused, so it keeps serving for the tests after these."""

from __future__ import annotations

import json

import zmq

from conftest import http, wait_for
from servectl.client import ControlClient
from servectl.paths import RuntimePaths
from servectl.wire import control as P


def audit_lines(d) -> list[dict]:
    """Accepted commands and refusals (these in a file of their own: issue 53)."""
    paths = (d.runtime_dir / "state" / "audit.log", d.runtime_dir / "state" / "audit-denied.log")
    return [json.loads(line) for path in paths if path.exists() for line in path.read_text().splitlines()]


def test_a_fake_hang_report_from_a_process_of_the_owner_is_refused_and_audited(daemon):
    engine = daemon.child("engine_core:default").pid
    st = daemon.status()
    incarnation = next(m.incarnation for m in st.models if m.name == "default")
    client = ControlClient(daemon.runtime_dir)
    for msg in (P.GroupHung(model="default", incarnation=incarnation),
                P.ChildReady(component="gateway:0", pid=daemon.child("gateway:0").pid),
                P.GroupReleased(model="default", incarnation=incarnation, released=True)):
        reply = client.request(msg)
        assert isinstance(reply, P.Ack) and not reply.ok and "only from the child process" in reply.message, reply
    assert daemon.child("engine_core:default").pid == engine  # not killed, not released
    denied = [r for r in audit_lines(daemon) if r["outcome"] == "denied"]
    assert {"group_hung", "child_ready", "group_released"} <= {r["command"] for r in denied}, denied
    r = http(daemon, "POST", "/v1/completions", {"model": "default", "prompt": "def ", "max_tokens": 2})
    assert r.status == 200, r.text


def test_an_oversized_message_is_dropped_before_the_manager_holds_it(daemon):
    audit = daemon.runtime_dir / "state" / "audit.log"
    manager_log = daemon.runtime_dir / "state" / "logs" / "manager.log"
    sizes = [p.stat().st_size if p.exists() else 0 for p in (audit, manager_log)]
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(RuntimePaths.ipc(RuntimePaths(daemon.runtime_dir).control_ro))
        for _ in range(3):
            sock.send(P.encoder.encode(P.UnloadModel(name="x" * (30 << 20))))
        assert sock.poll(2000) == 0  # no answer: the connection was closed at the size
    finally:
        sock.close()
    wait_for(lambda: ControlClient(daemon.runtime_dir).status(), 30, what="the manager answering")
    grown = [(p.stat().st_size if p.exists() else 0) - s for p, s in zip((audit, manager_log), sizes)]
    assert all(g < 64 * 1024 for g in grown), grown


def test_an_undecodable_frame_cannot_forge_a_line_in_the_managers_log(daemon):
    import msgspec

    manager_log = daemon.runtime_dir / "state" / "logs" / "manager.log"
    forged = "x\n2026-12-01 00:00:00,000 manager ERROR FORGED-LINE the engine was killed by root"
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(RuntimePaths.ipc(RuntimePaths(daemon.runtime_dir).control_ro))
        sock.send(msgspec.msgpack.encode({"type": forged}))
        assert sock.poll(10000)  # refused with an answer (a bad request)
        reply = P.control_out_decoder.decode(sock.recv())
        assert isinstance(reply, P.Ack) and not reply.ok
    finally:
        sock.close()
    lines = manager_log.read_text(errors="replace").splitlines()
    assert any("rejected control frame" in line and "FORGED-LINE" in line for line in lines)
    assert not any(line.startswith("2026-12-01 00:00:00,000 manager ERROR FORGED-LINE") for line in lines)
