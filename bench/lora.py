"""The LoRA cell: decode tokens per second through an adapter against the base model (issue 34).

    python -m bench.lora                 # 3 rounds, c=1 and c=8
    python -m bench.lora --smoke

Each round starts a fresh servectl and a fresh `vllm serve` (one after the other), both
serving the bundled model with `enable_lora` (max_lora_rank 8) and the bundled adapter
(servectl/model/lora/vllm-code) as `vllm-code`, float32, eager, the same KV cache. On each,
streams of `--tokens` tokens (ignore_eos, temperature 0) are sent at each concurrency, to the
base model and to the adapter in turn (the order alternates between rounds). Figures: decode
tokens per second per stream (tokens after the first over the time from the first chunk to the
stream's end, the median stream), and
aggregate output tokens per second; the median of the rounds with the spread; adapter / base
for each server. Results: ``bench/results/<date>-lora.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.run import (DEFAULT_MODEL_DIR, DTYPE, KV_BYTES, MAX_MODEL_LEN, ROOT, Servectl, VllmServe, machine,
                       wait_completion)
from bench.spread import alternate, ratio_row, spreads

LORA_DIR = DEFAULT_MODEL_DIR.parent / "lora" / "vllm-code"
FLAGS = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules", f"vllm-code={LORA_DIR}")
PROMPT = "from vllm.config import "


class ServectlLora(Servectl):
    def start(self) -> None:
        config = self.workdir / f"{self.name}.toml"
        config.write_text(f'[manager]\nwarm_standby = false\n[[models]]\nname = "default"\n'
                          f'model = "{DEFAULT_MODEL_DIR}"\nlora_modules = {{ "vllm-code" = "{LORA_DIR}" }}\n'
                          f'[models.engine_args]\nenforce_eager = true\nkv_cache_memory_bytes = {KV_BYTES}\n'
                          f'max_model_len = {MAX_MODEL_LEN}\ndtype = "{DTYPE}"\nenable_lora = true\n'
                          'max_lora_rank = 8\nmax_loras = 2\n')
        self.launched = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "servectl.cli", "start", "--config", str(config),
                                      "--port", str(self.port), "--runtime-dir", str(self.runtime)], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def streams(base: str, model: str, concurrency: int, total: int, tokens: int) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    decode_rates, out_tokens, failed = [], 0, 0

    async def one(session):
        nonlocal out_tokens, failed
        body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with sem:
            first = None
            async with session.post(f"{base}/v1/completions", json=body) as r:
                if r.status != 200:
                    failed += 1
                    return
                async for raw in r.content:
                    if first is None and raw.startswith(b"data: {"):
                        first = time.monotonic()
            end = time.monotonic()
            # ignore_eos: every stream has exactly `tokens` tokens, however a server groups them in
            # chunks; the rate is the tokens after the first over the time after the first chunk.
            out_tokens += tokens
            if first is not None and end > first:
                decode_rates.append((tokens - 1) / (end - first))

    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(session) for _ in range(total)))
    seconds = time.monotonic() - t0
    return {"streams": total, "failed": failed, "decode_tok_s": statistics.median(decode_rates) if decode_rates
            else None, "output_tok_s": out_tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=8, help="streams per concurrency (at least the concurrency)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p = ap.parse_args(argv)
    concurrency = [int(c) for c in p.concurrency.split(",")]
    if p.smoke:
        p.rounds, concurrency, p.tokens, p.streams = 1, [1], 8, 1
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        work = Path(tmp)

        def one_round(i: int, name: str) -> dict:
            server = (VllmServe(work, flags=FLAGS, max_model_len=MAX_MODEL_LEN) if name == "vllm serve"
                      else ServectlLora(work, label=f"lora-{i}", warm_standby=False))
            server.start()
            try:
                if wait_completion(server.base, server.proc, 900) is None:
                    raise SystemExit(f"{name} did not start")
                for model in ("default", "vllm-code"):  # warm-up: both paths compiled, the adapter loaded
                    asyncio.run(streams(server.base, model, 2, 2, 16))
                order = ("default", "vllm-code") if i % 2 == 0 else ("vllm-code", "default")
                result = {str(c): {m: asyncio.run(streams(server.base, m, c, max(p.streams, c), p.tokens))
                                   for m in order} for c in concurrency}
            finally:
                server.stop()
            print(f"round {i + 1} {name}: " + "; ".join(
                f"c={c} " + ", ".join(f"{m} {r['decode_tok_s'] or 0:.0f} tok/s/stream" for m, r in res.items())
                for c, res in result.items()), flush=True)
            return result

        raw = alternate(p.rounds, ("servectl", "vllm serve"), one_round, swap=True)
    figures = ("decode_tok_s", "output_tok_s")
    summary = {name: {c: {m: spreads(rs, figures, lambda r, f: r[c][m][f]) for m in ("default", "vllm-code")}
                      for c in rs[0]} for name, rs in raw.items()}
    date = time.strftime("%Y-%m-%d")
    res = {"date": date, "rounds": p.rounds, "tokens": p.tokens, "machine": machine(), "raw": raw,
           "summary": summary}
    lines = [f"# LoRA cell ({date}, {p.rounds} rounds, {res['machine']['cpu']}, {res['machine']['cores']} cores)",
             "", f"Streams of {p.tokens} tokens (`ignore_eos`, temperature 0) to the base model and to the bundled "
             "adapter on the same server (`enable_lora`, max_lora_rank 8); median [min–max] of the rounds.", "",
             "| server | cell | figure | base model | adapter | adapter / base |", "|---|---|---|---|---|---|"]
    for name, cells in summary.items():
        for c, by_model in cells.items():
            for f in figures:
                a, b = by_model["default"].get(f), by_model["vllm-code"].get(f)
                if a and b:
                    lines.append(ratio_row(name, f"c={c}", f, a=a, b=b))
    lines += ["", "decode_tok_s is the median stream's; a round where the client read a whole stream in one "
              "burst (its process descheduled while the server ran) shows as an extreme maximum. output_tok_s "
              "(every stream's tokens over the cell's time) has no such artefact."]
    md = "\n".join(lines) + "\n"
    print(md)
    failed = sum(r[c][m]["failed"] for rs in raw.values() for r in rs for c in r for m in r[c])
    if p.smoke:
        return 0 if failed == 0 else 1
    p.out.mkdir(parents=True, exist_ok=True)
    (p.out / f"{date}-lora.json").write_text(json.dumps(res, indent=1) + "\n")
    (p.out / f"{date}-lora.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
