"""/live, /ready and /kv_event_sources on a real gateway against a scripted engine, and the
KV-events endpoints each engine group gets (servectl/kv_events.py). No vLLM."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

from gateway_harness import MODEL, run
from servectl import config as C
from servectl import kv_events as K
from servectl.wire import engine as EP

pytestmark = pytest.mark.unit


async def get(h, path: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.get(h.url + path) as r:
            return r.status, await r.json()


def test_ready_follows_the_model_and_live_does_not():
    async def scenario(h):
        assert await get(h, "/live") == (200, {"status": "alive"})
        status, body = await get(h, "/ready")
        assert status == 503 and body["models"][MODEL]["state"] == "starting", body
        await h.ready()
        assert await get(h, "/ready") == (200, {"status": "ready", "models": {MODEL: {"ready": True,
                                                                                       "state": "ready"}}})
        assert (await get(h, f"/ready?model={MODEL}"))[0] == 200
        assert (await get(h, "/ready?model=other"))[0] == 404
        h.model_state("released")  # a request wakes it: still a host to send to
        status, body = await get(h, "/ready")
        assert status == 200 and body["models"][MODEL] == {"ready": True, "state": "released",
                                                           "wakes_on_request": True}, body
        h.link.set_unfit("needs 9 GiB, the budget is 4 GiB")  # released for good: a request is a 503
        status, body = await get(h, "/ready")
        assert status == 503 and body["models"][MODEL] == {"ready": False, "state": "released",
                                                           "reason": "needs 9 GiB, the budget is 4 GiB"}, body
        h.link.set_unfit(None)
        h.model_state("failed", reason="crash loop")
        status, body = await get(h, "/ready")
        assert status == 503 and body["models"][MODEL] == {"ready": False, "state": "failed",
                                                           "reason": "crash loop"}, body
        assert (await get(h, "/live"))[0] == 200  # a failed model is not a dead host
        assert (await get(h, "/health"))[0] == 503  # /health keeps its meaning
    run(scenario)


def test_stopping_fails_ready_first_and_still_serves():
    async def scenario(h):
        await h.ready()
        h.gw.stop_being_ready()  # the manager's SIGUSR1 on a stop with unready_grace_s
        status, body = await get(h, "/ready")
        assert status == 503 and body["status"] == "stopping", body
        assert (await get(h, "/live"))[0] == 200
        assert (await get(h, "/health"))[0] == 200  # requests are still served in the grace
        assert not h.gw.draining
    run(scenario)


def test_live_fails_once_the_manager_is_gone():
    async def scenario(h):
        h.gw.probes.manager_pid = os.getppid() + 1_000_000  # as if reparented: not our manager
        status, body = await get(h, "/live")
        assert status == 503 and body == {"status": "manager gone"}
    run(scenario)


def test_kv_event_sources_says_what_the_engine_said():
    async def scenario(h):
        assert await get(h, "/kv_event_sources") == (200, {})
        h.model_state("ready", "inc1")
        await h.engine.recv()
        h.engine.incarnation = "inc1"
        published = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}
        await h.engine.send(EP.HelloReply(version=EP.PROTOCOL_VERSION, incarnation="inc1", model=MODEL,
                                          max_model_len=128, kv_events=published))
        await asyncio.wait_for(h.link.ready.wait(), 10)
        assert await get(h, "/kv_event_sources") == (200, {"0": published})
        assert await get(h, f"/kv_event_sources?model={MODEL}") == (200, {"0": published})
    run(scenario)


# ---- where each engine group publishes ----------------------------------------------------

def model(name: str, replicas: int = 1, **events) -> C.ModelConfig:
    return C.ModelConfig(name=name, model="x", replicas=replicas,
                         engine_args={"kv_events_config": {"enable_kv_cache_events": True, **events}})


def test_events_default_to_the_gateways_host_not_every_interface():
    for host, want in (("10.1.2.3", "tcp://10.1.2.3:5557"), ("::1", "tcp://[::1]:5557")):
        cfg = C.finalize(C.Config(gateway=C.GatewayConfig(host=host), models=[model("a")]))
        events = cfg.models[0].engine_args["kv_events_config"]
        assert K.for_slot(events, 0, cfg.gateway.host)["endpoint"] == want
    # The default follows the host as it is when the engine starts (a --host override included):
    # the configuration keeps no endpoint of its own.
    cfg = C.apply_overrides(C.finalize(C.Config(models=[model("a")])), C.Overrides(host="10.0.0.11"))
    assert K.for_slot(cfg.models[0].engine_args["kv_events_config"], 0, cfg.gateway.host)["endpoint"] == \
        "tcp://10.0.0.11:5557"
    # As `vllm serve --kv-events-config '<json>'`: a JSON string is taken too; an endpoint given is kept.
    cfg = C.finalize(C.Config(models=[C.ModelConfig(name="a", model="x", engine_args={
        "kv_events_config": '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000"}'})]))
    assert K.for_slot(cfg.models[0].engine_args["kv_events_config"], 0, "h")["endpoint"] == "tcp://*:6000"


def test_each_group_has_a_port_of_its_own():
    cfg = model("a", replicas=2, endpoint="tcp://127.0.0.1:6000", replay_endpoint="tcp://127.0.0.1:6100")
    C.finalize(C.Config(models=[cfg]))
    events = cfg.engine_args["kv_events_config"]
    # Slots 0 .. replicas: two replicas and a rolling reload's new group beside the old.
    assert [K.for_slot(events, n, "h")["endpoint"] for n in range(3)] == \
        [f"tcp://127.0.0.1:{p}" for p in (6000, 6001, 6002)]
    assert K.for_slot(events, 1, "h")["replay_endpoint"] == "tcp://127.0.0.1:6101"
    assert K.for_slot(events, -1, "h")["endpoint"] == "tcp://127.0.0.1:0"  # none left: the system picks
    assert K.for_slot({"endpoint": "ipc:///run/ev"}, 1, "h")["endpoint"] == "ipc:///run/ev-1"
    assert K.for_slot({"endpoint": "tcp://127.0.0.1:0"}, 1, "h")["endpoint"] == "tcp://127.0.0.1:0"


def test_the_manager_gives_each_group_a_free_slot():
    from types import SimpleNamespace

    from manager.daemon import Manager

    cfg = model("a", replicas=2)
    def group(slot):
        return SimpleNamespace(model="a", model_cfg=cfg, events_slot=slot)
    host = SimpleNamespace(groups={})
    new = group(None)
    host.groups = {"a@0": group(0), "a@1": group(1), "a@2": new}
    assert Manager.events_slot(host, new) == 2  # a roll's new group beside both replicas
    host.groups = {"a@1": group(1), "a@2": group(2), "a@0": new}
    assert Manager.events_slot(host, new) == 0  # the slot the removed group held
    host.groups = {"a@0": group(0), "a@1": group(1), "x": group(2), "a": new}
    assert Manager.events_slot(host, new) == -1  # every slot held (a shrinking roll)


@pytest.mark.parametrize("models, gateway_port", [
    ([model("a"), model("b")], 8000),  # both on the default port
    ([model("a", replicas=2, endpoint="tcp://127.0.0.1:6000"), model("b", endpoint="tcp://127.0.0.1:6002")], 8000),
    ([model("a", endpoint="tcp://127.0.0.1:8000")], 8000),  # the gateway's port
    ([model("a"), model("b", endpoint="tcp://10.9.9.9:5558")], 8000),  # other host, same engines' ports
])
def test_ports_that_meet_are_refused(models, gateway_port):
    with pytest.raises(C.ConfigError, match="kv_events_config.endpoint: ports"):
        C.finalize(C.Config(gateway=C.GatewayConfig(port=gateway_port), models=models))


def test_events_off_or_bad_endpoints():
    off = C.ModelConfig(name="a", model="x", engine_args={"kv_events_config": {"enable_kv_cache_events": False}})
    C.finalize(C.Config(models=[off, C.ModelConfig(name="b", model="x", engine_args={
        "kv_events_config": {"enable_kv_cache_events": False}})]))  # off: no port taken
    assert K.events_config(off.engine_args) is None
    with pytest.raises(C.ConfigError, match="not tcp://host:port"):
        C.finalize(C.Config(models=[model("a", endpoint="http://x:1")]))
    with pytest.raises(C.ConfigError, match="has no port"):
        C.finalize(C.Config(models=[model("a", endpoint="tcp://host:")]))
    with pytest.raises(C.ConfigError, match="pass 65535"):
        C.finalize(C.Config(models=[model("a", replicas=2, endpoint="tcp://h:65534")]))
    with pytest.raises(C.ConfigError, match="ipc:///run/ev is models.a"):
        C.finalize(C.Config(models=[model("a", endpoint="ipc:///run/ev"), model("b", endpoint="ipc:///run/ev")]))
