"""Issue 19: what an operator meets in the first hour, through the real CLI.

Model names that are rich emoji codes print as they are; a taken port is one
line and exit 2 with nothing left running; a model path that is not a model is
refused before anything starts; a load failure a restart cannot fix fails the
model after one attempt, with its reason in status. The pure parts are in
test_operator_messages_unit.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time

import pytest

from conftest import ROOT, SERVECTL, DaemonFactory, http, wait_for
from servectl.config import DEFAULT_MODEL_DIR

EMOJI = ("🔥", "Ⓜ", "😄")


def literal(text: str) -> bool:
    return not any(e in text for e in EMOJI)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and not proc.stdout.strip(), (proc.stdout, proc.stderr)
    return lines[0]


# ---- one daemon: names that are emoji codes, and a load failure a restart cannot fix ----------

@pytest.fixture(scope="module")
def emoji(tmp_path_factory):
    """Model `fire` serves; model `m` has no weights, so its load fails in the worker
    in a way a restart cannot fix (:fire: is 🔥 and :m: is Ⓜ to rich)."""
    no_weights = tmp_path_factory.mktemp("models") / "no-weights"
    shutil.copytree(DEFAULT_MODEL_DIR, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    with DaemonFactory(tmp_path_factory, "emoji") as make:
        yield make(f'[manager]\nwarm_standby = false\nfreeze_grace_s = 1.0\nbackoff_initial_s = 0.2\n'
                   f'[[models]]\nname = "fire"\nmodel = "{DEFAULT_MODEL_DIR}"\n'
                   f'[[models]]\nname = "m"\nmodel = "{no_weights}"\n', expect_ok=False), no_weights


def test_emoji_code_names_print_literally(emoji):
    d, _ = emoji
    out = d.start_output
    # `start` shows the state changes it sees (those before its subscription are
    # not published to it); the last ones, every member settled, come before its answer.
    assert out.returncode == 1 and "worker:fire:0" in out.stdout and "model m failed" in out.stderr, out
    assert literal(out.stdout + out.stderr)

    table = d.cli("status").stdout
    for name in ("engine_core:fire", "worker:fire:0", "engine_core:m", "worker:m:0", "model m failed"):
        assert name in table, table
    assert literal(table)
    st = json.loads(d.cli("status", "--json").stdout)
    assert {c["component"] for c in st["children"]} == {"gateway:0", "engine_core:fire", "worker:fire:0",
                                                         "engine_core:m", "worker:m:0"}
    assert [m["name"] for m in st["models"]] == ["fire", "m"]

    events = subprocess.Popen([*SERVECTL, "events", "--runtime-dir", str(d.runtime_dir)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=d.env, cwd=ROOT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(events.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        def seen() -> bool:
            # Thawing and freezing the worker makes events (the first ones may go
            # out before the subscription is in place: probe until one is seen).
            d.cli("freeze", "fire", "off", check=True)
            d.cli("freeze", "fire", "on", check=True)
            return "worker:fire:0" in "".join(lines)

        wait_for(seen, 60, interval=1.5, what="events of worker:fire:0", diagnose=lambda: "".join(lines))
    finally:
        events.terminate()
        events.wait(10)
    assert literal("".join(lines)), lines

    # The engine hands vLLM rendered prompts (not the deprecated raw-prompt path).
    r = http(d, "POST", "/v1/completions", {"model": "fire", "prompt": "def ", "max_tokens": 4, "temperature": 0})
    assert r.status == 200 and r.json()["choices"][0]["text"], r.text
    log = d.log("engine_core:fire")
    assert "ready:" in log and "Passing raw prompts" not in log, log[-2000:]


def test_a_load_failure_a_restart_cannot_fix_fails_after_one_attempt(emoji):
    """The worker's load fails (no weights), it judges the failure permanent, the
    engine reports it, the group fails without a restart. (An engine-side failure,
    e.g. an unsupported architecture, takes the same path from the engine on:
    test_operator_messages_unit.py.)"""
    d, no_weights = emoji
    reason = (f"RuntimeError: Cannot find any model weights with `{no_weights}`; not restarted: a restart cannot "
              "fix this (details: servectl logs engine_core:m)")
    assert d.start_output.stderr.strip() == f"model m failed: {reason}", d.start_output.stderr

    st = d.status()
    assert [(m.name, m.state, m.reason) for m in st.models] == [("fire", "ready", None), ("m", "failed", reason)]
    engine = next(c for c in st.children if c.component == "engine_core:m")
    assert engine.state == "failed" and engine.restarts == 0 and engine.last_exit == "exit code 78", engine
    assert "Traceback" in d.log("engine_core:m") and "Traceback" in d.log("worker:m:0")  # details stay in the logs
    assert all(c.restarts == 0 for c in d.status().children)  # long past the first backoff (0.2 s)
    status = d.cli("status")
    assert status.returncode == 1 and f"model m failed: {reason}" in status.stdout
    assert "Traceback" not in status.stdout + status.stderr


# ---- a taken port ---------------------------------------------------------------------------

def test_a_taken_port_is_one_line_exit_2_and_nothing_left(daemon_factory):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        d = daemon_factory(f"[gateway]\nport = {port}\n", start=False)
        proc = d.cli("start", "--config", str(d.config_path), timeout=60)
        assert proc.returncode == 2, (proc.stdout, proc.stderr)
        line = one_line_error(proc)
        assert line.startswith(f"127.0.0.1:{port} is already in use by pid {os.getpid()} (")
        assert "--port" in line and "gateway.port" in line and str(d.config_path) in line, line
        assert not d.leftovers() and not (d.runtime_dir / "control").exists()
        assert not (d.runtime_dir / "manager.pid").exists()

        # The same through --port, and from a script.
        proc = d.cli("start", "--port", str(port), timeout=60)
        assert proc.returncode == 2 and one_line_error(proc).startswith(f"127.0.0.1:{port} is already in use")
        from servectl.library import Server, ServerError

        with pytest.raises(ServerError) as info:
            Server(port=port, runtime_dir=d.runtime_dir / "lib", timeout=60)
        assert str(info.value) == line.replace(f" in {d.config_path}", "")
        assert not d.leftovers()


# ---- a model path that is not a model -------------------------------------------------------

def test_a_missing_model_path_is_refused_before_anything_starts(daemon_factory):
    d = daemon_factory('[[models]]\nname = "fire"\nmodel = "/nonexistent/model/dir"\n', start=False)
    began = time.monotonic()
    check = subprocess.run([*SERVECTL, "config", "check", str(d.config_path)], capture_output=True, text=True,
                           cwd=ROOT, env=d.env, timeout=60)
    assert check.returncode == 2
    assert one_line_error(check) == (f"config error in {d.config_path}: models[0].model (fire): "
                                     "/nonexistent/model/dir does not exist")
    start = d.cli("start", "--config", str(d.config_path), timeout=60)
    assert start.returncode == 2 and one_line_error(start) == check.stderr.strip()
    start = d.cli("start", "--model", "/nonexistent/model/dir", timeout=60)
    assert start.returncode == 2
    assert one_line_error(start) == "bad option: --model: /nonexistent/model/dir does not exist"
    empty = d.config_path.parent / "empty-model"
    empty.mkdir()
    start = d.cli("start", "--model", str(empty), timeout=60)
    assert start.returncode == 2 and "holds no config.json" in one_line_error(start)
    assert time.monotonic() - began < 30  # no engine, no vLLM import
    assert not d.runtime_dir.exists() and not d.leftovers()
