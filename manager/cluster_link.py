"""The authenticated TCP link between two hosts' managers (a member dials its head), so that
only hosts holding the cluster secret can make a manager run code or hear about its ranks.

Both ends prove the secret and the head checks the member's name against its address in the
cluster config; then each frame (4-byte length of MAC + payload, 32-byte MAC, msgpack) carries an
HMAC under the session key over direction, sequence number and payload, checked before decoding:
an altered, replayed, reordered or reflected frame closes the link and nothing forged is decoded.
No timers while idle: the kernel notices a dead peer (``tune_socket``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import hmac
import ipaddress
import os
import secrets
import stat
from typing import Union

import msgspec

from servectl.tcp import tune_socket  # noqa: F401 - used below, and by tests as this module's

from servectl.wire import cluster as wire

FRAME_MAX = 16 << 20  # bytes of one frame's payload
HANDSHAKE_TIMEOUT_S = 5.0
HANDSHAKE_MAX = 4096  # a handshake frame's payload: read before anyone is proven
SECRET_MIN = 16
_MAC_LEN = 32
_NO_MAC = bytes(_MAC_LEN)  # handshake frames: there is no key yet
# Before the handshake only these; a member refuses a head's wrong proof with Refused too (its log).
_head_handshake = msgspec.msgpack.Decoder(Union[wire.Join, wire.Proof, wire.Refused])
_member_handshake = msgspec.msgpack.Decoder(Union[wire.Challenge, wire.Refused])
_WRONG_SECRET = "wrong cluster secret"


class ClusterSecretError(Exception):
    """A secret file that cannot be used; str(exc) is one sentence for the operator."""


class Refusal(Exception):
    """The handshake refused; ``reason`` is for the operator and the audit log (never the secret)."""
    reason = property(lambda self: self.args[0])


class LinkClosed(Exception):
    """The peer went away, or sent a frame that failed its check; the link is unusable."""
    reason = property(lambda self: self.args[0])


def derive(secret: bytes, label: str, *parts: bytes | str) -> bytes:
    """HMAC-SHA256 over ``label`` and ``parts``, each length-prefixed: ("ab", "c") is not ("a", "bc")."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (label, *parts):
        data = part.encode() if isinstance(part, str) else bytes(part)
        mac.update(len(data).to_bytes(8, "big") + data)
    return mac.digest()


def read_secret(path: str | os.PathLike) -> bytes:
    """The cluster secret in ``path``, refused unless only this user could have written or read it."""
    path = os.fspath(path)
    bad = lambda what: ClusterSecretError(f"The cluster secret file {path} {what}.")  # noqa: E731
    try:
        # O_NOFOLLOW: a symlink could point anywhere; O_NONBLOCK: a FIFO must not hang the manager.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise bad("is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise bad("is not a regular file")
        if st.st_uid != os.geteuid():
            raise bad(f"is owned by uid {st.st_uid}, not by uid {os.geteuid()} that servectl runs as")
        if st.st_mode & 0o077:
            raise bad(f"is readable or writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
        secret = os.read(fd, 1 << 16).strip()
    finally:
        os.close(fd)
    if len(secret) < SECRET_MIN:
        raise bad(f"holds {len(secret)} bytes, and a cluster secret needs at least {SECRET_MIN} "
                  f"(e.g. `head -c 32 /dev/urandom | base64`)")
    return secret


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> tuple[bytes, bytes]:
    """(MAC, payload) of the next frame; the length is checked before the body is read."""
    try:
        n = int.from_bytes(await reader.readexactly(4), "big")
        if n < _MAC_LEN or n - _MAC_LEN > limit:
            raise LinkClosed(f"the peer sent a frame of {n} bytes (at most {limit} + {_MAC_LEN})")
        body = await reader.readexactly(n)
    except asyncio.IncompleteReadError:
        raise LinkClosed("the peer closed the link") from None
    except OSError as exc:  # reset, or ETIMEDOUT from keepalive / TCP_USER_TIMEOUT
        raise LinkClosed(f"the link failed ({exc.strerror or exc})") from None
    return body[:_MAC_LEN], body[_MAC_LEN:]


class Link:
    """One proven link: ``send`` and ``recv`` messages, each frame sealed with the session key."""

    def __init__(self, reader, writer, key: bytes, *, head: bool, peer_host: str, peer_addr: str):
        self.peer_host, self.peer_addr = peer_host, peer_addr  # its name as the cluster config spells it; its IP
        self._reader, self._writer, self._key = reader, writer, key
        self._out, self._in = (b"h", b"m") if head else (b"m", b"h")  # direction: who sent the frame
        self._decoder = wire.member_decoder if head else wire.head_decoder
        self._sent = self._received = 0  # sequence numbers, per direction, from 0
        self._closed: str | None = None

    def _mac(self, direction: bytes, seq: int, payload: bytes) -> bytes:
        return hmac.new(self._key, direction + seq.to_bytes(8, "big") + payload, hashlib.sha256).digest()

    def _seal(self, msg) -> bytes:
        payload = wire.encoder.encode(msg)
        if len(payload) > FRAME_MAX:
            raise ValueError(f"a {type(msg).__name__} of {len(payload)} bytes is over FRAME_MAX")
        self._sent += 1
        return (_MAC_LEN + len(payload)).to_bytes(4, "big") + self._mac(self._out, self._sent - 1, payload) + payload

    async def send(self, msg) -> None:
        if self._closed:
            raise LinkClosed(self._closed)
        # Sealed and written with no await between: concurrent senders keep seq order on the wire.
        self._writer.write(self._seal(msg))
        try:
            await self._writer.drain()
        except OSError as exc:
            self.close(f"the link failed ({exc.strerror or exc})")
            raise LinkClosed(self._closed) from None

    async def recv(self):
        """The next message. Cancelling it closes the link (a frame may be half read)."""
        if self._closed:
            raise LinkClosed(self._closed)
        try:
            mac, payload = await _read_frame(self._reader, FRAME_MAX)
            if not hmac.compare_digest(mac, self._mac(self._in, self._received, payload)):
                raise LinkClosed("a frame failed its MAC check (altered, replayed, reordered or not the peer's)")
            self._received += 1
            try:  # only now: the frame is the peer's, and the next in order
                return self._decoder.decode(payload)
            except msgspec.DecodeError as exc:  # ValidationError included
                raise LinkClosed(f"the peer sent a frame that does not decode ({exc})") from None
        except BaseException as exc:  # LinkClosed, or cancelled with a frame maybe half read: done either way
            self.close(getattr(exc, "reason", "recv was cancelled"))
            raise

    def close(self, reason: str = "the link was closed here") -> None:
        if self._closed is None:
            self._closed = reason
            self._writer.close()


async def _exchange(reader, writer, who: str, say=None, hear: msgspec.msgpack.Decoder | None = None):
    """One handshake step: say ``say``, then hear what ``hear`` decodes; in HANDSHAKE_TIMEOUT_S or Refusal."""
    async def step():
        if say is not None:
            payload = wire.encoder.encode(say)
            writer.write((_MAC_LEN + len(payload)).to_bytes(4, "big") + _NO_MAC + payload)
            await writer.drain()
        if hear is not None:
            mac, payload = await _read_frame(reader, HANDSHAKE_MAX)
            if mac != _NO_MAC:
                raise LinkClosed("a handshake frame carried a MAC")
            return hear.decode(payload)
    try:
        # event-proof: one bounded wait per handshake step; a peer that says nothing is refused.
        return await asyncio.wait_for(step(), HANDSHAKE_TIMEOUT_S)
    except TimeoutError:
        raise Refusal(f"{who} did not finish the handshake within {HANDSHAKE_TIMEOUT_S:g} s") from None
    except (LinkClosed, OSError, msgspec.DecodeError) as exc:
        raise Refusal(f"{who} failed the handshake: {getattr(exc, 'reason', exc)}") from None


def _same_ip(a: str, b: str) -> bool:
    """Whether two IP literals name one address (a dual-stack listener sees ::ffff:a.b.c.d)."""
    try:
        x, y = (ipaddress.ip_address(text) for text in (a, b))
        return (getattr(x, "ipv4_mapped", None) or x) == (getattr(y, "ipv4_mapped", None) or y)
    except ValueError:
        return False


async def dial(addr: str, port: int, secret: bytes, this_host: str, *, dead_after_s: float = 6.0,
               local_addr: str | None = None) -> Link:
    """The member's side: connect to the head at ``addr``:``port`` and prove both ends.
    Raises OSError (TimeoutError included) if no connection is made, Refusal if it is not proven.
    ``local_addr``: this host's configured address, the connection's source (the head checks
    it; a host with several addresses would otherwise pick one by its routes)."""
    reader, writer = await asyncio.wait_for(  # event-proof: a bounded connect, once per dial
        asyncio.open_connection(addr, port, local_addr=(local_addr, 0) if local_addr else None), HANDSHAKE_TIMEOUT_S)
    who = f"the head at {addr}"
    try:
        tune_socket(writer.get_extra_info("socket"), dead_after_s)
        m_nonce = secrets.token_bytes(32)
        msg = await _exchange(reader, writer, who, wire.Join(host=this_host, nonce=m_nonce), _member_handshake)
        if isinstance(msg, wire.Refused):
            raise Refusal("".join(c if c.isprintable() else "?" for c in msg.reason[:500]))
        if len(h_nonce := msg.nonce) != 32 or not hmac.compare_digest(
                msg.proof, derive(secret, "servectl-head", m_nonce, h_nonce, this_host)):
            # Prove nothing to a head that has not proven itself; tell it why, for its operator.
            await _exchange(reader, writer, who, wire.Refused(reason=_WRONG_SECRET))
            raise Refusal(f"{who} does not hold this cluster's secret")
        proof = derive(secret, "servectl-member", m_nonce, h_nonce, this_host)
        await _exchange(reader, writer, who, wire.Proof(proof=proof))
        key = derive(secret, "servectl-session", m_nonce, h_nonce, this_host)
        return Link(reader, writer, key, head=False, peer_host=addr, peer_addr=writer.get_extra_info("peername")[0])
    except BaseException:
        writer.close()
        raise


async def accept(reader, writer, secret: bytes, hosts: dict[str, str], *, dead_after_s: float = 6.0) -> Link:
    """The head's side, for a connection from ``asyncio.start_server``: check the member's name
    against its address in ``hosts`` (name -> IP literal), and prove both ends."""
    addr = who = str((writer.get_extra_info("peername") or ("an unknown address",))[0])

    async def refuse(reason: str, logged: str = ""):  # reason: said to the member too
        with contextlib.suppress(Refusal):  # if it does not hear why, ours to log all the same
            await _exchange(reader, writer, who, wire.Refused(reason=reason))
        raise Refusal(logged or f"{who}: {reason}")

    try:
        tune_socket(writer.get_extra_info("socket"), dead_after_s)
        join = await _exchange(reader, writer, who, hear=_head_handshake)
        if not isinstance(join, wire.Join) or len(join.nonce) != 32:
            await refuse("the first frame must be a join with a 32-byte nonce")
        host, said = join.host, repr(join.host[:64])  # what an unproven peer claims, quoted for the log
        if join.protocol != wire.CLUSTER_PROTOCOL:
            await refuse(f"{said} speaks cluster protocol {join.protocol}, this head {wire.CLUSTER_PROTOCOL}")
        if host not in hosts:
            await refuse(f"host {said} is not in the head's cluster config")
        if not _same_ip(hosts[host], addr):  # the unproven member is not told which address the config holds
            await refuse(f"{addr} is not {host}'s address in the head's cluster config",
                         f"{addr} says it is {host}, whose address in the cluster config is {hosts[host]!r}")
        who = f"{host} ({addr})"
        m_nonce, h_nonce = join.nonce, secrets.token_bytes(32)
        proof = derive(secret, "servectl-head", m_nonce, h_nonce, host)
        msg = await _exchange(reader, writer, who, wire.Challenge(nonce=h_nonce, proof=proof), _head_handshake)
        if isinstance(msg, wire.Refused) and msg.reason == _WRONG_SECRET:
            raise Refusal(f"{who}: {_WRONG_SECRET}")  # the member found our proof wrong
        if not isinstance(msg, wire.Proof) or not hmac.compare_digest(
                msg.proof, derive(secret, "servectl-member", m_nonce, h_nonce, host)):
            await refuse(_WRONG_SECRET)
        key = derive(secret, "servectl-session", m_nonce, h_nonce, host)
        return Link(reader, writer, key, head=True, peer_host=host, peer_addr=addr)
    except BaseException:
        writer.close()
        raise
