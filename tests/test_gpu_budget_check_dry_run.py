"""Issue 35: the operators' GPU budget check (bench/gpu_budget_check.py) runs its CPU dry run, so it cannot rot.

On CPU the footprint is the engine group's RSS and eviction unloads (no sleep mode): the dry
run asserts the measured footprint, the eviction by the memory budget alone, the same greedy
answer from either copy, and the evicted model's processes gone.
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_gpu_budget_check_dry_run(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_budget_check", "--dry-run", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["dry_run"]
    assert res["footprint_a"]["measured"] and res["footprint_a"]["source"].startswith("RSS")
    assert res["budget_after_first_eviction"]["last_eviction"]["model"] == "a"
    assert res["text"] and res["evicted_to_first_token_s"] > 0
    assert "gpu_budget_check passed" in proc.stdout


def test_gpu_budget_check_refuses_a_host_without_a_gpu():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_budget_check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    if proc.returncode == 2:
        assert "Use --dry-run" in proc.stderr
    else:  # a CUDA host: the full check ran
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
