"""Per-step cost, servectl against `vllm serve`: alternating rounds, medians and spread.

    python -m bench.rounds                       # 3 rounds: A B A B A B, fresh servers each time
    python -m bench.rounds --rounds 5 --concurrency 1,16,64
    python -m bench.rounds --only servectl --env-b OMP_NUM_THREADS=2   # an A/B of servectl settings
    python -m bench.rounds --only servectl --engine-arg-b async_scheduling=true
    python -m bench.rounds --pool bench/results/A.json bench/results/B.json   # all their rounds' medians
    python -m bench.rounds --base-commit ae4a39d --rounds 3   # another commit's servectl against this tree's
    python -m bench.rounds --ceiling --concurrency 1,16   # and vLLM's in-process LLM after each round (bench.ceiling)
    python -m bench.rounds --early --concurrency 1,16   # also from the first completion on (standbys importing)

With ``--base-commit`` side A is servectl as that commit has it, checked out by
``git worktree add`` into a temporary directory and run from there (its CLI's
working directory and ``PYTHONPATH``; the children it spawns import from the
same checkout), side B this working tree, uncommitted changes included; both
serve the model of this tree with the same settings. The sides are labelled
with the commits (``servectl@<base>``, ``servectl@<HEAD>`` or ``…+dirty``), so
runs of the same pair pool.

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
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.run import ROOT, Servectl, VllmServe, machine, non_stream_load, vllm_bench, wait_completion
from bench.spread import spread

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


def stream_cell(server, c: int, p: argparse.Namespace, work: Path) -> dict:
    """One streaming cell at concurrency ``c``: vLLM's benchmark, and the engine steps around it."""
    before = step_totals(server.base)
    r = vllm_bench(server.base, c, max(p.prompts, 2 * c), p.input_len, p.output_len, work, p.dataset)
    r.update(step_figures(before, step_totals(server.base), r.get("duration")))
    return {k: r.get(k) for k in FIGURES}


def one_round(server, concurrency: list[int], p: argparse.Namespace, work: Path) -> dict:
    server.start()
    try:
        cold = wait_completion(server.base, server.proc if isinstance(server, VllmServe) else None, 900)
        if cold is None:
            return {"error": "did not start"}
        out: dict = {"stream": {}}
        if p.early:  # from the first completion on: no warm-up, the standbys still importing
            for c in concurrency:
                out["stream"][f"{c} early"] = stream_cell(server, c, p, work)
        if isinstance(server, Servectl) and server.warm_standby:
            # the standbys' import is not part of the settled load (after --early: how long it still ran)
            out["standbys_warm_after_s"] = server.wait_warm()
        vllm_bench(server.base, 4, 16, p.input_len, p.output_len, work)  # warm-up, not counted
        for c in concurrency:
            out["stream"][str(c)] = stream_cell(server, c, p, work)
        if p.non_stream_requests > 0:  # 0: streaming cells only
            ns = asyncio.run(non_stream_load(server.base, 16, p.non_stream_requests, p.output_len))
            out["non_stream_c16"] = {**ns, "tok_s": round(ns["ok"] * p.output_len / ns["seconds"], 1)}
        return out
    finally:
        server.stop()


def repeat_dataset(path: Path, count: int = 256, lines: int = 8) -> Path:
    """Prompts that contain the text to be repeated (speculative decoding by n-grams has something
    to find): a chunk of this project's code twice, then its first two lines again. JSONL."""
    text = [ln for f in sorted((ROOT / "servectl").rglob("*.py")) for ln in f.read_text().splitlines()
            if ln.strip()]
    chunks = ["\n".join(text[i:i + lines]) for i in range(0, len(text) - lines, lines)]
    chunks = [c for c in chunks if len(c) <= 360]  # the prompt stays well inside max_model_len
    with path.open("w") as out:
        for i in range(count):
            chunk = chunks[i % len(chunks)]
            out.write(json.dumps({"prompt": f"{chunk}\n\n{chunk}\n\n" + "\n".join(chunk.splitlines()[:2])}) + "\n")
    return path


def toml_inline(value: dict) -> str:
    """A flat JSON object as a TOML inline table (an engine argument's value)."""
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + " }"


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
                out["stream"][c][k] = spread(vals, 3)
    vals = [r["non_stream_c16"]["tok_s"] for r in ok if "non_stream_c16" in r]
    if vals:
        out["non_stream_c16_tok_s"] = spread(vals)
    return out


def markdown(res: dict, a: str, b: str) -> str:
    sa, sb = res["summary"][a], res["summary"][b]
    lines = [f"# {b} vs {a}: {res['rounds']} alternating rounds — {res['date']}", "",
             *(f"{note}\n" for note in res.get("notes", [])),  # a caller's (bench.tracing: the spans exported)
             f"Machine: {res['machine']['cores']} cores, {res['machine']['cpu']}. "
             + ("Prompts that contain the text to be repeated (`repeat_dataset`: a chunk of code twice, then "
                "its start; ~260 tokens)" if res["params"].get("repeat_prompts") else
                f"Prompts {res['params']['input_len']} tokens")
             + f", {res['params']['output_len']} output tokens (ignore_eos)"
             + (f"; both servers with `speculative_config` {json.dumps(res['params']['speculative_config'])}"
                if res["params"].get("speculative_config") else "")
             + ". Median of the rounds, [min – max] beside it.", "",
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
    ceiling = res.get("summary", {}).get("ceiling")
    if ceiling:
        lines += ["", "The ceiling: the same load through vLLM's in-process `LLM` (`bench.ceiling`, "
                  "`max_num_seqs` = the concurrency), run after each round; each server's share of it "
                  "(ratio of medians).", "",
                  f"| concurrency | LLM tok/s | {a} share | {b} share |", "|---|---|---|---|"]
        for c, lim in ceiling.items():
            shares = []
            for side in (sa, sb):
                got = side["stream"].get(c, {}).get("output_throughput")
                shares.append(f"{got['median'] / lim['median']:.2f}" if got and lim["median"] else "-")
            lines.append(f"| {c} | {cell(lim)} | {shares[0]} | {shares[1]} |")
    return "\n".join(lines) + "\n"


def summarize_ceiling(rounds: list[dict]) -> dict:
    """Median and spread of the ceiling's tok/s per concurrency, over the rounds that measured it."""
    out: dict = {}
    for c in (rounds[0] if rounds else {}):
        vals = [r[c]["tok_s"] for r in rounds if "tok_s" in r.get(c, {})]
        if vals:
            out[c] = {"median": round(statistics.median(vals), 1), "min": min(vals), "max": max(vals)}
    return out


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
    if all("ceiling" in r for r in runs):
        res["ceiling"] = [rnd for r in runs for rnd in r["ceiling"]]
        res["summary"]["ceiling"] = summarize_ceiling(res["ceiling"])
    return res, a, b


@dataclass
class Side:
    """One server of the comparison: `vllm serve`, or servectl from ``code`` (None: this tree)."""

    name: str
    kind: str  # "vllm" or "servectl"
    env: dict[str, str] = field(default_factory=dict)
    engine_args: dict[str, str] = field(default_factory=dict)
    code: Path | None = None
    commit: str | None = None  # the commit a checkout serves (side A of --base-commit)
    start_env: dict[str, str] = field(default_factory=dict)  # of `servectl start`: every process inherits it


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def resolve_commit(rev: str, repo: Path = ROOT) -> str:
    """The full id of ``rev`` (a commit), or SystemExit naming it."""
    try:
        return git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"--base-commit: {rev!r} is not a commit of {repo}") from None


def tree_label(repo: Path = ROOT) -> str:
    """This tree's commit, short, with ``+dirty`` when tracked files differ from it."""
    head = git(repo, "rev-parse", "--short=10", "HEAD")
    return head + ("+dirty" if git(repo, "status", "--porcelain", "--untracked-files=no") else "")


@contextlib.contextmanager
def worktree(commit: str, repo: Path = ROOT) -> Iterator[Path]:
    """A detached checkout of ``commit`` in a temporary directory, removed afterwards."""
    parent = Path(tempfile.mkdtemp(prefix="servectl-base-"))
    path = parent / commit[:10]
    git(repo, "worktree", "add", "--detach", "--quiet", str(path), commit)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(path)], capture_output=True)
        shutil.rmtree(parent, ignore_errors=True)
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)


def plan(p: argparse.Namespace, base_code: Path | None = None, base_commit: str | None = None,
         tree: str = "tree") -> tuple[Side, Side]:
    """The two sides of the run, A then B (each round runs A, then B)."""
    env_a, env_b = parse_env(p.env_a), parse_env(p.env_b)
    args_a, args_b = parse_env(p.engine_arg_a), parse_env(p.engine_arg_b)
    start_a, start_b = parse_env(p.start_env_a), parse_env(p.start_env_b)
    if base_commit is not None:
        return (Side(f"servectl@{base_commit[:10]}", "servectl", env_a, args_a, base_code, base_commit, start_a),
                Side(f"servectl@{tree}", "servectl", env_b, args_b, start_env=start_b))
    if p.only:
        return (Side(p.name_a or "servectl A", "servectl", env_a, args_a, start_env=start_a),
                Side(p.name_b or "servectl B", "servectl", env_b, args_b, start_env=start_b))
    return Side("vllm serve", "vllm"), Side("servectl", "servectl", env_b, args_b, start_env=start_b)


def schedule(rounds: int, sides: tuple[Side, Side]) -> list[tuple[int, Side]]:
    """A B A B …: every round runs both sides, fresh servers each time."""
    return [(i, side) for i in range(rounds) for side in sides]


def label(name: str) -> str:
    """A side's name as a file name (runtime directory, config)."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in name)


def parser() -> argparse.ArgumentParser:
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
    ap.add_argument("--start-env-a", action="append", default=[], metavar="K=V",
                    help="environment of `servectl start` of servectl A (--only), which its every process inherits")
    ap.add_argument("--start-env-b", action="append", default=[], metavar="K=V",
                    help="environment of `servectl start` of servectl B")
    ap.add_argument("--name-a", help="side A's label (--only; default 'servectl A')")
    ap.add_argument("--name-b", help="side B's label (--only; default 'servectl B')")
    ap.add_argument("--no-standby", action="store_true", help="servectl without warm standbys")
    ap.add_argument("--speculative-config", metavar="JSON",
                    help='both servers: vLLM\'s speculative_config, e.g. \'{"method": "ngram", '
                         '"num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}\'')
    ap.add_argument("--repeat-prompts", action="store_true",
                    help="streaming cells on prompts that contain the text to be repeated (repeat_dataset)")
    ap.add_argument("--early", action="store_true",
                    help="first the streaming cells from the first completion on (no warm-up, standbys "
                         "still importing: 'c=N early'), then the settled cells as usual")
    ap.add_argument("--ceiling", action="store_true",
                    help="after each round, the same streaming cells through vLLM's in-process LLM (bench.ceiling)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results",
                    help="a folder (<date>-<tag>.json and .md in it) or a .json file (and the .md beside it)")
    ap.add_argument("--tag", default="rounds")
    ap.add_argument("--pool", type=Path, nargs="+", metavar="JSON",
                    help="no servers: the medians of all the rounds of these result files together")
    ap.add_argument("--base-commit", metavar="REV",
                    help="servectl A from a git worktree of this commit, servectl B from this tree "
                         "(--env-a/--engine-arg-a apply to A)")
    return ap


def check(p: argparse.Namespace) -> None:
    if p.base_commit and p.pool:
        raise SystemExit("--base-commit runs servers; --pool reads results: one or the other")
    if p.base_commit and p.only:
        raise SystemExit("--base-commit already compares two servectls (A: the commit, B: this tree); drop --only")
    if p.rounds < 1:
        raise SystemExit("--rounds: at least 1")
    if (p.name_a or p.name_b) and not p.only:
        raise SystemExit("--name-a/--name-b label the sides of --only")
    if p.name_a and p.name_a == p.name_b:
        raise SystemExit("--name-a and --name-b: two sides, two names")
    for item in (*p.env_a, *p.env_b, *p.engine_arg_a, *p.engine_arg_b, *p.start_env_a, *p.start_env_b):
        if "=" not in item:
            raise SystemExit(f"expected K=V, got {item!r}")


def main(argv: list[str] | None = None) -> int:
    p = parser().parse_args(argv)
    check(p)
    if p.pool:
        res, a, b = pool(p.pool)
        print(markdown(res, a, b))
        return 0
    concurrency = [int(c) for c in p.concurrency.split(",")]
    with contextlib.ExitStack() as stack:
        base_code = base_commit = None
        if p.base_commit:
            base_commit = resolve_commit(p.base_commit)
            base_code = stack.enter_context(worktree(base_commit))
            print(f"== side A: {base_commit} checked out in {base_code}", flush=True)
        sides = plan(p, base_code, base_commit, tree_label() if base_commit else "tree")
        return run_rounds(p, sides, concurrency)


def run_rounds(p: argparse.Namespace, sides: tuple[Side, Side], concurrency: list[int],
               after_round: Callable[[Side, dict], None] | None = None,
               before_write: Callable[[dict], None] | None = None) -> int:
    """The rounds, the summary and the files. ``after_round`` sees each round's result once its
    server stopped (and may add to it); ``before_write`` the whole result (``res["notes"]``: lines
    the table's heading is followed by)."""
    work = Path(tempfile.mkdtemp(prefix="servectl-rounds-"))
    standby = not p.no_standby
    a, b = (side.name for side in sides)
    p.dataset = repeat_dataset(work / "repeat.jsonl") if getattr(p, "repeat_prompts", False) else None
    spec = json.loads(p.speculative_config) if getattr(p, "speculative_config", None) else None

    def make(side: Side):
        if side.kind == "vllm":
            return VllmServe(work, flags=("--speculative-config", json.dumps(spec)) if spec else ())
        engine_args = {**side.engine_args, **({"speculative_config": toml_inline(spec)} if spec else {})}
        return Servectl(work, env=side.env, label=label(side.name), warm_standby=standby,
                        engine_args=engine_args, code=side.code, start_env=side.start_env)

    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "rounds": p.rounds,
                 "params": {"concurrency": concurrency, "prompts": p.prompts, "input_len": p.input_len,
                            "output_len": p.output_len, "non_stream_requests": p.non_stream_requests,
                            "env_a": p.env_a, "env_b": p.env_b, "engine_args_a": p.engine_arg_a,
                            "engine_args_b": p.engine_arg_b, "start_env_a": p.start_env_a,
                            "start_env_b": p.start_env_b, "warm_standby": standby,
                            "speculative_config": spec, "repeat_prompts": p.dataset is not None,
                            "early": getattr(p, "early", False),
                            "base_commit": sides[0].commit, "sides": [a, b]},
                 "raw": {a: [], b: []}}
    if p.ceiling:
        res["ceiling"] = []
    for i, side in schedule(p.rounds, sides):
        print(f"== round {i + 1}/{p.rounds}: {side.name}", flush=True)
        r = one_round(make(side), concurrency, p, work)
        if after_round is not None:
            after_round(side, r)
        res["raw"][side.name].append(r)
        print(json.dumps(r), flush=True)
        if p.ceiling and side is sides[1]:
            from bench.ceiling import measure

            print(f"== round {i + 1}/{p.rounds}: the ceiling (LLM)", flush=True)
            res["ceiling"].append(measure(concurrency, p.prompts, p.input_len, p.output_len))
            print(json.dumps(res["ceiling"][-1]), flush=True)
    res["summary"] = {name: summarize(res["raw"][name]) for name in (a, b)}
    if p.ceiling:
        res["summary"]["ceiling"] = summarize_ceiling(res["ceiling"])
    if before_write is not None:
        before_write(res)
    stem = p.out.with_suffix("") if p.out.suffix == ".json" else p.out / f"{time.strftime('%Y-%m-%d')}-{p.tag}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res, a, b)
    stem.with_suffix(".md").write_text(md)
    print(md)
    return 0 if all(res["summary"][n]["rounds"] == p.rounds for n in (a, b)) else 1


if __name__ == "__main__":
    sys.exit(main())
