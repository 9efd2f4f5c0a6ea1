"""The embeddings cell: embedding inputs per second, servectl against `vllm serve` (issue 33).

    python -m bench.pooling                 # 3 alternating rounds, c=16
    python -m bench.pooling --smoke

Both serve the bundled default model as an embedding model (`--runner pooling
--convert embed`, float32, eager, the same KV cache). Each round starts a fresh
server, warms it up, sends `--requests` embedding requests of `--batch` short
code lines each at each concurrency, and stops it; then the other server.
Figures: inputs embedded per second and median latency, the median of the
rounds with the spread, and servectl / vllm serve. Results:
``bench/results/<date>-pooling.{json,md}``.
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

from bench.run import DEFAULT_MODEL_DIR, DTYPE, KV_BYTES, ROOT, Servectl, VllmServe, machine
from bench.spread import alternate, ratio_row, spreads

FLAGS = ("--runner", "pooling", "--convert", "embed")


class ServectlEmbed(Servectl):
    def start(self) -> None:
        import subprocess

        config = self.workdir / "pooling.toml"
        config.write_text(f'[manager]\nwarm_standby = false\n[[models]]\nname = "default"\n'
                          f'model = "{DEFAULT_MODEL_DIR}"\n[models.engine_args]\nrunner = "pooling"\nconvert = "embed"\n'
                          f'enforce_eager = true\nkv_cache_memory_bytes = {KV_BYTES}\nmax_model_len = 512\n'
                          f'dtype = "{DTYPE}"\n')
        self.launched = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "servectl.cli", "start", "--config", str(config),
                                      "--port", str(self.port), "--runtime-dir", str(self.runtime)], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def load(base: str, concurrency: int, total: int, batch: int) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    latencies, failed = [], 0

    async def one(session, i: int):
        nonlocal failed
        body = {"model": "default", "input": [f"def f{i}_{j}(x): return x + {j}" for j in range(batch)]}
        async with sem:
            t0 = time.monotonic()
            async with session.post(f"{base}/v1/embeddings", json=body) as r:
                data = await r.json()
                if r.status != 200 or len(data.get("data", ())) != batch:
                    failed += 1
                    return
            latencies.append(time.monotonic() - t0)

    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(session, i) for i in range(total)))
    seconds = time.monotonic() - t0
    return {"requests": total, "failed": failed, "inputs_per_s": (total - failed) * batch / seconds,
            "median_latency_ms": 1000 * statistics.median(latencies) if latencies else None}


def wait_ready(base: str, proc, timeout: float) -> bool:
    import urllib.request

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() not in (None, 0):
            return False
        try:
            req = urllib.request.Request(f"{base}/v1/embeddings", data=json.dumps(
                {"model": "default", "input": "x"}).encode(), headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)  # event-proof: a benchmark waiting for a server it started
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="16")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p = ap.parse_args(argv)
    concurrency = [int(c) for c in p.concurrency.split(",")]
    if p.smoke:
        p.rounds, concurrency, p.requests = 1, [2], 4
    with tempfile.TemporaryDirectory(prefix="bench-pooling-") as tmp:
        work = Path(tmp)

        def one_round(i: int, name: str) -> dict:
            server = (VllmServe(work, served="default", flags=FLAGS, max_model_len=512) if name == "vllm serve"
                      else ServectlEmbed(work, label=f"pooling-{i}"))
            server.start()
            try:
                if not wait_ready(server.base, server.proc, 900):
                    raise SystemExit(f"{name} did not start")
                asyncio.run(load(server.base, 4, 16, p.batch))  # warm-up
                result = {str(c): asyncio.run(load(server.base, c, p.requests, p.batch)) for c in concurrency}
            finally:
                server.stop()
            print(f"round {i + 1} {name}: " + ", ".join(
                f"c={c} {r['inputs_per_s']:.0f} inputs/s ({r['failed']} failed)" for c, r in result.items()),
                flush=True)
            return result

        rounds = alternate(p.rounds, ("vllm serve", "servectl"), one_round)
    summary = {name: {c: spreads(rs, ("inputs_per_s", "median_latency_ms"), lambda r, f: r[c][f])
                      for c in rs[0]} for name, rs in rounds.items()}
    date = time.strftime("%Y-%m-%d")
    res = {"date": date, "rounds": p.rounds, "batch": p.batch, "machine": machine(), "raw": rounds,
           "summary": summary}
    lines = [f"# Embeddings cell ({date}, {p.rounds} alternating rounds, {res['machine']['cpu']}, "
             f"{res['machine']['cores']} cores)", "", f"`/v1/embeddings`, {p.batch} inputs a request, default model "
             "(`--runner pooling --convert embed`), median [min–max] of the rounds.", "",
             "| cell | figure | vllm serve | servectl | servectl / vllm serve |", "|---|---|---|---|---|"]
    for c in summary["vllm serve"]:
        for f in ("inputs_per_s", "median_latency_ms"):
            a, b = summary["vllm serve"][c].get(f), summary["servectl"][c].get(f)
            if a and b:
                lines.append(ratio_row(f"c={c}", f, a=a, b=b))
    md = "\n".join(lines) + "\n"
    print(md)
    if p.smoke:
        return 0 if all(r[c]["failed"] == 0 for rs in rounds.values() for r in rs for c in r) else 1
    p.out.mkdir(parents=True, exist_ok=True)
    (p.out / f"{date}-pooling.json").write_text(json.dumps(res, indent=1) + "\n")
    (p.out / f"{date}-pooling.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
