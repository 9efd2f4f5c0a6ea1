"""The journal's native protocol without journald: field names, the encoding (a value with a
newline in its binary form), a log line sent as one datagram, and text when no journald answers."""

from __future__ import annotations

import json
import socket
import struct

import pytest

from manager.journal import Journal, encode, field_name, fields
from manager.logs import LogSink

pytestmark = pytest.mark.unit


def test_keys_become_journal_field_names():
    assert [field_name(k) for k in ("message", "request_id", "trace_id", "span_id", "component", "duration_ms",
                                    "weird-key.x")] == \
        ["MESSAGE", "REQUEST_ID", "TRACE_ID", "SPAN_ID", "SERVECTL_COMPONENT", "SERVECTL_DURATION_MS",
         "SERVECTL_WEIRD_KEY_X"]
    assert len(field_name("k" * 100)) == 64


def test_an_object_becomes_fields_with_its_priority():
    got = dict(fields({"time": "2026-12-04T05:01:02.345Z", "level": "ERROR", "component": "gateway:0",
                       "model": None, "message": "boom", "status": 503, "pid": 7}))
    assert got == {"SYSLOG_IDENTIFIER": "servectl", "PRIORITY": "3", "SERVECTL_TIME": "2026-12-04T05:01:02.345Z",
                   "SERVECTL_COMPONENT": "gateway:0", "MESSAGE": "boom", "SERVECTL_STATUS": "503", "SERVECTL_PID": "7"}


def test_a_value_with_a_newline_is_sent_in_the_binary_form():
    raw = encode([("MESSAGE", "one\ntwo"), ("SERVECTL_MODEL", "chat")])
    assert raw == b"MESSAGE\n" + struct.pack("<Q", 7) + b"one\ntwo\n" + b"SERVECTL_MODEL=chat\n"


@pytest.fixture
def fake_journald(tmp_path):
    """A datagram socket where journald's would be (a test double for the socket only)."""
    path = str(tmp_path / "socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    yield path, sock
    sock.close()


def test_a_log_line_is_one_entry(fake_journald):
    path, sock = fake_journald
    line = json.dumps({"level": "INFO", "component": "engine_core:chat", "message": "ready", "exc": "a\nb"})
    assert Journal(path).send_line(line)
    got = sock.recv(65536)
    assert got.startswith(b"SYSLOG_IDENTIFIER=servectl\nPRIORITY=6\nSERVECTL_COMPONENT=engine_core:chat\n")
    assert b"SERVECTL_EXC\n" + struct.pack("<Q", 3) + b"a\nb\n" in got
    assert not Journal(path).send_line("not json") and not Journal(path).send_line("[1]")


def test_a_sink_under_systemd_sends_objects_and_writes_what_did_not_go(tmp_path, fake_journald, monkeypatch, capsys):
    import manager.journal as J

    path, sock = fake_journald
    monkeypatch.setattr(J, "_shared", Journal(path))
    sink = LogSink("gateway:0", tmp_path / "gateway-0.log", journal=True, json_lines=True)
    sink.write(b'{"level": "INFO", "component": "gateway:0", "message": "hello"}\na progress bar\n')
    first, second = sock.recv(65536), sock.recv(65536)
    assert b"MESSAGE=hello\n" in first
    assert b"MESSAGE=a progress bar\n" in second and b"SERVECTL_LOGGER=output\n" in second  # wrapped, then sent
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(J, "_shared", Journal(str(tmp_path / "nobody")))  # no journald: text, prefixed
    sink.write(b'{"message": "still here"}\n')
    assert capsys.readouterr().err == 'gateway:0: {"message": "still here"}\n'
    assert not (tmp_path / "gateway-0.log").exists()
