"""Client-given text in a log line: escaped and capped (shared by the access log and body parsing)."""

from __future__ import annotations

import re

# What a log line must not hold raw: control characters (a newline forges a line),
# backslashes and spaces (the access log's field separators), undecodable bytes
# (surrogates), line separators.
_UNSAFE = re.compile(r"[\x00-\x20\x7f-\xa0\\\u2028\u2029\ud800-\udfff]")


def escape(text: str, limit: int = 200) -> str:
    """One log field: unsafe characters as \\xNN / \\uNNNN escapes, at most ``limit`` characters kept."""
    cut = "..." if len(text) > limit else ""
    return _UNSAFE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 256 else f"\\u{ord(m[0]):04x}",
                       text[:limit]) + cut
