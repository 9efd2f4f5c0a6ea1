"""Issue 7: library mode, each case a real script run as a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from conftest import ROOT, wait_for
from servectl.proc import processes_of_instance

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run_script(tmp_path, body: str, timeout: float = 400) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
                          env=ENV, cwd=tmp_path)


def assert_ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"
    assert "bootstrapping phase" not in proc.stderr
    return proc.stdout


def instance_left(stdout: str) -> list[int]:
    tag = next(line.split()[1] for line in stdout.splitlines() if line.startswith("INSTANCE "))
    return processes_of_instance(tag)


def test_script_without_main_guard_runs_once(tmp_path):
    out = assert_ok(run_script(tmp_path, """
        import servectl
        print("TOP OF SCRIPT", flush=True)
        with servectl.Server(model="default") as srv:
            print("INSTANCE", srv.status().instance)
            text = srv.generate("def ", max_tokens=8)[0]
            assert text.strip(), text
            r = srv.client().completions.create(model="default", prompt="import ", max_tokens=4)
            assert r.usage.completion_tokens == 4
        print("DONE")
    """))
    assert out.count("TOP OF SCRIPT") == 1 and "DONE" in out
    assert not instance_left(out)  # stopped on exit of the with block


def test_after_torch_with_threads(tmp_path):
    out = assert_ok(run_script(tmp_path, """
        import threading, torch
        torch.set_num_threads(2)
        x = torch.randn(512, 512)
        print("torch op", float((x @ x).sum()) != 0.0)
        stop = threading.Event()
        worker = threading.Thread(target=stop.wait, daemon=True)
        worker.start()
        import servectl
        srv = servectl.Server()
        print("INSTANCE", srv.status().instance)
        print("TEXT", srv.generate(["def ", "class "], max_tokens=4))
        srv.stop()
        stop.set()
    """))
    assert "TEXT" in out
    assert not instance_left(out)


def start_method_script(method: str) -> str:
    return f"""
        import multiprocessing
        multiprocessing.set_start_method("{method}")
        import servectl
        srv = servectl.Server()
        print("INSTANCE", srv.status().instance)
        print("TEXT", srv.generate("x = ", max_tokens=4))
    """  # no explicit stop: interpreter exit stops it (atexit)


def test_spawn_start_method(tmp_path):
    out = assert_ok(run_script(tmp_path, start_method_script("spawn")))
    assert "TEXT" in out
    wait_for(lambda: not instance_left(out), 60, what="the tree to exit with the script")


def test_fork_start_method(tmp_path):
    out = assert_ok(run_script(tmp_path, start_method_script("fork")))
    assert "TEXT" in out
    wait_for(lambda: not instance_left(out), 60, what="the tree to exit with the script")


def test_python_dash_c(tmp_path):
    code = ("import servectl; s = servectl.Server(); print('INSTANCE', s.status().instance); "
            "print('TEXT', s.generate('def ', max_tokens=3)); s.stop()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400, env=ENV,
                          cwd=tmp_path)
    out = assert_ok(proc)
    assert "TEXT" in out and not instance_left(out)


def test_two_servers_side_by_side(tmp_path):
    out = assert_ok(run_script(tmp_path, """
        import servectl
        a = servectl.Server(name="alpha", model=servectl.library.C.DEFAULT_MODEL_DIR.as_posix())
        b = servectl.Server(name="beta", model=servectl.library.C.DEFAULT_MODEL_DIR.as_posix())
        assert a.port != b.port and a.runtime_dir != b.runtime_dir
        assert a.models() == ["alpha"] and b.models() == ["beta"]
        print("A", a.generate("def ", max_tokens=3), "B", b.generate("def ", max_tokens=3))
        print("INSTANCE", a.status().instance)
        print("INSTANCE_B", b.status().instance)
        a.stop(); b.stop()
    """))
    assert "A [" in out and "B [" in out
    assert not instance_left(out)


def test_server_from_a_thread_survives_the_thread_and_dies_with_the_script(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import threading, time, servectl
        box = {}
        t = threading.Thread(target=lambda: box.update(srv=servectl.Server()))
        t.start(); t.join()
        time.sleep(2)  # PDEATHSIG would have fired by now if it followed that thread
        srv = box["srv"]
        print("TEXT", srv.generate("def ", max_tokens=3), flush=True)
        print("INSTANCE", srv.status().instance, flush=True)
        print("SERVING", flush=True)
        srv.generate("def ", max_tokens=480, ignore_eos=True)  # in flight when we are killed
        time.sleep(600)  # until the test SIGKILLs this script
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, cwd=tmp_path)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("SERVING"):
                break
        out = "".join(lines)
        assert "TEXT" in out, proc.stderr.read() if proc.poll() is not None else out
        assert instance_left(out), "the server died with its thread"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_for(lambda: not instance_left(out), 120, what="the tree to die with the SIGKILLed script")
    finally:
        if proc.poll() is None:
            proc.kill()
