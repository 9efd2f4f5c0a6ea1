"""Pure: a saturated model shared between keys by weight, as the requests' vLLM ``priority``.

A request's priority (lower runs first; vLLM breaks ties by arrival) is its key's sequences
already in flight on the model in this gateway, times ``SCALE / weight``, and never less than
the highest priority the key has in flight there (so a key's own requests keep their order).
An engine with ``scheduling_policy = "priority"`` (servectl's default) takes its waiting
requests in that order: a key with 64 requests waiting holds priorities 0 … 63 000, a key
with one gets 0 and goes next; with several each, the keys take turns, a key of weight 2 two
turns to another's one. Counts, not clocks, so the gateways' priorities meet in the engine
on one scale (each gateway counts its own requests).
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

SCALE = 1000  # one sequence of a weight-1 key (priorities are ints)


@dataclass
class Held:
    """One key's requests in flight on one model: their sequences and priorities."""

    sequences: int = 0
    tags: Counter = field(default_factory=Counter)
    highest: list[int] = field(default_factory=list)  # max-heap (negated), stale entries dropped lazily

    def top(self) -> int:
        while self.highest and not self.tags[-self.highest[0]]:
            heapq.heappop(self.highest)
        return -self.highest[0] if self.highest else 0


class FairShare:
    def __init__(self):
        self.held: dict[tuple[str, str], Held] = {}

    def start(self, model: str, key: str, weight: float, sequences: int = 1) -> int:
        """A request's priority; give it back with ``done`` when the request ends."""
        held = self.held.setdefault((model, key), Held())
        tag = max(round(held.sequences * SCALE / weight), held.top())
        held.sequences += sequences
        if not held.tags[tag]:
            heapq.heappush(held.highest, -tag)
        held.tags[tag] += 1
        return tag

    def done(self, model: str, key: str, tag: int, sequences: int = 1) -> None:
        held = self.held.get((model, key))
        if held is None or not held.tags[tag]:
            return
        held.tags[tag] -= 1
        if not held.tags[tag]:
            del held.tags[tag]
        held.sequences -= sequences
        if not held.tags:
            del self.held[model, key]  # nothing in flight: its next request starts from 0
        elif len(held.highest) > 64 + 2 * len(held.tags):  # stale entries under the top: rebuilt
            held.highest = [-t for t in held.tags]
            heapq.heapify(held.highest)
