"""Signed pickles: the one hop in servectl that unpickles anything.

Every pickled frame is ``[mac, payload]`` with ``mac = HMAC-SHA256(key, payload)``, the
key generated per engine group by the manager and handed over through an
inherited pipe (never argv or the environment). The signature is checked
before a byte is unpickled (as Jupyter's wire protocol does). A step's reply
of sampled tokens only is not pickled and not signed (tokens_reply.py);
its frame carries an empty MAC, which ``loads`` refuses.

The MAC is RFC 2104's HMAC-SHA256, computed from the key's two padded SHA-256
states made once per ``Signer`` and copied per message, rather than with
``hmac.new`` per message: with OpenSSL 3, ``hmac.new`` sets up a new HMAC
context on every call, which on a decode step's path (code and caches cold
again by the next step) measured 64 µs for a 384-byte reply against 38 µs
for the two copies; two MACs per worker are on every step's path (the call's,
signed and checked; four when the reply is a signed pickle too). Same bytes
as ``hmac.new`` for any key (tests/test_signing_unit.py).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
from typing import Any

KEY_BYTES = 32
BLOCK = 64  # SHA-256's block size, HMAC's pad length


def read_key(fd: int) -> bytes:
    """Read the group key from the inherited pipe, then close it."""
    chunks = []
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    key = b"".join(chunks)
    if len(key) < KEY_BYTES:
        raise SystemExit(f"group key pipe gave {len(key)} bytes, need {KEY_BYTES}")
    return key


class BadSignature(Exception):
    pass


class Signer:
    def __init__(self, key: bytes):
        self.rejected = 0
        # RFC 2104: a key longer than SHA-256's block is hashed first, then zero-padded to the block.
        block = (key if len(key) <= BLOCK else hashlib.sha256(key).digest()).ljust(BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))  # never updated: only copied
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def mac(self, payload: bytes | memoryview) -> bytes:
        """HMAC-SHA256(key, payload)."""
        inner = self._inner.copy()
        inner.update(payload)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()

    def dumps(self, obj: Any) -> list[bytes]:
        payload = pickle.dumps(obj, protocol=5)
        return [self.mac(payload), payload]

    def loads(self, frames: list[bytes]) -> Any:
        """Verify then unpickle; a bad frame raises BadSignature and is counted."""
        if len(frames) != 2:
            self.rejected += 1
            raise BadSignature(f"expected 2 frames, got {len(frames)}")
        mac, payload = frames
        if not mac:  # an unsigned frame (worker_link.UNSIGNED): never unpickled
            self.rejected += 1
            raise BadSignature("an unsigned frame")
        if not hmac.compare_digest(mac, self.mac(payload)):
            self.rejected += 1
            raise BadSignature("HMAC mismatch")
        return pickle.loads(payload)
