"""A CPU worker of the real daemon warms its matmul kernels' row counts before it serves
(engine_core/workers/warm_rows.py; what that buys: bench/results/2026-12-05-warm-rows-ab)."""

from __future__ import annotations

import re


def test_the_worker_warms_every_weight_shape_before_the_model_serves(daemon):
    r = daemon.openai().completions.create(model="default", prompt="def ", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
    log = daemon.log("worker:default:0")
    warmed = re.findall(r"warmed (\d+) weight shapes × row counts 1-(\d+) in", log)
    assert warmed, log[-3000:]
    # qkv, o, gate-up, down and the LM head: every shape of the bundled Llama, each row count up
    # to twice max_num_seqs or the default's 192, whichever is less.
    assert all(int(shapes) == 5 and int(rows) >= 32 for shapes, rows in warmed), warmed
    assert "matmul warm-up skipped" not in log
