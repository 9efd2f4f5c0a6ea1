"""Issue 13: the operators' GPU check (bench/gpu_check.py) runs its CPU dry run, so it cannot rot.

The dry run starts a real daemon (servectl on CPU, where vLLM keeps async
scheduling off), asserts what it can without a GPU and drives one short round
of load with vLLM's serving benchmark.
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["dry_run"]
    assert res["async_scheduling"].startswith("on (max_concurrent_batches 2")  # on CPU too (issue 40)
    assert res["overlapped_steps"]["after"] > res["overlapped_steps"]["before"]
    summary = res["summary"]["servectl"]
    assert set(summary) == {"1", "4"}
    assert all(s["output_tok_s"] > 0 and s["rounds"] == 1 for s in summary.values())
    assert res["settings"]["enforce_eager"] is True and "gpu_memory_utilization" not in res["settings"]
    # `vllm serve`'s command line is assembled (and printed), not run.
    assert "vllm.entrypoints.openai.api_server" in proc.stdout and "not started: --dry-run" in proc.stdout
    assert "gpu_check passed" in proc.stdout


def test_gpu_check_refuses_a_host_without_a_gpu():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    if proc.returncode == 2:
        assert "Use --dry-run" in proc.stderr
    else:  # a CUDA host: the full check ran
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_gpu_check_medians_and_table_for_two_servers():
    """What only a GPU run reaches: medians of alternating rounds and the side-by-side table."""
    from bench.gpu_check import summary, table

    def r(tok, itl):
        return {"output_throughput": tok, "median_itl_ms": itl, "median_ttft_ms": 1.0}

    results = {"servectl": {1: [r(100, 2), r(300, 1), r(200, 3)], 16: [r(1000, 5)] * 3},
               "vllm serve": {1: [r(90, 2)] * 3, 16: [r(500, 4), r(400, 6), r(600, 5)]}}
    s = summary(results)
    assert s["servectl"][1] == {"output_tok_s": 200, "itl_p50_ms": 2, "ttft_p50_ms": 1.0, "rounds": 3}
    assert s["vllm serve"][16]["output_tok_s"] == 500
    text = table(s, [1, 16])
    assert "| 16 | output tok/s (median) | 1000 | 500 | 2.00 |" in text
