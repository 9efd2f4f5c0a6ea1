"""Pure: the named keys' limits for the whole server (every gateway process asks here).

A key's ``max_concurrent_requests`` counts the requests it holds a slot for (``Admit`` to
``Finished``, across gateways; a gateway that dies gives its slots back);
``requests_per_minute`` the requests admitted in the last 60 s; ``tokens_per_minute`` the
prompt and completion tokens of its requests that finished in the last 60 s (a request's
tokens are known only at its end: one may take the window past the limit, and the next
waits until enough of the window has passed). The caller gives the clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from servectl.config import NamedKey
from servectl.wire import control as P

WINDOW_S = 60.0

Holder = tuple[bytes, int]  # (the gateway's identity on the control socket, its ticket)


@dataclass
class KeyState:
    """One key's counts now."""

    in_flight: set[Holder] = field(default_factory=set)
    starts: deque[float] = field(default_factory=deque)  # admitted requests' times, last 60 s
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # finished requests' (time, tokens)
    token_sum: int = 0

    def prune(self, now: float) -> None:
        edge = now - WINDOW_S
        while self.starts and self.starts[0] <= edge:
            self.starts.popleft()
        while self.tokens and self.tokens[0][0] <= edge:
            self.token_sum -= self.tokens.popleft()[1]


class KeyLimits:
    """Every named key's limits and counts; a reload's new keys keep the counts of the names they keep."""

    def __init__(self, keys: list[NamedKey]):
        self.keys: dict[str, NamedKey] = {}
        self.state: dict[str, KeyState] = {}
        self.set_keys(keys)

    def set_keys(self, keys: list[NamedKey]) -> None:
        self.keys = {k.name: k for k in keys}
        self.state = {name: self.state.get(name) or KeyState() for name in self.keys}

    def admit(self, name: str, holder: Holder, now: float) -> P.Admitted:
        """Whether a request of this key starts now; if so it is counted (and holds a slot)."""
        key, st = self.keys.get(name), self.state.get(name)
        if key is None or st is None:  # not (or no longer) a named key: nothing to hold it to
            return P.Admitted(ticket=holder[1], ok=True)
        st.prune(now)
        refusal = None
        if key.max_concurrent_requests and len(st.in_flight) >= key.max_concurrent_requests:
            refusal = ("concurrency", 1.0, f"key {name!r} has {len(st.in_flight)} request(s) in progress, its limit "
                                           f"(max_concurrent_requests = {key.max_concurrent_requests})")
        elif key.requests_per_minute and len(st.starts) >= key.requests_per_minute:
            wait = st.starts[0] + WINDOW_S - now
            refusal = ("requests", wait, f"rate limit reached for key {name!r} on requests per minute: limit "
                                         f"{key.requests_per_minute}, used {len(st.starts)}")
        elif key.tokens_per_minute and st.token_sum >= key.tokens_per_minute:
            refusal = ("tokens", self._tokens_free_in(key, st, now),
                       f"rate limit reached for key {name!r} on tokens per minute: limit {key.tokens_per_minute}, "
                       f"used {st.token_sum}")
        if refusal is not None:
            limit, wait, message = refusal
            wait = max(wait, 0.001)
            return P.Admitted(ticket=holder[1], ok=False, limit=limit, retry_after_s=wait,
                              message=f"{message}. Please try again in {wait:.3g}s.", window=self.window(key, st, now))
        st.starts.append(now)
        st.in_flight.add(holder)
        return P.Admitted(ticket=holder[1], ok=True, window=self.window(key, st, now))

    def finish(self, name: str, holder: Holder | None, tokens: int, now: float) -> None:
        """A request of this key ended: its slot back, its tokens in the window."""
        st = self.state.get(name)
        if st is None:
            return
        if holder is not None:
            st.in_flight.discard(holder)
        if tokens and self.keys[name].tokens_per_minute:
            st.tokens.append((now, tokens))
            st.token_sum += tokens

    def gateway_gone(self, ident: bytes) -> int:
        """A gateway died: the slots its requests held are free (how many)."""
        freed = 0
        for st in self.state.values():
            gone = {h for h in st.in_flight if h[0] == ident}
            st.in_flight -= gone
            freed += len(gone)
        return freed

    @staticmethod
    def _tokens_free_in(key: NamedKey, st: KeyState, now: float) -> float:
        """Seconds until the window's tokens drop below the limit (its oldest entries leave)."""
        left = st.token_sum
        for at, n in st.tokens:
            left -= n
            if left < key.tokens_per_minute:
                return at + WINDOW_S - now
        return 0.0

    @staticmethod
    def window(key: NamedKey, st: KeyState, now: float) -> P.Window:
        w = P.Window()
        if key.requests_per_minute:
            w.limit_requests = key.requests_per_minute
            w.remaining_requests = max(0, key.requests_per_minute - len(st.starts))
            w.reset_requests_s = st.starts[0] + WINDOW_S - now if st.starts else 0.0
        if key.tokens_per_minute:
            w.limit_tokens = key.tokens_per_minute
            w.remaining_tokens = max(0, key.tokens_per_minute - st.token_sum)
            w.reset_tokens_s = st.tokens[0][0] + WINDOW_S - now if st.tokens else 0.0
        return w

