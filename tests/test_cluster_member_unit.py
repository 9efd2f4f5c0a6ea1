"""Issue 54: what a member host runs when its head asks (manager/cluster_member.py), without a daemon.

A head (or whoever holds the secret) can only ask for ranks of a model the member's own file
configures with the head as its head, with the same configuration identity, and the member's
share of the ranks: anything else is refused with a reason reported back, and nothing is
exec'd. No vLLM, no processes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from manager.cluster_member import ClusterMember
from servectl import config as C
from servectl.wire import cluster as W
from servectl.wire.vocab import ChildState

pytestmark = pytest.mark.unit


class Host:
    def __init__(self, tmp: Path):
        self.settings = C.ManagerConfig()
        self.runtime_dir = tmp
        self.log_dir = tmp
        self.shutting_down = False
        self.spawned: list = []

    def child_env(self, extra):
        return dict(extra)

    def watch(self, child) -> None:
        self.spawned.append(child)

    def on_child_change(self, child, detail) -> None:
        pass

    def on_cluster_change(self, host, joined, detail) -> None:
        pass

    async def wait_exit(self, children, grace_s) -> None:
        pass


class Link:
    def __init__(self):
        self.sent: list = []

    async def send(self, msg) -> None:
        self.sent.append(msg)


def member(tmp_path: Path) -> tuple[ClusterMember, Host, Link, C.ModelConfig]:
    secret = tmp_path / "key"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    big = C.ModelConfig(name="big", model="/models/big", tensor_parallel_size=2, hosts=["a", "b"])
    cfg = C.Config(cluster=C.ClusterConfig(hosts={"a": "127.0.0.1", "b": "127.0.0.2"}, this_host="b",
                                           secret_file=str(secret)), models=[big])
    host = Host(tmp_path)
    m = ClusterMember(cfg, "b", host)
    link = Link()
    m.links["a"] = link
    return m, host, link, big


def ask(m: ClusterMember, head: str, **kw) -> None:
    msg = W.RunRanks(**{"group": "big", "incarnation": "i1", "model": "big", "config_id": "",
                        "ranks": [W.RankSpec(rank=1, local_rank=0)], "world_size": 2, "nonce": b"n" * 16,
                        "engine_addr": "127.0.0.1", "engine_port": 1, "init_method": "tcp://127.0.0.1:2?host=b",
                        "worker_reply_timeout_s": 5.0, **kw})
    asyncio.run(m._run(head, msg))


@pytest.mark.parametrize("head, change, says", [
    ("a", dict(model="other"), "not configured here"),
    ("c", {}, "not configured here with c as its head"),
    ("a", dict(config_id="0" * 16), "configured differently"),
    ("a", dict(ranks=[W.RankSpec(rank=0, local_rank=0)]), "not this host's share"),
])
def test_a_request_outside_the_members_configuration_is_refused_and_nothing_runs(tmp_path, head, change, says):
    m, host, link, big = member(tmp_path)
    if head != "a":
        m.links[head] = link
    ask(m, head, **{"config_id": C.output_identity(big), **change})
    assert host.spawned == [] and m.ranks == {}
    [report] = link.sent
    assert report.state is ChildState.FAILED and says in report.last_exit, report


def test_the_heads_request_for_its_share_is_reported_started(tmp_path, monkeypatch):
    m, host, link, big = member(tmp_path)
    argv: list = []
    monkeypatch.setattr("manager.children.Child.spawn", lambda self, a, env, fds=(): argv.append((a, env)))
    monkeypatch.setattr("manager.children.Child.pid", property(lambda self: 4242))
    ask(m, "a", config_id=C.output_identity(big))
    [(args, env)] = argv
    assert args[args.index("--dial") + 1] == "127.0.0.1:1" and args[args.index("--rank") + 1] == "1"
    assert env["GLOO_SOCKET_IFNAME"] == "lo"  # its own address's interface (127.0.0.2: loopback)
    [report] = link.sent
    assert report == W.RankState(group="big", incarnation="i1", rank=1, pid=4242, state=ChildState.STARTING)
