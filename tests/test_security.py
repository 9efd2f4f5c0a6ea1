"""Issue 17 on a real daemon: secrets stay off command lines and out of foreign environments (standbys,
crash restarts and reloads included), keys rotate at once, prompts are not logged, the runtime
directory is locked and shared with its group read-only, the control plane refuses the group's
state changes and audits every change, and the gateway's HTTP policy holds.

One daemon serves the whole module (in order: what needs it intact first, its crash and reload last
but one). Its runtime directory stands in for systemd's /run/servectl: 02750, group ``nogroup``;
"a member of the group" is ``nobody`` in a forked child (tests run as root).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import tempfile
import time
from pathlib import Path

import pytest

from as_user import NOBODY, finish, run_as, start_as
from conftest import DaemonFactory, http, wait_for
from servectl.config import DEFAULT_MODEL_DIR
from servectl.proc import all_pids, environ_of, is_zombie

KEY = "sk-sec-" + secrets.token_hex(8)
NEW_KEY = "sk-sec-new-" + secrets.token_hex(8)
ENV_SECRET = "hf_sec_" + secrets.token_hex(8)
MODEL_KINDS = ("engine_core", "worker", "standby")  # asked for the model's env: they may carry it


def config(key: str, extra_gateway: str = "") -> str:
    return (f'[gateway]\napi_keys = ["{key}"]\n{extra_gateway}[manager]\nfreeze_grace_s = 1.0\n'
            f'[[models]]\nname = "default"\nmodel = "{DEFAULT_MODEL_DIR}"\n'
            f'[models.env]\nHF_TOKEN = "{ENV_SECRET}"\n')


@pytest.fixture(scope="module")
def shared_rt():
    base = Path(tempfile.mkdtemp(prefix="servectl-sec-", dir="/tmp"))
    os.chmod(base, 0o755)
    rt = base / "rt"
    rt.mkdir()
    os.chown(rt, 0, NOBODY)
    os.chmod(rt, 0o2750)  # as systemd's RuntimeDirectoryMode=0750 with the operators' group
    yield rt
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def sec(tmp_path_factory, shared_rt):
    with DaemonFactory(tmp_path_factory, "security") as make:
        d = make(config(KEY), api_key=KEY, start=False)
        d.runtime_dir = shared_rt
        d.start()
        yield d


def tree_pids(d) -> set[int]:
    mark = d.mark  # bytes, as in /proc/<pid>/environ
    return {pid for pid in all_pids() if pid != os.getpid() and not is_zombie(pid) and mark in environ_of(pid)}


def assert_no_secret_leaks(d, *keys: str) -> dict[int, str]:
    """No process of the tree has a key or the model's secret on its command line; only the model's
    processes (engine, workers, their standbys) have the secret in their environment; none has a key."""
    st = d.status()
    kinds = {c.pid: c.kind for c in st.children if c.pid}
    kinds[st.manager_pid] = "manager"
    pids = tree_pids(d)
    assert set(kinds) <= pids, (kinds, pids)
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        environ = b"\0".join(environ_of(pid))
        for secret in (*keys, ENV_SECRET):
            assert secret.encode() not in cmdline, (pid, kinds.get(pid), cmdline[:300])
        for key in keys:
            assert key.encode() not in environ, (pid, kinds.get(pid))
        if kinds.get(pid) not in MODEL_KINDS:
            assert ENV_SECRET.encode() not in environ, (pid, kinds.get(pid))
    for pid, kind in kinds.items():
        if kind in MODEL_KINDS:
            assert f"HF_TOKEN={ENV_SECRET}".encode() in environ_of(pid), (pid, kind)  # it asked for it
    return kinds


def logs_text(d) -> str:
    logs = d.runtime_dir / "state" / "logs"
    return "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log*")))


def start_as_nobody(fn, *args) -> tuple[int, int]:
    return start_as(NOBODY, fn, *args)


def run_as_nobody(fn, *args):
    return run_as(NOBODY, fn, *args)


def as_system_dir(rt: Path) -> None:
    """In a forked child: the daemon's directory plays /run/servectl."""
    from servectl import client, paths

    paths.SYSTEM_RUNTIME_DIR = rt
    client.SYSTEM_RUNTIME_DIR = rt


# ---- 1. secrets ---------------------------------------------------------------------------------

def test_no_secret_on_a_command_line_standbys_included(sec):
    sec.wait_standbys_warm(2)
    kinds = assert_no_secret_leaks(sec, KEY)
    assert sorted(kinds.values()) == ["engine_core", "gateway", "manager", "standby", "standby", "worker"]
    assert KEY not in logs_text(sec) and ENV_SECRET not in logs_text(sec)


def test_prompts_and_completions_are_not_logged(sec):
    marker = "zqx" + secrets.token_hex(6)
    r = http(sec, "POST", "/v1/completions", {"model": "default", "prompt": f"def {marker}(): ", "max_tokens": 24,
                                              "ignore_eos": True, "temperature": 0})
    assert r.status == 200, r.text
    text = r.json()["choices"][0]["text"]
    # The access line is written once the answer went out and reaches the file through the manager's
    # relay: wait for it, then read everything logged up to it.
    wait_for(lambda: "POST /v1/completions 200" in logs_text(sec), 30, what="the access log line")
    logged = logs_text(sec)
    assert marker not in logged
    if len(text.strip()) >= 20:
        assert text not in logged


# ---- 2. the runtime directory ----------------------------------------------------------------

def test_the_directory_keeps_its_mode_and_a_second_manager_fails_fast(sec):
    from servectl import config as C
    from servectl.client import spawn_manager

    rt = sec.runtime_dir
    st = os.stat(rt)
    assert stat.S_IMODE(st.st_mode) == 0o2750 and st.st_gid == NOBODY  # checked, never chmodded
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in rt.iterdir() if p.is_socket()}
    assert modes.pop("control") == 0o600 and modes.pop("control-ro") == 0o660 and modes.pop("events") == 0o660
    assert set(modes.values()) == {0o600}, modes  # engine and worker sockets
    cfg = C.finalize(C.Config())
    cfg.manager.runtime_dir = str(rt)
    cfg.gateway.port = 0
    log = rt.parent / "second-manager.log"
    started = time.monotonic()
    proc = spawn_manager(cfg, log)
    assert proc.wait(60) != 0 and time.monotonic() - started < 30
    assert f"servectl is already running (manager pid {sec.manager_pid}) in {rt}" in log.read_text()
    assert sec.status().manager_pid == sec.manager_pid and (rt / "control").exists()


# ---- 4. the control plane: the group reads, the owner changes, everything audited ----------------

def test_the_group_may_read_but_not_change(sec):
    from click.testing import CliRunner

    import zmq

    from servectl import cli
    from servectl.client import ControlClient, wait_settled
    from servectl.wire import control as P

    rt = sec.runtime_dir
    CliRunner().invoke(cli.main, ["status", "--runtime-dir", str(rt)])  # the imports nobody will need
    CliRunner().invoke(cli.main, ["stop", "--runtime-dir", str(rt / "none")])

    def member():
        as_system_dir(rt)
        out = {}
        status = CliRunner().invoke(cli.main, ["status", "--runtime-dir", str(rt)])
        out["status"] = (status.exit_code, status.output)
        out["settled"] = [m.state for m in wait_settled(ControlClient(rt), None, 30).models]
        state_dir = Path(ControlClient(rt).status().state_dir)
        out["log_readable"] = bool((state_dir / "logs" / "gateway-0.log").read_text())
        for args in (["stop"], ["reload"], ["restart"], ["unload", "default"], ["freeze", "default", "off"]):
            res = CliRunner().invoke(cli.main, [*args, "--runtime-dir", str(rt)])
            out[args[0]] = (res.exit_code, res.output)
        # Past the CLI: the read-only socket itself refuses a change (and the manager audits it).
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{rt / 'control-ro'}")
        sock.send(P.encoder.encode(P.StopRequest()))
        out["raw"] = P.control_out_decoder.decode(sock.recv()) if sock.poll(10000) else None
        sock.close()
        out["pid"] = os.getpid()
        return out

    out = run_as_nobody(member)
    code, text = out["status"]
    assert code == 0 and "engine_core:default" in text, text
    assert out["settled"] == ["ready"] and out["log_readable"]
    for verb in ("stop", "reload", "restart", "unload", "freeze"):
        code, text = out[verb]
        assert code == 4 and "permission denied" in text and "Traceback" not in text, (verb, text)
    assert out["raw"] is not None and not out["raw"].ok and "permission denied" in out["raw"].message
    assert sec.status().state == "running"  # nothing changed
    audit = [json.loads(x) for x in (rt / "state" / "audit-denied.log").read_text().splitlines()]  # issue 53
    denied = [a for a in audit if a["outcome"] == "denied"]
    assert denied and denied[-1]["uid"] == NOBODY and denied[-1]["pid"] == out["pid"] and \
        denied[-1]["command"] == "stop" and denied[-1]["via"] == "control-ro", denied


def test_the_group_follows_events(sec):
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from servectl.wire import status as WS

    rt = sec.runtime_dir
    ready_r, ready_w = os.pipe()

    def member():
        os.close(ready_r)
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(f"ipc://{rt / 'events'}")
        connected = monitor.poll(10000) and recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        os.write(ready_w, b"1" if connected else b"0")
        os.close(ready_w)
        seen = []
        end = time.monotonic() + 30
        while connected and time.monotonic() < end and not any(e[0] == "model:default" for e in seen):
            if sub.poll(1000):
                ev = WS.event_decoder.decode(sub.recv())
                seen.append((ev.component, ev.state))
        return seen

    pid, result = start_as_nobody(member)
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        connected = ready.read(1) == b"1"
    if connected:  # the owner makes the manager publish: a thaw, then a freeze once idle again
        sec.cli("freeze", "default", "off", check=True)
        sec.cli("freeze", "default", "on", check=True)
    seen = finish(pid, result)
    assert connected, "nobody (group nogroup) could not connect to the events socket"
    assert any(component == "model:default" for component, _ in seen), seen


# ---- 1 (again) and 5: a crash restart, a reload that rotates keys; HTTP policy ---------------------

def test_http_policy(sec):
    body = json.dumps({"model": "default", "prompt": "x", "max_tokens": 1})
    for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded"):
        assert http(sec, "POST", "/v1/completions", body, headers={"Content-Type": ctype}).status == 415, ctype
    r = http(sec, "POST", "/v1/completions", body, headers={"Content-Type": ""})
    assert r.status == 415 and r.json()["error"]["message"].startswith("unsupported content type")
    # Bound to 127.0.0.1: a page whose own name resolves to 127.0.0.1 (DNS rebinding) gets 421.
    r = http(sec, "GET", "/v1/models", headers={"Host": f"rebind.example:{sec.port}"})
    assert r.status == 421 and "rebind.example" in r.json()["error"]["message"]
    assert http(sec, "GET", "/health", headers={"Host": "evil.example"}).status == 421
    for host in (f"localhost:{sec.port}", f"127.0.0.1:{sec.port}", "[::1]"):
        assert http(sec, "GET", "/v1/models", headers={"Host": host}).status == 200, host
    # CORS is off unless configured: no header says a page may read the answer, no preflight passes.
    origin = {"Origin": "https://page.example"}
    assert "Access-Control-Allow-Origin" not in http(sec, "GET", "/v1/models", headers=origin).headers
    pre = http(sec, "OPTIONS", "/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST"})
    assert pre.status == 405 and "Access-Control-Allow-Origin" not in pre.headers


def test_crash_restart_and_reload_keep_secrets_off_and_rotate_keys_at_once(sec):
    before = sec.child("worker:default:0").pid
    warm = sec.wait_standbys_warm(2)
    os.kill(before, signal.SIGKILL)
    wait_for(lambda: any(m.state == "ready" for m in sec.status().models) and
             sec.child("worker:default:0").pid not in (before, None) and
             sec.child("worker:default:0").restarts == 1, 300, interval=0.5, what="the group restarted")
    assert sec.child("worker:default:0").pid == warm["worker:default:0"].pid  # a standby took the role
    assert_no_secret_leaks(sec, KEY)
    sec.wait_standbys_warm(2)  # fresh standbys, exec'd with the env: still nothing on their argv
    assert_no_secret_leaks(sec, KEY)

    # Rotate the key and enable CORS (a [gateway] change: the gateway restarts too). The reload is
    # asked with $SERVECTL_CONFIG naming another file: the manager re-reads exactly its own.
    other = sec.config_path.parent / "other.toml"
    other.write_text(config("sk-from-the-wrong-file"))
    sec.config_path.write_text(config(NEW_KEY, 'cors_origins = ["https://app.example"]\n'))
    gateway_before = sec.child("gateway:0").pid
    sec.env["SERVECTL_CONFIG"] = str(other)
    try:
        proc = sec.cli("reload")
    finally:
        del sec.env["SERVECTL_CONFIG"]
    assert proc.returncode == 0, proc.stderr
    # At once: the moment reload answered, the old key is refused.
    assert http(sec, "GET", "/v1/models", key=KEY).status == 401
    assert http(sec, "GET", "/v1/models", key="sk-from-the-wrong-file").status == 401
    assert http(sec, "GET", "/v1/models", key=NEW_KEY).status == 200
    sec.api_key = NEW_KEY
    wait_for(lambda: sec.child("gateway:0").pid != gateway_before and sec.child("gateway:0").state == "ready",
             120, what="the gateway restarted with the new [gateway] section")
    assert http(sec, "GET", "/v1/models", key=KEY).status == 401
    assert_no_secret_leaks(sec, KEY, NEW_KEY)
    assert NEW_KEY not in logs_text(sec) and ENV_SECRET not in logs_text(sec)
    # CORS, now configured: the allowed origin's preflight and answers say so; others get nothing.
    pre = http(sec, "OPTIONS", "/v1/chat/completions", key=None,
               headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status == 204 and pre.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "authorization" in pre.headers["Access-Control-Allow-Headers"]
    r = http(sec, "POST", "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 2, "stream": True},
             headers={"Origin": "https://app.example"})
    assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "Access-Control-Allow-Origin" not in http(sec, "GET", "/v1/models",
                                                     headers={"Origin": "https://evil.example"}).headers
    # Audited: who (root, the CLI's pid), what, when.
    audit = [json.loads(x) for x in (sec.runtime_dir / "state" / "audit.log").read_text().splitlines()]
    reload = [a for a in audit if a["command"] == "reload"]
    assert reload and reload[-1]["uid"] == 0 and reload[-1]["user"] == "root" and reload[-1]["pid"] and \
        reload[-1]["outcome"] == "accepted"
