"""Shared fixtures: real daemons with the real vLLM engine and the default model.

Every daemon gets its own runtime directory and a free port (``--port 0``; the
manager reports the port it bound), so tests run beside a user's daemon. A
daemon that a test does not kill is shared (session scope). Daemons come from
one factory (``daemon_factory``, ``DaemonFactory``), whose teardown stops
each and checks, through the instance tag and the test's own mark in
/proc/<pid>/environ, that nothing is left; requests go through ``http()``.

Importing this file loads no vLLM or torch (``pytest -m unit`` runs without
them); only the daemon fixtures start anything.
"""

from __future__ import annotations

import gc
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import contextlib
import time
import urllib.error
import urllib.request
from email.message import Message
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from servectl.client import ControlClient, NotRunning  # noqa: E402
from servectl.config import DEFAULT_MODEL_DIR  # noqa: E402
from servectl.proc import all_pids, environ_of, is_zombie, processes_of_instance  # noqa: E402

SERVECTL = [sys.executable, "-m", "servectl.cli"]
SHARED_API_KEY = "sk-servectl-test"
TEST_MARK_ENV = "SERVECTL_TEST_DAEMON"


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition", diagnose=None):
    """Tests may wait with a deadline (product code may not).

    ``diagnose`` returns text (log tails) worth reading when the wait fails.
    """
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            extra = f"\n{diagnose()}" if diagnose is not None else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{extra}")
        time.sleep(interval)


class Response(NamedTuple):
    status: int
    headers: Message  # case-insensitive: headers["retry-after"] == headers["Retry-After"]
    body: bytes

    def json(self):
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode()


DAEMON_KEY = object()  # http(): the daemon's API key, if it has one


def http(target: "Daemon | str", method: str, path: str, body: bytes | str | dict | list | None = None,
         headers: dict[str, str] | None = None, *, key: str | None | object = DAEMON_KEY,
         timeout: float = 120) -> Response:
    """One HTTP request to a daemon (or a base URL); every status comes back, none raises.

    A dict or list body is sent as JSON; ``key`` is the bearer token (the
    daemon's own by default, ``None`` for no Authorization header).
    """
    base = target.base_url if isinstance(target, Daemon) else target
    if key is DAEMON_KEY:
        key = target.api_key if isinstance(target, Daemon) else None
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    h = {"Content-Type": "application/json"} if body is not None else {}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    h.update(headers or {})
    req = urllib.request.Request(f"{base}{path}", data=body, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Response(resp.status, resp.headers, resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return Response(exc.code, exc.headers, exc.read())


class Daemon:
    """A servectl daemon started through the CLI, as an operator would.

    Make them with ``daemon_factory`` (or ``DaemonFactory``), which stops them
    and checks that nothing of their tree is left.
    """

    def __init__(self, tmp: Path, config: str = "", args: list[str] | None = None, env: dict | None = None,
                 api_key: str | None = None, command: list[str] | None = None, cwd: Path | None = None):
        self.api_key = api_key
        # The `servectl` command and its working directory: this checkout's by default; an installed
        # one (tests/test_install.py) runs from outside the tree.
        self.command = command or SERVECTL
        self.cwd = cwd or ROOT
        self.runtime_dir = tmp / "rt"
        self.config_path = tmp / "servectl.toml"
        self.config_path.write_text(config)
        self.args = args or []
        # Every process this daemon's CLI starts inherits the mark, so a tree is
        # found in /proc even before (or without) the manager telling its instance.
        token = secrets.token_hex(8)
        self.mark = f"{TEST_MARK_ENV}={token}".encode()  # as it appears in /proc/<pid>/environ
        self.env = {**os.environ, **(env or {}), TEST_MARK_ENV: token}
        self.instance = None
        self.instances: list[str] = []  # every tree this daemon had (a restart after a kill is a new one)
        self.port = None
        self.manager_pid = None
        self.start_output: subprocess.CompletedProcess | None = None

    def cli(self, *args: str, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
        proc = subprocess.run([*self.command, *args, "--runtime-dir", str(self.runtime_dir)], capture_output=True,
                              text=True, env=self.env, timeout=timeout, cwd=self.cwd)
        if check and proc.returncode != 0:
            raise AssertionError(f"servectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def start(self, expect_ok: bool = True) -> subprocess.CompletedProcess:
        proc = self.cli("start", "--config", str(self.config_path), "--port", "0", *self.args)
        self.start_output = proc
        self.attach()  # whatever the outcome: a manager that answers is ours to stop
        if expect_ok and proc.returncode != 0:
            raise AssertionError(f"servectl start failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def attach(self) -> bool:
        """Learn the running manager's instance, port and pid (False if none answers)."""
        try:
            st = self.status()
        except NotRunning:
            return False
        self.instance, self.port, self.manager_pid = st.instance, st.port, st.manager_pid
        if st.instance not in self.instances:
            self.instances.append(st.instance)
        return True

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status(self):
        return ControlClient(self.runtime_dir).status()

    def child(self, component: str):
        return next(c for c in self.status().children if c.component == component)

    def openai(self, **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=kw.pop("api_key", self.api_key or "unused"),
                             max_retries=0, timeout=kw.pop("timeout", 120), **kw)

    def standbys(self) -> dict[str, object]:
        """Warm standbys by the member they stand in for (``worker:a:0``)."""
        return {c.component.removeprefix("standby:"): c for c in self.status().children if c.kind == "standby"}

    def wait_standbys_warm(self, count: int, timeout: float = 180) -> dict[str, object]:
        """Until ``count`` standbys have imported vLLM and sleep waiting for a role."""
        return wait_for(lambda: (lambda s: len(s) == count and all(c.state == "ready" for c in s.values()) and s)(
            self.standbys()), timeout, interval=0.5, what=f"{count} warm standbys",
            diagnose=lambda: str(self.standbys()))

    def log(self, component: str) -> str:
        path = self.runtime_dir / "state" / "logs" / f"{component.replace(':', '-')}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tails(self, *components: str, lines: int = 25) -> str:
        """The last lines of each component's log, for a failing test's message."""
        return "\n".join(f"--- {c}\n" + "\n".join(self.log(c).splitlines()[-lines:]) for c in components)

    def tree(self) -> list[int]:
        """The live processes of the current instance."""
        return processes_of_instance(self.instance) if self.instance else []

    def leftovers(self) -> list[int]:
        """Every live process of every tree this daemon had, and any carrying its mark."""
        pids = {pid for inst in self.instances for pid in processes_of_instance(inst)}
        pids.update(pid for pid in all_pids() if pid != os.getpid() and self.mark in environ_of(pid)
                    and not is_zombie(pid))
        return sorted(pids)

    def stop(self) -> None:
        """``servectl stop``, then wait until nothing of the tree is left."""
        if self.instances or self.runtime_dir.exists():
            self.cli("stop", timeout=120)
        wait_for(lambda: not self.leftovers(), 60, what="every process of the tree to exit",
                 diagnose=lambda: f"left: {self.leftovers()}")

    def kill_all(self) -> list[int]:
        """Last resort: SIGKILL (after SIGCONT) whatever of the tree is left, by pid; returns those pids."""
        left = self.leftovers()
        for pid in left:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


class NamespaceDaemon(Daemon):
    """A daemon started inside a network namespace (tests/netns.py's hosts: ``topo.host_ns[index]``);
    the CLI's other verbs reach it over its runtime directory's Unix sockets from anywhere."""

    def __init__(self, tmp: Path, topo, index: int, config: str, **kw):
        self.topo, self.ns, self.ip = topo, topo.host_ns[index], topo.host_ip[index]
        super().__init__(tmp, config=config, **kw)

    def start(self, expect_ok: bool = True) -> subprocess.CompletedProcess:
        argv = [*SERVECTL, "start", "--config", str(self.config_path), "--runtime-dir", str(self.runtime_dir)]
        proc = subprocess.run(self.topo.command(self.ns, argv), capture_output=True, text=True, env=self.env,
                              timeout=600, cwd=ROOT)
        self.start_output = proc
        self.attach()
        if expect_ok and proc.returncode != 0:
            raise AssertionError(f"servectl start in {self.ns} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    @property
    def base_url(self) -> str:
        return f"http://{self.ip}:{self.port}"


class DaemonFactory:
    """Makes ``Daemon``s; ``close()`` stops every one and asserts that nothing of
    any of their trees is left (what is left is SIGKILLed first, by pid)."""

    def __init__(self, tmp_path_factory, name: str):
        self.tmp_path_factory = tmp_path_factory
        self.name = name
        self.daemons: list[Daemon] = []

    def __call__(self, config: str = "", *, args: list[str] | None = None, env: dict | None = None,
                 api_key: str | None = None, start: bool = True, expect_ok: bool = True,
                 command: list[str] | None = None, cwd: Path | None = None) -> Daemon:
        d = Daemon(self.tmp_path_factory.mktemp(self.name), config=config, args=args, env=env, api_key=api_key,
                   command=command, cwd=cwd)
        self.daemons.append(d)
        if start:
            d.start(expect_ok=expect_ok)
        return d

    def close(self) -> None:
        problems = []
        for d in self.daemons:
            try:
                d.stop()
            except Exception as exc:  # noqa: BLE001 - still kill and report
                problems.append(f"{d.runtime_dir}: stop failed: {exc}")
            killed = d.kill_all()
            if killed:
                problems.append(f"{d.runtime_dir}: processes left after stop (SIGKILLed): {killed}")
        assert not problems, "\n".join(problems)

    def __enter__(self) -> "DaemonFactory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def daemon_factory(tmp_path_factory, request):
    """Start daemons in a test; every one is stopped at teardown, nothing of it left."""
    with DaemonFactory(tmp_path_factory, request.node.name[:40]) as make:
        yield make


class EventStream:
    """The manager's events (its PUB socket), subscribed before the test acts.

    PUB sends nothing to a subscriber whose subscription has not reached it
    yet, and says nothing when it has. So the stream is only handed out once
    an event came through: the SUB handshake first, then a probe that makes the
    manager publish (``servectl freeze MODEL off`` then ``on``: a thaw, or a
    freeze once the engine is idle again; freezing stays on as configured).
    """

    def __init__(self, d: Daemon, probe_model: str, timeout: float = 60):
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        from servectl.wire import status as WS

        self.decoder = WS.event_decoder
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            self.sub.connect(f"ipc://{d.runtime_dir / 'events'}")
            assert monitor.poll(10000), "no connection to the events socket"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        finally:
            self.sub.disable_monitor()
            monitor.close()
        d.cli("freeze", probe_model, "off", check=True)
        d.cli("freeze", probe_model, "on", check=True)
        self.seen: list = []
        self.until(lambda seen: any(e.component == f"model:{probe_model}" for e in seen), timeout,
                   what="the probe's event (the subscription is in place)")
        self.seen.clear()

    def until(self, predicate, timeout: float, what: str = "events") -> list:
        """Collect events into ``seen`` until ``predicate(seen)`` holds."""
        end = time.monotonic() + timeout
        while not predicate(self.seen):
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; seen: "
                                     f"{[(e.component, e.state) for e in self.seen]}")
            if self.sub.poll(int(min(left, 1.0) * 1000)):
                self.seen.append(self.decoder.decode(self.sub.recv()))
        return self.seen

    def close(self) -> None:
        self.sub.close()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    assert (DEFAULT_MODEL_DIR / "config.json").exists(), "the default model is missing"
    return DEFAULT_MODEL_DIR


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    """The shared daemon: default model, one gateway, a short freeze grace."""
    with DaemonFactory(tmp_path_factory, "shared") as make:
        yield make(f'[gateway]\napi_keys = ["{SHARED_API_KEY}"]\n[manager]\nfreeze_grace_s = 1.0\n',
                   api_key=SHARED_API_KEY)


TOOLS_MODEL_DIR = DEFAULT_MODEL_DIR.parent / "tools"
# The tool-calling models (issue 31), configured as `vllm serve` would be with the same flags:
# `tools` (the bundled tool-calling model: hermes calls, qwen3 reasoning) and `default-hermes`
# (the default model with a tool parser: constrained calls under `required` / a named choice).
TOOL_MODELS = {
    "tools": (TOOLS_MODEL_DIR, ["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                "--reasoning-parser", "qwen3"], 2048),
    "default-hermes": (DEFAULT_MODEL_DIR, ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], 512),
}
# Both publish vLLM's KV-cache events (tests/test_kv_events.py): `tools` on the default
# endpoint (a socket in the runtime directory) with token ids (its opt-in), `default-hermes` on
# loopback TCP, these ports, without (the default).
TOOLS_KV_EVENTS_PORT = 5571
TOOLS_KV_REPLAY_PORT = 5581
TOOLS_CONFIG = f"""[manager]
warm_standby = false
[[models]]
name = "tools"
model = "{TOOLS_MODEL_DIR}"
enable_auto_tool_choice = true
tool_call_parser = "hermes"
kv_events_token_ids = true
[models.engine_args]
dtype = "float32"
reasoning_parser = "qwen3"
kv_events_config = {{ enable_kv_cache_events = true }}
[[models]]
name = "default-hermes"
model = "{DEFAULT_MODEL_DIR}"
enable_auto_tool_choice = true
tool_call_parser = "hermes"
[models.engine_args]
dtype = "float32"
[models.engine_args.kv_events_config]
enable_kv_cache_events = true
endpoint = "tcp://127.0.0.1:{TOOLS_KV_EVENTS_PORT}"
replay_endpoint = "tcp://127.0.0.1:{TOOLS_KV_REPLAY_PORT}"
"""


# Issue 33: the default model served again as an embedding model and as a classifier (vLLM's
# engine arguments), beside itself generating. name -> engine arguments (also `vllm serve` flags).
# The classifier is servectl/model/classify (the default model with a trained head): `convert =
# "classify"` on a model without one gives it an uninitialised head. name -> (model, engine arguments).
CLASSIFY_MODEL_DIR = DEFAULT_MODEL_DIR.parent / "classify"
POOLING_MODELS = {
    "default-embed": (DEFAULT_MODEL_DIR, {"runner": "pooling", "convert": "embed", "dtype": "float32"}),
    "classify": (CLASSIFY_MODEL_DIR, {"runner": "pooling", "dtype": "float32"}),
}
POOLING_CONFIG = "[manager]\nwarm_standby = false\n[[models]]\nname = \"default\"\nmodel = \"%s\"\n" % DEFAULT_MODEL_DIR + "".join(
    f'[[models]]\nname = "{name}"\nmodel = "{model}"\n[models.engine_args]\n'
    + "".join(f'{k} = "{v}"\n' for k, v in args.items()) for name, (model, args) in POOLING_MODELS.items())


@pytest.fixture(scope="session")
def pooling_daemon(tmp_path_factory):
    """The pooling tests' daemon (no kills): `default` generating, `default-embed`, `classify`."""
    with DaemonFactory(tmp_path_factory, "pooling") as make:
        yield make(POOLING_CONFIG)


@pytest.fixture(scope="session")
def tools_daemon(tmp_path_factory):
    """The tool-calling tests' daemon (no kills, no reconfiguring): both TOOL_MODELS."""
    with DaemonFactory(tmp_path_factory, "tools") as make:
        yield make(TOOLS_CONFIG)


def requests_running(d: "Daemon", model: str | None = None) -> float:
    """``servectl_requests_running`` (the engines' unfinished requests) plus
    ``servectl_requests_waiting`` (sequences the gateways hold), for one model or all."""
    total = 0.0
    for line in http(d, "GET", "/metrics", key=None, timeout=30).text.splitlines():
        if line.startswith(("servectl_requests_running{", "servectl_requests_waiting{")):
            if model is None or f'model="{model}"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def assert_nothing_running(d: "Daemon", timeout: float = 30) -> None:
    wait_for(lambda: requests_running(d) == 0, timeout, interval=0.2,
             what="servectl_requests_running and _waiting back to 0", diagnose=lambda: str(requests_running(d)))


@pytest.fixture(autouse=True)
def _nothing_left_running(request):
    """After every test that used the shared daemon: nothing of its load is left in flight."""
    yield
    if "daemon" in request.fixturenames:
        d = request.getfixturevalue("daemon")
        if d.port:
            assert_nothing_running(d)


class VllmServe(NamedTuple):
    base_url: str
    log: Path


@pytest.fixture(scope="session")
def vllm_serve(tmp_path_factory):
    """One `vllm serve` of the bundled model for the whole run, started as the benchmark starts
    it (same venv, float32, eager, the same KV cache and max_model_len; bench/run.py: VllmServe).
    Its model is served as `default`, without API keys."""
    from bench.run import VllmServe as Server, wait_completion

    server = Server(tmp_path_factory.mktemp("vllm-serve"))
    server.start()
    log = server.workdir / "vllm.log"
    try:
        if wait_completion(server.base, server.proc, 900) is None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else ""
            raise AssertionError(f"vllm serve did not answer a completion within 900 s:\n{tail}")
        yield VllmServe(server.base, log)
    finally:
        server.stop()


def read_stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def context_switches(pids: list[int]) -> int:
    """Voluntary + involuntary switches summed over every thread of every pid."""
    total = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                for line in (task / "status").read_text().splitlines():
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        total += int(line.split()[1])
            except OSError:
                continue
    return total


def sse_lines(text: str) -> list[str]:
    """An event stream's lines, split as the SSE spec says (CR, LF, CRLF) — not str.splitlines(),
    which also splits at U+2028 and other characters a JSON string may hold unescaped."""
    return re.split(r"\r\n|\r|\n", text)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in sse_lines(text) if line.startswith("data: {")]


# ---- the unit tier loads no vLLM or torch ---------------------------------------------

HEAVY = ("vllm", "torch")
_heavy_since: list[str] = []  # the collector or test after which vLLM/torch were first in sys.modules


def heavy_modules() -> list[str]:
    return sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)


class _NoHeavyImports:
    """A ``sys.meta_path`` finder that refuses vLLM and torch, as if they were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HEAVY:
            raise ImportError(f"the unit tier imports no vLLM or torch, not even lazily: {name!r} refused by "
                              f"tests/conftest.py (a test that needs it is marked vllm_unit, not unit)")
        return None


def _takes(markexpr: str, *marks: str) -> bool:
    """Whether ``-m markexpr`` selects a test that carries exactly these marks."""
    from _pytest.mark.expression import Expression  # pytest's own -m parser

    return Expression.compile(markexpr).evaluate(lambda name, /, **kwargs: name in marks)


def selects_unit_tier(markexpr: str) -> bool:
    """Whether ``-m markexpr`` selects unit tests only (``unit``, ``deep``, ``unit and not ...``)."""
    return bool(markexpr) and (_takes(markexpr, "unit") or _takes(markexpr, "unit", "deep")) and not (
        _takes(markexpr) or _takes(markexpr, "vllm_unit"))


def unit_tests_taken(markexpr: str) -> bool:
    """Whether ``-m markexpr`` selects the unit tests that are not properties (``-m unit``)."""
    return bool(markexpr) and _takes(markexpr, "unit")


def pytest_configure(config):
    """The unit tier (``-m unit``): vLLM and torch cannot be imported at all, so a unit test that
    reaches them fails where it reaches them, and hypothesis runs the ``unit`` profile (few
    examples, the same each run); every other run runs the properties ``deep``."""
    if selects_unit_tier(config.option.markexpr) and not any(isinstance(f, _NoHeavyImports) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoHeavyImports())
    from hypothesis import settings

    settings.register_profile("unit", max_examples=20, deadline=None, derandomize=True)
    settings.register_profile("deep", max_examples=200, deadline=None)
    if not config.getoption("hypothesis_profile", None):  # --hypothesis-profile still wins
        # `-m deep` alone takes no unit test that is not a property: the properties run deep.
        settings.load_profile("unit" if unit_tests_taken(config.option.markexpr) else "deep")


def pytest_ignore_collect(collection_path, config):
    """The unit tier imports only the files that name the ``unit`` or ``deep`` mark: a file that
    never does holds no unit test, and importing the end-to-end files (openai, their helpers) was
    a sixth of the tier's time."""
    if (collection_path.suffix == ".py" and collection_path.name.startswith("test_")
            and selects_unit_tier(config.option.markexpr)):
        try:
            text = collection_path.read_text()
        except OSError:
            return None
        if "mark.unit" not in text and "mark.deep" not in text:
            return True
    return None


def pytest_collectreport(report):
    if not _heavy_since and heavy_modules():
        _heavy_since.append(f"collecting {report.nodeid}")


def pytest_collection_finish(session):
    """What collection built (every test module, their imports) lives for the session: frozen out
    of the garbage collector, so a collection during a test, pytest's own at the end and the
    interpreter's at exit scan only what tests made (the unit tier spent ~6 s at exit without it)."""
    gc.collect()
    gc.freeze()


def pytest_runtest_teardown(item):
    if not _heavy_since and heavy_modules():
        _heavy_since.append(f"running {item.nodeid}")


def pytest_sessionfinish(session, exitstatus):
    """`pytest -m unit` must not import vLLM or torch (collection included): fail the run if it did."""
    items = getattr(session, "items", None)
    if not items or not all(item.get_closest_marker("unit") for item in items) or not heavy_modules():
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", "unit tier loaded vLLM/torch", red=True)
        reporter.write_line(f"first seen after {_heavy_since[0] if _heavy_since else '?'}: "
                            f"{', '.join(heavy_modules()[:5])} ...")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@contextlib.contextmanager
def vllm_serving(server, what: str):
    """A started ``bench.run.VllmServe`` once healthy (up to 15 minutes), stopped on the way out."""
    server.start()
    log = server.workdir / "vllm.log"
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and server.proc.poll() is None:
            try:
                if http(server.base, "GET", "/health", key=None, timeout=5).status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else ""
            raise AssertionError(f"vllm serve ({what}) did not become healthy:\n{tail}")
        yield server.base
    finally:
        server.stop()
