"""Several hosts behind vllm-router (issue 37): what a host's death costs, how well prefixes stick.

    python -m bench.hosts [--rounds 3] [--out bench/results/<date>-hosts.json]   (root)

Each round makes the miniature of tests/test_hosts.py afresh (tests/netns.py: network
namespaces, nothing in the root one): two servectl daemons serving the bundled model (no
standbys), vllm-router with ``cache_aware`` checking ``/ready`` every second, the clients in
the router's namespace. Figures:

- ``prefix_follow``: 8 groups of prompts, each sharing ~200 tokens; each group's first request
  sent at once with the others, then 5 more of each, one at a time: the share that went to the
  host their group's first request went to;
- a host killed under load: 8 clients stream (64 tokens each, one request after another) and
  after 5 s host 1's manager is SIGKILLed (its tree dies with it); 10 s later the load stops.
  ``lost_streaming``: streams cut after they had started on the dead host; ``lost_other``:
  any other failed request (retried by the router, they should be 0); ``longest_gap_s``: the
  longest any client waited for its next token, from the kill on (retries included);
  ``router_dropped_s``: from the kill until the router marks the host unhealthy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import run as B
from bench.spread import spread
from servectl.config import DEFAULT_MODEL_DIR

sys.path.insert(0, str(B.ROOT / "tests"))
from netns import Load, Router, Topology, longest_gap  # noqa: E402  (the tests' helper, shared)

PORT = 8000


class HostDaemon:
    def __init__(self, workdir: Path, topo: Topology, index: int):
        self.topo, self.ns, self.ip = topo, topo.host_ns[index], topo.host_ip[index]
        workdir.mkdir(parents=True, exist_ok=True)
        self.runtime = workdir / "rt"
        self.config = workdir / "servectl.toml"
        self.config.write_text(f'[gateway]\nhost = "{self.ip}"\nport = {PORT}\n[manager]\nwarm_standby = false\n'
                               f'[[models]]\nname = "default"\nmodel = "{DEFAULT_MODEL_DIR}"\n')
        self.base = f"http://{self.ip}:{PORT}"

    def cli(self, *args: str, ns: bool = False) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "servectl.cli", *args, "--runtime-dir", str(self.runtime)]
        return subprocess.run(self.topo.command(self.ns, argv) if ns else argv, capture_output=True, text=True,
                              cwd=B.ROOT, timeout=900)

    def start(self) -> None:
        proc = self.cli("start", "--config", str(self.config), ns=True)
        if proc.returncode != 0:
            raise RuntimeError(f"servectl start in {self.ns} failed:\n{proc.stderr}")

    def manager_pid(self) -> int:
        return json.loads(self.cli("status", "--json").stdout)["manager_pid"]


def complete_on(url: str, prompt: str, max_tokens: int = 4) -> str:
    import urllib.request

    body = json.dumps({"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["id"]


def prefix_of(response_id: str) -> str:
    return response_id.split("-", 1)[1].rsplit("-", 1)[0]  # the gateway's request-id prefix


def one_round(n: int, workdir: Path) -> dict:
    topo = Topology(f"bh{os.getpid() % 1000}{n}", 2).up()
    router = None
    daemons: list[HostDaemon] = []
    try:
        for i in range(2):
            daemons.append(HostDaemon(workdir / f"h{i + 1}", topo, i))
            daemons[-1].start()
        router = Router(topo, [d.base for d in daemons], workdir / "router.log")
        router.start()
        with topo.inside():
            host = {prefix_of(complete_on(d.base, "x", 1)): i for i, d in enumerate(daemons)}
            groups = [f"# group {g}: " + " ".join(f"def f{g}_{i}(x): return x * {i}" for i in range(20))
                      for g in range(8)]
            with ThreadPoolExecutor(8) as pool:
                firsts = list(pool.map(lambda p: host[prefix_of(complete_on(router.url, p + " # first", 16))], groups))
            followed = sum(host[prefix_of(complete_on(router.url, f"{p} # tail {t}"))] == firsts[g]
                           for t in range(5) for g, p in enumerate(groups))
            with Load(router.url, n=8, max_tokens=64) as load:
                time.sleep(5.0)
                killed_at = time.monotonic()
                os.kill(daemons[0].manager_pid(), signal.SIGKILL)
                dropped = None
                while time.monotonic() < killed_at + 10.0:
                    if dropped is None and daemons[0].base not in router.healthy():
                        dropped = time.monotonic() - killed_at
                    time.sleep(0.05)  # the bench's sampling of the router's view
        after = [r for r in load.results if r["sent"] >= killed_at or (r["times"] and r["times"][-1] >= killed_at)]
        return {
            "prefix_follow": followed / 40,
            "hosts_of_first_requests": sorted(firsts),
            "requests": len(load.results),
            "lost_streaming": sum(1 for r in load.results if (r["error"] or not r["done"]) and r["times"]),
            "lost_other": sum(1 for r in load.results if (r["error"] or not r["done"]) and not r["times"]),
            "longest_gap_s": round(longest_gap(after), 3),
            "router_dropped_s": round(dropped, 3) if dropped is not None else None,
        }
    finally:
        if router is not None:
            router.stop()
        for d in daemons:
            d.cli("stop")
        topo.down()


def summary(rounds: list[dict]) -> dict:
    out = {}
    for key in ("prefix_follow", "lost_streaming", "lost_other", "longest_gap_s", "router_dropped_s", "requests"):
        out[key] = spread(r[key] for r in rounds if r[key] is not None)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hosts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench-hosts-") as tmp:
        for n in range(args.rounds):
            rounds.append(one_round(n, Path(tmp) / f"round{n}"))
            print(json.dumps(rounds[-1]), flush=True)
    result = {"rounds": rounds, "summary": summary(rounds), "machine": B.machine()}
    print(json.dumps(result["summary"], indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
