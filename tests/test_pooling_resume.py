"""Issue 33: embedding requests ride a worker SIGKILL with 0 client errors (a real kill).

Four clients send embedding requests back to back; the model's worker is
SIGKILLed while they run. A pooling request is one step, so each one in flight
is sent again whole to the restarted engine: every request answers 200 with the
same vectors as before the kill.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from conftest import DEFAULT_MODEL_DIR, DaemonFactory, assert_nothing_running, http, wait_for


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    with DaemonFactory(tmp_path_factory, "pooling-resume") as make:
        yield make(f'[gateway]\nhold_timeout_s = 120\n[manager]\nbackoff_initial_s = 0.3\n[[models]]\n'
                   f'name = "emb"\nmodel = "{DEFAULT_MODEL_DIR}"\n[models.engine_args]\nrunner = "pooling"\n'
                   'convert = "embed"\ndtype = "float32"\n')


def embed(d, i: int):
    return http(d, "POST", "/v1/embeddings", {"model": "emb", "input": [f"def f{i}(x):", f"import m{i}"]},
                timeout=300)


def test_a_worker_sigkill_during_embedding_requests_costs_no_errors(d):
    d.wait_standbys_warm(2)
    reference = {i: embed(d, i).json()["data"] for i in range(8)}
    stop, killed = threading.Event(), threading.Event()
    errors, after_kill = [], [0]

    def client(k: int):
        n = 0
        while not stop.is_set():
            i = (k + n) % 8
            n += 1
            r = embed(d, i)
            if r.status != 200:
                errors.append((r.status, r.body[:200]))
            elif [x["embedding"] for x in r.json()["data"]] != [x["embedding"] for x in reference[i]]:
                errors.append(("differs", i))
            elif killed.is_set():
                after_kill[0] += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    old = d.child("worker:emb:0").pid
    engine = d.child("engine_core:emb").pid
    os.kill(old, signal.SIGKILL)
    killed.set()
    wait_for(lambda: d.child("engine_core:emb").pid != engine
             and next(m.state for m in d.status().models if m.name == "emb") == "ready", 300, interval=0.1,
             what="the group restarted", diagnose=lambda: d.log_tails("manager", "engine_core:emb"))
    wait_for(lambda: after_kill[0] >= 8, 120, interval=0.1, what="requests answered after the restart")
    stop.set()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert "going on with" in d.log("gateway:0"), d.log_tails("gateway:0")  # requests were in flight
    assert_nothing_running(d)
