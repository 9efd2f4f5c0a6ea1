"""What a load balancer, a router or a kubelet asks a host: ``/live``, ``/ready``, ``/kv_event_sources``.

``/health`` (app.py) is one answer for the whole host, 503 while any model is
not serving: right for "is everything up", wrong for a liveness probe (it would
kill a host whose other models serve) and for a router that routes one model.
So, apart (docs/operations.md, "Several hosts"):

- ``/live``: this gateway answers and the manager that owns it is alive. Failed
  models, stopped workers and a drain do not make it fail: restarting the host
  fixes none of them.
- ``/ready`` (``?model=NAME``): this host should get new requests, for every
  model it serves (for that one): ready, degraded (some replicas serve),
  released or asleep (a request wakes it: ``wakes_on_request``). Not while
  starting, draining, failed, down, or while the host is stopping: ``servectl
  stop`` makes it fail ``[manager] unready_grace_s`` before new requests are
  refused (SIGUSR1 from the manager, ``Gateway.stop_being_ready``).
- ``/kv_event_sources``: where each engine publishes vLLM's KV-cache events,
  as ``vllm serve`` answers it (replica index → vLLM's ``KVEventsConfig``) for
  ``?model=NAME`` or a host serving one model; ``{model: {...}}`` for several.
  Behind the API keys when there are any (middleware.py's ``KEYED_PATHS``); the
  other two are open, as ``/health``.
"""

from __future__ import annotations

import os
from typing import Protocol

from aiohttp import web

from api_gateway.errors import HttpError
from api_gateway.link_state import LinkState
from api_gateway.served import ServedModel
from servectl.proc import PARENT_ENV
from servectl.wire.vocab import DEGRADED, IDLE_RELEASED, ModelState

# The states in which a model takes new requests at once, or wakes for them.
READY_STATES = frozenset({ModelState.READY, DEGRADED, *IDLE_RELEASED})


def model_readiness(served: ServedModel) -> dict:
    """One model's answer in /ready: ready or not, its state, and why not."""
    state = served.status
    unfit = served.unfit  # released, but too large for its memory budget: a request is a 503
    body: dict = {"ready": state in READY_STATES and not unfit, "state": state}
    if state in IDLE_RELEASED and not unfit:
        body["wakes_on_request"] = True
    reason = unfit or served.reason
    if state is not ModelState.READY and reason:
        body["reason"] = reason
    return body


class ProbeHost(Protocol):
    """What the probes read of their gateway."""

    served: dict[str, ServedModel]  # by the name requests use
    draining: bool  # refusing new work


class Probes:
    def __init__(self, gateway: ProbeHost):
        self.g = gateway
        self.manager_pid = int(os.environ.get(PARENT_ENV) or os.getppid())
        # Set when the manager says the host is stopping: /ready fails, requests are still served.
        self.unready = False

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/live", self.live)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/kv_event_sources", self.kv_event_sources)

    def _wanted(self, request: web.Request) -> dict[str, ServedModel]:
        served = self.g.served
        wanted = request.query.get("model")
        if wanted is None:
            return dict(served)
        if wanted not in served:
            raise HttpError(404, f"model {wanted!r} not found; served: {', '.join(sorted(served))}",
                            param="model", code="model_not_found")
        return {wanted: served[wanted]}

    async def live(self, request: web.Request) -> web.Response:
        # Our parent is the manager while it lives (we die with it: PDEATHSIG); reparented, it is gone.
        alive = os.getppid() == self.manager_pid
        return web.json_response({"status": "alive" if alive else "manager gone"}, status=200 if alive else 503)

    async def ready(self, request: web.Request) -> web.Response:
        models = {name: model_readiness(served) for name, served in sorted(self._wanted(request).items())}
        stopping = self.unready or self.g.draining
        ok = not stopping and bool(models) and all(m["ready"] for m in models.values())
        status = "ready" if ok else ("stopping" if stopping else "not ready")
        return web.json_response({"status": status, "models": models}, status=200 if ok else 503)

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        one = request.query.get("model") is not None or len(self.g.served) == 1
        wanted = self._wanted(request)
        by_model = {name: {str(link.kv_events_rank): link.kv_events
                           for link in sorted(served.links.values(), key=lambda link: link.kv_events_rank)
                           if link.kv_events is not None and link.state is LinkState.READY}
                    for name, served in sorted(wanted.items())}
        if one:
            return web.json_response(next(iter(by_model.values()), {}))
        return web.json_response(by_model)
