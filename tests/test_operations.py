"""Issue 5: config files, several models, reload, systemd, logs, status."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from conftest import ROOT, SERVECTL, Daemon, wait_for
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


def test_start_with_bad_config_starts_nothing(tmp_path):
    d = Daemon(tmp_path, config="[gateway]\nport = -1\n")
    proc = d.cli("start", "--config", str(d.config_path))
    assert proc.returncode == 2 and "gateway.port" in " ".join(proc.stderr.split())
    assert not (d.runtime_dir / "control").exists()


def test_commands_say_plainly_when_not_running(tmp_path):
    d = Daemon(tmp_path)
    for args in (["status"], ["restart"], ["reload"], ["unload", "x"]):
        proc = d.cli(*args)
        assert proc.returncode == 3, (args, proc.stdout, proc.stderr)
        assert "not running" in proc.stderr and str(d.runtime_dir) in " ".join(proc.stderr.split())
    proc = d.cli("stop")
    assert proc.returncode == 0 and "not running" in proc.stdout


def test_systemd_unit_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is installed by the test command (python -m servectl.doctor --fix --tests)"
    servectl = shutil.which("servectl") or str(ROOT / "servectl")
    unit = (ROOT / "systemd" / "servectl.service").read_text().replace("/usr/local/bin/servectl", servectl)
    for key in ("Type=notify", "KillMode=mixed", "RuntimeDirectory=servectl", "RuntimeDirectoryMode=0750",
                "Restart=on-failure", "ExecReload=", "TimeoutStopSec="):
        assert key in unit, key
    assert "PrivateDevices=yes" not in unit
    path = tmp_path / "servectl.service"
    path.write_text(unit)
    proc = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True)
    problems = [line for line in proc.stderr.splitlines()
                if "servectl.service" in line and "Unknown user" not in line and "Unknown group" not in line]
    assert proc.returncode == 0 or not problems, proc.stderr
    broken = unit.replace(servectl, "/nonexistent/servectl")
    path.write_text(broken)
    bad = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True)
    assert bad.returncode != 0 or "nonexistent" in bad.stderr  # positive control: verify does check


def test_sd_notify_protocol(tmp_path):
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(1.0)
    env = {**os.environ, "NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "2000000"}
    rt = tmp_path / "rt"
    proc = subprocess.Popen([*SERVECTL, "start", "--foreground", "--runtime-dir", str(rt), "--port", "0"],
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
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()
        subprocess.run(["pkill", "-KILL", "-f", str(rt)], capture_output=True)


def get(d: Daemon, path: str, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{d.base_url}{path}", headers=headers), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


MODEL = f'name = "{{name}}"\nmodel = "{DEFAULT_MODEL_DIR}"\n'


def test_several_models_load_unload_reload(tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("sk-ops\n")
    one = "[[models]]\n" + MODEL.format(name="one")
    two = "[[models]]\n" + MODEL.format(name="two")
    d = Daemon(tmp_path, config=one + two, args=["--api-key-file", str(keyfile)], api_key="sk-ops")
    d.start()
    try:
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
        assert get(d, "/v1/models/extra", "sk-ops") == 404
        now = {c.component: c.pid for c in d.status().children}
        assert all(now[k] == v for k, v in before.items()), "load/unload touched other processes"

        # reload: change one, drop two, add three, change the gateway section
        changed = "[[models]]\n" + MODEL.format(name="one") + "[models.engine_args]\nmax_num_seqs = 8\n"
        three = "[[models]]\n" + MODEL.format(name="three")
        d.config_path.write_text("[gateway]\nprocesses = 2\n" + changed + three)
        proc = d.cli("reload")
        assert proc.returncode == 0, proc.stderr
        wait_for(lambda: {m.name: m.state for m in d.status().models} == {"one": "ready", "three": "ready"}
                 and sum(1 for c in d.status().children if c.kind == "gateway" and c.state == "ready") == 2,
                 300, interval=1, what="the reload to settle")
        after = {c.component: c.pid for c in d.status().children}
        assert after["engine_core:one"] != before["engine_core:one"]  # changed: restarted
        assert "engine_core:two" not in after
        assert after["gateway:0"] != before["gateway:0"]  # gateway section changed
        assert api.completions.create(model="three", prompt="x", max_tokens=2).choices
        # The start option (--api-key-file) is still in force after the reload.
        assert get(d, "/v1/models") == 401 and get(d, "/v1/models", "sk-ops") == 200

        # reload with nothing changed touches nothing
        steady = {c.component: c.pid for c in d.status().children}
        assert d.cli("reload").returncode == 0
        time.sleep(2)
        assert {c.component: c.pid for c in d.status().children} == steady
    finally:
        d.stop()
        d.kill_all()


def test_logs_command(daemon):
    proc = daemon.cli("logs", "engine_core:default", "-n", "5")
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
    proc = daemon.cli("logs", "nonsense")
    assert proc.returncode == 2 and "gateway-0" in proc.stderr
