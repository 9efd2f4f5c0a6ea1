"""Issue 54: the operators' two-host GPU check (bench/gpu_cluster_check.py) runs its CPU dry run, so it cannot rot.

Two servectl daemons on this machine, "hosts" h1 (127.0.0.1) and h2 (127.0.0.2), serve the
bundled model at TP=2, one rank each: the dry run asserts the ranks' hosts in both daemons'
status, greedy answers equal to a one-daemon TP=2 group's, the group back after its remote rank's
SIGKILL with the same answer, and nothing of either tree left after the stop.
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_gpu_cluster_check_dry_run(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_cluster_check", "--dry-run", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["dry_run"]
    assert res["rank_1"]["host"] == "h2" and res["rank_1"]["head"] == "h1" and res["rank_1"]["pid"]
    assert res["member_link_source"] == "127.0.0.2"
    assert res["outputs_equal"] and res["texts_two_hosts"] == res["texts_one_host"]
    assert len(res["texts_two_hosts"]) == 3 and all(res["texts_two_hosts"])
    assert res["text_after_kill"] == res["texts_two_hosts"][0] and res["recovered_s"] > 0
    assert res["gpu_of_rank_1"] == "skipped (dry run)"
    assert res["two_host_start_s"] > 0 and res["itl_p50_ms_two_hosts"] and res["itl_p50_ms_one_host"]
    assert not res.get("left_running")
    assert "gpu_cluster_check passed" in proc.stdout


def test_gpu_cluster_check_refuses_a_host_without_two_gpus():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_cluster_check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    if proc.returncode == 2:
        assert "Use --dry-run" in proc.stderr
    else:  # a host with 2 CUDA GPUs: the full check ran
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
