"""bench.rounds --pool: the rounds of several result files as one result (no servers)."""

from __future__ import annotations

import json

import pytest

from bench.rounds import markdown, pool

pytestmark = pytest.mark.unit


def result(tps_a: list[float], tps_b: list[float], a: str = "vllm serve", b: str = "servectl") -> dict:
    def rnd(tps: float) -> dict:
        return {"stream": {"1": {"output_throughput": tps, "median_itl_ms": 1000 / tps}},
                "non_stream_c16": {"tok_s": tps * 10}}

    return {"date": "2026-12-01 00:00", "machine": {"cores": 2, "cpu": "x"}, "rounds": len(tps_a),
            "params": {"input_len": 32, "output_len": 64},
            "raw": {a: [rnd(t) for t in tps_a], b: [rnd(t) for t in tps_b]}}


def test_pooled_medians_are_over_every_round_of_every_file(tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(json.dumps(result([100, 110, 120], [90, 95, 300])))
    two.write_text(json.dumps(result([130, 140], [200, 210])))
    res, a, b = pool([one, two])
    assert (a, b, res["rounds"]) == ("vllm serve", "servectl", 5)
    assert res["summary"][a]["stream"]["1"]["output_throughput"] == {"median": 120, "min": 100, "max": 140}
    assert res["summary"][b]["stream"]["1"]["output_throughput"] == {"median": 200, "min": 90, "max": 300}
    assert res["summary"][b]["non_stream_c16_tok_s"]["median"] == 2000
    md = markdown(res, a, b)
    assert "5 alternating rounds" in md and "| stream tok/s, c=1 | 120 [100 – 140] | 200 [90 – 300] | 1.67 |" in md


def test_files_of_other_servers_are_not_pooled(tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(json.dumps(result([100], [90])))
    two.write_text(json.dumps(result([100], [90], a="servectl A", b="servectl B")))
    with pytest.raises(SystemExit, match="different servers"):
        pool([one, two])
