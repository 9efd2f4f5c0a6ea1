"""What a peer or a fault can make the manager keep or do, bounded (issue 39): audited arguments
cut, audit and component logs that survive a failing disk and rotate, log modes the umask does not
decide, child-only control messages accepted only from that child (no daemon, no vLLM)."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace

import pytest
import zmq.asyncio

from manager.audit import MAX_ITEMS, AuditLog, Peer, audit_line, audit_record, bounded
from manager.control import FROM_CHILDREN, Caller, ControlServer
from manager.logs import LogSink
from servectl.paths import open_append
from servectl.wire import control as P

pytestmark = pytest.mark.unit


# ---- audited arguments ------------------------------------------------------------------------

def test_a_huge_argument_is_its_start_and_its_length():
    record = audit_record(0.0, Peer(0, 0, 1), P.UnloadModel(name="x" * (30 << 20)), "denied", "control-ro")
    line = audit_line(record)
    assert len(line) < 2048 and f"({30 << 20} characters)" in line


def test_long_lists_and_dicts_are_cut_and_say_how_long_they_were():
    cut = bounded({"a": list(range(1000)), **{f"k{i}": i for i in range(200)}})
    assert cut["a"][:3] == [0, 1, 2] and cut["a"][-1] == "…(1000 items)" and len(cut["a"]) == MAX_ITEMS + 1
    assert cut["…"] == "(201 keys)" and len(cut) == MAX_ITEMS + 1
    assert bounded({"n": 5, "s": "short", "none": None}) == {"n": 5, "s": "short", "none": None}


def test_an_audit_line_is_one_line_whatever_the_argument_holds():
    line = audit_line(audit_record(0.0, Peer(0, 0, 1), P.UnloadModel(name='m\n{"forged": 1}\r'), "denied"))
    assert line.count("\n") == 1 and line.endswith("\n")


# ---- a failing disk ------------------------------------------------------------------------------

def test_an_audit_write_that_fails_is_counted_not_raised(tmp_path):
    audit = AuditLog(tmp_path / "gone" / "audit.log")
    audit.write(audit_record(0.0, Peer(0, 0, 1), P.StopRequest(), "accepted"))
    audit.write(audit_record(0.0, Peer(0, 0, 1), P.StopRequest(), "accepted"))
    assert audit.failures == 2


def test_the_audit_log_rotates_past_its_cap(tmp_path):
    audit = AuditLog(tmp_path / "audit.log", rotate_bytes=1000)
    for i in range(30):
        audit.write(audit_record(float(i), Peer(0, 0, 1), P.UnloadModel(name=f"m{i}"), "accepted"))
    assert (tmp_path / "audit.log.1").exists()
    assert (tmp_path / "audit.log").stat().st_size <= 1000
    assert '"m29"' in (tmp_path / "audit.log").read_text()


def test_a_component_log_on_a_failing_disk_keeps_its_lines_and_recovers(tmp_path):
    sink = LogSink("engine_core:m", tmp_path / "logs" / "engine_core-m.log")
    sink.write(b"one\ntwo\n")  # the directory does not exist: the write fails
    assert sink.write_errors == 1 and sink.tail(2) == ["one", "two"]
    (tmp_path / "logs").mkdir()
    sink.write(b"three\n")
    assert (tmp_path / "logs" / "engine_core-m.log").read_text() == "three\n"
    sink.close()


def test_log_files_are_group_readable_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        os.close(open_append(tmp_path / "x.log"))
        AuditLog(tmp_path / "audit.log").write(audit_record(0.0, Peer(0, 0, 1), P.StopRequest(), "accepted"))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.log").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "audit.log").stat().st_mode) == 0o640


# ---- child-only messages ---------------------------------------------------------------------------

ENGINE_PID, GATEWAY_PID, OTHER_PID = 1001, 2002, 3003


@pytest.fixture
def server(tmp_path):
    group = SimpleNamespace(engine=SimpleNamespace(pid=ENGINE_PID))
    manager = SimpleNamespace(state_dir=tmp_path, groups={"m": group},
                              gateways=SimpleNamespace(pids=lambda: {GATEWAY_PID}))
    ctx = zmq.asyncio.Context()
    srv = ControlServer(manager, ctx)
    yield srv
    ctx.destroy(linger=0)


def caller(pid: int | None, via: str = "control") -> Caller:
    return Caller(None, b"x", Peer(os.geteuid(), os.getegid(), pid), via)


GATEWAY_REPORTS = [P.GroupHung(model="m", incarnation="i"), P.WakeModel(model="m"),
                   P.KeysApplied(component="gateway:0", pid=GATEWAY_PID)]
ENGINE_REPORTS = [P.GroupFrozen(model="m", frozen=True), P.GroupDrained(model="m", incarnation="i"),
                  P.GroupIdle(model="m", incarnation="i", idle_s=1.0),
                  P.GroupReleased(model="m", incarnation="i", released=True),
                  P.EngineFailed(model="m", incarnation="i", reason="r"),
                  P.StepDeadlineChanged(model="m", incarnation="i", seconds=5.0)]


@pytest.mark.parametrize("msg", GATEWAY_REPORTS, ids=lambda m: type(m).__name__)
def test_a_gateways_report_is_taken_only_from_a_gateway(server, msg):
    assert server.refusal(caller(GATEWAY_PID), msg) is None
    for pid in (OTHER_PID, ENGINE_PID, None):
        why = server.refusal(caller(pid), msg)
        assert why is not None and "only from the child process" in why


@pytest.mark.parametrize("msg", ENGINE_REPORTS, ids=lambda m: type(m).__name__)
def test_an_engines_report_is_taken_only_from_that_models_engine(server, msg):
    assert server.refusal(caller(ENGINE_PID), msg) is None
    for pid in (OTHER_PID, GATEWAY_PID):
        assert server.refusal(caller(pid), msg) is not None
    other_model = type(msg)(**{**{f: getattr(msg, f) for f in msg.__struct_fields__}, "model": "nope"})
    assert server.refusal(caller(ENGINE_PID), other_model) is not None


def test_a_readiness_is_taken_only_from_the_process_it_names(server):
    ok_engine = P.ChildReady(component="engine_core:m", pid=ENGINE_PID, incarnation="i")
    ok_gateway = P.ChildReady(component="gateway:0", pid=GATEWAY_PID)
    assert server.refusal(caller(ENGINE_PID), ok_engine) is None
    assert server.refusal(caller(GATEWAY_PID), ok_gateway) is None
    assert server.refusal(caller(OTHER_PID), P.ChildReady(component="engine_core:m", pid=OTHER_PID)) is not None
    assert server.refusal(caller(OTHER_PID), P.ChildReady(component="engine_core:m", pid=ENGINE_PID)) is not None
    assert server.refusal(caller(GATEWAY_PID), P.ChildReady(component="engine_core:m", pid=GATEWAY_PID)) is not None


def test_the_owners_commands_are_not_child_only(server):
    for msg in (P.StatusRequest(), P.RestartRequest(model="m"), P.UnloadModel(name="m"), P.ReloadRequest()):
        assert not isinstance(msg, FROM_CHILDREN)
        assert server.refusal(caller(OTHER_PID), msg) is None


def test_every_control_message_is_either_a_childs_or_an_owners():
    from manager.audit import CHANGING, READ_ONLY

    children_or_owner = {*FROM_CHILDREN, *CHANGING, *READ_ONLY}
    assert set(P.ControlIn.__args__) <= children_or_owner | {P.StopRequest}, \
        set(P.ControlIn.__args__) - children_or_owner


def test_the_managers_own_log_rotates_and_its_descriptors_follow(tmp_path):
    import logging

    from manager.logs import OwnLogRotation

    path = tmp_path / "manager.log"
    fd = open_append(path)  # stands for the stderr the CLI gave the manager
    handler = OwnLogRotation(path, rotate_bytes=100, fds=(fd,))
    try:
        os.write(fd, b"x" * 150)
        handler.emit(logging.makeLogRecord({"msg": "m"}))
        os.write(fd, b"after\n")
        assert (tmp_path / "manager.log.1").read_bytes() == b"x" * 150
        assert path.read_bytes() == b"after\n"
        handler.emit(logging.makeLogRecord({"msg": "m"}))  # under the cap: nothing moves
        assert path.read_bytes() == b"after\n"
    finally:
        os.close(fd)


def test_the_manager_rotates_only_a_file_it_writes_to(tmp_path):
    import logging

    from manager.logs import OwnLogRotation

    path = tmp_path / "manager.log"
    path.write_bytes(b"y" * 500)
    r, w = os.pipe()  # a terminal or a pipe: nothing to rotate
    try:
        OwnLogRotation(path, rotate_bytes=100, fds=(w,)).emit(logging.makeLogRecord({"msg": "m"}))
    finally:
        os.close(r)
        os.close(w)
    assert not (tmp_path / "manager.log.1").exists()


# ---- what one message may do to the control loop -------------------------------------------------

class Replies:
    def __init__(self):
        self.sent = []

    def send_multipart(self, frames, flags=0):
        self.sent.append(P.control_out_decoder.decode(frames[-1]))


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"k": value}
    return value


@pytest.mark.parametrize("depth", [600, 1200, 5000])
@pytest.mark.parametrize("via", ["control", "control-ro"])
def test_a_deeply_nested_message_is_refused_and_the_loop_goes_on(server, depth, via):
    import msgspec

    # msgpack by hand: msgspec will not encode what deep (a peer's bytes need no encoder)
    args = b"\x81\xa1k" * depth + b"\x80"
    body = (b"\x82\xa4type\xa4load\xa5model\x83\xa4name\xa2m2\xa5model\xa2/m\xabengine_args" + args)
    assert msgspec.msgpack.decode(b"\x81\xa1k" * 3 + b"\x80") == nested(3)
    sock = Replies()
    caller = Caller(sock, b"x", Peer(os.geteuid(), os.getegid(), OTHER_PID), via)
    try:
        server.take(caller, body)
    except Exception as exc:  # the loop catches anything; take itself should answer
        pytest.fail(f"take raised {type(exc).__name__}")
    assert sock.sent and all(isinstance(r, P.Ack) and not r.ok for r in sock.sent), sock.sent


def test_a_chained_component_name_cannot_end_the_loop(server):
    sock = Replies()
    caller = Caller(sock, b"x", Peer(os.geteuid(), os.getegid(), OTHER_PID), "control")
    msg = P.ChildReady(component="standby:" * 5000 + "engine_core:m", pid=OTHER_PID)
    server.take(caller, P.encoder.encode(msg))
    assert len(sock.sent) == 1 and not sock.sent[0].ok


def test_audited_arguments_say_where_they_are_nested_too_deep():
    from manager.audit import MAX_DEPTH

    cut = bounded(nested(5000))
    depth = 0
    while isinstance(cut, dict):
        cut, depth = cut["k"], depth + 1
    assert depth == MAX_DEPTH and "nested deeper" in cut


def test_an_audit_rotation_whose_reopen_fails_closes_nothing_twice(tmp_path, monkeypatch):
    import errno

    import manager.audit as A

    audit = AuditLog(tmp_path / "audit.log", rotate_bytes=10)
    (tmp_path / "audit.log").write_text("x" * 100)
    real, calls = A.open_append, []

    def failing_second(path, *a):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *a)

    monkeypatch.setattr(A, "open_append", failing_second)
    closed = []
    real_close = os.close
    monkeypatch.setattr(A.os, "close", lambda fd: (closed.append(fd), real_close(fd)))
    audit.write(audit_record(0.0, Peer(0, 0, 1), P.StopRequest(), "accepted"))  # must not raise
    assert audit.failures == 1 and len(closed) == len(set(closed)) == 1
