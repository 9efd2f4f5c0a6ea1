"""Issue 18: the operators' GPU sleep check (bench/gpu_sleep_check.py) runs its CPU dry run, so it cannot rot.

On CPU vLLM has no sleep mode: the dry run asserts the fallback to unload (the
engine's warning, the engine and worker gone, their memory given back, no
vLLM gauges left) and the same greedy output after the wake.
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_gpu_sleep_check_dry_run(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_sleep_check", "--dry-run", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["dry_run"] and res["level"] == 1
    assert res["memory_serving"]["members_rss"] > 0 and res["memory_released"]["members_rss"] == 0
    assert res["memory_awake"]["members_rss"] > 0
    assert res["memory_serving"]["device_used"] is None  # no accelerator here: no GPU figures
    assert res["text"] and res["wake_first_token_s"] > 0
    assert "gpu_sleep_check passed" in proc.stdout


def test_gpu_sleep_check_refuses_a_host_without_a_gpu():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_sleep_check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    if proc.returncode == 2:
        assert "Use --dry-run" in proc.stderr
    else:  # a CUDA host: the full check ran
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
