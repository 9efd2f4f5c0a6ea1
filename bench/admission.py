"""Other clients' inter-token latency while one large batch is admitted (issue 15).

    python -m bench.admission                  # starts its own servectl
    python -m bench.admission --url URL [--key K]   # against a running daemon

Four streaming clients run steadily (ignore_eos, long outputs); after a quiet
window, one request with 256 prompts (the per-request cap) is posted. The
streams' inter-token gaps are compared: before the batch, while it is being
admitted (from its POST until each of its prompts produced its first token,
i.e. every sequence was submitted, tokenised, added and prefilled), and
after. The figure: the streams' p50 / p99 / max gap in each window.

Twice: with one-token prompts (given as token ids), whose prefill costs
next to nothing, so the middle window shows what admitting itself costs the
others (a gateway submitting in one blocking loop, an engine tokenising and
adding everything between two steps would show as a spike); and with
~50-token text prompts, where vLLM's scheduler also puts the batch's prefill
into the same steps as the streams' decoding (chunked prefill: a step's
token budget is shared), which lengthens those steps by the prefill's
compute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STREAMS = 4
BATCH = 256


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def stream(session: aiohttp.ClientSession, url: str, headers: dict, stamps: list[float], stop: asyncio.Event):
    body = {"model": "default", "prompt": "def ", "max_tokens": 480, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    stamps.append(time.monotonic())
                if stop.is_set():
                    break


async def measure(url: str, key: str | None, prompts: list, quiet_s: float = 3.0, after_s: float = 3.0) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    stop = asyncio.Event()
    stamps: list[list[float]] = [[] for _ in range(STREAMS)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = [asyncio.ensure_future(stream(session, url, headers, s, stop)) for s in stamps]
        await asyncio.sleep(quiet_s)  # the streams settle; this is the "before" window
        t_post = time.monotonic()
        batch = {"model": "default", "prompt": prompts, "max_tokens": 4, "stream": True}
        first: set[int] = set()
        t_admitted = None
        async with session.post(f"{url}/v1/completions", json=batch, headers=headers) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        first.add(choice["index"])
                    if t_admitted is None and len(first) == BATCH:
                        t_admitted = time.monotonic()
        t_done = time.monotonic()
        await asyncio.sleep(after_s)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    t_admitted = t_admitted or t_done

    def gaps(lo: float, hi: float) -> list[float]:
        out = []
        for s in stamps:
            out += [(b - a) * 1000 for a, b in zip(s, s[1:]) if lo <= b < hi]
        return out

    windows = {"before": gaps(t_post - quiet_s + 1.0, t_post), "admitting": gaps(t_post, t_admitted),
               "after": gaps(t_done, t_done + after_s)}
    return {"batch_prompts": BATCH, "streams": STREAMS, "admission_s": round(t_admitted - t_post, 3),
            "batch_done_s": round(t_done - t_post, 3),
            "itl_ms": {w: {"n": len(g), "p50": pct(g, 0.5), "p99": pct(g, 0.99), "max": max(g, default=None)}
                       for w, g in windows.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.admission")
    ap.add_argument("--url")
    ap.add_argument("--key")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    server = None
    if args.url is None:
        from bench.run import Servectl, wait_completion

        server = Servectl(Path(tempfile.mkdtemp(prefix="bench-adm-")))
        server.start()
        if wait_completion(server.base, None, 600) is None:
            print("servectl did not serve", file=sys.stderr)
            return 1
        args.url = server.base
    try:
        result = {
            "one_token_prompts": asyncio.run(measure(args.url, args.key, [[5 + i % 100] for i in range(BATCH)])),
            "text_prompts": asyncio.run(measure(args.url, args.key,
                                                [f"# prompt {i}\n" + "import os\n" * 20 for i in range(BATCH)])),
        }
    finally:
        if server is not None:
            server.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
