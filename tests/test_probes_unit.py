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


def test_kv_event_sources_needs_a_key_when_keys_are_configured_and_the_probes_do_not():
    """Issue 53: where the events are (what the engines cache) is behind the API keys, as /v1 is;
    /live and /ready stay open for kubelets and routers' health checks."""
    async def scenario(h):
        async with aiohttp.ClientSession() as s:
            async def status(path: str, key: str | None = None) -> int:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                async with s.get(h.url + path, headers=headers) as r:
                    return r.status
            assert await status("/kv_event_sources") == 401
            assert await status(f"/kv_event_sources?model={MODEL}", "wrong") == 401
            assert await status("/kv_event_sources", "sk-1") == 200
            assert await status("/kv_event_sources", "admin-1") == 200  # an admin key is an API key too
            assert await status("/live") == 200
            assert await status("/ready") == 503  # open: starting, not refused
    run(scenario, api_keys=["sk-1"], admin_keys=["admin-1"])


# ---- where each engine group publishes ----------------------------------------------------

def model(name: str, replicas: int = 1, **events) -> C.ModelConfig:
    return C.ModelConfig(name=name, model="x", replicas=replicas,
                         engine_args={"kv_events_config": {"enable_kv_cache_events": True, **events}})


def test_events_default_to_a_socket_in_the_runtime_directory_not_tcp():
    """Issue 53: no TCP port by default (anyone on the host, or beyond, could read it): a socket
    in the runtime directory (0700), one per group, named by model and slot."""
    for host in ("127.0.0.1", "10.1.2.3", "0.0.0.0"):
        cfg = C.finalize(C.Config(gateway=C.GatewayConfig(host=host), models=[model("a"), model("a.b")]))
        events = cfg.models[0].engine_args["kv_events_config"]
        assert K.for_slot(events, 0, "/run/rt", "a")["endpoint"] == "ipc:///run/rt/kv-events-a@0"
        assert K.for_slot(events, 2, "/run/rt", "a")["endpoint"] == "ipc:///run/rt/kv-events-a@2"
        assert K.for_slot(events, -1, "/run/rt", "a")["endpoint"] == f"ipc:///run/rt/kv-events-a@x{os.getpid()}"
        assert K.for_slot(events, 0, "/run/rt", "a")["replay_endpoint"] is None  # none unless asked for
        assert K.port_range(cfg.models[0].engine_args, 1) == {}  # no port held
    # Two models' default sockets never meet ("@" is in no model name): a-1's slot 0, a's slot 1.
    assert K.default_endpoint("/rt", "a-1", 0) != K.default_endpoint("/rt", "a", 1)
    # A dead manager's leftover sockets of that name are servectl's to clean (servectl/paths.py).
    from servectl.paths import _STALE_SOCKETS
    assert _STALE_SOCKETS.match("kv-events-a.b@0") and _STALE_SOCKETS.match("kv-events-a@x123")
    assert not _STALE_SOCKETS.match("kv-events-a") and not _STALE_SOCKETS.match("kv-events-@0")
    # As `vllm serve --kv-events-config '<json>'`: a JSON string is taken too; an endpoint given is kept.
    cfg = C.finalize(C.Config(models=[C.ModelConfig(name="a", model="x", kv_events_network=True, engine_args={
        "kv_events_config": '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000"}'})]))
    assert K.for_slot(cfg.models[0].engine_args["kv_events_config"], 0, "/rt", "a")["endpoint"] == "tcp://*:6000"


@pytest.mark.parametrize("endpoint", ["tcp://*:6000", "tcp://0.0.0.0:6000", "tcp://10.0.0.11:6000",
                                      "tcp://[::]:6000", "tcp://eth0:6000", "tcp://example.com:6000"])
def test_a_tcp_endpoint_off_loopback_needs_the_operators_opt_in(endpoint):
    for key in ("endpoint", "replay_endpoint"):
        with pytest.raises(C.ConfigError, match=rf"models\.a\.engine_args\.kv_events_config\.{key}: .* reachable "
                                                r"from other hosts.*kv_events_network = true"):
            C.finalize(C.Config(models=[model("a", **{key: endpoint})]))
        opted = model("a", **{key: endpoint})
        opted.kv_events_network = True  # block hashes only, on the operator's word
        C.finalize(C.Config(models=[opted]))


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:6000", "tcp://127.0.0.2:6000", "tcp://[::1]:6000",
                                      "tcp://localhost:6000"])
def test_a_loopback_tcp_endpoint_needs_no_opt_in(endpoint):
    C.finalize(C.Config(models=[model("a", endpoint=endpoint)]))


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:6000", "tcp://10.0.0.11:6000"])
def test_token_ids_never_go_over_tcp(endpoint):
    """Token ids are the prompts: only over ipc:// (file permissions), never over unauthenticated TCP,
    not even loopback (any local user reaches it) nor with kv_events_network."""
    m = model("a", endpoint=endpoint)
    m.kv_events_token_ids = m.kv_events_network = True
    with pytest.raises(C.ConfigError, match=r"kv_events_config\.endpoint: .* is TCP.*kv_events_token_ids"):
        C.finalize(C.Config(models=[m]))
    for ipc in ({}, {"endpoint": "ipc:///run/ev"}):  # the default socket, or one named
        m = model("a", **ipc)
        m.kv_events_token_ids = True
        C.finalize(C.Config(models=[m]))
    assert K.exposure_problem(None, True, False) is None  # events off: nothing published


def test_each_group_has_a_port_of_its_own():
    cfg = model("a", replicas=2, endpoint="tcp://127.0.0.1:6000", replay_endpoint="tcp://127.0.0.1:6100")
    C.finalize(C.Config(models=[cfg]))
    events = cfg.engine_args["kv_events_config"]
    # Slots 0 .. replicas: two replicas and a rolling reload's new group beside the old.
    assert [K.for_slot(events, n, "/rt", "a")["endpoint"] for n in range(3)] == \
        [f"tcp://127.0.0.1:{p}" for p in (6000, 6001, 6002)]
    assert K.for_slot(events, 1, "/rt", "a")["replay_endpoint"] == "tcp://127.0.0.1:6101"
    assert K.for_slot(events, -1, "/rt", "a")["endpoint"] == "tcp://127.0.0.1:0"  # none left: the system picks
    assert K.for_slot({"endpoint": "ipc:///run/ev"}, 1, "/rt", "a")["endpoint"] == "ipc:///run/ev-1"
    assert K.for_slot({"endpoint": "tcp://127.0.0.1:0"}, 1, "/rt", "a")["endpoint"] == "tcp://127.0.0.1:0"


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
    ([model("a", endpoint="tcp://127.0.0.1:5557"), model("b", endpoint="tcp://127.0.0.1:5557")], 8000),
    ([model("a", replicas=2, endpoint="tcp://127.0.0.1:6000"), model("b", endpoint="tcp://127.0.0.1:6002")], 8000),
    ([model("a", endpoint="tcp://127.0.0.1:8000")], 8000),  # the gateway's port
    ([model("a", endpoint="tcp://127.0.0.1:5557"), model("b", endpoint="tcp://127.0.0.2:5558")], 8000),  # other IP
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
        C.finalize(C.Config(models=[model("a", replicas=2, endpoint="tcp://127.0.0.1:65534")]))
    with pytest.raises(C.ConfigError, match="ipc:///run/ev is models.a"):
        C.finalize(C.Config(models=[model("a", endpoint="ipc:///run/ev"), model("b", endpoint="ipc:///run/ev")]))
