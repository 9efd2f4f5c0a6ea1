"""The media cells: image chats and transcriptions per second, servectl against `vllm serve` (issue 55).

    python -m bench.media                 # 3 alternating rounds, c=8
    python -m bench.media --smoke

Both serve the bundled vision model (servectl/model/vision) and speech model
(servectl/model/speech), float32, eager, the same KV cache, each model's own
context. `vllm serve` serves one model a server, so a round of it is two
servers, one after the other; servectl's round is one daemon serving both.
Each round starts fresh servers, warms each model up, then sends `--requests`
image chats (a fresh 64-pixel PNG as a data: URL, up to 8 tokens, greedy) and
as many transcriptions (a WAV of spoken digits) at each concurrency. Figures:
requests per second and median latency, the median of the rounds with the
spread, and servectl / vllm serve. Results: ``bench/results/<date>-media.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.run import DEFAULT_MODEL_DIR, DTYPE, KV_BYTES, ROOT, Servectl, VllmServe, machine
from bench.spread import alternate, ratio_row, spreads

VISION = DEFAULT_MODEL_DIR.parent / "vision"
SPEECH = DEFAULT_MODEL_DIR.parent / "speech"
CELLS = ("image_chat", "transcription")


def max_model_len(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return int(text.get("max_position_embeddings") or cfg.get("max_target_positions") or 448)


class ServectlMedia(Servectl):
    def start(self) -> None:
        config = self.workdir / f"{self.name}.toml"
        config.write_text("[manager]\nwarm_standby = false\n" + "".join(
            f'[[models]]\nname = "{name}"\nmodel = "{model}"\n[models.engine_args]\nenforce_eager = true\n'
            f'kv_cache_memory_bytes = {KV_BYTES}\nmax_model_len = {max_model_len(model)}\ndtype = "{DTYPE}"\n'
            for name, model in (("vision", VISION), ("speech", SPEECH))))
        self.launched = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "servectl.cli", "start", "--config", str(config),
                                      "--port", str(self.port), "--runtime-dir", str(self.runtime)], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pictures(n: int) -> list[str]:
    from training.train_vision_model import sample

    rng = random.Random(4242)
    urls = []
    for _ in range(n):
        img, _ = sample(rng)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return urls


def speech(n: int) -> list[bytes]:
    from training.train_speech_model import words

    rng = random.Random(4242)
    return [subprocess.run(["espeak-ng", "--stdout", "-v", "en", words(
        "".join(rng.choice("0123456789") for _ in range(4)), "en")], check=True, capture_output=True).stdout
        for _ in range(n)]


async def load(base: str, cell: str, concurrency: int, inputs: list) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    latencies, failed = [], 0

    async def one(session, item):
        nonlocal failed
        async with sem:
            t0 = time.monotonic()
            if cell == "image_chat":
                content = [{"type": "image_url", "image_url": {"url": item}},
                           {"type": "text", "text": "What is in the picture?"}]
                body = {"model": "vision", "temperature": 0, "max_tokens": 8,
                        "messages": [{"role": "user", "content": content}]}
                resp = session.post(f"{base}/v1/chat/completions", json=body)
            else:
                data = aiohttp.FormData()
                data.add_field("model", "speech")
                data.add_field("temperature", "0")
                data.add_field("file", item, filename="d.wav", content_type="audio/wav")
                resp = session.post(f"{base}/v1/audio/transcriptions", data=data)
            async with resp as r:
                await r.read()
                if r.status != 200:
                    failed += 1
                    return
            latencies.append(time.monotonic() - t0)

    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(session, item) for item in inputs))
    seconds = time.monotonic() - t0
    return {"requests": len(inputs), "failed": failed, "per_s": (len(inputs) - failed) / seconds,
            "median_latency_ms": 1000 * statistics.median(latencies) if latencies else None}


def ready(base: str, proc, cell: str, item, timeout: float = 900) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() not in (None, 0):
            return False
        try:
            if asyncio.run(load(base, cell, 1, [item]))["failed"] == 0:
                return True
        except OSError:
            pass
        time.sleep(0.5)  # event-proof: a benchmark waiting for a server it started
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="8")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p = ap.parse_args(argv)
    concurrency = [int(c) for c in p.concurrency.split(",")]
    if p.smoke:
        p.rounds, concurrency, p.requests = 1, [2], 4
    inputs = {"image_chat": pictures(p.requests), "transcription": speech(p.requests)}
    with tempfile.TemporaryDirectory(prefix="bench-media-") as tmp:
        work = Path(tmp)

        def measure(base: str, proc, cells) -> dict:
            out = {}
            for cell in cells:
                if not ready(base, proc, cell, inputs[cell][0]):
                    raise SystemExit(f"{base} did not answer {cell}")
                asyncio.run(load(base, cell, 4, inputs[cell][:8]))  # warm-up
                out[cell] = {str(c): asyncio.run(load(base, cell, c, inputs[cell])) for c in concurrency}
            return out

        def one_round(i: int, name: str) -> dict:
            result = {}
            if name == "vllm serve":
                for cell, model, served in (("image_chat", VISION, "vision"), ("transcription", SPEECH, "speech")):
                    server = VllmServe(work, model=model, served=served, max_model_len=max_model_len(model))
                    server.start()
                    try:
                        result.update(measure(server.base, server.proc, [cell]))
                    finally:
                        server.stop()
            else:
                server = ServectlMedia(work, label=f"media-{i}")
                server.start()
                try:
                    # `servectl start` returns once both models are ready: measure none while the
                    # other still loads on the same cores (vllm serve's rounds run one at a time).
                    server.proc.wait(900)
                    result = measure(server.base, None, CELLS)
                finally:
                    server.stop()
            print(f"round {i + 1} {name}: " + ", ".join(
                f"{cell} c={c} {r['per_s']:.1f}/s ({r['failed']} failed)"
                for cell, by_c in result.items() for c, r in by_c.items()), flush=True)
            return result

        rounds = alternate(p.rounds, ("vllm serve", "servectl"), one_round)
    summary = {name: {cell: {c: spreads(rs, ("per_s", "median_latency_ms"), lambda r, f: r[cell][c][f])
                             for c in rs[0][cell]} for cell in CELLS} for name, rs in rounds.items()}
    date = time.strftime("%Y-%m-%d")
    res = {"date": date, "rounds": p.rounds, "machine": machine(), "raw": rounds, "summary": summary}
    lines = [f"# Media cells ({date}, {p.rounds} alternating rounds, {res['machine']['cpu']}, "
             f"{res['machine']['cores']} cores)", "",
             "Image chats (a 64-pixel PNG as a data: URL, up to 8 tokens) to the bundled vision model and "
             "transcriptions (a WAV of four spoken digits) to the bundled speech model; median [min–max] of the "
             "rounds.", "", "| cell | figure | vllm serve | servectl | servectl / vllm serve |",
             "|---|---|---|---|---|"]
    for cell in CELLS:
        for c in summary["vllm serve"][cell]:
            for f in ("per_s", "median_latency_ms"):
                a, b = summary["vllm serve"][cell][c].get(f), summary["servectl"][cell][c].get(f)
                if a and b:
                    lines.append(ratio_row(f"{cell} c={c}", f, a=a, b=b))
    md = "\n".join(lines) + "\n"
    print(md)
    failed = sum(r[cell][c]["failed"] for rs in rounds.values() for r in rs for cell in r for c in r[cell])
    if p.smoke:
        return 0 if failed == 0 else 1
    p.out.mkdir(parents=True, exist_ok=True)
    (p.out / f"{date}-media.json").write_text(json.dumps(res, indent=1) + "\n")
    (p.out / f"{date}-media.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
