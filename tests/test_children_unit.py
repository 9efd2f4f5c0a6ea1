"""Unit tests of the supervision state: RestartPolicy and Child, with a fake process."""

from __future__ import annotations

import select
import signal
import sys

import pytest

from manager.children import Child, RestartPolicy, describe_exit

# The only processes started are the trivial FAKE child below (no manager, no vLLM).
pytestmark = pytest.mark.unit

FAKE = [sys.executable, "-c", "import sys, time; print('fake child up', flush=True); "
        "sys.exit(int(sys.argv[1])) if sys.argv[1] != 'sleep' else time.sleep(60)"]


def test_backoff_doubles_and_caps():
    p = RestartPolicy(initial_s=1, max_s=5, crash_loop_count=10, window_s=100)
    assert [p.record_exit(t) for t in range(5)] == [1, 2, 4, 5, 5]


def test_crash_loop_fails_after_n_exits_in_window():
    p = RestartPolicy(initial_s=1, max_s=30, crash_loop_count=3, window_s=60)
    assert p.record_exit(0) == 1
    assert p.record_exit(10) == 2
    assert p.record_exit(20) is None  # third exit within 60 s: failed


def test_old_exits_are_forgotten():
    p = RestartPolicy(initial_s=1, max_s=30, crash_loop_count=3, window_s=60)
    p.record_exit(0)
    p.record_exit(10)
    assert p.record_exit(100) == 1  # the first two fell out of the window


def run_child(tmp_path, arg: str):
    changes = []
    child = Child("fake:0", "fake", None, tmp_path / "fake.log", lambda c, d: changes.append((c.state, d)))
    child.spawn([*FAKE, arg], env={"PATH": "/usr/bin:/bin"})
    return child, changes


def wait_pidfd(child: Child, timeout: float = 30) -> bool:
    return bool(select.select([child.pidfd], [], [], timeout)[0])


def test_child_exit_code_is_collected_through_its_pidfd(tmp_path):
    child, changes = run_child(tmp_path, "3")
    assert child.state == "starting" and child.alive
    assert wait_pidfd(child)
    while child.read_output():  # the manager does this on the pipe's readiness
        select.select([child.output_fd], [], [], 5)
    assert child.reap() == "exit code 3"
    assert not child.alive and child.pid is None
    assert child.tail() == ["fake child up"]
    assert (tmp_path / "fake.log").read_text() == "fake child up\n"
    assert changes == [("starting", "")]


def test_child_killed_by_signal_is_described(tmp_path):
    child, _ = run_child(tmp_path, "sleep")
    assert not wait_pidfd(child, 0.2)  # alive: the pidfd is not readable
    child.signal(signal.SIGKILL)
    assert wait_pidfd(child)
    assert child.reap() == "signal SIGKILL"
    child.signal(signal.SIGTERM)  # signalling a reaped child is a no-op, not an error


def test_restart_counts(tmp_path):
    child, _ = run_child(tmp_path, "0")
    wait_pidfd(child)
    child.reap()
    assert child.exit_ok and child.restarts == 0
    child.spawn([*FAKE, "0"], env={})
    assert child.restarts == 1
    wait_pidfd(child)
    child.reap()


def test_describe_exit():
    import os

    assert describe_exit(0, os.CLD_EXITED) == "exit code 0"
    assert describe_exit(9, os.CLD_KILLED) == "signal SIGKILL"

