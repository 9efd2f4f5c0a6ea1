"""Issue 54: a model spread over hosts as the configuration says it (servectl/config/cluster.py).

Which host this is (its address is on this machine, or `this_host`), each host's share of the
ranks, which models get an engine here and which only ranks, and the rules refused before
anything starts. No daemon, no vLLM.
"""

from __future__ import annotations

import pytest

from builders import config_error, config_from
from servectl import config as C

pytestmark = pytest.mark.unit

CLUSTER = """
[cluster]
secret_file = "/etc/servectl/cluster.key"
[cluster.hosts]
a = "127.0.0.1"
b = "192.0.2.7"
"""


def model(name: str, hosts: str = "", tp: int = 2, extra: str = "") -> str:
    return f"[[models]]\nname = '{name}'\nmodel = '/models/{name}'\ntensor_parallel_size = {tp}\n{hosts}\n{extra}\n"


def test_this_host_is_the_one_whose_address_is_here():
    cfg = config_from_text(CLUSTER + model("big", "hosts = ['a', 'b']"))
    assert C.cluster.this_host(cfg.cluster) == "a"  # 127.0.0.1 is on every machine; 192.0.2.7 (TEST-NET) is not
    assert C.cluster.this_host(C.ClusterConfig(hosts={"a": "127.0.0.1", "b": "192.0.2.7"}, this_host="b")) == "b"


def config_from_text(text: str, tmp=None) -> C.Config:
    import pathlib
    import tempfile

    d = pathlib.Path(tempfile.mkdtemp())
    return config_from(d, text)


def test_each_host_runs_an_equal_share_of_the_ranks_in_order():
    m = C.ModelConfig(name="big", model="/x", tensor_parallel_size=4, hosts=["a", "b"])
    assert C.cluster.ranks_on(m, "a") == [0, 1]
    assert C.cluster.ranks_on(m, "b") == [2, 3]
    assert C.cluster.ranks_on(m, "c") == []
    assert C.cluster.head_of(m) == "a"
    assert C.cluster.world_size(m) == 4


def test_the_head_starts_the_engine_and_a_member_only_runs_ranks():
    text = CLUSTER + model("big", "hosts = ['a', 'b']") + model("small", tp=1) + model("there", "hosts = ['b']", tp=1)
    head = config_from_text(text)
    assert [m.name for m in C.cluster.engines_here(head)] == ["big", "small"]
    assert C.cluster.ranks_here(head) == []
    member = config_from_text(text.replace("[cluster]\n", "[cluster]\nthis_host = 'b'\n"))
    assert [m.name for m in C.cluster.engines_here(member)] == ["small", "there"]
    assert [m.name for m in C.cluster.ranks_here(member)] == ["big"]


@pytest.mark.parametrize("text, says", [
    (CLUSTER + model("big", "hosts = ['a', 'z']"), "['z'] not in [cluster] hosts"),
    (CLUSTER + model("big", "hosts = ['a', 'a']"), "named twice"),
    (CLUSTER + model("big", "hosts = ['a', 'b']", tp=3), "do not split evenly"),
    (CLUSTER + model("big", "hosts = ['a', 'b']", extra="replicas = 2"), "one replica"),
    (CLUSTER + model("big", "hosts = ['a', 'b']", extra="engine_args = { pipeline_parallel_size = 2 }"),
     "tensor parallelism only"),
    (CLUSTER.replace('secret_file = "/etc/servectl/cluster.key"', "") + model("big", "hosts = ['a', 'b']"),
     "cluster.secret_file"),
    (CLUSTER.replace("127.0.0.1", "192.0.2.8") + model("big", "hosts = ['a', 'b']"), "set cluster.this_host"),
    (CLUSTER.replace('"127.0.0.1"', '"head.example"') + model("big", "hosts = ['a', 'b']"), "not an IP address"),
    (CLUSTER.replace("[cluster]\n", "[cluster]\nthis_host = 'q'\n") + model("big"), "not one of cluster.hosts"),
])
def test_a_bad_cluster_is_refused_naming_the_key(tmp_path, text, says):
    assert says in config_error(tmp_path, text)


def test_config_check_says_what_this_host_does():
    from servectl.cli.config_check import cluster_lines

    text = CLUSTER + model("big", "hosts = ['a', 'b']")
    assert cluster_lines(config_from_text(text)) == [
        "this host is a (127.0.0.1)", "model big: head (engine and ranks [0]); the others: b ranks [1]"]
    member = config_from_text(text.replace("[cluster]\n", "[cluster]\nthis_host = 'b'\n"))
    assert cluster_lines(member)[1] == "model big: ranks [1] here, for the head a"
    assert cluster_lines(config_from_text(model("solo", tp=1))) == []
