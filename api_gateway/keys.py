"""Pure: which key a request carries and what it may do with it (API keys, admin keys).

An admin key is accepted wherever an API key is; only an admin key opens the
management routes (``/servectl/v1/``). Every configured key is compared in
constant time, whatever matched first. A key is named in logs and the audit
log only by its fingerprint.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from typing import NamedTuple

from servectl.config import NamedKey


class Access(enum.Enum):
    NONE = "none"  # no key, or one that is not configured
    API = "api"
    ADMIN = "admin"


def bearer_token(header: bytes) -> bytes:
    """The token of an ``Authorization: Bearer <token>`` header; the scheme is case-insensitive
    (RFC 9110 §11.1), so ``bearer`` works as clients send it. b"" when there is none."""
    scheme, _, token = header.partition(b" ")
    return token.strip(b" ") if scheme.lower() == b"bearer" else b""


def fingerprint(key: str | bytes) -> str:
    """A key's id for logs: the first 12 hex digits of its SHA-256 (never the key)."""
    raw = key.encode() if isinstance(key, str) else key
    return "sha256:" + hashlib.sha256(raw).hexdigest()[:12]


class RequestKey(NamedTuple):
    """The key a request came with: what it opens, the name its usage is counted under (a named
    key's name, an unnamed key's fingerprint, "(none)" when the API needs no key) and its settings."""

    access: Access
    label: str
    named: NamedKey | None = None


# The API needs no key (none configured): counted under a label no key's name can be.
OPEN = RequestKey(Access.API, "(none)")


class KeyRing:
    """The API keys, named keys and admin keys a gateway checks now (a reload replaces them in place)."""

    def __init__(self, api_keys: list[str], admin_keys: list[str], named: list[NamedKey] = ()):
        self.api = [k.encode() for k in api_keys]
        self.admin = [k.encode() for k in admin_keys]
        self.named = [(k.key.encode(), k) for k in named if k.key]

    @property
    def api_open(self) -> bool:
        """No API key configured: the API needs none (as `vllm serve` without --api-key)."""
        return not self.api and not self.named

    def identify(self, token: bytes) -> RequestKey | None:
        """Which key this token is (None: none configured). Every key is compared, in constant time each."""
        found = None
        for key, named in self.named:
            if hmac.compare_digest(token, key):
                found = named
        access = self.access(token)
        if not token:
            return None
        if found is not None:
            return RequestKey(Access.API, found.name, found)
        return RequestKey(access, fingerprint(token)) if access is not Access.NONE else None

    @property
    def admin_enabled(self) -> bool:
        return bool(self.admin)

    def access(self, token: bytes) -> Access:
        """What this token opens. Every key is compared, in constant time each."""
        api = admin = False
        for key in (*self.api, *(k for k, _ in self.named)):
            api |= hmac.compare_digest(token, key)
        for key in self.admin:
            admin |= hmac.compare_digest(token, key)
        if not token:
            return Access.NONE
        return Access.ADMIN if admin else Access.API if api else Access.NONE

    def by_label(self, label: str) -> RequestKey | None:
        """The key configured now under this label (a named key's name, another key's
        fingerprint, OPEN's when the API needs none); None: none is. A batch runs as its key."""
        if self.api_open:
            return OPEN if label == OPEN.label else None
        for _, named in self.named:
            if named.name == label:
                return RequestKey(Access.API, named.name, named)
        access = self.access_of(label)
        return RequestKey(access, label) if access is not Access.NONE else None

    def access_of(self, key_id: str) -> Access:
        """What the configured key with this fingerprint opens now (NONE: no such key any more)."""
        if any(fingerprint(k) == key_id for k in self.admin):
            return Access.ADMIN
        api = (*self.api, *(k for k, _ in self.named))
        return Access.API if any(fingerprint(k) == key_id for k in api) else Access.NONE


class RefusalBudget:
    """How many refused management calls a gateway reports one by one: ``per_s`` a second,
    bursts of ``burst``; the rest are counted and said with the next one reported, so a
    flood of bad keys cannot fill the audit log. Pure (the caller gives the clock)."""

    def __init__(self, per_s: float = 5.0, burst: int = 20):
        self.per_s = per_s
        self.burst = burst
        self.tokens = float(burst)
        self.at: float | None = None
        self.suppressed = 0

    def take(self, now: float) -> int | None:
        """None: do not report this one (it is counted). Else the number suppressed before it."""
        if self.at is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.per_s)
        self.at = now
        if self.tokens < 1:
            self.suppressed += 1
            return None
        self.tokens -= 1
        suppressed, self.suppressed = self.suppressed, 0
        return suppressed
