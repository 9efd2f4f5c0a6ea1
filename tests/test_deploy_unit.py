"""The Kubernetes recipe (docs/deploy/kubernetes.yaml) against the product: its probes name the
gateway's routes on the configured port, its grace periods add up, its servectl.toml loads."""

from __future__ import annotations

import tempfile
from pathlib import Path

import msgspec
import pytest
import yaml

from api_gateway.app import Gateway
from servectl import config as C
from servectl import kv_events as K
from servectl.wire.spawn import GatewaySpec

pytestmark = pytest.mark.unit

MANIFEST = Path(__file__).resolve().parent.parent / "docs" / "deploy" / "kubernetes.yaml"


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def find(docs, kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


@pytest.fixture(scope="module")
def cfg(docs) -> C.Config:
    text = find(docs, "ConfigMap", "servectl-config")["data"]["servectl.toml"]
    return C.finalize(msgspec.toml.decode(text.encode(), type=C.Config))


def gateway_routes(cfg: C.Config) -> set[str]:
    spec = GatewaySpec(index=0, runtime_dir=tempfile.mkdtemp(prefix="gwr-"), instance="t", gateway=cfg.gateway,
                       models=[m.name for m in cfg.models])
    gw = Gateway(spec)
    try:
        return {r.resource.canonical for r in gw.build_app().router.routes() if r.method == "GET"}
    finally:
        gw.ctx.destroy(linger=0)


def container(deployment: dict, name: str) -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def port_of(c: dict, name_or_number) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name_or_number)


def test_probes_are_the_gateways_routes_on_its_port(docs, cfg):
    routes = gateway_routes(cfg)
    server = container(find(docs, "Deployment", "servectl"), "servectl")
    probes = {kind: server[kind]["httpGet"] for kind in ("livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == "/live" and probes["readinessProbe"]["path"] == "/ready"
    for kind, probe in probes.items():
        assert probe["path"] in routes, (kind, probe)
        assert port_of(server, probe["port"]) == cfg.gateway.port, (kind, probe)
    # The router checks the same readiness, on each pod's gateway port.
    router = container(find(docs, "Deployment", "vllm-router"), "vllm-router")["command"]
    assert router[router.index("--health-check-endpoint") + 1] == "/ready"
    assert int(router[router.index("--service-discovery-port") + 1]) == cfg.gateway.port
    assert router[router.index("--policy") + 1] == "cache_aware"
    selector = router[router.index("--selector") + 1]
    assert selector == "=".join(*find(docs, "Deployment", "servectl")["spec"]["selector"]["matchLabels"].items())


def test_a_stop_is_unready_first_and_fits_the_grace_period(docs, cfg):
    pod = find(docs, "Deployment", "servectl")["spec"]["template"]["spec"]
    server = container(find(docs, "Deployment", "servectl"), "servectl")
    ready = server["readinessProbe"]
    pre_stop = int(server["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pre_stop >= ready["periodSeconds"]  # one probe period before the SIGTERM
    # Past the SIGTERM, /ready fails longer than the probe takes to notice.
    assert cfg.manager.unready_grace_s > ready["periodSeconds"] * ready.get("failureThreshold", 3)
    m = cfg.manager
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + m.unready_grace_s + m.drain_timeout_s + m.stop_grace_s


def test_the_services_reach_the_gateway_and_the_event_publisher(docs, cfg):
    server = container(find(docs, "Deployment", "servectl"), "servectl")
    service = find(docs, "Service", "servectl")
    assert service["spec"]["clusterIP"] == "None"  # the router talks to each pod
    targets = {port_of(server, p["targetPort"]) for p in service["spec"]["ports"]}
    events = K.events_config(cfg.models[0].engine_args)
    assert events is not None
    host, port = K.split_endpoint(K.for_slot(events, 0, "/run/servectl", cfg.models[0].name)["endpoint"])
    # The pod's network (an opt-in: block hashes only, servectl/kv_events.py), the Service's port.
    assert host == "0.0.0.0" and cfg.models[0].kv_events_network and not cfg.models[0].kv_events_token_ids
    assert targets == {cfg.gateway.port, port}
    command = server["command"]
    assert command[:3] == ["servectl", "start", "--foreground"]
    mount = next(v["mountPath"] for v in server["volumeMounts"] if v["name"] == "config")
    assert command[command.index("--config") + 1] == f"{mount}/servectl.toml"
