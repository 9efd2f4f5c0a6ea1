"""A short chaos run (issue 39; the long one is `python -m bench.chaos`): mixed greedy load on a
daemon with two gateways and warm standbys while every kind of fault and attack hits it once.
Nothing is lost but what docs/supervision.md calls unavoidable (a request on a gateway that was
killed), every answer equals the one taken before any fault, nothing runs at the end, the
manager's memory stays bounded, nothing of the tree is left (the factory checks)."""

from __future__ import annotations

from bench.chaos import FAULTS, Chaos, config_text, small_disk
from conftest import DaemonFactory


def test_a_chaos_run_loses_nothing(tmp_path_factory):
    work = tmp_path_factory.mktemp("chaos")
    with small_disk(work / "state", 64) as disk, DaemonFactory(tmp_path_factory, "chaos") as make:
        state = disk if disk is not None else work / "state"
        d = make(config_text(state))
        d.wait_standbys_warm(4)  # default's engine and worker, default-embed's
        chaos = Chaos(d.port, d.runtime_dir, state, seed=1, disk=disk)
        report = chaos.run(duration_s=0, gap=(5.0, 8.0), clients=3)  # each kind once; the long run is the bench's
        summary = report.summary()
        faults = "\n".join(f"{t}s {k}: {w}" for t, k, w in report.faults)
        kinds = sorted({(o.name, (o.error or "")[:160]) for o in report.errors()})
        print(summary, kinds[:10], faults, sep="\n")
        assert {k for _, k, _ in report.faults} == set(FAULTS), faults
        assert not any(w.startswith("fault failed") or w in ("ACCEPTED", "answered", "MISMATCH", "STALLED")
                       for _, _, w in report.faults), faults
        assert summary["errors"] == 0, f"{summary}\n{kinds[:8]}\n{faults}"
        assert summary["mismatches"] == 0, (summary, faults)
        assert summary["completed"] >= 20, summary
        assert summary["end_running"] == 0, summary
        assert summary["manager_rss_mb"] < 300, summary
