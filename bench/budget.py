"""More models than fit (issue 35): what an eviction costs.

    python -m bench.budget [--rounds 3] [--idle-s 10]

Two copies of the bundled model, ``a`` loaded at start and ``b`` on first use, with room for
one (``max_loaded_models = 1``: the same eviction path as a memory budget). Each round starts
a fresh daemon, asks ``a``, then ``b`` (``a`` is evicted: unloaded, no sleep mode on CPU), lets
``b`` go idle, then streams the measured request for ``a``: ``b`` is evicted and ``a`` started
again. Figures, median and spread of the rounds, with warm standbys (``a``'s, kept through its
eviction: the start takes their pre-imported interpreters) and without:

- request for the evicted model → first token;
- host memory held by the models before and after the eviction (engine and workers' RSS; the
  standbys' apart) and the footprints the budget counts;
- context switches per second of the whole tree, idle afterwards (``a`` frozen, ``b`` evicted):
  an evicted model leaves nothing that wakes;
- where the swap's time goes (``PHASES``, from the logs): ``b`` stopped, the role handed over,
  the role's start (its configuration, what the standby had not imported, the rendezvous),
  weights, vLLM's profiling pass, the KV cache and the matmuls' warm-up (engine_core/workers/warm_rows.py),
  the engine ready, the first step.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from bench import run as B
from bench.idle_release import PROMPT, IdleDaemon
from bench.spread import alternate, spread
from servectl.config import DEFAULT_MODEL_DIR


def config_text(warm: bool) -> str:
    args = {"enforce_eager": True, "kv_cache_memory_bytes": B.KV_BYTES, "max_model_len": B.MAX_MODEL_LEN,
            "dtype": B.DTYPE}
    engine = "[models.engine_args]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in args.items())
    return ("[gateway]\nhold_timeout_s = 600\n"
            f"[manager]\nfreeze_grace_s = 0.5\nwarm_standby = {str(warm).lower()}\nmax_loaded_models = 1\n"
            f'[[models]]\nname = "a"\nmodel = "{DEFAULT_MODEL_DIR}"\n{engine}'
            f'[[models]]\nname = "b"\nmodel = "{DEFAULT_MODEL_DIR}"\nautostart = false\n{engine}')


class Pair(IdleDaemon):
    def models(self) -> dict[str, dict]:
        return {m["name"]: m for m in self.status()["models"]}

    def held(self) -> dict:
        m = self.models()
        return {"models_rss": sum(x["memory_bytes"] for x in m.values()),
                "standbys_rss": sum(x["standby_memory_bytes"] for x in m.values()),
                "footprints_counted": self.status()["budget"]["devices"][0]["used_bytes"]}


def one_round(warm: bool, idle_s: float) -> dict:
    d = Pair(Path(tempfile.mkdtemp(prefix="servectl-budget-bench-")), config_text(warm))
    try:
        d.start()
        d.stream({**PROMPT, "model": "a"})
        d.stream({**PROMPT, "model": "b"})  # a evicted; b started cold (it never served: no standbys yet)
        if warm:
            d.wait_standbys_warm()  # a's kept from its eviction, b's made once it served
        d.wait(lambda: d.models()["b"]["frozen"], 60, "b idle")
        before = d.held()
        t0 = time.time()
        asked = d.stream({**PROMPT, "model": "a"})  # the measured eviction: b released, a started
        swap = phases(d.runtime / "state" / "logs", t0, asked["first_token_s"])
        m = d.models()
        assert m["b"]["state"] == "released" and m["a"]["state"] == "ready", {k: v["state"] for k, v in m.items()}
        after = d.held()
        if warm:
            d.wait_standbys_warm()
        d.wait(lambda: d.models()["a"]["frozen"], 60, "a idle")
        pids = d.pids()
        cpu0, sw0 = B.tree_counters(pids)
        time.sleep(idle_s)  # the measurement window: the tree is idle, nothing should wake
        cpu1, sw1 = B.tree_counters(pids)
        return {"first_token_s": round(asked["first_token_s"], 3), "phases_s": swap,
                "held_before": before, "held_after": after,
                "idle_context_switches_per_s": round((sw1 - sw0) / idle_s, 2),
                "idle_cpu_ms_per_s": round((cpu1 - cpu0) * 1000 / idle_s, 2)}
    finally:
        d.stop()


# Where a swap's time goes: the first line at or after the request that marks each phase's end
# (log file, pattern), in order. Our own log lines carry milliseconds (vLLM's own only seconds).
PHASES = [
    ("evict", "manager.log", r"model b: released"),  # b's engine and worker stopped
    ("hand_over", "manager.log", r"engine_core:a: (handed to its warm standby|started)"),
    ("role_start", "worker-a-0.log", r"Starting to load model"),  # its config, the rest of its imports, rendezvous
    ("weights", "worker-a-0.log", r"Loading weights took"),
    ("profile", "worker-a-0.log", r"for KV cache on node|KV cache"),  # vLLM's profiling forward pass
    ("kv_cache", "worker-a-0.log", r"warmed \d+ weight shapes"),  # the KV cache and the matmuls' row counts
    ("ready", "engine_core-a.log", r"engine_core\[a\] INFO ready:"),
]
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def phases(logs: Path, t0: float, first_token_s: float) -> dict[str, float]:
    """Seconds spent in each phase of the swap that began at wall-clock ``t0``; the rest up to the
    first token is ``first_step``. A phase whose mark is missing is left out (its time goes to the next)."""
    out, last = {}, t0
    for name, file, pattern in PHASES:
        try:
            lines = (logs / file).read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            m = STAMP.match(line)
            if m is None or not re.search(pattern, line):
                continue
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at >= last - 0.0005:
                out[name], last = round(max(at - last, 0.0), 3), at
                break
    out["first_step"] = round(t0 + first_token_s - last, 3)
    return out


def summarize(rounds: dict[str, list[dict]]) -> dict:
    out = {}
    for side, rs in rounds.items():
        out[side] = {
            "first_token_s": spread([r["first_token_s"] for r in rs], 3),
            "models_rss_before_mib": spread([r["held_before"]["models_rss"] / 2**20 for r in rs], 3),
            "models_rss_after_mib": spread([r["held_after"]["models_rss"] / 2**20 for r in rs], 3),
            "standbys_rss_mib": spread([r["held_after"]["standbys_rss"] / 2**20 for r in rs], 3),
            "idle_context_switches_per_s": spread([r["idle_context_switches_per_s"] for r in rs], 3),
            "phases_s": {name: spread([r["phases_s"].get(name, 0.0) for r in rs], 3)
                         for name in [p[0] for p in PHASES] + ["first_step"]},
        }
    return out


def markdown(res: dict) -> str:
    lines = [f"# More models than fit: eviction costs ({res['rounds']} rounds, fresh daemons)", "",
             f"Machine: {res['machine'].get('cpu', '?')}, {res['machine'].get('cores', '?')} cores.", "",
             "| standbys | evicted model → first token (s) | models' RSS before → after (MiB) | standbys' RSS (MiB) "
             "| idle context switches/s |", "|---|---|---|---|---|"]
    for side, s in res["summary"].items():
        f = s["first_token_s"]
        lines.append(f"| {side} | {f['median']} ({f['min']}–{f['max']}) | {s['models_rss_before_mib']['median']:.0f} → "
                     f"{s['models_rss_after_mib']['median']:.0f} | {s['standbys_rss_mib']['median']:.0f} "
                     f"| {s['idle_context_switches_per_s']['median']} |")
    lines += ["", "Where the time goes (median seconds per phase; from the logs' millisecond stamps):", "",
              "| standbys | " + " | ".join(name.replace("_", " ") for name in [p[0] for p in PHASES] + ["first_step"])
              + " |", "|---|" + "---|" * (len(PHASES) + 1)]
    for side, s in res["summary"].items():
        lines.append(f"| {side} | " + " | ".join(str(v["median"]) for v in s["phases_s"].values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.budget", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--out", type=Path, help="write <out>.json and <out>.md")
    p = ap.parse_args(argv)
    def run(i: int, side: str) -> dict:
        r = one_round(side == "warm", p.idle_s)
        print(f"round {i + 1} {side}: {json.dumps(r)}", flush=True)
        return r

    rounds = alternate(p.rounds, ("warm", "cold"), run, swap=True)  # warm, cold; cold, warm; ...
    res = {"machine": B.machine(), "rounds": p.rounds, "raw": rounds, "summary": summarize(rounds)}
    print(markdown(res))
    if p.out:
        p.out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
        p.out.with_suffix(".md").write_text(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
