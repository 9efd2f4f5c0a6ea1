"""bench/cluster.py without servers: its configurations are valid, its summary and table."""

from __future__ import annotations

import msgspec
import pytest

from bench import cluster as C
from servectl.config.rules import finalize
from servectl.config.schema import Config

pytestmark = pytest.mark.unit


def parsed(text: str) -> Config:
    return finalize(msgspec.toml.decode(text.encode(), type=Config))


def test_the_two_host_config_spreads_the_model_over_h1_and_h2_and_the_one_host_config_does_not(tmp_path):
    secret = tmp_path / "cluster.key"
    secret.write_text("x" * 64)
    secret.chmod(0o600)
    two = parsed(C.servectl_config(["127.0.0.1", "10.79.0.2"], secret))  # h1 local: this_host is found
    m = two.models[0]
    assert (m.name, m.hosts, m.tensor_parallel_size) == ("default", ["h1", "h2"], 2)
    assert two.cluster.hosts == {"h1": "127.0.0.1", "h2": "10.79.0.2"} and not two.manager.warm_standby
    one = parsed(C.servectl_config(["127.0.0.1", "10.79.0.2"], None))
    assert one.models[0].hosts == [] and one.models[0].tensor_parallel_size == 2 and not one.cluster.hosts
    for cfg in (two, one):  # bench/run.py's engine settings, as the vLLM side has them
        args = cfg.models[0].engine_args
        assert (args["max_model_len"], args["dtype"], args["enforce_eager"]) == (C.B.MAX_MODEL_LEN, C.B.DTYPE, True)


def test_vllms_head_serves_and_its_follower_is_headless_with_the_same_settings():
    class Topo:
        host_ip = ["10.79.0.1", "10.79.0.2"]

    head, follower = C.vllm_argv(Topo(), 0), C.vllm_argv(Topo(), 1)
    assert "vllm.entrypoints.openai.api_server" in head and "--headless" not in head
    assert follower[-1] == "--headless" and "serve" in follower
    for argv, rank in ((head, "0"), (follower, "1")):
        flags = dict(zip(argv, argv[1:]))
        assert flags["--node-rank"] == rank and flags["--nnodes"] == "2" and flags["--tensor-parallel-size"] == "2"
        assert flags["--master-addr"] == "10.79.0.1" and flags["--dtype"] == C.B.DTYPE


def test_the_summary_gives_each_side_its_spread_and_the_decode_step_ratios():
    raw = {"servectl-2hosts": [{"decode_step_ms": 30.0, "itl_p50_ms": 31.0, "tok_s_c4": 50.0},
                               {"decode_step_ms": 20.0, "itl_p50_ms": 21.0, "tok_s_c4": 60.0},
                               {"error": "TimeoutError: no completion"}],
           "servectl-1host": [{"decode_step_ms": 10.0, "itl_p50_ms": 11.0, "tok_s_c4": 80.0}] * 3,
           "vllm-multinode": [{"decode_step_ms": 12.5, "itl_p50_ms": 13.0, "tok_s_c4": 70.0}] * 3}
    s = C.summary(raw)
    assert s["servectl-2hosts"]["decode_step_ms"] == {"median": 25.0, "min": 20.0, "max": 30.0}
    assert s["decode_step_ratio"] == {"A/B": 2.5, "A/C": 2.0}
    res = {"summary": s, "raw": raw, "params": {"rounds": 3, "tokens": 128}, "date": "today",
           "machine": {"cores": 2, "cpu": "cpu"}}
    md = C.markdown(res)
    assert "| servectl-2hosts | 25.0 [20.0–30.0] | 26.0 [21.0–31.0] | 55.0 [50.0–60.0] | 2/3 |" in md
    assert "servectl-2hosts, round 3: `TimeoutError: no completion`" in md


def test_a_side_that_never_ran_has_no_ratio():
    raw = {"servectl-2hosts": [{"decode_step_ms": 20.0}], "servectl-1host": [{"decode_step_ms": 10.0}],
           "vllm-multinode": [{"error": "RuntimeError: vllm node-rank 1 exited 1: ..."}]}
    s = C.summary(raw)
    assert s["vllm-multinode"] == {} and s["decode_step_ratio"] == {"A/B": 2.0, "A/C": None}
