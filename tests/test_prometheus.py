"""The shipped alert rules and dashboard (issue 56; docs/operations.md, "Alerts and a dashboard").

Unit: docs/deploy/prometheus-rules.yaml and docs/deploy/grafana-dashboard.json are well formed
(every rule has `for`, a severity and annotations naming the model; every panel a query), and
the gateway's counters behind the rules count what the manager's events say.

End-to-end: Debian's `prometheus` (its own port, a temporary TSDB, 1 s scrapes and rule
evaluations, the shipped rules) scrapes a real daemon of this module; `promtool check rules`
passes, every dashboard query returns data after a little traffic, every rule evaluates without
error over metric names the daemon exports, and the gateway-restart, hung-step, crash-loop and
failed alerts fire after the gateway is killed once, the worker stopped once and then SIGKILLed
until the model fails. Needs root for Debian's package (CI runs as root; there a skip,
or a missing prometheus, is a failure).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, DaemonFactory, http, wait_for

RULES = ROOT / "docs" / "deploy" / "prometheus-rules.yaml"
DASHBOARD = ROOT / "docs" / "deploy" / "grafana-dashboard.json"
MODEL = "default"
CRASH_LOOP_COUNT = 3
CONFIG = f"""[manager]
warm_standby = false
crash_loop_count = {CRASH_LOOP_COUNT}
crash_loop_window_s = 600
backoff_initial_s = 0.1
backoff_max_s = 0.5
"""
# What Grafana substitutes in a panel's query, as the test's values.
GRAFANA_VARIABLES = {"$__rate_interval": "2m", "$__range": "10m", "$model": MODEL}
SERIES_NAME = re.compile(r"\b(servectl_[a-z_]+|vllm:[a-z_]+)")

needs_root = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="Debian's prometheus needs root to install")


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels if p["type"] != "row" for t in p["targets"]]


def substituted(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


# ---- unit -------------------------------------------------------------------------------------


@pytest.mark.unit
def test_rules_have_for_severity_and_annotations_naming_the_model():
    yaml = pytest.importorskip("yaml", reason="PyYAML absent: the rules are parsed by promtool end to end")
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    names = {r["alert"] for r in rules}
    assert {"ServectlModelFailed", "ServectlModelCrashLooping", "ServectlEngineHung", "ServectlNoReadyReplica",
            "ServectlKVCacheNearlyFull", "ServectlQueueGrowing", "ServectlEvictionsThrashing",
            "ServectlGatewayRestarting"} <= names, names
    for r in rules:
        assert re.fullmatch(r"\d+[smh]", r.get("for", "")), r["alert"]
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        # Which model (or gateway): the label the expression keeps, in the summary.
        assert re.search(r"\{\{ \$labels\.(model|model_name|component) \}\}", r["annotations"]["summary"]), r["alert"]
        assert SERIES_NAME.search(r["expr"]), r["alert"]


@pytest.mark.unit
def test_dashboard_panels_each_have_a_query_per_model():
    dash = json.loads(DASHBOARD.read_text())
    assert 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["model"]["query"]["query"].startswith("label_values(")
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(panels) >= 12
    for p in panels:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert SERIES_NAME.search(t["expr"]), (p["title"], t["expr"])
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for family in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                   "vllm:e2e_request_latency_seconds_bucket", "vllm:kv_cache_usage_perc",
                   "vllm:num_requests_waiting", "servectl_requests_total", "servectl_engine_restarts_total",
                   "servectl_child_restarts", "servectl_child_state"):
        assert family in exprs, family
    # Every panel about models is narrowed to the chosen ones.
    assert all("$model" in t["expr"] for p in panels for t in p["targets"]
               if "model" in t["expr"] and "servectl_requests_total" not in t["expr"])


@pytest.mark.unit
def test_gateway_counts_restarts_hangs_and_evictions_from_model_events():
    from prometheus_client.parser import text_string_to_metric_families

    from api_gateway.metrics import Metrics
    from servectl.wire.vocab import ModelState as S

    m = Metrics()

    def values() -> dict:
        text = m.render()[0].decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples if not s.name.endswith("_created")}

    m.model_known("a")
    m.model_known("a@1")
    v = values()
    for name in ("servectl_engine_restarts_total", "servectl_engine_hangs_total", "servectl_model_evictions_total"):
        assert v[(name, (("model", "a@1"),))] == 0  # there before the first: increase() sees it
    m.model_event("a", S.EXITED, "worker:a:0 signal SIGKILL", hung=False)
    m.model_event("a", S.EXITED, "engine_core:a exit code 1 (killed as hung: a gateway saw no output in time)",
                  hung=True)
    m.model_event("a", S.EXITED, "engine_core:a exit code 75", hung=False)  # its workers missed the deadline
    m.model_event("a", S.EXITED, "worker:a:0 exit code 75", hung=False)  # a worker's own code: not a hang
    m.model_event("a", S.RELEASING, "evicted: model b needs room (...)", hung=False)
    m.model_event("a", S.RELEASING, "idle for 60 s", hung=False)
    m.model_event("a", S.BACKOFF, "", hung=True)
    v = values()
    assert v[("servectl_engine_restarts_total", (("model", "a"),))] == 4
    assert v[("servectl_engine_hangs_total", (("model", "a"),))] == 2
    assert v[("servectl_model_evictions_total", (("model", "a"),))] == 1
    m.child_restarts.labels(component="gateway:0").set(2)
    assert values()[("servectl_child_restarts", (("component", "gateway:0"),))] == 2


# ---- end to end -------------------------------------------------------------------------------


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} is missing: `python -m servectl.doctor --tests` installs Debian's prometheus"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """Debian's prometheus on a free loopback port, scraping one daemon every second."""

    def __init__(self, binary: str, tmp: Path, target_port: int):
        self.port = free_port()
        self.log_path = tmp / "prometheus.log"
        config = tmp / "prometheus.yml"
        # The shipped rules with their one-minute `for`s made 5 s: what fires is the same
        # expression, without a minute's wait per alert (the rules themselves: promtool, above).
        rules = tmp / "rules.yaml"
        rules.write_text(RULES.read_text().replace("for: 1m", "for: 5s"))
        config.write_text(f"""global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - {rules}
scrape_configs:
  - job_name: servectl
    static_configs:
      - targets: ["127.0.0.1:{target_port}"]
""")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                                          f"--web.listen-address=127.0.0.1:{self.port}"],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self.ready, 60, what="prometheus ready", diagnose=self.log)

    def log(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited {self.proc.returncode}:\n{self.log()}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def firing(self, states: tuple[str, ...] = ("firing",)) -> set[tuple[str, str]]:
        """(alertname, model) of every alert in one of ``states`` (pending: its `for` not over yet)."""
        return {(a["labels"]["alertname"], a["labels"].get("model", a["labels"].get("model_name", "")))
                for a in self.api("alerts")["alerts"] if a["state"] in states}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def prom_daemon(tmp_path_factory):
    with DaemonFactory(tmp_path_factory, "prometheus") as make:
        yield make(CONFIG)


@pytest.fixture(scope="module")
def prometheus(prom_daemon, tmp_path_factory):
    p = Prometheus(tool("prometheus"), tmp_path_factory.mktemp("prometheus"), prom_daemon.port)
    try:
        yield p
    finally:
        p.stop()


@needs_root
def test_promtool_checks_the_rules():
    proc = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 8 rules found" in proc.stdout, proc.stdout


@needs_root
def test_every_dashboard_query_returns_data_and_every_rule_evaluates(prom_daemon, prometheus):
    d = prom_daemon
    # A little traffic: past the engine's 16 warm-up steps (it then publishes its step deadline),
    # a stream, and a refused request (the errors panel).
    for _ in range(3):
        r = http(d, "POST", "/v1/completions", {"model": MODEL, "prompt": "def ", "max_tokens": 12,
                                                "ignore_eos": True})
        assert r.status == 200, r.text
    r = http(d, "POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 8, "stream": True,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 200, r.text
    assert http(d, "POST", "/v1/completions", {"model": "no-such-model", "prompt": "x"}).status == 404

    queries = [(title, substituted(expr)) for title, expr in dashboard_queries()]
    assert all("$" not in expr for _, expr in queries), queries

    def empty() -> list:
        return [q for q in queries if not prometheus.query(q[1])]

    wait_for(lambda: not empty(), 90, interval=1, what="every dashboard query to return data",
             diagnose=lambda: "\n".join(f"{t}: {e}" for t, e in empty()))

    # The rules: every one evaluated, without error, over series the daemon exports.
    rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
    assert len(rules) == 8
    wait_for(lambda: all(r["health"] == "ok" for g in prometheus.api("rules")["groups"] for r in g["rules"]), 30,
             what="every rule evaluated", diagnose=lambda: str(prometheus.api("rules")))
    exported = set(prometheus.api("label/__name__/values"))
    for r in rules:
        for name in SERIES_NAME.findall(r["query"]):
            assert name in exported, (r["name"], name)
    assert not prometheus.firing(("pending", "firing")), prometheus.api("alerts")


@needs_root
def test_restart_hang_and_crash_loop_alerts_fire(prom_daemon, prometheus):
    """The gateway is SIGKILLed once, the worker hangs once (SIGSTOP: the engine's step deadline
    finds it), then is SIGKILLed until the model fails: the gateway-restart, hung-step,
    crash-loop and failed alerts fire, no-ready-replica is pending."""
    d = prom_daemon
    component = f"worker:{MODEL}:0"
    request = {"model": MODEL, "prompt": "def ", "max_tokens": 12, "ignore_eos": True}

    def model_state() -> str:
        return next(m.state for m in d.status().models if m.name == MODEL)

    def worker_back(pid: int) -> None:
        wait_for(lambda: d.child(component).pid not in (None, pid), 180, what=f"{component} back",
                 diagnose=lambda: d.log_tails("manager", f"engine_core:{MODEL}"))

    def ready() -> None:
        wait_for(lambda: model_state() == "ready", 180, what=f"{MODEL} ready",
                 diagnose=lambda: d.log_tails("manager", f"engine_core:{MODEL}"))

    def scraped(expr: str) -> None:
        wait_for(lambda: prometheus.query(expr), 60, interval=0.5, what=f"prometheus to scrape {expr}",
                 diagnose=prometheus.log)

    # Prometheus has the counts before anything happens (an increase needs where it started).
    ready()
    scraped('servectl_child_restarts{component="gateway:0"} == 0')
    scraped(f'servectl_engine_hangs_total{{model="{MODEL}"}} == 0')
    # The gateway first: its successor (same port) reads the states and restart counts from the
    # manager's snapshot, and its predecessor's view of them leaves /metrics.
    gateway = d.child("gateway:0").pid
    os.kill(gateway, signal.SIGKILL)
    wait_for(lambda: d.child("gateway:0").pid not in (None, gateway) and d.child("gateway:0").state == "ready", 60,
             what="gateway:0 back", diagnose=lambda: d.log_tails("manager", "gateway:0"))
    scraped('servectl_child_restarts{component="gateway:0"} == 1')
    # Warm (the step deadline is then the short floor, not the first steps' long timeout), then
    # the same request with the worker stopped: a hung step, and the group's first exit.
    for _ in range(3):
        assert http(d, "POST", "/v1/completions", request).status == 200
    wait_for(lambda: next(m for m in d.status().models if m.name == MODEL).step_deadline_s is not None, 30,
             what="the engine's step deadline published")
    pid = d.child(component).pid
    os.kill(pid, signal.SIGSTOP)
    http(d, "POST", "/v1/completions", request, timeout=300)  # resumed on the next engine, or refused
    worker_back(pid)
    # Then killed until the crash loop fails the model.
    for i in range(1, CRASH_LOOP_COUNT):
        ready()
        pid = d.child(component).pid
        os.kill(pid, signal.SIGKILL)
        if i < CRASH_LOOP_COUNT - 1:
            worker_back(pid)
    wait_for(lambda: model_state() == "failed", 60, what=f"{MODEL} failed (the crash loop)",
             diagnose=lambda: d.log_tails("manager"))
    alerts = {("ServectlEngineHung", MODEL), ("ServectlModelCrashLooping", MODEL), ("ServectlModelFailed", MODEL),
              ("ServectlGatewayRestarting", "")}
    wait_for(lambda: alerts <= prometheus.firing(), 180, interval=1, what=f"{alerts} firing",
             diagnose=lambda: json.dumps(prometheus.api("alerts"), indent=1) + "\n" + prometheus.log())
    # No replica serves it any more: pending (its `for` is 10 minutes, longer than a load). Only
    # the live gateway's view counts: the dead one's "ready" would hide this.
    assert ("ServectlNoReadyReplica", MODEL) in prometheus.firing(("pending", "firing")), prometheus.api("alerts")
    for name, count in (("servectl_engine_restarts_total", CRASH_LOOP_COUNT), ("servectl_engine_hangs_total", 1)):
        series = prometheus.query(f'{name}{{model="{MODEL}"}}')
        assert float(series[0]["value"][1]) == count, (name, series)
    # The manager's own count of the worker's restarts reached Prometheus too.
    worker = prometheus.query(f'servectl_child_restarts{{component="{component}"}}')
    assert worker and float(worker[0]["value"][1]) >= CRASH_LOOP_COUNT - 1, worker
