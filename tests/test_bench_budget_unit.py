"""bench/budget.py's phase breakdown of a swap, read from log lines (no daemon)."""

from __future__ import annotations

from datetime import datetime

import pytest

from bench.budget import phases

pytestmark = pytest.mark.unit


def test_each_phase_ends_at_its_first_mark_after_the_request(tmp_path):
    t0 = datetime(2026, 12, 4, 13, 39, 28, 638000).timestamp()
    (tmp_path / "manager.log").write_text(
        "2026-12-04 13:39:08,782 manager INFO model b: released (unloaded; 2 standby(s) kept)\n"  # before: not it
        "2026-12-04 13:39:28,684 manager INFO model b: released (unloaded; 2 standby(s) kept)\n"
        "2026-12-04 13:39:28,688 manager INFO engine_core:a: handed to its warm standby (pid 3)\n")
    (tmp_path / "worker-a-0.log").write_text(
        "2026-12-04 13:39:29,285 worker[a:0] INFO Starting to load model /m...\n"
        "Loading safetensors checkpoint shards: 100% Completed\n"
        "2026-12-04 13:39:29,356 worker[a:0] INFO Loading weights took 0.01 seconds\n"
        "2026-12-04 13:39:29,912 worker[a:0] INFO Explicitly set (0.25/23.54) GiB for KV cache on node 0.\n"
        "2026-12-04 13:39:30,177 worker[a:0] INFO warmed 5 weight shapes × row counts 1-192 in 0.20 s\n")
    (tmp_path / "engine_core-a.log").write_text(
        "2026-12-04 13:39:08,126 engine_core[a] INFO ready: /m (max_model_len 512, 1 worker(s))\n"
        "(MainProcess pid=1) INFO 12-04 13:39:30 [core.py:402] init engine took 0.10 s\n"
        "2026-12-04 13:39:30,277 engine_core[a] INFO ready: /m (max_model_len 512, 1 worker(s))\n")
    got = phases(tmp_path, t0, 1.683)
    assert got == {"evict": 0.046, "hand_over": 0.004, "role_start": 0.597, "weights": 0.071, "profile": 0.556,
                   "kv_cache": 0.265, "ready": 0.1, "first_step": 0.044}
    assert abs(sum(got.values()) - 1.683) < 0.002


def test_a_missing_mark_gives_its_time_to_the_next_phase(tmp_path):
    t0 = datetime(2026, 12, 4, 13, 0, 0).timestamp()
    (tmp_path / "engine_core-a.log").write_text("2026-12-04 13:00:05,000 engine_core[a] INFO ready: /m\n")
    assert phases(tmp_path, t0, 5.5) == {"ready": 5.0, "first_step": 0.5}
