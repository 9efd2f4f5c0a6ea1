"""Per-step cost, servectl against `vllm serve`: alternating rounds, medians and spread.

    python -m bench.rounds                       # 3 rounds: A B A B A B, fresh servers each time
    python -m bench.rounds --rounds 5 --concurrency 1,16,64
    python -m bench.rounds --only servectl --env-b OMP_NUM_THREADS=2   # an A/B of servectl settings
    python -m bench.rounds --only servectl --engine-arg-b async_scheduling=true
    python -m bench.rounds --pool bench/results/A.json bench/results/B.json   # all their rounds' medians

One round starts a server, warms it up (a short run, not counted), drives it
with vLLM's own serving benchmark at each concurrency (streaming), then with
the in-repo non-streaming client at concurrency 16, and stops it; then the
other server, the same way. Single runs on this shared 2-core machine move by
±30 %: only the median of alternating rounds, with the spread beside it,
counts. Raw rounds, medians and ratios go to ``bench/results/<date>-rounds.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.run import ROOT, Servectl, VllmServe, machine, non_stream_load, vllm_bench, wait_completion

# ITL is the gap between two chunks the client read; TPOT a request's decode time per token
# ((end - first token) / (tokens - 1)), which tokens handed over in pairs cannot shorten.
FIGURES = ("output_throughput", "median_itl_ms", "median_tpot_ms", "median_ttft_ms", "p99_itl_ms", "tokens_per_step",
           "mean_step_ms")
STEP_HISTOGRAM = "vllm:iteration_tokens_total"  # vLLM's tokens-per-step histogram, in both servers' /metrics


def step_totals(base: str) -> tuple[float, float] | None:
    """(tokens, steps) so far from the server's /metrics, summed over engines; None if it has none."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    tokens = steps = 0.0
    found = False
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        metric = name.split("{", 1)[0]
        if metric == STEP_HISTOGRAM + "_sum":
            tokens += float(value)
            found = True
        elif metric == STEP_HISTOGRAM + "_count":
            steps += float(value)
    return (tokens, steps) if found else None


def step_figures(before: tuple[float, float] | None, after: tuple[float, float] | None, seconds: float | None) -> dict:
    """Tokens per engine step and the mean step's wall time over one cell.

    At a fixed concurrency these say why ITL differs: a server whose batches are
    fuller (more sequences decoded per step) has longer steps and a higher ITL
    for the same cost per sequence."""
    if before is None or after is None or not seconds:
        return {}
    tokens, steps = after[0] - before[0], after[1] - before[1]
    if steps <= 0:
        return {}
    return {"tokens_per_step": round(tokens / steps, 2), "mean_step_ms": round(seconds * 1000 / steps, 3)}


def one_round(server, concurrency: list[int], p: argparse.Namespace, work: Path) -> dict:
    server.start()
    try:
        cold = wait_completion(server.base, server.proc if isinstance(server, VllmServe) else None, 900)
        if cold is None:
            return {"error": "did not start"}
        if isinstance(server, Servectl) and server.warm_standby:
            server.wait_warm()  # the standbys' import is not part of the load
        vllm_bench(server.base, 4, 16, p.input_len, p.output_len, work)  # warm-up, not counted
        out: dict = {"stream": {}}
        for c in concurrency:
            before = step_totals(server.base)
            r = vllm_bench(server.base, c, max(p.prompts, 2 * c), p.input_len, p.output_len, work)
            r.update(step_figures(before, step_totals(server.base), r.get("duration")))
            out["stream"][str(c)] = {k: r.get(k) for k in FIGURES}
        if p.non_stream_requests > 0:  # 0: streaming cells only
            ns = asyncio.run(non_stream_load(server.base, 16, p.non_stream_requests, p.output_len))
            out["non_stream_c16"] = {**ns, "tok_s": round(ns["ok"] * p.output_len / ns["seconds"], 1)}
        return out
    finally:
        server.stop()


def summarize(rounds: list[dict]) -> dict:
    """Median and (min, max) of every figure over the rounds that completed."""
    ok = [r for r in rounds if "error" not in r]
    out: dict = {"rounds": len(ok), "stream": {}, "non_stream_c16_tok_s": None}
    if not ok:
        return out
    for c in ok[0]["stream"]:
        out["stream"][c] = {}
        for k in FIGURES:
            vals = [r["stream"][c][k] for r in ok if r["stream"][c].get(k) is not None]
            if vals:
                out["stream"][c][k] = {"median": round(statistics.median(vals), 3), "min": round(min(vals), 3),
                                       "max": round(max(vals), 3)}
    vals = [r["non_stream_c16"]["tok_s"] for r in ok if "non_stream_c16" in r]
    if vals:
        out["non_stream_c16_tok_s"] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return out


def markdown(res: dict, a: str, b: str) -> str:
    sa, sb = res["summary"][a], res["summary"][b]
    lines = [f"# {b} vs {a}: {res['rounds']} alternating rounds — {res['date']}", "",
             f"Machine: {res['machine']['cores']} cores, {res['machine']['cpu']}. Prompts {res['params']['input_len']}"
             f" tokens, {res['params']['output_len']} output tokens (ignore_eos). Median of the rounds, "
             "[min – max] beside it.", "",
             f"| figure | {a} | {b} | ratio ({b} / {a}) |", "|---|---|---|---|"]

    def cell(s):
        return f"{s['median']:g} [{s['min']:g} – {s['max']:g}]" if s else "-"

    for c in sa["stream"]:
        for k, label in (("output_throughput", "stream tok/s"), ("median_itl_ms", "ITL p50 ms"),
                         ("median_tpot_ms", "TPOT p50 ms"), ("median_ttft_ms", "TTFT p50 ms"), ("tokens_per_step", "tokens per engine step"),
                         ("mean_step_ms", "mean engine step ms")):
            x, y = sa["stream"][c].get(k), sb["stream"].get(c, {}).get(k)
            if x is None and y is None:
                continue  # a figure neither server gave (older results, no /metrics)
            ratio = f"{y['median'] / x['median']:.2f}" if x and y and x["median"] else "-"
            lines.append(f"| {label}, c={c} | {cell(x)} | {cell(y)} | {ratio} |")
    x, y = sa["non_stream_c16_tok_s"], sb["non_stream_c16_tok_s"]
    ratio = f"{y['median'] / x['median']:.2f}" if x and y and x["median"] else "-"
    lines.append(f"| non-stream tok/s, c=16 | {cell(x)} | {cell(y)} | {ratio} |")
    return "\n".join(lines) + "\n"


def parse_env(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


def pool(paths: list[Path]) -> tuple[dict, str, str]:
    """The raw rounds of several result files of the same two servers as one result: the medians
    and spreads of all their rounds (how docs/performance.md pools runs)."""
    runs = [json.loads(path.read_text()) for path in paths]
    names = [list(r["raw"]) for r in runs]
    if any(n != names[0] for n in names):
        raise SystemExit(f"--pool: the files compare different servers: {names}")
    a, b = names[0]
    raw = {name: [rnd for r in runs for rnd in r["raw"][name]] for name in (a, b)}
    res = {"date": ", ".join(r["date"] for r in runs), "machine": runs[0]["machine"],
           "rounds": min(len(raw[a]), len(raw[b])), "params": runs[0]["params"],
           "pooled": [str(path) for path in paths], "raw": raw}
    res["summary"] = {name: summarize(raw[name]) for name in (a, b)}
    return res, a, b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rounds", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--prompts", type=int, default=64, help="requests per streaming cell (at least 2 × c)")
    ap.add_argument("--non-stream-requests", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--only", choices=["servectl"], help="A/B two servectl settings instead of vllm serve")
    ap.add_argument("--env-a", action="append", default=[], metavar="K=V", help="model env of servectl A (--only)")
    ap.add_argument("--env-b", action="append", default=[], metavar="K=V", help="model env of servectl B")
    ap.add_argument("--engine-arg-a", action="append", default=[], metavar="K=V",
                    help="engine argument of servectl A (--only), a TOML value: async_scheduling=true")
    ap.add_argument("--engine-arg-b", action="append", default=[], metavar="K=V", help="engine argument of servectl B")
    ap.add_argument("--no-standby", action="store_true", help="servectl without warm standbys")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--tag", default="rounds")
    ap.add_argument("--pool", type=Path, nargs="+", metavar="JSON",
                    help="no servers: the medians of all the rounds of these result files together")
    p = ap.parse_args(argv)
    if p.pool:
        res, a, b = pool(p.pool)
        print(markdown(res, a, b))
        return 0
    concurrency = [int(c) for c in p.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="servectl-rounds-"))
    standby = not p.no_standby

    if p.only:
        a, b = "servectl A", "servectl B"

        def make(name):
            env = parse_env(p.env_a if name == a else p.env_b)
            args = parse_env(p.engine_arg_a if name == a else p.engine_arg_b)
            return Servectl(work, env=env, label=name.replace(" ", "-"), warm_standby=standby, engine_args=args)
    else:
        a, b = "vllm serve", "servectl"

        def make(name):
            return VllmServe(work) if name == a else Servectl(work, env=parse_env(p.env_b), warm_standby=standby,
                                                              engine_args=parse_env(p.engine_arg_b))

    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "rounds": p.rounds,
                 "params": {"concurrency": concurrency, "prompts": p.prompts, "input_len": p.input_len,
                            "output_len": p.output_len, "non_stream_requests": p.non_stream_requests,
                            "env_a": p.env_a, "env_b": p.env_b, "engine_args_a": p.engine_arg_a,
                            "engine_args_b": p.engine_arg_b, "warm_standby": standby},
                 "raw": {a: [], b: []}}
    for i in range(p.rounds):
        for name in (a, b):
            print(f"== round {i + 1}/{p.rounds}: {name}", flush=True)
            r = one_round(make(name), concurrency, p, work)
            res["raw"][name].append(r)
            print(json.dumps(r), flush=True)
    res["summary"] = {name: summarize(res["raw"][name]) for name in (a, b)}
    p.out.mkdir(parents=True, exist_ok=True)
    stem = p.out / f"{time.strftime('%Y-%m-%d')}-{p.tag}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res, a, b)
    stem.with_suffix(".md").write_text(md)
    print(md)
    return 0 if all(res["summary"][n]["rounds"] == p.rounds for n in (a, b)) else 1


if __name__ == "__main__":
    sys.exit(main())
