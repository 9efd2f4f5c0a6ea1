"""Issue 17, the pure parts: directory trust, the pid-file lock and stale cleanup, config lookup,
API key rules, the gateway's Host/CORS/content-type policy, the audit log's lines, killing by pidfd,
and what a user outside the service's group sees. No daemon; no vLLM or torch.

The tests run as root; "another user" is ``nobody`` (a directory chowned to it, or a forked
child that setuid()s to it before acting).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import msgspec
import pytest

from as_user import NOBODY, run_as
from conftest import wait_for
from api_gateway.http_policy import CorsPolicy, HostPolicy, host_name, is_json_content_type
from manager.audit import REDACTED, AuditLog, Peer, audit_line, audit_record, parse_peer_address
from servectl import config as C
from servectl import paths as PT
from servectl import proc
from servectl.wire import control as P

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


def st(mode: int, uid: int = 0) -> os.stat_result:
    """A stat result with this st_mode and st_uid (the rest zero)."""
    return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


@pytest.fixture
def open_tmp():
    """A directory other users can reach (pytest's tmp_path sits under a 0700 directory of root's)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="servectl-sec-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ---- directory trust (servectl/paths.py) ------------------------------------------------

@pytest.mark.parametrize("mode,uid,needle", [
    (stat.S_IFLNK | 0o777, 0, "symbolic link"),
    (stat.S_IFREG | 0o600, 0, "not a directory"),
    (stat.S_IFDIR | 0o700, NOBODY, "owned by uid 65534"),
    (stat.S_IFDIR | 0o770, 0, "group-writable"),
    (stat.S_IFDIR | 0o703, 0, "world-writable"),
])
def test_dir_problem_names_what_is_wrong(mode, uid, needle):
    assert needle in PT.dir_problem(st(mode, uid), {0})


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755, 0o2750])
def test_dir_problem_accepts_own_directories_others_cannot_write(mode):
    assert PT.dir_problem(st(stat.S_IFDIR | mode, 0), {0}) is None


def test_parent_problem_refuses_world_writable_unless_sticky():
    assert "not sticky" in PT.parent_problem(st(stat.S_IFDIR | 0o777))
    assert PT.parent_problem(st(stat.S_IFDIR | 0o1777)) is None  # /tmp
    assert PT.parent_problem(st(stat.S_IFDIR | 0o755)) is None


def test_system_runtime_dir_may_be_roots_or_the_service_users(monkeypatch):
    monkeypatch.setattr(PT, "service_uid", lambda: 995)
    assert PT.trusted_owners(PT.SYSTEM_RUNTIME_DIR) == {os.geteuid(), 0, 995}
    assert PT.trusted_owners(Path("/tmp/servectl-0")) == {os.geteuid()}


def test_secure_dir_creates_private_and_keeps_an_existing_mode(tmp_path):
    made = PT.secure_dir(tmp_path / "a" / "rt")
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o750)
    os.chmod(shared, 0o750)
    PT.secure_dir(shared)
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o750  # verified, never chmodded


def test_secure_dir_refuses_a_directory_another_user_made_first(open_tmp):
    # As `nobody` would on a shared host: made first, in a sticky world-writable parent.
    base = open_tmp / "tmp"
    base.mkdir()
    os.chmod(base, 0o1777)
    run_as(NOBODY, os.mkdir, str(base / "servectl-0"), 0o700)
    assert os.stat(base / "servectl-0").st_uid == NOBODY
    with pytest.raises(PT.UntrustedDirectory) as exc:
        PT.secure_dir(base / "servectl-0")
    msg = str(exc.value)
    assert "owned by uid 65534" in msg and "--runtime-dir" in msg, msg


def test_secure_dir_refuses_a_symlink_and_writes_nothing_through_it(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "rt").symlink_to(target)
    with pytest.raises(PT.UntrustedDirectory) as exc:
        PT.secure_dir(tmp_path / "rt")
    assert "symbolic link" in str(exc.value)
    with pytest.raises(PT.UntrustedDirectory):
        PT.prepare_dirs(tmp_path / "rt")
    assert list(target.iterdir()) == []


def test_secure_dir_refuses_a_group_writable_directory(tmp_path):
    d = tmp_path / "rt"
    d.mkdir()
    os.chmod(d, 0o770)
    with pytest.raises(PT.UntrustedDirectory) as exc:
        PT.secure_dir(d)
    assert "group-writable (mode 0770)" in str(exc.value)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o770  # refused, not "fixed"


def test_open_append_never_follows_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "manager.log").symlink_to(victim)
    with pytest.raises(OSError):
        PT.open_append(tmp_path / "manager.log")
    assert victim.read_text() == "precious\n"


# ---- one manager per directory; what a dead one left ---------------------------------------

def test_the_pid_file_lock_refuses_a_second_manager(tmp_path):
    paths = PT.RuntimePaths(tmp_path)
    fd = PT.lock_pidfile(paths)
    try:
        PT.write_pidfile(fd, 4242, "cafe")
        with pytest.raises(PT.AlreadyRunning) as exc:
            PT.lock_pidfile(paths)
        assert str(exc.value) == f"servectl is already running (manager pid 4242) in {tmp_path}"
    finally:
        os.close(fd)
    os.close(PT.lock_pidfile(paths))  # released with its holder


def test_stale_entries_are_servectls_own_names_only():
    sock, reg, lnk = stat.S_IFSOCK | 0o600, stat.S_IFREG | 0o644, stat.S_IFLNK | 0o777
    entries = [("control", st(sock)), ("control-ro", st(sock)), ("events", st(sock)),
               ("engine-m.1", st(sock)), ("worker-my-model-0", st(sock)), ("dist-m.1-6af51dbf3229", st(reg)),
               # not ours by name, type or owner:
               ("notes.txt", st(reg)), ("control", st(reg)), ("engine-x", st(lnk)), ("events", st(sock, NOBODY)),
               ("worker-m-01", st(sock)), ("dist-m-xyz", st(reg)), ("engine-", st(sock)), ("state", st(stat.S_IFDIR))]
    assert PT.stale_entries(entries, 0) == ["control", "control-ro", "events", "engine-m.1", "worker-my-model-0",
                                            "dist-m.1-6af51dbf3229"]
    assert PT.stale_metrics([("counter_12.db", st(reg)), ("gauge_all_3.db", st(reg)), ("keep.db", st(reg)),
                             ("histogram_1.db", st(lnk))], 0) == ["counter_12.db", "gauge_all_3.db"]


def test_remove_stale_leaves_everything_else(tmp_path):
    import socket

    paths = PT.RuntimePaths(tmp_path)
    for name in ("control", "engine-a"):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(tmp_path / name))
        s.close()
    (tmp_path / "control-notes").write_text("x")
    (tmp_path / "dist-a-00ff").write_text("x")
    (tmp_path / "metrics").mkdir(mode=0o700)
    (tmp_path / "metrics" / "counter_1.db").write_text("x")
    (tmp_path / "metrics" / "mine.txt").write_text("x")
    assert sorted(PT.remove_stale(paths)) == ["control", "dist-a-00ff", "engine-a", "metrics/counter_1.db"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["control-notes", "metrics"]
    assert [p.name for p in (tmp_path / "metrics").iterdir()] == ["mine.txt"]


# ---- config lookup -----------------------------------------------------------------------

def test_config_lookup_order():
    env = {"HOME": "/home/u", "XDG_CONFIG_HOME": "/xdg"}
    assert C.config_candidates("/given.toml", False, {**env, "SERVECTL_CONFIG": "/env.toml"}) == \
        (Path("/given.toml"), True)
    assert C.config_candidates(None, False, {**env, "SERVECTL_CONFIG": "/env.toml"}) == (Path("/env.toml"), True)
    assert C.config_candidates(None, False, env) == (Path("/xdg/servectl/servectl.toml"), False)
    assert C.config_candidates(None, False, {"HOME": "/home/u"}) == \
        (Path("/home/u/.config/servectl/servectl.toml"), False)
    assert C.config_candidates(None, False, {"HOME": "/home/u", "XDG_CONFIG_HOME": "rel"}) == \
        (Path("/home/u/.config/servectl/servectl.toml"), False)  # a relative XDG_CONFIG_HOME is ignored
    assert C.config_candidates(None, True, env) == (Path("/etc/servectl/servectl.toml"), False)


def test_the_working_directory_is_never_searched(tmp_path, monkeypatch):
    (tmp_path / "servectl.toml").write_text("[manager]\ntrust = 'planted'\n[[models]]\nname='x'\nmodel='/x'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SERVECTL_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    cfg, found = C.load_config(None, system=False)
    assert found is None and cfg.models[0].name == "default"
    user = tmp_path / "xdg" / "servectl" / "servectl.toml"
    user.parent.mkdir(parents=True)
    user.write_text("[gateway]\nport = 9123\n")
    assert C.load_config(None, system=False)[1] == user
    monkeypatch.setenv("SERVECTL_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(C.ConfigError) as exc:  # named, so it must exist
        C.load_config(None, system=False)
    assert "missing.toml" in str(exc.value)


def test_reload_without_a_file_reads_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVECTL_CONFIG", str(tmp_path / "planted.toml"))
    (tmp_path / "planted.toml").write_text("[gateway]\nport = 1\n")
    cfg, found = C.effective_config(None, C.Overrides(port=0), search=False)
    assert found is None and cfg.gateway.port == 0


# ---- API keys ----------------------------------------------------------------------------

@pytest.mark.parametrize("keys,needle", [
    ('[""]', "empty API key"), ('["ok", "  "]', "api_keys[1]: an empty API key"),
    ('["with space"]', "printable ASCII"), ('["tab\\there"]', "printable ASCII"),
])
def test_empty_or_unsendable_api_keys_are_config_errors(tmp_path, keys, needle):
    path = tmp_path / "c.toml"
    path.write_text(f"[gateway]\napi_keys = {keys}\n")
    with pytest.raises(C.ConfigError) as exc:
        C.load_config(path)
    assert needle in str(exc.value) and str(path) in str(exc.value), str(exc.value)


# ---- the gateway's HTTP policy -------------------------------------------------------------

@pytest.mark.parametrize("header,name", [("localhost:8000", "localhost"), ("[::1]:8000", "::1"), ("::1", "::1"),
                                         ("Example.COM.", "example.com"), ("127.0.0.1", "127.0.0.1")])
def test_host_name(header, name):
    assert host_name(header) == name


def test_host_allowlist_on_a_loopback_bind():
    policy = HostPolicy("127.0.0.1", ["api.internal"])
    for ok in ("localhost", "localhost:8000", "127.0.0.1:8000", "127.1.2.3", "[::1]:8000", "app.localhost",
               "api.internal:8000", "API.internal", None):
        assert policy.allows(ok), ok
    for bad in ("evil.example", "evil.example:8000", "192.168.1.5", "localhost.evil.example", "", "[::2]"):
        assert not policy.allows(bad), bad


def test_host_allowlist_elsewhere_only_when_configured():
    assert HostPolicy("0.0.0.0", []).allows("anything.example")
    policy = HostPolicy("10.0.0.5", ["llm.example"])
    assert policy.allows("llm.example") and policy.allows("10.0.0.5:8000") and policy.allows("localhost")
    assert not policy.allows("evil.example")
    assert HostPolicy("127.0.0.1", ["*"]).allows("evil.example")


def test_cors_is_off_by_default_and_exact_when_on():
    assert not CorsPolicy([]).enabled and not CorsPolicy([]).allows("https://a.example")
    cors = CorsPolicy(["https://app.example/"])
    assert cors.allows("https://app.example") and not cors.allows("https://evil.example") and not cors.allows(None)
    pre = cors.preflight_headers("https://app.example", "authorization, x-stainless-os")
    assert pre["Access-Control-Allow-Origin"] == "https://app.example" and pre["Vary"] == "Origin"
    assert pre["Access-Control-Allow-Headers"] == "authorization, x-stainless-os"
    assert CorsPolicy(["*"]).allows("https://any.example")


@pytest.mark.parametrize("ctype,ok", [("application/json", True), ("Application/JSON; charset=utf-8", True),
                                      ("text/plain", False), ("text/plain;charset=UTF-8", False),
                                      ("application/x-www-form-urlencoded", False), ("multipart/form-data", False),
                                      (None, False), ("", False), ("application/jsonx", False)])
def test_only_application_json_bodies(ctype, ok):
    assert is_json_content_type(ctype) is ok


# ---- the audit log ------------------------------------------------------------------------

def test_peer_address_parsing():
    assert parse_peer_address("localhost:1000:1001:4242") == Peer(1000, 1001, 4242)
    assert parse_peer_address(":0:0:7") == Peer(0, 0, 7)
    assert parse_peer_address("") == Peer(None, None, None)
    assert parse_peer_address("x:y:z:w") == Peer(None, None, None)


def test_audit_line_format_says_who_what_when_and_hides_env_values():
    model = C.ModelConfig(name="m", model="/models/m", env={"HF_TOKEN": "hf_secret"})
    record = audit_record(0.0, Peer(0, 0, 99), P.LoadModel(model=model), "accepted")
    line = audit_line(record)
    assert line.endswith("\n") and "\n" not in line[:-1] and "hf_secret" not in line
    data = json.loads(line)
    assert data == {"time": "1970-01-01T00:00:00.000+00:00", "uid": 0, "user": "root", "pid": 99,
                    "via": "control", "command": "load", "args": {"model": {
                        **msgspec.to_builtins(model), "env": {"HF_TOKEN": REDACTED}}},
                    "outcome": "accepted"}
    assert list(data) == ["time", "uid", "user", "pid", "via", "command", "args", "outcome"]
    sighup = audit_record(1.5, Peer(None, None, None), "reload (SIGHUP)", "accepted", "signal")
    assert (sighup["command"], sighup["uid"], sighup["via"]) == ("reload (SIGHUP)", None, "signal")


def test_audit_log_appends_and_never_writes_through_a_symlink(tmp_path):
    AuditLog(tmp_path / "audit.log").write(audit_record(0.0, Peer(0, 0, 1), P.StopRequest(), "accepted"))
    AuditLog(tmp_path / "audit.log").write(audit_record(1.0, Peer(0, 0, 1), P.UnloadModel(name="m"), "accepted"))
    lines = (tmp_path / "audit.log").read_text().splitlines()
    assert [json.loads(x)["command"] for x in lines] == ["stop", "unload"]
    assert stat.S_IMODE(os.stat(tmp_path / "audit.log").st_mode) & 0o007 == 0
    victim = tmp_path / "victim"
    victim.write_text("")
    (tmp_path / "linked.log").symlink_to(victim)
    AuditLog(tmp_path / "linked.log").write(audit_record(0.0, Peer(0, 0, 1), P.StopRequest(), "accepted"))
    assert victim.read_text() == ""


# ---- killing strays by pidfd ----------------------------------------------------------------

def test_kill_instance_signals_through_pidfds_and_only_tagged_processes(monkeypatch):
    tag = os.urandom(6).hex()
    tagged = subprocess.Popen(["sleep", "60"], env={**os.environ, proc.INSTANCE_ENV: tag})
    other = subprocess.Popen(["sleep", "60"])
    try:
        # Popen returns once the child has exec'd, but its /proc environ may read empty for a moment
        # after the exec (a CI run saw it): wait for the tag, briefly.
        wait_for(lambda: proc.carries_instance(tagged.pid, tag), 10, interval=0.01, what="the tag in /proc")
        # A pid the scan reported but that now names an untagged process (reuse) is left alone.
        monkeypatch.setattr(proc, "processes_of_instance", lambda instance: [tagged.pid, other.pid])
        sent = []
        real = signal.pidfd_send_signal
        monkeypatch.setattr(signal, "pidfd_send_signal", lambda fd, sig: (sent.append(sig), real(fd, sig)))
        assert proc.kill_instance(tag, exclude={os.getpid()}) == [tagged.pid]
        assert sent == [signal.SIGKILL]
        assert tagged.wait(10) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for p in (tagged, other):
            p.kill()
            p.wait()


def test_kill_strays_uses_kill_instance():
    source = (ROOT / "manager" / "daemon.py").read_text()
    assert "kill_instance(" in source and "os.kill(" not in source


# ---- a user outside the service's group ------------------------------------------------------

def test_a_user_outside_the_group_gets_a_message_not_a_traceback(open_tmp, monkeypatch):
    """/run/servectl (0750, root:root here) holds a daemon's socket; `nobody` may not enter it."""
    from click.testing import CliRunner

    from servectl import cli, client

    tmp_path = open_tmp
    system = tmp_path / "run-servectl"
    system.mkdir(mode=0o750)
    (system / "control").write_text("")
    for module in (PT, client):
        monkeypatch.setattr(module, "SYSTEM_RUNTIME_DIR", system)
    monkeypatch.delenv("SERVECTL_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "nobody-tmp"))  # gettempdir() caches $TMPDIR
    (tmp_path / "nobody-tmp").mkdir(mode=0o1777)
    os.chmod(tmp_path / "nobody-tmp", 0o1777)
    assert PT.resolve_runtime_dir() == system  # root sees the daemon
    CliRunner().invoke(cli.main, ["status", "--runtime-dir", str(tmp_path / "none")])  # imports what nobody needs

    def as_nobody():
        found = PT.resolve_runtime_dir()
        result = CliRunner().invoke(cli.main, ["status"])
        return str(found), PT.system_dir_denied(), result.exit_code, result.output, \
            repr(result.exception) if not isinstance(result.exception, SystemExit) else None

    found, denied, code, out, exc = run_as(NOBODY, as_nobody)
    assert found == str(tmp_path / "nobody-tmp" / f"servectl-{NOBODY}") and denied
    assert exc is None and code == 3, out
    text = " ".join(out.split())
    assert "not running" in text and f"{system} exists but you may not enter it" in text, text


def test_requires_python_matches_the_code():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["requires-python"] == ">=3.11"  # StrEnum, tomllib, asyncio.TaskGroup-era typing
    assert sys.version_info >= (3, 11)


# ---- the CLI and a directory another user planted (the reproduction) ---------------------------

def cli_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "SERVECTL_RUNTIME_DIR",
                                                            "SERVECTL_CONFIG")}
    return {**env, "TMPDIR": str(tmp), "XDG_CONFIG_HOME": str(tmp / "no-config"), **extra}


def test_the_cli_refuses_a_runtime_dir_another_user_planted(open_tmp):
    """`nobody` makes $TMPDIR/servectl-0 first, with the CLI's log a link to root's shell profile: the CLI
    refuses before writing a byte (and never talks to a control socket there)."""
    tmp = open_tmp / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    victim = open_tmp / "bashrc"
    victim.write_text("# root's\n")

    def plant():
        logs = tmp / "servectl-0" / "state" / "logs"
        os.makedirs(logs, 0o755)
        os.symlink(victim, logs / "manager.log")

    run_as(NOBODY, plant)
    commands = (["start", "--port", "0"], ["status"], ["stop"], ["logs"])
    # Side by side: each is an interpreter start, most of this test's time.
    procs = [subprocess.Popen([sys.executable, "-m", "servectl.cli", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=cli_env(tmp), cwd=ROOT) for args in commands]
    for args, proc in zip(commands, procs):
        stdout, stderr = proc.communicate(timeout=60)
        text = " ".join(stderr.split())
        assert proc.returncode == 2, (args, stdout, stderr)
        assert f"refusing to use {tmp / 'servectl-0'}: it is owned by uid 65534 (nobody)" in text, text
        assert "Traceback" not in stderr
    assert victim.read_text() == "# root's\n"
    assert not (tmp / "servectl-0" / "control").exists()


def test_the_cli_refuses_a_symlinked_runtime_dir(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "rt").symlink_to(real)
    res = subprocess.run([sys.executable, "-m", "servectl.cli", "start", "--port", "0", "--runtime-dir",
                          str(tmp_path / "rt")], capture_output=True, text=True, env=cli_env(tmp_path), cwd=ROOT,
                         timeout=60)
    assert res.returncode == 2 and "it is a symbolic link" in " ".join(res.stderr.split()), res.stderr
    assert list(real.iterdir()) == []


def test_secure_dir_keeps_a_shared_parents_setgid_group(tmp_path):
    shared = tmp_path / "rt"
    shared.mkdir()
    os.chown(shared, 0, NOBODY)
    os.chmod(shared, 0o2750)
    old = os.umask(0o077)  # masks the group bits we ask for: secure_dir puts them back
    try:
        logs = PT.prepare_dirs(shared)
    finally:
        os.umask(old)
    for d in (shared / "state", logs):
        st = os.stat(d)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o2750, NOBODY), (d, oct(st.st_mode))


# ---- the systemd unit ----------------------------------------------------------------------------

def unit_exposure(path: Path) -> float:
    import re
    import shutil

    analyze = shutil.which("systemd-analyze")
    if analyze is None:  # only where the tool is absent; where it exists, a bad score fails
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    proc = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(path)], capture_output=True,
                          text=True, timeout=120)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout + proc.stderr)
    assert m, proc.stdout + proc.stderr
    return float(m.group(1))


def test_systemd_unit_is_hardened(tmp_path):
    unit = ROOT / "systemd" / "servectl.service"
    score = unit_exposure(unit)
    assert score <= 3.0, f"systemd-analyze security: {score} (target <= 3.0)"
    text = unit.read_text()
    for line in ("UMask=0077", "CapabilityBoundingSet=\n", "SystemCallArchitectures=native",
                 "SystemCallFilter=@system-service", "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
                 "ProtectKernelLogs=yes", "ProtectClock=yes", "ProtectHostname=yes", "ProtectProc=invisible",
                 "RemoveIPC=yes", "DevicePolicy=closed", "DeviceAllow=/dev/nvidiactl rw", "MemoryMax=", "TasksMax="):
        assert line in text, line
    assert "PrivateDevices=yes" not in text  # it would hide /dev/nvidia*
    docs = (ROOT / "docs" / "operations.md").read_text()
    assert f"scores it {score:.1f}" in docs, "docs/operations.md states the unit's current score"
    assert f"scores this unit {score:.1f}" in text
    # A positive control: the unit as it was before hardening scores worse than the target.
    bare = tmp_path / "servectl.service"
    bare.write_text("[Service]\nType=notify\nUser=servectl\nExecStart=/usr/local/bin/servectl start\n")
    assert unit_exposure(bare) > 3.0


def test_config_check_shows_no_key_or_env_value(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(f'[gateway]\napi_keys = ["sk-shown-nowhere"]\n[[models]]\nname = "m"\nmodel = "{C.DEFAULT_MODEL_DIR}"\n'
                    '[models.env]\nHF_TOKEN = "hf_shown_nowhere"\n')
    cfg, _ = C.load_config(path)
    shown = C.redacted(cfg)
    assert shown.gateway.api_keys == [C.REDACTED] and shown.models[0].env == {"HF_TOKEN": C.REDACTED}
    assert cfg.gateway.api_keys == ["sk-shown-nowhere"]  # the original is untouched
    text = msgspec.json.encode(shown).decode()
    assert "shown_nowhere" not in text and "shown-nowhere" not in text
