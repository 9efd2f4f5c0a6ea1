"""Which browsers and Host names the gateway answers: pure, unit-tested without a server.

- **Host allowlist** (``HostPolicy``): bound to a loopback address (the
  default, 127.0.0.1), the gateway answers only requests whose ``Host`` is a
  localhost name, a loopback IP, or one of ``gateway.allowed_hosts``; anything
  else gets 421. A web page the operator opens can then not read answers by
  DNS rebinding (its own name resolving to 127.0.0.1). Bound elsewhere the
  check applies only when ``allowed_hosts`` is set; ``"*"`` turns it off.
- **CORS** (``CorsPolicy``): off unless ``gateway.cors_origins`` lists
  origins (or ``"*"``). Requests with a body must be ``application/json``
  (bodies.py), which a page can only send after a preflight that this policy
  answers: with no origins configured, no page can.
"""

from __future__ import annotations

import ipaddress

LOCALHOST_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
ANY = "*"


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def host_name(header: str) -> str:
    """The name part of a Host header: no port, no IPv6 brackets, lower case, no final dot."""
    text = header.strip().lower()
    if text.startswith("["):  # [::1]:8000
        end = text.find("]")
        return text[1:end] if end > 0 else text
    if text.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        text = text.split(":", 1)[0]
    return text.rstrip(".")


def is_loopback_name(name: str) -> bool:
    """localhost, *.localhost (RFC 6761), or a loopback IP."""
    if name in LOCALHOST_NAMES or name.endswith(".localhost"):
        return True
    ip = _ip(name)
    if ip is None:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def is_loopback_bind(host: str) -> bool:
    name = host_name(host)
    return name in LOCALHOST_NAMES or (_ip(name) is not None and _ip(name).is_loopback)


class HostPolicy:
    def __init__(self, bind_host: str, allowed: list[str]):
        names = {host_name(a) for a in allowed if a.strip()}
        self.enforced = ANY not in names and (is_loopback_bind(bind_host) or bool(names))
        bind = host_name(bind_host)
        if bind and not (_ip(bind) is not None and _ip(bind).is_unspecified):
            names.add(bind)  # a request to the address we are bound to
        self.names = frozenset(names)

    def allows(self, header: str | None) -> bool:
        """Whether to answer a request with this Host header (None: absent, as HTTP/1.0; not a browser)."""
        if not self.enforced or header is None:
            return True
        name = host_name(header)
        return is_loopback_name(name) or name in self.names


class CorsPolicy:
    ALLOW_METHODS = "GET, POST, OPTIONS"
    ALLOW_HEADERS = "Authorization, Content-Type, X-Request-Id"
    MAX_AGE = "600"

    def __init__(self, origins: list[str]):
        self.any = ANY in origins
        self.origins = frozenset(o.strip().rstrip("/").lower() for o in origins if o.strip() and o != ANY)

    @property
    def enabled(self) -> bool:
        return self.any or bool(self.origins)

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (self.any or origin.strip().rstrip("/").lower() in self.origins)

    def headers(self, origin: str) -> dict[str, str]:
        """What an answer to an allowed origin carries."""
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin",
                "Access-Control-Expose-Headers": "X-Request-Id"}

    def preflight_headers(self, origin: str, requested_headers: str | None = None) -> dict[str, str]:
        """The answer to an allowed origin's preflight; the headers it asks for are allowed (SDKs add
        their own, e.g. the OpenAI client's x-stainless-*), the methods are ours."""
        return {**self.headers(origin), "Access-Control-Allow-Methods": self.ALLOW_METHODS,
                "Access-Control-Allow-Headers": requested_headers or self.ALLOW_HEADERS,
                "Access-Control-Max-Age": self.MAX_AGE}


def is_json_content_type(header: str | None) -> bool:
    """Only ``application/json`` (parameters allowed): never one of the CORS-simple types
    (text/plain, form encodings) a page can send cross-origin without a preflight, nor none at all."""
    if not header:
        return False
    return header.split(";", 1)[0].strip().lower() == "application/json"
