"""Issue 2: tensor_parallel_size 2 gives two manager-owned workers that serve."""

from __future__ import annotations

import pytest

from conftest import Daemon, read_stat


@pytest.fixture(scope="module")
def tp_daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("tp2"), args=["--tp", "2"])
    try:
        d.start()
        yield d
    finally:
        d.stop()
        leftover = d.tree()
        d.kill_all()
        assert not leftover


def test_tp2_serves_with_two_manager_owned_workers(tp_daemon, daemon):
    st = tp_daemon.status()
    workers = [c for c in st.children if c.kind == "worker"]
    assert len(workers) == 2
    for w in workers:
        assert int(read_stat(w.pid)[1]) == st.manager_pid
    prompt = "def main():\n"
    r = tp_daemon.openai().completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0)
    assert r.usage.completion_tokens == 12
    # Same greedy output as the single-worker engine of the shared daemon.
    single = daemon.openai().completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == single.choices[0].text
