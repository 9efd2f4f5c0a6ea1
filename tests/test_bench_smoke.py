"""Issue 6: the benchmark harness runs (tiny counts), so it cannot rot.

It starts both servers (`vllm serve` and servectl) and drives each with vLLM's
own serving benchmark; the figures are not asserted as times, only that each
was measured.
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_bench_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(next(tmp_path.glob("*-smoke.json")).read_text())
    for name in ("vllm serve", "servectl"):
        r = result[name]
        assert r["cold_start_s"] > 0
        stream = r["stream"]["2"]
        assert stream["completed"] == 4 and stream["output_throughput"] > 0
        assert r["non_stream_c32"]["ok"] == r["non_stream_c32"]["requests"]
        assert r["idle"]["processes"] >= 2 and "rss_mib" in r
    assert (tmp_path / next(tmp_path.glob("*-smoke.md")).name).read_text().count("|") > 20
    # The headline, as a count that does not depend on machine speed:
    assert result["servectl"]["idle"]["context_switches_per_s"] < result["vllm serve"]["idle"]["context_switches_per_s"]


def test_hop_rtt_smoke(tmp_path):
    """bench.hop_rtt (what a transport costs per round trip) runs and measures each way."""
    out = tmp_path / "rtt"
    proc = subprocess.run([sys.executable, "-m", "bench.hop_rtt", "--rounds", "1", "--n", "50", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert set(result["runs"]) == {"zmq", "zmq+spin", "unix", "unix+spin"}
    assert all(run[0]["p50_us"] > 0 for run in result["runs"].values())
