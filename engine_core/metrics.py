"""vLLM's own Prometheus metrics, rendered by the engine for the gateway's /metrics.

``LLMEngine`` records every step into vLLM's ``PrometheusStatLogger``
(``log_stats`` is on unless ``disable_log_stats``), whose metrics live in
prometheus_client's default registry of the engine process, labelled
``model_name`` = vLLM's ``served_model_name`` (the engine sets it to the
served name). On a scrape the gateway sends ``MetricsRequest``; the engine
answers with the ``vllm:*`` families as exposition text. Nothing here runs
unless asked: vLLM's stat loggers are fed by ``step()`` and log from it, they
arm no timer. Each replica of a model is its own engine, and vLLM labels every
one ``engine="0"``; the replica's index goes there instead, as vLLM's data
parallel ranks are labelled.

No vLLM import here (prometheus_client only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

PREFIX = "vllm:"
# What a sleeping engine still reports: the one figure that describes it. Its other
# gauges would be the last values before it slept (stale), so they disappear.
ASLEEP_FAMILIES = frozenset({"vllm:engine_sleep_state"})


class _Only:
    """A collector yielding the families of another registry that ``keep`` accepts."""

    def __init__(self, source: CollectorRegistry, keep: Callable[[str], bool], engine: int = 0):
        self.source = source
        self.keep = keep
        self.engine = str(engine)

    def collect(self) -> Iterable[Metric]:
        for family in self.source.collect():
            if self.keep(family.name):
                if self.engine != "0":
                    family.samples = [s._replace(labels={**s.labels, "engine": self.engine}) if "engine" in s.labels
                                      else s for s in family.samples]
                yield family


def render(asleep: bool = False, source: CollectorRegistry = REGISTRY, engine: int = 0) -> str:
    """The ``vllm:*`` families (only the sleep state while asleep) in Prometheus text format."""
    if asleep:
        def keep(name: str) -> bool:
            return name in ASLEEP_FAMILIES
    else:
        def keep(name: str) -> bool:
            return name.startswith(PREFIX)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Only(source, keep, engine))
    return generate_latest(registry).decode()
