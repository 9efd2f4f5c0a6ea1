"""Issue 19, the pure parts: what an operator reads is one line, literal, without a traceback.

Text from users and processes printed by the CLI (no emoji codes, no markup),
error lines, the busy-port sentence and who holds a port, model path checks,
which load failures are permanent, and the group's verdict on them. No daemon,
no vLLM.
"""

from __future__ import annotations

import errno
import io
import os
import socket
import types
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from engine_core.load_errors import RemoteFailure, permanent_reason
from engine_core.workers import WorkerCallFailed
from manager.children import ChildState
from manager.group import GroupState
from servectl import cli
from servectl.cli import common, lifecycle, watch
from servectl import config as C
from servectl import model_check as MC
from servectl.messages import bind_failure, last_error, one_line, without_tracebacks
from servectl.proc import listeners, port_holder
from servectl.wire import control as P
from servectl.wire import status as WS
from test_manager_unit import Alive, group_in

pytestmark = pytest.mark.unit

EMOJI_NAMES = ["fire", "m", "smile"]  # rich reads :fire: as 🔥, :m: as Ⓜ, :smile: as 😄
TRACEBACK = """2026-11-30 10:00:00,000 engine_core[fire] ERROR engine start failed
Traceback (most recent call last):
  File "/x/core.py", line 3, in main
    engine = build()
             ^^^^^^^
ValueError: first

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/x/core.py", line 9, in main
RuntimeError: Cannot find any model weights with `/m`
""".splitlines()


def rendered(fn, *args, terminal: bool = False) -> str:
    buf = io.StringIO()
    fn(common.make_console(file=buf, width=200, force_terminal=terminal), *args)
    return buf.getvalue()


def no_emoji(text: str) -> bool:
    return not any(ch in "🔥Ⓜ😄" or ord(ch) >= 0x1F000 for ch in text)


def child(component: str, model: str | None, state: str = "failed", last_log: list[str] | None = None,
          last_exit: str = "exit code 1", exit_code: int | None = 1):
    return WS.ChildStatus(component=component, kind=component.split(":")[0], model=model, pid=41, ppid=40,
                         state=state, since=1.0, started_at=None, restarts=0, last_exit=last_exit,
                         last_log=last_log or [], exit_code=exit_code)


# ---- the CLI prints names, reasons and log lines literally ----------------------------------

@pytest.mark.parametrize("name", EMOJI_NAMES)
def test_event_lines_keep_emoji_code_names(name):
    ev = WS.Event(component=f"worker:{name}:0", kind="worker", model=name, state="ready", pid=7, time=0.0,
                 detail=f":{name}: [bold]x[/bold]")
    for out in (rendered(common.say, *lifecycle.start_event_parts(ev)), rendered(common.say, watch.event_line(ev))):
        assert f"worker:{name}:0" in out and f":{name}: [bold]x[/bold]" in out and no_emoji(out), out


@pytest.mark.parametrize("terminal", [False, True])
def test_a_failure_prints_markup_and_emoji_codes_as_they_are(terminal):
    model = WS.ModelStatus(name="fire", state="failed", frozen=False, incarnation="a", reason="[red]:fire: [/bold]")
    log = ["loading :smile: [/bold] [link=x]", *TRACEBACK]
    out = rendered(lifecycle.show_model_failure, model, [child("engine_core:fire", "fire", last_log=log),
                                                   child("worker:fire:0", "fire", last_log=["[/]"])],
                   terminal=terminal)
    for literal in ("model fire failed", "[red]:fire: [/bold]", "last lines of engine_core:fire",
                    "last lines of worker:fire:0", "loading :smile: [/bold] [link=x]", "[/]"):
        assert literal in out, out
    assert no_emoji(out)
    assert "Traceback" not in out and "File " not in out and "RuntimeError: Cannot find any model weights" in out


def test_an_excerpt_that_begins_inside_a_traceback_shows_no_frames():
    assert without_tracebacks(TRACEBACK[4:]) == ["ValueError: first",
                                                 "RuntimeError: Cannot find any model weights with `/m`"]


def test_a_load_failure_a_restart_cannot_fix_is_its_reason_alone():
    model = WS.ModelStatus(name="fire", state="failed", frozen=False, incarnation="a",
                          reason="RuntimeError: Cannot find any model weights with `/m`; not restarted")
    out = rendered(lifecycle.show_model_failure, model, [
        child("engine_core:fire", "fire", last_log=TRACEBACK, last_exit="exit code 78",
              exit_code=P.ExitCode.PERMANENT),
        child("worker:fire:0", "fire", last_log=TRACEBACK, last_exit="signal SIGKILL", exit_code=None)])
    assert out == f"model fire failed: {model.reason}\n"


def test_status_table_and_json_keep_the_names(monkeypatch):
    st = P.StatusReply(version=P.PROTOCOL_VERSION, instance="f00d", manager_pid=40, started_at=1.0, state="running",
                       port=8000, host="127.0.0.1", state_dir="/st",
                       children=[child(c, m, "ready") for m in EMOJI_NAMES
                                 for c in (f"engine_core:{m}", f"worker:{m}:0", f"standby:worker:{m}:0")],
                       models=[WS.ModelStatus(name=m, state="ready", frozen=False, incarnation="a")
                               for m in EMOJI_NAMES])
    monkeypatch.setattr(common, "client_for", lambda runtime_dir, timeout=10.0: types.SimpleNamespace(status=lambda: st))
    buf = io.StringIO()
    monkeypatch.setattr(common, "console", common.make_console(file=buf, width=250))
    assert CliRunner().invoke(cli.main, ["status"]).exit_code == 0
    table = buf.getvalue()
    for m in EMOJI_NAMES:
        assert f"worker:{m}:0" in table and f"standby:worker:{m}:0" in table and f"engine_core:{m}" in table
    assert no_emoji(table), table
    out = CliRunner().invoke(cli.main, ["status", "--json"]).output
    assert [c["component"] for c in msgspec.json.decode(out)["children"]] == [c.component for c in st.children]


def test_an_unexpected_cli_error_is_one_line(monkeypatch):
    def broken(runtime_dir, timeout=10.0):
        raise msgspec.ValidationError("Expected `int`, got `str` - at `$.port`")

    monkeypatch.setattr(common, "client_for", broken)
    monkeypatch.delenv("SERVECTL_DEBUG", raising=False)
    buf = io.StringIO()
    monkeypatch.setattr(common, "err", common.make_console(file=buf, width=250))
    result = CliRunner().invoke(cli.main, ["status"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert buf.getvalue().count("\n") == 1 and "ValidationError: Expected `int`" in buf.getvalue()


# ---- one line, no traceback -----------------------------------------------------------------

def test_without_tracebacks_keeps_the_exception_lines_only():
    assert without_tracebacks(TRACEBACK) == [TRACEBACK[0], "ValueError: first",
                                             "RuntimeError: Cannot find any model weights with `/m`"]
    assert last_error(TRACEBACK) == "RuntimeError: Cannot find any model weights with `/m`"
    assert last_error(["all good", "2026-11-30 10:00:00,000 manager ERROR not started: 127.0.0.1:80 is in use"]) \
        == "not started: 127.0.0.1:80 is in use"
    assert last_error(["nothing", "to see"]) is None


def test_one_line_takes_pydantics_first_error_and_bounds_the_length():
    arch = ("1 validation error for ModelConfig\n  Value error, Model architectures ['NoSuchForCausalLM'] are "
            "not supported for now. Supported architectures: dict_keys([" + "'A', " * 200 + "])\n"
            "    For further information visit https://errors.pydantic.dev/2.13/v/value_error")
    line = one_line(arch)
    assert line.startswith("Model architectures ['NoSuchForCausalLM'] are not supported") and len(line) <= 300
    dtype = ("2 validation errors for ModelConfig\ndtype.literal['auto','half']\n  Input should be 'auto' or 'half' "
             "[type=literal_error, input_value='float99', input_type=str]\n")
    assert one_line(dtype) == "dtype.literal['auto','half']: Input should be 'auto' or 'half'"
    assert one_line("  \n") == "" and one_line("a\n  b") == "a"


# ---- a taken port -------------------------------------------------------------------------

def test_the_bind_failure_names_the_address_the_holder_and_the_settings():
    used = OSError(errno.EADDRINUSE, "Address already in use (while attempting to bind on address x)")
    line = bind_failure("127.0.0.1", 8000, used, "pid 12 (python -m http.server)", "/etc/servectl.toml")
    assert line == ("127.0.0.1:8000 is already in use by pid 12 (python -m http.server); choose another port "
                    "with --port or gateway.port in /etc/servectl.toml")
    assert bind_failure("::1", 80, OSError(errno.EACCES, "Permission denied")).startswith("[::1]:80: permission")
    assert "--host or gateway.host" in bind_failure("10.9.9.9", 1, OSError(errno.EADDRNOTAVAIL, "x"))
    odd = bind_failure("nohost.invalid", 1, socket.gaierror(-2, "Name or service not known (while attempting x)"))
    assert odd.startswith("cannot listen on nohost.invalid:1: Name or service not known;") and "\n" not in odd


PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0 100 0 0 10 0
   1: 0100007F:1F40 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000  1000        0 4343 1 0 20 4 30 10 -1
   2: 00000000:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 99 1 0 100 0 0 10 0
"""


def test_listeners_are_read_from_proc_net_tcp():
    assert listeners(PROC_NET_TCP, 8000) == [(4242, 1000)]  # the established connection is not a listener
    assert listeners(PROC_NET_TCP, 80) == [(99, 0)]
    assert listeners(PROC_NET_TCP, 8001) == [] and listeners("garbage\n1 2 3", 1) == []


def test_the_holder_of_a_port_is_found_through_proc():
    with socket.create_server(("127.0.0.1", 0)) as s:
        assert port_holder(s.getsockname()[1]).startswith(f"pid {os.getpid()} (")


# ---- model paths, before any process starts ------------------------------------------------

def offline(**env) -> dict[str, str]:
    return {**C.ENGINE_OFFLINE_ENV, **env}


def test_model_paths(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    assert MC.model_path_problem(str(model), offline()) == f"{model} holds no config.json (not a Hugging Face model directory)"
    (model / "config.json").write_text("{}")
    assert MC.model_path_problem(str(model), offline()) is None
    assert MC.model_path_problem(str(C.DEFAULT_MODEL_DIR), offline()) is None
    assert MC.model_path_problem("/nonexistent/model/dir", offline()) == "/nonexistent/model/dir does not exist"
    assert MC.model_path_problem(str(model / "config.json"), offline()).endswith("is not a model directory")
    (tmp_path / "w.gguf").write_bytes(b"GGUF")
    assert MC.model_path_problem(str(tmp_path / "w.gguf"), offline()) is None
    assert "not a Hugging Face hub id" in MC.model_path_problem("not a/hub id!", offline())


def test_hub_ids_offline_must_be_in_the_local_cache(tmp_path):
    env = offline(HF_HUB_CACHE=str(tmp_path))
    why = MC.model_path_problem("org/tiny", env)
    assert "org/tiny" in why and str(tmp_path) in why and "HF_HUB_OFFLINE" in why
    snap = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    assert MC.model_path_problem("org/tiny", env) is not None  # a snapshot without a config
    (snap / "config.json").write_text("{}")
    assert MC.model_path_problem("org/tiny", env) is None
    assert MC.model_path_problem("org/other", {**env, "HF_HUB_OFFLINE": "0"}) is None  # downloaded at load
    assert MC.hf_hub_cache({"HF_HOME": "/h"}) == Path("/h/hub")


def test_check_model_paths_names_the_key_and_the_file_or_the_option(tmp_path):
    cfg = C.Config(models=[C.ModelConfig(name="ok", model=str(C.DEFAULT_MODEL_DIR)),
                           C.ModelConfig(name="fire", model="/nonexistent/model/dir")])
    assert MC.check_model_paths(cfg, tmp_path / "c.toml") == [
        f"config error in {tmp_path / 'c.toml'}: models[1].model (fire): /nonexistent/model/dir does not exist"]
    cfg.models.reverse()
    assert MC.check_model_paths(cfg, None, C.Overrides(model="/nonexistent/model/dir")) == [
        "bad option: --model: /nonexistent/model/dir does not exist"]
    # A model's own env decides: online, a hub id is left to the engine.
    cfg = C.Config(models=[C.ModelConfig(name="h", model="org/tiny", env={"HF_HUB_OFFLINE": "0"})])
    assert MC.check_model_paths(cfg) == []


# ---- which load failures are permanent ------------------------------------------------------

def raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        raise exc from cause
    except BaseException as e:  # noqa: BLE001
        return e


@pytest.mark.parametrize("exc,says", [
    (FileNotFoundError(2, "No such file or directory", "/m/tokenizer.json"), "FileNotFoundError: [Errno 2]"),
    (ValueError("1 validation error for ModelConfig\n  Value error, Model architectures ['X'] are not supported "
                "for now. Supported architectures: dict_keys(['A', 'B'])"),
     "ValueError: Model architectures ['X'] are not supported for now."),
    (TypeError("EngineArgs.__init__() got an unexpected keyword argument 'bogus'"), "TypeError: EngineArgs"),
    (RuntimeError("Cannot find any model weights with `/m`"), "RuntimeError: Cannot find any model weights"),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "RuntimeError: CUDA out of memory"),
    (MemoryError(), "MemoryError"),
    (raised(RuntimeError("Engine core initialization failed"), NotImplementedError("no kernel")),
     "NotImplementedError: no kernel"),
])
def test_permanent_load_failures(exc, says):
    assert permanent_reason(exc).startswith(says)


@pytest.mark.parametrize("exc", [RuntimeError("gloo: connection reset by peer"), ConnectionError("hub"),
                                 TimeoutError(), OSError(errno.ENOSPC, "No space left on device"), KeyError("x")])
def test_other_load_failures_are_crashes(exc):
    assert permanent_reason(exc) is None


def test_a_workers_verdict_travels_with_its_failure():
    import pickle

    failure = pickle.loads(pickle.dumps(RemoteFailure("RuntimeError: x\nTraceback ...", "RuntimeError: x"), 5))
    assert isinstance(failure, str) and failure.permanent == "RuntimeError: x" and failure.startswith("RuntimeError")
    assert permanent_reason(WorkerCallFailed("worker call load_model failed: rank 0: ...", "RuntimeError: x")) == \
        "RuntimeError: x"
    # The worker said it is not permanent: its text (a traceback) is not searched again.
    assert permanent_reason(WorkerCallFailed("rank 0: RuntimeError: out of memory in a traceback line", None)) is None


# ---- the group fails at once ------------------------------------------------------------------

def test_a_permanent_load_failure_fails_the_group_at_once(tmp_path):
    group, host = group_in(tmp_path, GroupState.STARTING)
    group.incarnation = "inc"
    group.on_engine_failed("old", "stale")  # another incarnation's report changes nothing
    assert group.permanent_failure is None
    group.on_engine_failed("inc", "RuntimeError: Cannot find any model weights with `/m`")
    group.engine.exit_code = P.ExitCode.PERMANENT
    Alive.die(group.engine, "exit code 78")
    group.on_member_exit(group.engine)
    assert group.state is GroupState.EXITED  # the worker is still alive
    Alive.die(group.workers[0])
    group.on_member_exit(group.workers[0])
    assert group.state is GroupState.FAILED and group.restart_timer is None
    assert group.reason.startswith("RuntimeError: Cannot find any model weights with `/m`; not restarted")
    assert "servectl logs engine_core:m" in group.reason
    assert host.published == ["exited", "failed"] and host.standbys.released == ["m"]
    assert {c.state for c in group.children} == {ChildState.FAILED}


def test_exit_78_without_a_report_is_permanent_too(tmp_path):
    group, host = group_in(tmp_path, GroupState.STARTING)
    group.engine.exit_code = P.ExitCode.PERMANENT
    for c in group.children:
        Alive.die(c)
        group.on_member_exit(c)
    assert group.state is GroupState.FAILED and "engine_core:m could not load the model" in group.reason
