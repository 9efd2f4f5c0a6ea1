"""Prometheus metrics, merged across gateway processes.

prometheus-client's multiprocess mode: every gateway writes its values to
files in ``$PROMETHEUS_MULTIPROC_DIR`` (the manager sets it to a directory of
the runtime dir and empties it at start) and any gateway renders the sum.
"""

from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from servectl.wire.vocab import EventKind, ExitCode, ModelState

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
ENGINE_HUNG_EXIT = f" exit code {int(ExitCode.HUNG)}"  # manager/children.py's describe_exit


class Metrics:
    endpoints = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                 "/v1/messages/count_tokens", "/v1/embeddings", "/v2/embed", "/pooling", "/score", "/v1/score",
                 "/rerank", "/v1/rerank", "/v2/rerank", "/classify", "/v1/models", "/health", "/live", "/ready",
                 "/kv_event_sources", "/metrics", "/version",
                 "/openapi.json")

    def __init__(self):
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = None if self.multiprocess else CollectorRegistry()
        reg = {} if self.multiprocess else {"registry": self.registry}
        self.requests = Counter("servectl_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], **reg)
        self.prompt_tokens = Counter("servectl_prompt_tokens", "Prompt tokens processed", ["model"], **reg)
        self.generation_tokens = Counter("servectl_generation_tokens", "Tokens generated", ["model"], **reg)
        self.ttft = Histogram("servectl_time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=LATENCY_BUCKETS, **reg)
        self.itl = Histogram("servectl_inter_token_latency_seconds", "Mean time between tokens of a request",
                             ["model"], buckets=ITL_BUCKETS, **reg)
        self.e2e = Histogram("servectl_e2e_request_latency_seconds", "Request latency, end to end", ["model"],
                             buckets=LATENCY_BUCKETS, **reg)
        self.running = Gauge("servectl_requests_running", "Requests the engine has not finished",
                             ["model"], multiprocess_mode="livemostrecent", **reg)
        self.waiting = Gauge("servectl_requests_waiting", "Requests waiting for their engine to be ready",
                             ["model"], multiprocess_mode="livesum", **reg)
        # Steps whose next execute_model went to the workers before the previous
        # reply came back (vLLM's async scheduling overlap; 0 with it off).
        self.overlapped_steps = Gauge("servectl_engine_overlapped_steps",
                                      "Engine steps sent while the previous one was still executing",
                                      ["model"], multiprocess_mode="livemostrecent", **reg)
        # How the workers' replies came (engine_core/workers/tokens_reply.py): "tokens", a step's sampled
        # tokens only, unsigned msgpack; "signed_pickle", everything else.
        self.worker_replies = Gauge("servectl_engine_worker_replies",
                                    "Worker replies the engine took, by encoding", ["model", "encoding"],
                                    multiprocess_mode="livemostrecent", **reg)
        # The engine's yield (engine_core/batch_yield.py): "one_deep", steps run without a second
        # queued while only batch lines or a flood ran; "sat_out", steps those sat out for an
        # interactive request's or a newcomer's prompt. Growing: the yield is engaging.
        self.yield_steps = Gauge("servectl_engine_yield_steps",
                                 "Engine steps shaped for interactive requests and newcomers, by kind",
                                 ["model", "kind"], multiprocess_mode="livemostrecent", **reg)
        self.step_deadline = Gauge("servectl_engine_step_deadline_seconds",
                                   "The engine's deadline for a step, derived from the steps it has seen (as last "
                                   "published; hangs are found in this long)", ["model"],
                                   multiprocess_mode="livemostrecent", **reg)
        self.engine_restarts = Counter("servectl_engine_restarts", "Engine group restarts seen", ["model"], **reg)
        # Alerts (docs/deploy/prometheus-rules.yaml) read these two: a hung step, evictions thrashing.
        self.engine_hangs = Counter("servectl_engine_hangs", "Engine groups killed as hung (no output within the "
                                    "step deadline)", ["model"], **reg)
        self.evictions = Counter("servectl_model_evictions", "Models released to make room for another under the "
                                 "memory budget", ["model"], **reg)
        # Each process's restarts as the manager counts them (a gateway's own included: the manager's
        # count outlives the gateway, and a new gateway reads it in the manager's snapshot).
        self.child_restarts = Gauge("servectl_child_restarts", "Restarts of each supervised process",
                                    ["component"], multiprocess_mode="livemax", **reg)
        # Live gateways' only (the manager marks an exited one dead): a dead one's last view would
        # stay at 1 beside the states its successor learns.
        self.child_states = Gauge("servectl_child_state", "1 for the state each supervised process is in",
                                  ["component", "state"], multiprocess_mode="livemax", **reg)
        self._last_state: dict[str, str] = {}

    def child_state(self, component: str, state: str) -> None:
        old = self._last_state.get(component)
        if old is not None and old != state:
            self.child_states.labels(component=component, state=old).set(0)
        self._last_state[component] = state
        self.child_states.labels(component=component, state=state).set(1)

    def model_known(self, model: str) -> None:
        """A model's counters at 0 from the start: Prometheus' increase() cannot see a first
        increment of a series that did not exist before it."""
        for counter in (self.engine_restarts, self.engine_hangs, self.evictions):
            counter.labels(model=model)

    def model_event(self, model: str, state: ModelState, detail: str, hung: bool) -> None:
        """Count what a model's event says happened (one gateway counts: the sum is the count)."""
        if state == ModelState.EXITED:
            self.engine_restarts.labels(model=model).inc()
            # Hung: killed on a gateway's GroupHung, or the engine found its workers hung (the
            # step deadline) and exited HUNG; the manager's detail is "<member> <last exit>".
            if hung or (detail.startswith(f"{EventKind.ENGINE}:") and detail.endswith(ENGINE_HUNG_EXIT)):
                self.engine_hangs.labels(model=model).inc()
        elif state == ModelState.RELEASING and detail.startswith("evicted"):  # manager/budget.py's reason
            self.evictions.labels(model=model).inc()

    def collected(self) -> CollectorRegistry:
        """Our metrics: every gateway's (multiprocess), or this one's."""
        if not self.multiprocess:
            return self.registry
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry

    def render(self, engines: list[str] = ()) -> tuple[bytes, str]:
        """Our metrics, then the engines' own (``vllm:*``, as each engine rendered them), merged."""
        return generate_latest(self.collected()) + merge_exposition(engines), CONTENT_TYPE_LATEST

    def generated_tokens(self) -> dict[str, float]:
        """Tokens generated so far by model, by every gateway of the daemon."""
        totals: dict[str, float] = {}
        for family in self.collected().collect():
            if family.name == "servectl_generation_tokens":
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        model = sample.labels.get("model", "")
                        totals[model] = totals.get(model, 0.0) + sample.value
        return totals


def merge_exposition(texts: list[str]) -> bytes:
    """Several engines' Prometheus text (as prometheus_client renders it) as one exposition.

    Each metric family may appear once only (one HELP, one TYPE, its samples
    together), so the samples of a family that several engines report (one
    model_name each) are gathered under the first engine's HELP and TYPE lines.
    """
    families: dict[str, tuple[list[str], list[str]]] = {}  # name -> (HELP/TYPE lines, samples)
    for text in texts:
        samples: list[str] | None = None
        header: list[str] | None = None  # the family's header while we are writing it (first engine only)
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                name = line.split(" ", 3)[2]
                if line.startswith("# HELP "):
                    header = [] if name not in families else None
                    samples = families.setdefault(name, ([], []))[1]
                    if header is not None:
                        families[name] = (header, samples)
                if header is not None:
                    header.append(line)
            elif line and not line.startswith("#") and samples is not None:
                samples.append(line)
    out = [line for header, samples in families.values() for line in (*header, *samples)]
    return ("\n".join(out) + "\n").encode() if out else b""


# Usage per key and model (the manager's ledger, kept across restarts: monotonic as counters must be).
KEY_COUNTERS = (("requests", "Requests per API key and model"),
                ("prompt_tokens", "Prompt tokens per API key and model"),
                ("completion_tokens", "Completion tokens per API key and model"),
                ("errors", "Requests answered with an error, per API key and model"))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def key_usage_exposition(rows) -> bytes:
    """``servectl_key_*_total`` counters from the manager's usage rows (``UsageRow``)."""
    out = []
    for field, help_text in KEY_COUNTERS:
        name = f"servectl_key_{field}_total"
        out += [f"# HELP {name} {help_text} (kept across restarts)", f"# TYPE {name} counter"]
        out += [f'{name}{{key="{_label(r.key)}",model="{_label(r.model)}"}} {getattr(r, field)}' for r in rows]
    return ("\n".join(out) + "\n").encode()
