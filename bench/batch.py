"""A batch on spare capacity (issue 59): an interactive stream's time to first token while a
batch runs, against without; the batch's throughput, against the same lines sent by a client.

    python -m bench.batch                    # 3 rounds, 1,000 lines, ~5 minutes on 2 cores
    python -m bench.batch --rounds 1 --lines 50 --solo-requests 3    # the harness only

Each round starts a fresh servectl (no warm standbys) serving the bundled model as configured by
default (`[gateway.batch] concurrency` 16). In it: B alone (``--solo-requests`` streaming
completions one after another, 32-token prompts, 16 tokens out); then a batch of ``--lines``
completion lines (32-token prompts, 32 tokens out, greedy) created through the Files and Batch
APIs and, once its first lines are answered, B again the same way, and once more after the
engine's yield window passed without one (engine_core/batch_yield.py); then, once the batch
has ended and the window passed, in an order that alternates between rounds, the same batch
alone from create to completed, and the same lines sent by a client (aiohttp, ``concurrency``
at a time) to ``/v1/completions``. A cell is the median over rounds of each round's median
(TTFT) or its time, with [min – max]. ``--env SERVECTL_BATCH_YIELD=0``: the engine without the
yield (the control).

Results: ``bench/results/<date>-batch.{json,md}``.
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
from engine_core.batch_yield import YIELD_WINDOW_S

PROMPT = " ".join(["word"] * 31)  # ~32 tokens
CONCURRENCY = 16  # [gateway.batch] concurrency's default: the client sends as many at once


def lines(n: int) -> list[dict]:
    return [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "default", "prompt": f"{PROMPT} {i}", "max_tokens": 32, "temperature": 0,
                      "ignore_eos": True}} for i in range(n)]


async def ttft(session: aiohttp.ClientSession, base: str) -> float:
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 16, "stream": True, "ignore_eos": True,
            "temperature": 0}
    t0 = time.perf_counter()
    async with session.post(f"{base}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        first = None
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    return first if first is not None else float("nan")


async def create_batch(session: aiohttp.ClientSession, base: str, n: int) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", "".join(json.dumps(x) + "\n" for x in lines(n)).encode(), filename="in.jsonl")
    async with session.post(f"{base}/v1/files", data=form) as resp:
        resp.raise_for_status()
        file_id = (await resp.json())["id"]
    async with session.post(f"{base}/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                          "completion_window": "24h"}) as resp:
        resp.raise_for_status()
        return (await resp.json())["id"]


async def batch_state(session: aiohttp.ClientSession, base: str, batch_id: str) -> dict:
    async with session.get(f"{base}/v1/batches/{batch_id}") as resp:
        resp.raise_for_status()
        return await resp.json()


async def until(session, base, batch_id, done) -> dict:
    while not done(state := await batch_state(session, base, batch_id)):
        await asyncio.sleep(0.05)  # a client polling, as the SDK's users do
    return state


async def timed_batch(session, base: str, n: int) -> float:
    t0 = time.perf_counter()
    batch_id = await create_batch(session, base, n)
    state = await until(session, base, batch_id, lambda s: s["status"] in ("completed", "failed", "cancelled"))
    assert state["status"] == "completed" and state["request_counts"]["completed"] == n, state
    return time.perf_counter() - t0


async def timed_client(session, base: str, n: int) -> float:
    slots = asyncio.Semaphore(CONCURRENCY)

    async def one(line: dict) -> None:
        async with slots:
            async with session.post(f"{base}/v1/completions", json=line["body"]) as resp:
                resp.raise_for_status()
                await resp.read()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(x) for x in lines(n)))
    return time.perf_counter() - t0


async def measure(base: str, n: int, solo: int, client_first: bool) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        for _ in range(3):  # warm-up
            await ttft(session, base)
        alone = [await ttft(session, base) for _ in range(solo)]
        batch_id = await create_batch(session, base, n)
        await until(session, base, batch_id, lambda s: s["request_counts"]["completed"] >= CONCURRENCY)
        during = [await ttft(session, base) for _ in range(solo)]
        # One more after the engine's yield window without an interactive request: the batch's
        # steps are two deep again when it comes (engine_core/batch_yield.py).
        await asyncio.sleep(YIELD_WINDOW_S + 0.5)
        cold = await ttft(session, base)
        state = await batch_state(session, base, batch_id)
        assert state["status"] == "in_progress", "the batch ended before B's requests did: use more --lines"
        await until(session, base, batch_id, lambda s: s["status"] == "completed")
        await asyncio.sleep(YIELD_WINDOW_S + 0.5)  # the batch alone: nothing interactive ran within the window
        if client_first:
            client_s = await timed_client(session, base, n)
            batch_s = await timed_batch(session, base, n)
        else:
            batch_s = await timed_batch(session, base, n)
            client_s = await timed_client(session, base, n)
    return {"alone_ttft_s": alone, "during_ttft_s": during, "cold_ttft_s": cold, "batch_s": batch_s,
            "client_s": client_s}


def cell(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f} – {max(values):.{digits}f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lines", type=int, default=1000)
    ap.add_argument("--solo-requests", type=int, default=10)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for the engine (a switch to compare)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    env = dict(e.split("=", 1) for e in args.env)
    stem = args.out or ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-batch.json"
    raw: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="servectl-batch-") as tmp:
        for r in range(args.rounds):
            server = Servectl(Path(tmp), label=f"round{r}", warm_standby=False, env=env)
            try:
                server.start()
                if server.proc.wait(300) != 0:
                    raise RuntimeError(f"servectl start failed (see {server.runtime})")
                result = asyncio.run(measure(server.base, args.lines, args.solo_requests, client_first=r % 2 == 1))
            finally:
                server.stop()
            raw.append(result)
            print(f"round {r + 1}: B alone {statistics.median(result['alone_ttft_s']):.4f}s, during the batch "
                  f"{statistics.median(result['during_ttft_s']):.4f}s; batch {result['batch_s']:.1f}s, "
                  f"client {result['client_s']:.1f}s", flush=True)
    alone = [statistics.median(x["alone_ttft_s"]) for x in raw]
    during = [statistics.median(x["during_ttft_s"]) for x in raw]
    ratio = [d / a for d, a in zip(during, alone)]
    cold = [x["cold_ttft_s"] for x in raw]
    cold_ratio = [c / a for c, a in zip(cold, alone)]
    batch = [x["batch_s"] for x in raw]
    client = [x["client_s"] for x in raw]
    speed = [c / b for c, b in zip(client, batch)]
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.write_text(json.dumps({"machine": machine(), "args": vars(args) | {"out": str(stem)}, "raw": raw}, indent=1))
    md = [f"# A batch on spare capacity — {time.strftime('%Y-%m-%d %H:%M')}", "",
          f"Machine: {machine()['cores']} cores, {machine()['cpu']}. servectl, no warm standbys, the bundled model "
          f"as configured by default; a batch of {args.lines} completion lines (32-token prompts, 32 tokens out), "
          f"`[gateway.batch] concurrency` {CONCURRENCY}; B: {args.solo_requests} streaming requests one after "
          f"another (16 tokens out). Fresh server per round; a cell is the median of the {args.rounds} rounds "
          "[min – max].", "",
          "| | value |", "|---|---|",
          f"| B's TTFT alone (s) | {cell(alone, 4)} |",
          f"| B's TTFT while the batch runs (s) | {cell(during, 4)} |",
          f"| during / alone | {statistics.median(ratio):.2f}× [{min(ratio):.2f} – {max(ratio):.2f}] |",
          f"| B's first request after {YIELD_WINDOW_S:g} s without one, the batch running (s) | {cell(cold, 4)} "
          f"({statistics.median(cold_ratio):.2f}× alone) |",
          f"| the batch, create to completed, nothing else running (s) | {cell(batch, 1)} |",
          f"| the same lines from a client, {CONCURRENCY} at a time (s) | {cell(client, 1)} |",
          f"| batch throughput / client's | {statistics.median(speed):.2f}× [{min(speed):.2f} – {max(speed):.2f}] |"]
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
