"""Text an operator or a client reads: one line, no traceback, printed literally.

Pure functions (no I/O) shared by the CLI, the library, the manager and the
engine: the one-line form of an error, a log excerpt without its traceback
frames, and the sentence for a listening address that cannot be bound.
"""

from __future__ import annotations

import errno
import re

TRACEBACK_HEAD = "Traceback (most recent call last):"
# Python's chained-exception separators: the block after them is another traceback.
CHAIN_LINES = ("During handling of the above exception, another exception occurred:",
               "The above exception was the direct cause of the following exception:")
_PYDANTIC_HEAD = re.compile(r"^\d+ validation errors? for \S+$")
_LOG_PREFIX = re.compile(r"^(?:\d{4}-\d\d-\d\d [\d:,.]+ )?\S+ (?:ERROR|CRITICAL|WARNING|INFO) ")


def one_line(text: str, limit: int = 300) -> str:
    """The informative first line of an error message, whitespace collapsed, at most ``limit`` characters.

    A pydantic report ("1 validation error for ModelConfig" then the error
    indented below it) gives its first error; pydantic's "Value error, "
    prefix is dropped.
    """
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if not lines:
        return ""
    if _PYDANTIC_HEAD.match(lines[0]) and len(lines) > 1:
        first = lines[1]
        # "loc\n  message [type=...]": a field location line, then its message.
        if len(lines) > 2 and not first.startswith("Value error,") and "[type=" in lines[2]:
            first = f"{first}: {lines[2]}"
        lines = [first]
    line = re.sub(r"\s+", " ", lines[0]).removeprefix("Value error, ")
    line = re.sub(r"\s*\[type=[^\]]*\]", "", line)
    if len(line) > limit:
        line = line[: limit - 1].rstrip() + "…"
    return line


def without_tracebacks(lines: list[str]) -> list[str]:
    """Log lines with every traceback reduced to its last line (the exception itself),
    and no blank lines: what an operator reads of a failure; the frames stay in the log file."""
    out: list[str] = []
    in_traceback = True  # an excerpt may begin inside a traceback: indented lines before any other are frames
    for line in lines:
        stripped = line.strip()
        if not stripped or stripped in CHAIN_LINES:
            continue
        if stripped.endswith(TRACEBACK_HEAD) or (line[:1].isspace() and stripped.startswith('File "')):
            in_traceback = True
            continue
        if in_traceback:
            # Frames ("  File ...", their source lines, carets) are indented; the
            # exception line that ends a traceback is not.
            if line[:1].isspace():
                continue
            in_traceback = False
        out.append(line)
    return out


def last_error(lines: list[str]) -> str | None:
    """The last line that reads like an error (an exception line or an ERROR log line), one-lined."""
    for line in reversed(without_tracebacks(lines)):
        s = line.strip()
        if not s:
            continue
        body = _LOG_PREFIX.sub("", s)
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", body) or " ERROR " in f" {s} ":
            return one_line(body)
    return None


def bind_failure(host: str, port: int, exc: OSError | Exception, holder: str | None = None,
                 config_path: str | None = None) -> str:
    """One line for a listening address that cannot be bound: what, why, who, and the setting that changes it."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    in_file = f" in {config_path}" if config_path else ""
    code = getattr(exc, "errno", None)
    if code == errno.EADDRINUSE:
        by = f" by {holder}" if holder else ""
        return f"{where} is already in use{by}; choose another port with --port or gateway.port{in_file}"
    if code == errno.EACCES:
        return (f"{where}: permission denied (ports below 1024 need privileges); choose another port with "
                f"--port or gateway.port{in_file}")
    if code == errno.EADDRNOTAVAIL:
        return (f"{where}: {host} is not an address of this machine; choose another with --host or "
                f"gateway.host{in_file}")
    reason = getattr(exc, "strerror", None) or one_line(str(exc)) or type(exc).__name__
    reason = reason.split(" (while attempting")[0]  # socket.create_server's addition
    return f"cannot listen on {where}: {reason}; check --host/--port or gateway.host/gateway.port{in_file}"
