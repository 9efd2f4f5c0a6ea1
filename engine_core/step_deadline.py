"""How long a worker may take to answer a step: derived from the steps the engine has seen.

A hung worker is found by the reply deadline of the call in flight. A fixed
generous deadline (``worker_reply_timeout_s``, 120 s) finds it in minutes; a
step of the bundled model takes milliseconds. So once the engine has served
its first steps, a step's deadline is ``multiple`` × the recent 99th
percentile of steps of its size (scheduled tokens, in power-of-two buckets;
a size seen fewer than ``MIN_SAMPLES`` times borrows the next larger size
that has been, so a bigger step is never held to a smaller one's times, and
a slow big step does not stretch the small ones'), never below ``floor_s``. The generous deadline
stays where a step can legitimately be slow: the first ``warmup`` steps
(compilation, caches), a step larger than any seen recently (a very long
prefill, until one has been seen), and every call that is not a step (model
loading, sleep/wake, profiling). Nothing of it runs while nothing is in
flight: it is consulted when a call is sent and fed when it settles.
"""

from __future__ import annotations

from collections import deque

WARMUP_STEPS = 16
WINDOW = 256  # recent steps kept per bucket
MIN_SAMPLES = 8  # a bucket with fewer borrows the next larger one's times
PERCENTILE = 0.99


class StepDeadline:
    def __init__(self, generous_s: float, floor_s: float = 5.0, multiple: float = 20.0, warmup: int = WARMUP_STEPS):
        self.generous_s = generous_s
        self.floor_s = min(floor_s, generous_s)
        self.multiple = multiple
        self.warmup = warmup
        self.steps = 0
        self.buckets: dict[int, deque[float]] = {}
        self._p99: dict[int, float] = {}  # cached per bucket, refreshed as samples come

    @staticmethod
    def bucket(tokens: int) -> int:
        return max(0, int(tokens)).bit_length()

    def observe(self, seconds: float, tokens: int) -> None:
        """A step of ``tokens`` scheduled tokens took ``seconds`` (from its deadline's arming to its reply)."""
        self.steps += 1
        b = self.bucket(tokens)
        window = self.buckets.setdefault(b, deque(maxlen=WINDOW))
        window.append(seconds)
        if len(window) < 32 or len(window) % 8 == 0:  # a sort of <= 256 floats now and then
            ordered = sorted(window)
            self._p99[b] = ordered[min(len(ordered) - 1, int(PERCENTILE * len(ordered)))]

    def timeout_for(self, tokens: int | None) -> float:
        """The deadline for a call: a step of ``tokens`` tokens, or (None) any other call."""
        if tokens is None or self.steps < self.warmup:
            return self.generous_s
        estimate = self._estimate(self.bucket(tokens))
        if estimate is None:
            return self.generous_s
        return min(self.generous_s, max(self.floor_s, self.multiple * estimate))

    def _estimate(self, b: int) -> float | None:
        """The 99th percentile of a step in bucket ``b``, from the buckets seen often enough."""
        known = sorted(k for k in self._p99 if len(self.buckets[k]) >= MIN_SAMPLES)
        if not known:
            return None
        if b in known:
            return self._p99[b]
        larger = [k for k in known if k > b]
        if larger:
            return self._p99[larger[0]]
        below = known[-1]
        return self._p99[below] * 2 ** (b - below)  # up to twice the tokens per bucket step

    @property
    def warm(self) -> bool:
        return self.steps >= self.warmup
