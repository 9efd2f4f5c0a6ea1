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
loading, sleep/wake, profiling), and a step whose batch needs something of
the sampler that no finished step has needed at that batch size (``StepKinds``):
vLLM compiles parts of its sampler on first use (``torch.compile`` of the
logprob ranks, of top-k/top-p; Triton or FlashInfer kernels on a GPU), and
that first step takes seconds — a slow step, not a hung worker. Nothing of it
runs while nothing is in flight: it is consulted when a call is sent and fed
when it settles.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

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
        self._p10: dict[int, float] = {}  # the early end of the same: when a reply starts to be due
        # Buckets whose percentiles are stale: observe() only marks them and refresh() sorts, so
        # neither a step's reply nor the next step's call waits for a sort. Queries answer from
        # the last refresh (the group's, while it waits for a reply: one step behind at most);
        # samples of a bucket never computed yet are taken in by the first query (_first_samples).
        self._stale: set[int] = set()
        self._estimates: dict[int, float | None] = {}  # _estimate per bucket, until a refresh
        self.kinds_seen: set[str] = set()  # StepKinds of the steps that finished

    @staticmethod
    def bucket(tokens: int) -> int:
        return max(0, int(tokens)).bit_length()

    def observe(self, seconds: float, tokens: int, kinds: Iterable[str] = ()) -> None:
        """A step of ``tokens`` scheduled tokens (needing ``kinds``) took ``seconds`` (from its
        deadline's arming to its reply)."""
        self.steps += 1
        if not self.kinds_seen.issuperset(kinds):
            self.kinds_seen.update(kinds)
            return  # a first-use step (compiling, maybe): not a sample of how long steps take
        b = self.bucket(tokens)
        window = self.buckets.get(b)
        if window is None:
            window = self.buckets[b] = deque(maxlen=WINDOW)
        window.append(seconds)
        if len(window) < 32 or len(window) % 8 == 0:  # a sort of <= 256 floats now and then
            self._stale.add(b)

    def refresh(self) -> None:
        """Recompute the percentiles of the buckets observed since the last refresh."""
        if not self._stale:
            return
        for b in self._stale:
            ordered = sorted(self.buckets[b])
            self._p99[b] = ordered[min(len(ordered) - 1, int(PERCENTILE * len(ordered)))]
            self._p10[b] = ordered[int(0.1 * len(ordered))]
        self._stale.clear()
        self._estimates.clear()

    def _first_samples(self) -> None:
        """Refresh now if a stale bucket has never been computed (the first samples of a size);
        otherwise a query answers from the last refresh."""
        if self._stale and not self._stale.issubset(self._p99):
            self.refresh()

    def timeout_for(self, tokens: int | None, kinds: Iterable[str] = ()) -> float:
        """The deadline for a call: a step of ``tokens`` tokens needing ``kinds``, or (None) any other call."""
        if tokens is None or self.steps < self.warmup:
            return self.generous_s
        if not self.kinds_seen.issuperset(kinds):
            return self.generous_s  # the first step that needs it may compile it
        self._first_samples()
        b = self.bucket(tokens)
        estimate = self._estimates[b] if b in self._estimates else self._estimates.setdefault(b, self._estimate(b))
        if estimate is None:
            return self.generous_s
        return min(self.generous_s, max(self.floor_s, self.multiple * estimate))

    def earliest(self, tokens: int) -> float | None:
        """How soon a step of ``tokens`` tokens usually answers (the 10th percentile of its size's
        recent steps), or None while that size has too few samples: when spinning for it can start."""
        b = self.bucket(tokens)
        window = self.buckets.get(b)
        if window is None or len(window) < MIN_SAMPLES:
            return None
        self._first_samples()
        return self._p10.get(b)

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


def request_kinds(params: Any) -> frozenset[str]:
    """What a request's sampling parameters (vLLM's ``SamplingParams``, read by attribute) need of
    the sampler beyond greedy decoding: each may have a code path compiled on first use."""
    if params is None:
        return frozenset()
    kinds = []
    if getattr(params, "logprobs", None) is not None:
        kinds.append("logprobs")
    if getattr(params, "prompt_logprobs", None) is not None:
        kinds.append("prompt_logprobs")
    if (getattr(params, "temperature", 0.0) or 0.0) > 0:
        kinds.append("random")
    if (getattr(params, "top_k", 0) or 0) > 0 or (getattr(params, "top_p", 1.0) or 1.0) < 1.0:
        kinds.append("top_k_top_p")
    if (getattr(params, "min_p", 0.0) or 0.0) > 0:
        kinds.append("min_p")
    if (getattr(params, "presence_penalty", 0.0) or getattr(params, "frequency_penalty", 0.0)
            or (getattr(params, "repetition_penalty", 1.0) or 1.0) != 1.0):
        kinds.append("penalties")
    for name in ("logit_bias", "allowed_token_ids", "bad_words", "min_tokens", "structured_outputs"):
        if getattr(params, name, None):
            kinds.append(name)
    if getattr(params, "seed", None) is not None:
        kinds.append("seed")
    return frozenset(kinds)


class StepKinds:
    """What each step's batch needs of the sampler (``request_kinds`` of the requests the engine
    holds), at its batch size class ("1" or "n": a compiled graph specialises on a batch of one).

    Fed each step's ``SchedulerOutput`` (read by attribute): its new requests are added, the
    requests it says finished are dropped, so the cost per step is that of its new and finished
    requests, not of the batch.
    """

    def __init__(self) -> None:
        self.live: dict[str, frozenset[str]] = {}
        self.counts: Counter[str] = Counter()
        self._by_size: dict[str, frozenset[str]] = {}  # the answer per size class, until the requests change

    def of(self, scheduler_output: Any) -> frozenset[str]:
        for rid in getattr(scheduler_output, "finished_req_ids", None) or ():
            kinds = self.live.pop(rid, None)
            if kinds:
                self.counts.subtract(kinds)
                self._by_size.clear()
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            rid = getattr(new, "req_id", None)
            kinds = request_kinds(getattr(new, "sampling_params", None))
            if rid is None or not kinds or rid in self.live:
                continue
            self.live[rid] = kinds
            self.counts.update(kinds)
            self._by_size.clear()
        size = "1" if len(getattr(scheduler_output, "num_scheduled_tokens", None) or ()) == 1 else "n"
        found = self._by_size.get(size)
        if found is None:  # decode steps of the same requests reuse it: no work per token
            found = self._by_size[size] = frozenset(f"{k}@{size}" for k, n in self.counts.items() if n > 0)
        return found
