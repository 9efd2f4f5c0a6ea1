"""A saturated model shared between keys (issue 58): key B's time to first token while key A
floods, with the fair share and without, against B alone.

    python -m bench.fair_share                 # 3 alternating rounds of 3 sides, ~5 minutes on 2 cores
    python -m bench.fair_share --rounds 1 --flood 8 --solo-requests 3    # the harness only

Each round starts a fresh servectl (no warm standbys: not under test) serving the bundled model
with ``max_num_seqs`` (16 by default: at 64 streams, 48 wait, so the model is saturated) and two
named keys, ``flood`` and ``solo``, for each side: ``fair`` with ``[gateway] fair_share = true``
(the default: each request's vLLM priority is its key's rank, and a better priority takes a
running request's slot, engine_core/slot_preemption.py), ``fair-nopreempt`` the same with the
slot preemption off (``SERVECTL_SLOT_PREEMPTION=0``: the priority orders only the waiting
queue), ``fcfs`` with ``fair_share = false`` (every priority 0: first come, first served). In
each: B alone (``--solo-requests`` streaming requests one after another, 32-token prompts, 16
tokens out), then A's flood (``--flood`` concurrent streams in a closed loop, 64 tokens each,
ignore_eos) and, once it has run ``--settle`` seconds, B again the same way; A's throughput
(tokens counted as they stream) during B's requests is its cost. A's client is a process of its
own (another team's), so B's event loop reads only B's lines. B's TTFT is the time from sending
its request to its first token (as the client sees it). A cell is the median over rounds of each
round's median, with [min – max] of the rounds.

Results: ``bench/results/<date>-fair-share.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.run import ROOT, Servectl, machine
from engine_core.slot_preemption import PREEMPTION_ENV

KEYS = {"flood": "sk-bench-flood-0123456789", "solo": "sk-bench-solo-0123456789"}
PROMPT = " ".join(["word"] * 31)  # ~32 tokens


# Each side: the fair share on or off, the slot preemption (engine_core/slot_preemption.py) on or off.
SIDES = {"fair": (True, True), "fair-nopreempt": (True, False), "fcfs": (False, True)}
LABELS = {"fair": "fair share (`fair_share = true`)",
          "fair-nopreempt": "fair share, no slot preemption (`SERVECTL_SLOT_PREEMPTION=0`)",
          "fcfs": "first come first served (`fair_share = false`)"}


def keyed_servectl(workdir: Path, side: str, max_num_seqs: int) -> Servectl:
    """bench.run's servectl, with the two named keys and the side's fair share and preemption."""
    fair, preempt = SIDES[side]
    sections = f"[gateway]\nfair_share = {str(fair).lower()}\n" + "".join(
        f'[[gateway.keys]]\nname = "{name}"\nkey = "{key}"\n' for name, key in KEYS.items())
    return Servectl(workdir, label=side, warm_standby=False, engine_args={"max_num_seqs": max_num_seqs},
                    sections=sections, env=None if preempt else {PREEMPTION_ENV: "0"})


async def one_stream(session: aiohttp.ClientSession, base: str, key: str, max_tokens: int,
                     counter=None) -> tuple[float, int]:
    """(seconds to the first token, tokens) of one streaming completion; each token also counted
    in ``counter`` (a shared value) as it comes."""
    body = {"model": "default", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    t0 = time.perf_counter()
    first, tokens = None, 0
    async with session.post(f"{base}/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {KEYS[key]}"}) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                tokens += 1
                if counter is not None:
                    counter.value += 1
                if first is None:
                    first = time.perf_counter() - t0
    return first if first is not None else float("nan"), tokens


def flood_process(base: str, flood: int, tokens: "multiprocessing.sharedctypes.c_longlong",
                  started: "multiprocessing.synchronize.Event", stop: "multiprocessing.synchronize.Event") -> None:
    """Key A's flood, in a process of its own: another team's client, whose streams' lines are
    never read by B's event loop (B's first token is timed as B's client alone would see it)."""

    async def run() -> None:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def loop() -> None:
                while not stop.is_set():  # counted token by token (this process alone writes it)
                    await one_stream(session, base, "flood", 64, counter=tokens)

            tasks = [asyncio.create_task(loop()) for _ in range(flood)]
            started.set()
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())


async def measure(base: str, flood: int, solo_requests: int, settle: float) -> dict:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    tokens, started, stop = ctx.RawValue("q", 0), ctx.Event(), ctx.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for _ in range(3):  # warm-up
            await one_stream(session, base, "solo", 8)
        alone = [(await one_stream(session, base, "solo", 16))[0] for _ in range(solo_requests)]
        proc = ctx.Process(target=flood_process, args=(base, flood, tokens, started, stop), daemon=True)
        proc.start()
        try:
            assert started.wait(60), "the flood's process did not start"
            await asyncio.sleep(settle)  # the flood reaches its steady state (every slot taken, the rest waiting)
            before, t0 = tokens.value, time.perf_counter()
            loaded = [(await one_stream(session, base, "solo", 16))[0] for _ in range(solo_requests)]
            flood_rate = (tokens.value - before) / (time.perf_counter() - t0)
        finally:
            stop.set()
            proc.join(120)
            if proc.is_alive():
                proc.kill()
    return {"alone_ttft_s": alone, "flooded_ttft_s": loaded, "flood_tok_s": flood_rate}


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f} – {max(values):.3f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flood", type=int, default=64, help="key A's concurrent streams")
    ap.add_argument("--solo-requests", type=int, default=10, help="key B's requests, one after another")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    stem = args.out or ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-fair-share.json"
    raw: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="servectl-fair-") as tmp:
        for r in range(args.rounds):
            for side in SIDES:
                server = keyed_servectl(Path(tmp), side, args.max_num_seqs)
                try:
                    server.start()
                    if server.proc.wait(300) != 0:  # `servectl start` returns once the model serves
                        raise RuntimeError(f"{side}: servectl start failed (see {server.runtime})")
                    result = asyncio.run(measure(server.base, args.flood, args.solo_requests, args.settle))
                finally:
                    server.stop()
                raw[side].append(result)
                print(f"round {r + 1} {side}: B alone {statistics.median(result['alone_ttft_s']):.3f}s, "
                      f"flooded {statistics.median(result['flooded_ttft_s']):.3f}s, "
                      f"A {result['flood_tok_s']:.0f} tok/s", flush=True)
    rows = {}
    for side, results in raw.items():
        alone = [statistics.median(x["alone_ttft_s"]) for x in results]
        flooded = [statistics.median(x["flooded_ttft_s"]) for x in results]
        ratio = [f / a for f, a in zip(flooded, alone)]
        rows[side] = {"alone": alone, "flooded": flooded, "ratio": ratio,
                      "flood_tok_s": [x["flood_tok_s"] for x in results]}
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.write_text(json.dumps({"machine": machine(), "args": vars(args) | {"out": str(stem)}, "raw": raw,
                                "rows": rows}, indent=1))
    md = [f"# Fair share of a saturated model — {time.strftime('%Y-%m-%d %H:%M')}", "",
          f"Machine: {machine()['cores']} cores, {machine()['cpu']}. servectl, no warm standbys, "
          f"max_num_seqs = {args.max_num_seqs}; key A floods with {args.flood} concurrent streams (64 tokens "
          f"each, closed loop); key B sends {args.solo_requests} streaming requests one after another (32-token "
          "prompt, 16 tokens out), alone and then during the flood. Fresh servers, sides alternating; a cell is "
          f"the median of the {args.rounds} rounds' medians [min – max].", "",
          "| | B's TTFT alone (s) | B's TTFT, A flooding (s) | flooded / alone | A's tok/s during B |",
          "|---|---|---|---|---|"]
    for side, label in LABELS.items():
        row = rows[side]
        md.append(f"| {label} | {cell(row['alone'])} | {cell(row['flooded'])} | "
                  f"{statistics.median(row['ratio']):.2f}× [{min(row['ratio']):.2f} – {max(row['ratio']):.2f}] | "
                  f"{statistics.median(row['flood_tok_s']):.0f} |")
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
