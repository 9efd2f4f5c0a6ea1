"""Issue 5: config files, several models, reload, systemd, logs, status."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time

import pytest

from conftest import ROOT, SERVECTL, http, wait_for
from servectl.config import DEFAULT_MODEL_DIR


def check(tmp_path, text: str) -> subprocess.CompletedProcess:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return subprocess.run([*SERVECTL, "config", "check", str(path)], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize("text,needle", [
    ("[gateway]\nprot = 1\n", "prot"),
    ("[gateway]\nport = 'eighty'\n", "gateway.port"),
    ("[gateway]\nport = 70000\n", "gateway.port"),
    ("[manager]\ncrash_loop_count = 0\n", "manager.crash_loop_count"),
    ("[[models]]\nname = 'a b'\nmodel = '/x'\n", "models[0].name"),
    ("[[models]]\nname = 'x'\n", "model"),
    ("not toml at all [", "TOML"),
])
def test_config_errors_name_the_key_and_the_file(tmp_path, text, needle):
    proc = check(tmp_path, text)
    assert proc.returncode == 2
    msg = " ".join(proc.stderr.split())
    assert needle in msg and "c.toml" in msg, msg
    assert "Traceback" not in proc.stderr


def test_unknown_engine_argument_rejected_by_vllm(tmp_path):
    proc = check(tmp_path, f"[[models]]\nname = 'x'\nmodel = '{DEFAULT_MODEL_DIR}'\n"
                           "[models.engine_args]\nbogus_setting = 1\n")
    assert proc.returncode == 2
    assert "bogus_setting" in proc.stderr


def test_config_check_prints_the_effective_config(tmp_path):
    proc = check(tmp_path, "[gateway]\nport = 9999\n")
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout)
    assert cfg["gateway"]["port"] == 9999
    assert "kv_cache_memory_bytes" in cfg["models"][0]["engine_args"]  # defaults filled in
    assert cfg["models"][0]["name"] == "default"


def test_example_config_is_valid(tmp_path):
    text = (ROOT / "docs" / "servectl.example.toml").read_text().replace("/path/to/hf/model/dir",
                                                                       str(DEFAULT_MODEL_DIR))
    proc = check(tmp_path, text)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.unit  # the CLI refuses the file: no daemon, no vLLM
def test_start_with_bad_config_starts_nothing(daemon_factory):
    d = daemon_factory("[gateway]\nport = -1\n", start=False)
    proc = d.start(expect_ok=False)
    assert proc.returncode == 2 and "gateway.port" in " ".join(proc.stderr.split())
    assert not (d.runtime_dir / "control").exists()
    assert d.leftovers() == []


@pytest.mark.unit  # CLI processes only
def test_commands_say_plainly_when_not_running(daemon_factory):
    d = daemon_factory(start=False)
    # The commands run side by side (each is an interpreter start, most of this test's time).
    commands = (["status"], ["restart"], ["reload"], ["unload", "x"], ["stop"])
    procs = [subprocess.Popen([*SERVECTL, *args, "--runtime-dir", str(d.runtime_dir)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=d.env, cwd=ROOT) for args in commands]
    outs = [proc.communicate(timeout=120) for proc in procs]
    for args, proc, (stdout, stderr) in zip(commands[:-1], procs, outs):
        assert proc.returncode == 3, (args, stdout, stderr)
        assert "not running" in stderr and str(d.runtime_dir) in " ".join(stderr.split())
    assert procs[-1].returncode == 0 and "not running" in outs[-1][0]


@pytest.mark.unit  # a file only
def test_systemd_unit_keys():
    """The unit's own keys (`systemd-analyze verify` of it, with the installed command: test_install.py)."""
    unit = (ROOT / "systemd" / "servectl.service").read_text()
    for key in ("Type=notify", "KillMode=mixed", "RuntimeDirectory=servectl", "RuntimeDirectoryMode=0750",
                "Restart=on-failure", "ExecReload=", "TimeoutStopSec="):
        assert key in unit, key
    assert "PrivateDevices=yes" not in unit


def test_sd_notify_protocol(tmp_path, daemon_factory):
    d = daemon_factory(start=False)
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(1.0)
    env = {**d.env, "NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "2000000"}
    proc = subprocess.Popen([*SERVECTL, "start", "--foreground", "--runtime-dir", str(d.runtime_dir), "--port", "0"],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env["WATCHDOG_PID"] = str(proc.pid)
    messages: list[str] = []

    def until(needle: str, timeout: float):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                messages.append(sock.recv(4096).decode())
            except socket.timeout:
                continue
            if any(needle in m for m in messages):
                return
        raise AssertionError(f"no {needle!r} in {messages}")

    try:
        until("READY=1", 300)
        assert d.attach() and d.manager_pid == proc.pid  # the foreground CLI became the manager
        assert any(m.startswith("STATUS=") for m in messages)
        assert any("WATCHDOG=1" in m for m in messages)
        messages.clear()
        until("WATCHDOG=1", 5)  # again: it is periodic while systemd asks for it
        proc.send_signal(signal.SIGHUP)
        until("RELOADING=1", 30)
        reloading = next(m for m in messages if "RELOADING=1" in m)
        assert "MONOTONIC_USEC=" in reloading
        messages.clear()
        until("READY=1", 60)
        proc.send_signal(signal.SIGTERM)
        until("STOPPING=1", 30)
        assert proc.wait(120) == 0  # the foreground manager exits 0 after a clean stop
        wait_for(lambda: not d.leftovers(), 60, what="the tree to exit with the manager")
    finally:
        sock.close()
        if proc.poll() is None:  # failed before the stop: kill the tree, by its pids
            d.kill_all()
            proc.wait()


# hold_timeout_s: how long a reload waits for a rolled model's new group (a cold start; minutes on a
# loaded 2-core machine, past the default 60 s).
MODEL = f'name = "{{name}}"\nmodel = "{DEFAULT_MODEL_DIR}"\nhold_timeout_s = 300\n'


def status_of(d, path: str, key: str | None) -> int:
    return http(d, "GET", path, key=key, timeout=30).status


def test_several_models_load_unload_reload(tmp_path, daemon_factory):
    keyfile = tmp_path / "keys"
    keyfile.write_text("sk-ops\n")
    one = "[[models]]\n" + MODEL.format(name="one")
    two = "[[models]]\n" + MODEL.format(name="two")
    d = daemon_factory(one + two, args=["--api-key-file", str(keyfile)], api_key="sk-ops")
    api = d.openai()
    assert sorted(m.id for m in api.models.list().data) == ["one", "two"]
    for name in ("one", "two"):
        assert api.completions.create(model=name, prompt="x", max_tokens=2).choices
    before = {c.component: c.pid for c in d.status().children}

    # load / unload at runtime
    proc = d.cli("load", "extra", "--model", str(DEFAULT_MODEL_DIR))
    assert proc.returncode == 0, proc.stderr
    wait_for(lambda: any(m.name == "extra" and m.state == "ready" for m in d.status().models), 300,
             interval=1, what="extra ready")
    assert api.completions.create(model="extra", prompt="x", max_tokens=2).choices
    assert d.cli("unload", "extra").returncode == 0
    wait_for(lambda: all(m.name != "extra" for m in d.status().models), 120, what="extra gone")
    assert status_of(d, "/v1/models/extra", "sk-ops") == 404
    now = {c.component: c.pid for c in d.status().children}
    assert all(now[k] == v for k, v in before.items()), "load/unload touched other processes"

    # reload: change one, drop two, add three, change the gateway section.
    changed = "[[models]]\n" + MODEL.format(name="one") + "[models.engine_args]\nmax_num_seqs = 8\n"
    three = "[[models]]\n" + MODEL.format(name="three")
    d.config_path.write_text("[gateway]\nprocesses = 2\n" + changed + three)
    warm = d.wait_standbys_warm(4)  # one's and two's
    proc = d.cli("reload")
    assert proc.returncode == 0, proc.stderr
    # `servectl reload` answers once the reload is applied: two is gone, one
    # restarted, three started, gateway 0 replaced (its successor is ready).
    st = d.status()
    applied = {c.component: c.pid for c in st.children}
    # one is rolled out: a new group beside the old (docs/operations.md), ready when reload answers
    assert "one rolled" in proc.stdout, proc.stdout
    assert sorted(m.name for m in st.models) == ["one@1", "three"]
    assert not any(c.model in ("two", "one") for c in st.children), applied
    assert applied["engine_core:one@1"] and "engine_core:one" not in applied
    assert "engine_core:three" in applied
    assert applied["gateway:0"] != before["gateway:0"]  # the gateway section changed
    assert d.child("gateway:0").state == "ready"
    assert "gateway:1" in applied
    # Loading the models takes its time.
    wait_for(lambda: {m.name: m.state for m in d.status().models} == {"one@1": "ready", "three": "ready"}
             and {c.component: c.state for c in d.status().children if c.kind == "gateway"}
             == {"gateway:0": "ready", "gateway:1": "ready"},
             300, interval=1, what="the reloaded models and gateways ready")
    assert applied["engine_core:one@1"] == d.child("engine_core:one@1").pid  # started once, by the reload
    # ... on one's warm standbys (issue 57: a roll imports nothing; the environment is the same)
    assert (applied["engine_core:one@1"], applied["worker:one@1:0"]) == \
        (warm["engine_core:one"].pid, warm["worker:one:0"].pid)
    assert api.completions.create(model="three", prompt="x", max_tokens=2).choices
    # The start option (--api-key-file) is still in force after the reload.
    assert status_of(d, "/v1/models", None) == 401
    assert status_of(d, "/v1/models", "sk-ops") == 200

    # A reload with nothing changed touches nothing (it has been applied when the command returns).
    steady = {c.component: c.pid for c in d.status().children}
    proc = d.cli("reload")
    assert proc.returncode == 0, proc.stderr
    assert "added -; removed -; changed -; gateway unchanged" in proc.stdout, proc.stdout
    assert {c.component: c.pid for c in d.status().children} == steady
    assert {m.name: m.state for m in d.status().models} == {"one@1": "ready", "three": "ready"}


def test_logs_command(daemon):
    proc = daemon.cli("logs", "engine_core:default", "-n", "5")
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
    proc = daemon.cli("logs", "nonsense")
    assert proc.returncode == 2 and "gateway-0" in proc.stderr
