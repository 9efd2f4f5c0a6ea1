"""Children's output: read by the manager from a pipe, one sink per component.

The manager reads each child's stdout+stderr as it arrives (an event on the
pipe, no polling), keeps the last lines in memory for `servectl status`, and
writes them either to ``<state>/logs/<component>.log`` (size-capped: rotated
to ``.log.1`` past the cap) or, under systemd (``$JOURNAL_STREAM`` set), to
its own stderr prefixed with the component, where journald timestamps them.

With JSON logs (``[manager] log_format = "json"``) a line that is not a JSON object (a child's
output outside logging: a progress bar, a library's print) is wrapped into one
(servectl/logjson.py ``wrap_line``), so every line of a file is an object. Under systemd a line
is sent to journald as an entry of its own whose fields are the object's (manager/journal.py:
``journalctl SERVECTL_MODEL=chat REQUEST_ID=...``); one it cannot take goes as text, prefixed.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import deque
from pathlib import Path

from manager.journal import shared
from servectl.logjson import is_json_line, json_logs, wrap_line
from servectl.paths import open_append
from servectl.wire.spawn import model_of, parse_component

ROTATE_BYTES = 16 * 1024 * 1024
log = logging.getLogger("manager.logs")


def journal_mode() -> bool:
    return bool(os.environ.get("JOURNAL_STREAM"))


class LogSink:
    def __init__(self, component: str, path: Path, rotate_bytes: int = ROTATE_BYTES, journal: bool = False,
                 json_lines: bool | None = None):
        self.component = component
        self.json_lines = json_logs() if json_lines is None else json_lines
        parsed = parse_component(component)
        self.model = model_of(parsed.model) if parsed is not None and parsed.model else None  # for lines it wraps
        self.pid: int | None = None  # the child's, once spawned (for the lines it wraps)
        self.path = path
        self.rotate_bytes = rotate_bytes
        self.journal = journal
        self.lines: deque[str] = deque(maxlen=200)
        self.written = 0  # lines written since it was made (the status page follows by this count)
        self._partial = b""
        self._file = None
        self._size = 0
        self.write_errors = 0

    def _open(self) -> None:
        self._file = os.fdopen(open_append(self.path), "ab", buffering=0)  # never through a symlink
        self._size = self._file.tell()

    def write(self, data: bytes) -> None:
        data = self._partial + data
        *complete, self._partial = data.split(b"\n")
        if len(self._partial) > 65536:  # a line without end: flush it anyway
            complete.append(self._partial)
            self._partial = b""
        if not complete:
            return
        text = [line.decode("utf-8", "replace") for line in complete]
        if self.json_lines:
            wrapped = [line if is_json_line(line) else wrap_line(line, self.component, self.model, self.pid)
                       for line in text]
            if wrapped != text:
                text, complete = wrapped, [line.encode() for line in wrapped]
        self.lines.extend(text)
        self.written += len(text)
        if self.journal:
            if self.json_lines:  # each object as the journal's own fields; what did not go, as text
                native = shared()
                text = [line for line in text if not native.send_line(line)]
            sys.stderr.write("".join(f"{self.component}: {line}\n" for line in text))
            sys.stderr.flush()
            return
        blob = b"\n".join(complete) + b"\n"
        try:
            if self._file is None:
                self._open()
            if self._size + len(blob) > self.rotate_bytes:
                self._file.close()
                self._file = None
                os.replace(self.path, self.path.with_suffix(".log.1"))
                self._open()
            self._file.write(blob)
            self._size += len(blob)
        except OSError as exc:
            # A full disk or a lost directory: the lines stay in memory (`servectl status`), the
            # file is reopened with the next output, and the child's pipe is still drained.
            self.write_errors += 1
            if self.write_errors == 1 or self.write_errors % 1000 == 0:
                log.error("cannot write %s (%d write(s) lost so far): %s", self.path, self.write_errors, exc)
            if self._file is not None:
                try:
                    self._file.close()
                except OSError:
                    pass
                self._file = None

    def close(self) -> None:
        if self._partial:
            self.write(b"\n")
        if self._file is not None:
            self._file.close()
            self._file = None

    def tail(self, n: int) -> list[str]:
        return list(self.lines)[-n:]

    def since(self, after: int) -> list[str]:
        """The lines after the ``after``-th written (as many as are still kept)."""
        return list(self.lines)[-min(len(self.lines), max(0, self.written - after)):] if self.written > after else []


class OwnLogRotation(logging.Handler):
    """The manager's own log is its stdout and stderr, a file the CLI opened (``manager.log``).
    Past the cap it is renamed to ``manager.log.1`` and a fresh file takes those descriptors, so
    every later write (logging's, a library's, a traceback's) lands in the new one. Added after
    the stream handler, it runs once a record was written; nothing is checked but on a write."""

    def __init__(self, path: Path, rotate_bytes: int = ROTATE_BYTES, fds: tuple[int, ...] = (1, 2)):
        super().__init__()
        self.path = path
        self.rotate_bytes = rotate_bytes
        self.fds = fds

    def emit(self, record: logging.LogRecord) -> None:
        try:
            st = os.fstat(self.fds[-1])
            if st.st_size <= self.rotate_bytes:
                return
            on_disk = os.stat(self.path)
            if (on_disk.st_dev, on_disk.st_ino) != (st.st_dev, st.st_ino):
                return  # not writing to our log file (a terminal, a pipe, one rotated by someone else)
            os.replace(self.path, self.path.with_suffix(".log.1"))
            fd = open_append(self.path)
            try:
                for target in self.fds:
                    os.dup2(fd, target)
            finally:
                os.close(fd)
        except OSError:
            pass  # a full disk: the writes go on into the old file (LogSink counts the children's)


def rotate_own_log(path: Path) -> None:
    """Cap the manager's own log file (not under systemd, where the journal keeps it)."""
    if not journal_mode():
        logging.getLogger().addHandler(OwnLogRotation(path))
