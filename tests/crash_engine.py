"""A test double: an engine factory (SERVECTL_ENGINE_FACTORY=crash_engine:build) whose engine
process dies of SIGSEGV at every start, as a broken device or driver would make it: a crash a
restart might fix, so the manager restarts it with backoff until its crash loop fails it."""

import os
import signal


def build(spec):
    os.kill(os.getpid(), signal.SIGSEGV)
