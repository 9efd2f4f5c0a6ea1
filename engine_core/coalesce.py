"""A non-streaming request's output, sent to its gateway in a few messages instead of one per step.

A client that did not ask for a stream sees nothing until its request ends,
yet the gateway keeps every request's output so far: that is what lets a
request resume on a restarted engine (issue 14). Sending it every step made
the gateway decode, queue and accumulate one delta per request per step. So
after a non-streaming request's first delta (which goes at once: it carries
the prompt's details and times the first token), its deltas are held and
merged, one delta per choice, and sent when the request finishes or when the
oldest held one is ``HOLD_S`` old. What a crash then loses is at most that
much output, which the resumed request computes again; the gateway's wait for
output (the step deadline plus 2 s, at least 7 s) is far longer.

Pure: no vLLM, no sockets (tests/test_coalesce_unit.py).
"""

from __future__ import annotations

from servectl.wire import engine as P

HOLD_S = 0.5


def merge(deltas: list[P.Delta]) -> list[P.Delta]:
    """Consecutive deltas of the same choices as one delta per (request, choice), in first-seen order."""
    merged: dict[tuple[str, int], P.Delta] = {}
    for d in deltas:
        key = (d.request_id, d.index)
        m = merged.get(key)
        if m is None:
            merged[key] = P.Delta(request_id=d.request_id, index=d.index, text=d.text, token_ids=list(d.token_ids),
                                  finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                                  logprobs=list(d.logprobs) if d.logprobs is not None else None, prompt=d.prompt,
                                  message=d.message, reasoning_tokens=d.reasoning_tokens)
            continue
        m.text += d.text
        m.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            m.logprobs = (m.logprobs or []) + d.logprobs
        if d.finish_reason is not None:
            m.finish_reason, m.stop_reason = d.finish_reason, d.stop_reason
        if d.message is not None:  # a parsed whole answer's message: on its last delta only
            m.message = d.message
        if d.reasoning_tokens is not None:
            m.reasoning_tokens = d.reasoning_tokens
        if m.prompt is None:
            m.prompt = d.prompt
    return list(merged.values())


class HeldOutput:
    """The held deltas of non-streaming requests, by request id."""

    def __init__(self, hold_s: float = HOLD_S):
        self.hold_s = hold_s
        self.held: dict[str, tuple[float, list[P.Delta]]] = {}  # request id -> (held since, deltas)

    def take(self, rid: str, deltas: list[P.Delta], finished: bool, now: float) -> list[P.Delta]:
        """What of this request's output goes out now (held deltas merged in); the rest is held."""
        entry = self.held.get(rid)
        if entry is None:
            if finished:
                return deltas
            self.held[rid] = (now, list(deltas))
            return []
        since, kept = entry
        kept.extend(deltas)
        if finished or now - since >= self.hold_s:
            del self.held[rid]
            return merge(kept)
        return []

    def drop(self, rid: str) -> None:
        self.held.pop(rid, None)

    def __len__(self) -> int:
        return len(self.held)
