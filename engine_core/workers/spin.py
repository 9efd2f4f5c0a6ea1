"""The hot path's bounded spins: how long the engine and a worker poll before blocking.

A message on the engine ⇄ worker hop wakes its receiver in the kernel. A
bounded spin right after work arrived trades CPU for that wake-up: the engine
polls for a step's reply for up to ``SERVECTL_ENGINE_SPIN_US`` µs (default
5,000) before blocking, a worker polls for the next call for up to
``SERVECTL_WORKER_SPIN_US`` µs (default 2,000) after answering one. Each
empty poll yields the core (``sched_yield``, as the reader of vLLM's
shared-memory ring does), so a spinner never keeps a core from the process
that has work: without the yield, spinning lost 19–33 % on 2 cores; with it,
it gained (bench/results/2026-11-30-yield-spin-ab.md). Neither spins while nothing is in flight,
so an idle tree stays asleep; 0 blocks at once. The engine starts its spin
for a step of a familiar size only shortly before that size's usual reply
(``WorkerGroup._spin_from``), sleeping in the kernel until then; with another
call already queued behind it (async scheduling) only just before, since the
worker goes straight on to that one (bench/results/2026-12-03-spin-lead-ab.md).
"""

from __future__ import annotations

import logging
import os

ENGINE_SPIN_ENV = "SERVECTL_ENGINE_SPIN_US"
WORKER_SPIN_ENV = "SERVECTL_WORKER_SPIN_US"
DEFAULTS_US = {ENGINE_SPIN_ENV: 5000.0, WORKER_SPIN_ENV: 2000.0}
# With another call already queued behind the one in flight, the engine's spin starts only
# this far ahead of the step's usual earliest reply (WorkerGroup._spin_from).
QUEUED_SPIN_LEAD_S = 250e-6
MAX_US = 100_000.0  # a tenth of a second: longer is no longer "right after work arrived"

log = logging.getLogger("engine_core.spin")


def spin_seconds(env: str, environ: dict[str, str] | None = None) -> float:
    """The spin of ``env`` in seconds: its default when unset, 0 (with a warning) when not a
    number of µs in [0, MAX_US]."""
    raw = (os.environ if environ is None else environ).get(env)
    if raw is None or raw.strip() == "":
        return DEFAULTS_US[env] / 1e6
    try:
        us = float(raw)
    except ValueError:
        us = -1.0
    if not 0 <= us <= MAX_US:
        log.warning("%s=%r is not a number of microseconds in [0, %d]: not spinning", env, raw, MAX_US)
        return 0.0
    return us / 1e6
