"""Who asked the manager to change what, and when: the audit log.

Every command on the control plane that starts code or changes state (stop,
restart, reload, load, unload, freeze) is one JSON line in
``<state dir>/audit.log`` (and a line in the manager's own log, so the
journal has it too), written when the command arrives, whether it is carried
out or refused. Read-only commands (status, wait-settled) are not recorded.

Who: the peer's uid, user name and pid, which the kernel vouches for
(``SO_PEERCRED``, which libzmq reports as the ``Peer-Address`` of an ipc
connection: ``…:uid:gid:pid``); a reload by SIGHUP says so instead. A
command a gateway sends for an HTTP client (the management routes) also
names that client: the admin key's fingerprint and the client's address
(``via: "http"``); the gateway's refusals of such calls are recorded too. Model
``env`` values never reach the log (only their names): they may be tokens.

Refusals go to a file of their own, ``audit-denied.log`` (rotated on its own), so
a flood of them never rotates an accepted command's line away; and each peer's
are rate-limited (``RefusalLimiter``): past its burst they are counted, and the
count is said in its next refusal written, or before the next accepted line.
"""

from __future__ import annotations

import datetime
import logging
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

import msgspec

from servectl.paths import open_append
from servectl.wire import control as P

log = logging.getLogger("manager.audit")

# Messages that start code or change state: owner only, and audited.
CHANGING = (P.StopRequest, P.RestartRequest, P.ReloadRequest, P.LoadModel, P.LoadConfigured, P.UnloadModel,
            P.SetFreezing, P.LoadLora, P.UnloadLora)
# What a member of a group-shared runtime directory's group may ask (the read-only socket).
READ_ONLY = P.READ_ONLY
REDACTED = "<redacted>"
ROTATE_BYTES = 16 * 1024 * 1024  # as the components' logs (manager/logs.py)


@dataclass(frozen=True)
class Peer:
    """A control-socket client as the kernel saw it when it connected."""

    uid: int | None
    gid: int | None
    pid: int | None

    @property
    def user(self) -> str | None:
        if self.uid is None:
            return None
        try:
            return pwd.getpwuid(self.uid).pw_name
        except KeyError:
            return None


UNKNOWN = Peer(None, None, None)


def parse_peer_address(text: str | None) -> Peer:
    """libzmq's ``Peer-Address`` of an ipc connection (``[host]:uid:gid:pid``) as a Peer. Pure."""
    parts = (text or "").rsplit(":", 3)
    if len(parts) != 4:
        return UNKNOWN
    try:
        uid, gid, pid = (int(x) for x in parts[1:])
    except ValueError:
        return UNKNOWN
    return Peer(uid, gid, pid)


def command_name(msg: msgspec.Struct) -> str:
    return msg.__struct_config__.tag or type(msg).__name__


# What one audited argument may take of a line: a peer's 30 MiB string is its first
# characters and its length, a long list its first items and its count.
MAX_STRING = 512
MAX_ITEMS = 64


MAX_DEPTH = 8


def bounded(value, depth: int = 0):
    """``value`` with every string, list and dict cut to the bounds above (and nesting past
    ``MAX_DEPTH`` said, not written), saying what was cut. Pure."""
    if depth >= MAX_DEPTH and isinstance(value, (list, dict)):
        return f"…(nested deeper than {MAX_DEPTH})"
    if isinstance(value, str):
        return value if len(value) <= MAX_STRING else f"{value[:MAX_STRING]}…({len(value)} characters)"
    if isinstance(value, list):
        items = [bounded(v, depth + 1) for v in value[:MAX_ITEMS]]
        return items + [f"…({len(value)} items)"] if len(value) > MAX_ITEMS else items
    if isinstance(value, dict):
        out = {bounded(str(k)): bounded(v, depth + 1) for k, v in list(value.items())[:MAX_ITEMS]}
        if len(value) > MAX_ITEMS:
            out["…"] = f"({len(value)} keys)"
        return out
    return value


def command_args(msg: msgspec.Struct) -> dict:
    """A message's fields for the log, bounded; a model's env values become ``<redacted>``. Pure."""
    args = msgspec.to_builtins(msg)
    args.pop("type", None)
    args.pop("http", None)  # said as the record's who (audit_record)
    args.pop("wait_s", None)  # how long its caller waited: not what it changes
    model = args.get("model")
    if isinstance(model, dict) and isinstance(model.get("env"), dict):
        model["env"] = dict.fromkeys(model["env"], REDACTED)
    return bounded(args)


def audit_record(when: float, peer: Peer, msg: msgspec.Struct | str, outcome: str, via: str = "control") -> dict:
    """One audit entry. ``msg`` is a control message, or a word for what is not one ("SIGHUP reload"). Pure."""
    stamp = datetime.datetime.fromtimestamp(when, datetime.timezone.utc).isoformat(timespec="milliseconds")
    record = {"time": stamp, "uid": peer.uid, "user": peer.user, "pid": peer.pid, "via": via}
    if isinstance(msg, str):
        record["command"] = msg
        record["args"] = {}
    else:
        record["command"] = command_name(msg)
        record["args"] = command_args(msg)
        http = getattr(msg, "http", None)
        if isinstance(http, P.HttpCaller):
            # Sent by a gateway for an HTTP client: the peer above is that gateway's process.
            record.update(via="http", admin_key=http.key_id, client=http.address, gateway=http.gateway,
                          route=http.route)
    record["outcome"] = outcome
    return record


def audit_line(record: dict) -> str:
    return msgspec.json.encode(record).decode() + "\n"


class RefusalLimiter:
    """How many refusals of one peer are written one by one: ``per_s`` a second, bursts of
    ``burst``; the rest are counted and said later (the gateway's ``RefusalBudget``, per peer).
    At most ``max_peers`` are remembered (those with nothing owed are forgotten first). Pure
    (the caller gives the clock)."""

    def __init__(self, per_s: float = 1.0, burst: int = 20, max_peers: int = 1024):
        self.per_s = per_s
        self.burst = burst
        self.max_peers = max_peers
        self.peers: dict[object, list] = {}  # peer -> [tokens, at, suppressed]

    def take(self, peer, now: float) -> int | None:
        """None: do not write this one (it is counted). Else how many were not written before it."""
        state = self.peers.get(peer)
        if state is None:
            if len(self.peers) >= self.max_peers:
                self.forget(now)
            state = self.peers[peer] = [float(self.burst), now, 0]
        state[0] = min(self.burst, state[0] + (now - state[1]) * self.per_s)
        state[1] = now
        if state[0] < 1:
            state[2] += 1
            return None
        state[0] -= 1
        suppressed, state[2] = state[2], 0
        return suppressed

    def owed(self) -> list[tuple[object, int]]:
        """The peers with refusals not written, and how many; said once (counted from zero again)."""
        out = [(peer, state[2]) for peer, state in self.peers.items() if state[2]]
        for peer, _ in out:
            self.peers[peer][2] = 0
        return out

    def forget(self, now: float) -> None:
        full = [p for p, (tokens, at, owed) in self.peers.items()
                if not owed and tokens + (now - at) * self.per_s >= self.burst]
        for peer in full or list(self.peers)[: len(self.peers) // 2]:
            del self.peers[peer]


class AuditLog:
    """Appends audit lines to a file (0640 inside the state directory; never through a symlink),
    rotated to ``audit.log.1`` past ``rotate_bytes``; refusals to ``audit-denied.log`` beside it,
    rotated likewise, so they never rotate an accepted line away. A write that fails (a full
    disk) is counted and logged, never raised: the control loop that records a command must go
    on serving."""

    def __init__(self, path: Path, rotate_bytes: int = ROTATE_BYTES):
        self.path = path
        self.denied_path = path.with_name("audit-denied.log")
        self.rotate_bytes = rotate_bytes
        self.failures = 0  # lines that could not be written

    def write(self, record: dict) -> None:
        line = audit_line(record)
        log.info("audit: %s", line.rstrip())
        self.append(self.denied_path if record.get("outcome") == "denied" else self.path, line)

    def append(self, path: Path, line: str) -> None:
        try:
            fd = open_append(path)
        except OSError as exc:
            self.failed(exc)
            return
        data = line.encode()
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return
            if st.st_size + len(data) > self.rotate_bytes:
                os.replace(path, path.with_suffix(".log.1"))
                os.close(fd)
                fd = -1  # closed: never closed twice (the number may be another's by then)
                fd = open_append(path)
            os.write(fd, data)
        except OSError as exc:
            self.failed(exc)
        finally:
            if fd >= 0:
                os.close(fd)

    def failed(self, exc: OSError) -> None:
        self.failures += 1
        log.error("cannot write the audit log %s (%d line(s) lost so far): %s", self.path, self.failures, exc)
