"""Signed pickles: the one hop in servectl that unpickles anything.

Every frame is ``[mac, payload]`` with ``mac = HMAC-SHA256(key, payload)``, the
key generated per engine group by the manager and handed over through an
inherited pipe (never argv or the environment). The signature is checked
before a byte is unpickled (as Jupyter's wire protocol does).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
from typing import Any

KEY_BYTES = 32


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
        self._key = key
        self.rejected = 0

    def mac(self, payload: bytes | memoryview) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()

    def dumps(self, obj: Any) -> list[bytes]:
        payload = pickle.dumps(obj, protocol=5)
        return [self.mac(payload), payload]

    def loads(self, frames: list[bytes]) -> Any:
        """Verify then unpickle; a bad frame raises BadSignature and is counted."""
        if len(frames) != 2:
            self.rejected += 1
            raise BadSignature(f"expected 2 frames, got {len(frames)}")
        mac, payload = frames
        if not hmac.compare_digest(mac, self.mac(payload)):
            self.rejected += 1
            raise BadSignature("HMAC mismatch")
        return pickle.loads(payload)
