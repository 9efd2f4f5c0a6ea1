"""JSON logs under systemd: each object's fields as the journal's own, by its native protocol.

With ``[manager] log_format = "json"`` and the manager under systemd (``$JOURNAL_STREAM``), every
line of every process (the children's, read by the manager from their pipes, and the manager's
own records) is sent to journald's socket as one entry whose fields are the object's: ``MESSAGE``,
``PRIORITY`` (from ``level``), ``SYSLOG_IDENTIFIER=servectl``, ``REQUEST_ID``, ``TRACE_ID``,
``SPAN_ID``, and every other key as ``SERVECTL_<KEY>`` (``SERVECTL_COMPONENT``,
``SERVECTL_MODEL``, ``SERVECTL_LOGGER``, ``SERVECTL_PID``, the access log's ``SERVECTL_STATUS``,
...), so ``journalctl SERVECTL_MODEL=chat TRACE_ID=...`` finds them. An entry journald cannot take
(no socket, past its size) goes to stderr as text, as before.
(https://systemd.io/JOURNAL_NATIVE_PROTOCOL/: ``KEY=value`` lines, a value with a newline as the
key, a newline, its length as 64-bit little-endian and the bytes.)
"""

from __future__ import annotations

import json
import logging
import re
import socket
import struct
import sys

SOCKET = "/run/systemd/journal/socket"
PRIORITY = {"CRITICAL": "2", "ERROR": "3", "WARNING": "4", "INFO": "6", "DEBUG": "7"}
NAMED = {"message": "MESSAGE", "request_id": "REQUEST_ID", "trace_id": "TRACE_ID", "span_id": "SPAN_ID"}
SKIPPED = {"level"}  # the journal's PRIORITY says it
_NOT_NAME = re.compile(r"[^A-Z0-9_]")


def field_name(key: str) -> str:
    """A journal field's name for a JSON key: upper case, [A-Z0-9_], prefixed, at most 64."""
    return NAMED.get(key) or ("SERVECTL_" + _NOT_NAME.sub("_", key.upper()))[:64]


def fields(obj: dict) -> list[tuple[str, str]]:
    out = [("SYSLOG_IDENTIFIER", "servectl"), ("PRIORITY", PRIORITY.get(str(obj.get("level")), "6"))]
    for key, value in obj.items():
        if key in SKIPPED or value is None:
            continue
        out.append((field_name(key), value if isinstance(value, str) else json.dumps(value, default=str)))
    return out


def encode(entry: list[tuple[str, str]]) -> bytes:
    parts = []
    for name, value in entry:
        raw = value.encode("utf-8", "replace")
        if b"\n" in raw:
            parts.append(name.encode() + b"\n" + struct.pack("<Q", len(raw)) + raw + b"\n")
        else:
            parts.append(name.encode() + b"=" + raw + b"\n")
    return b"".join(parts)


class Journal:
    """journald's native socket; ``send`` is False where the entry did not go (then: text)."""

    def __init__(self, path: str = SOCKET):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 * 2**20)  # a traceback fits
        except OSError:
            pass

    def send(self, obj: dict) -> bool:
        try:
            self.sock.sendto(encode(fields(obj)), self.path)
            return True
        except OSError:  # no journald there, or an entry past what a datagram takes
            return False

    def send_line(self, line: str) -> bool:
        """One JSON log line (an object) as an entry; False for anything else or a failed send."""
        try:
            obj = json.loads(line)
        except ValueError:
            return False
        return isinstance(obj, dict) and self.send(obj)


class JournalHandler(logging.Handler):
    """The manager's own records, formatted as JSON (servectl/logjson.py), as journal entries."""

    def __init__(self, journal: Journal, formatter: logging.Formatter):
        super().__init__()
        self.journal = journal
        self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            if not self.journal.send_line(line):
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging never raises into its caller
            self.handleError(record)


_shared: Journal | None = None


def shared() -> Journal:
    """The process's one socket to journald (every LogSink's and the manager's own records')."""
    global _shared
    if _shared is None:
        _shared = Journal()
    return _shared


def journal_own_records() -> Journal:
    """The manager's root handler (JSON to stderr, servectl/proc.py) replaced by one to the journal."""
    journal = shared()
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.StreamHandler) and handler.formatter is not None:
            root.removeHandler(handler)
            root.addHandler(JournalHandler(journal, handler.formatter))
    return journal
