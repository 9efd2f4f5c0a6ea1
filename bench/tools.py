"""The tools cell: agent-style requests (`auto` tool calls with reasoning), servectl against `vllm serve`.

    python -m bench.tools                     # 3 alternating rounds, c=1 and c=16
    python -m bench.tools --rounds 5 --concurrency 1,4,16
    python -m bench.tools --apis responses,messages   # the same turns on /v1/responses, /v1/messages
    python -m bench.tools --smoke             # the harness itself, tiny counts

Both serve the bundled tool-calling model (servectl/model/tools) with the same
flags (`--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser
qwen3`, float32, eager, the same KV cache). Each round starts a fresh server,
warms it up, then sends streamed chat requests with two tools at temperature 0
(`What is the weather in <city>?`, cycling cities: every answer is reasoning
and one call, parsed on every step) at each concurrency, and stops it; then the
other server. Figures per cell: output tokens per second (usage), requests per
second, median TTFT (first reasoning or call chunk) and end-to-end latency; the
median of the rounds with their spread, and servectl / vllm serve. Results:
``bench/results/<date>-tools.{json,md}``.
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

from bench.run import (DTYPE, KV_BYTES, ROOT, Servectl, VllmServe, machine, sse_events,  # noqa: F401
                       wait_completion)
from bench.spread import alternate, ratio_row, spreads

TOOLS_DIR = ROOT / "servectl" / "model" / "tools"
FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
MAX_MODEL_LEN = 2048
CITIES = ["Oslo", "Lisbon", "Cairo", "Lima", "Tokyo", "Nairobi", "Quito", "Hanoi"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "description": "Get the local time in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


class ServectlTools(Servectl):
    def start(self) -> None:
        import subprocess

        config = self.workdir / "tools.toml"
        config.write_text(f'[manager]\nwarm_standby = false\n[[models]]\nname = "tools"\nmodel = "{TOOLS_DIR}"\n'
                          'enable_auto_tool_choice = true\ntool_call_parser = "hermes"\n'
                          f'[models.engine_args]\nenforce_eager = true\nkv_cache_memory_bytes = {KV_BYTES}\n'
                          f'max_model_len = {MAX_MODEL_LEN}\ndtype = "{DTYPE}"\nreasoning_parser = "qwen3"\n')
        self.launched = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "servectl.cli", "start", "--config", str(config),
                                      "--port", str(self.port), "--runtime-dir", str(self.runtime)], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def request(api: str, question: str) -> tuple[str, dict]:
    """(path, body) of one streamed agent turn on ``api``: chat, responses or messages."""
    ask = {"role": "user", "content": question}
    if api == "responses":
        return "/v1/responses", {"model": "tools", "temperature": 0, "max_output_tokens": 200, "stream": True,
                                 "input": question, "tools": [{"type": "function", **t["function"]} for t in TOOLS]}
    if api == "messages":
        return "/v1/messages", {"model": "tools", "temperature": 0, "max_tokens": 200, "stream": True,
                                "messages": [ask], "tools": [{"name": t["function"]["name"],
                                                              "description": t["function"]["description"],
                                                              "input_schema": t["function"]["parameters"]}
                                                             for t in TOOLS]}
    return "/v1/chat/completions", {"model": "tools", "temperature": 0, "max_tokens": 200, "stream": True,
                                    "tools": TOOLS, "stream_options": {"include_usage": True}, "messages": [ask]}


def read_event(api: str, event: dict) -> tuple[int, bool, bool]:
    """(output tokens it reports, whether it shows output, whether it says a tool was called)."""
    if api == "responses":
        kind = event.get("type", "")
        if kind == "response.completed":
            r = event["response"]
            return r["usage"]["output_tokens"], False, any(i["type"] == "function_call" for i in r["output"])
        return 0, kind.endswith(".delta"), False
    if api == "messages":
        kind = event.get("type")
        if kind == "message_delta":
            return event["usage"]["output_tokens"], False, event["delta"].get("stop_reason") == "tool_use"
        return 0, kind == "content_block_delta", False
    tokens = event["usage"]["completion_tokens"] if event.get("usage") and not event["choices"] else 0
    shows = any((c.get("delta") or {}).get(k) for c in event["choices"] for k in ("reasoning", "content", "tool_calls"))
    return tokens, shows, any(c.get("finish_reason") == "tool_calls" for c in event["choices"])


async def load(base: str, concurrency: int, total: int, api: str = "chat") -> dict:
    """``total`` streamed agent turns at ``concurrency``: throughput, TTFT and latency."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    tokens, ttfts, latencies, failed, calls = 0, [], [], 0, 0

    async def one(session, i: int):
        nonlocal tokens, failed, calls
        path, body = request(api, f"What is the weather in {CITIES[i % len(CITIES)]}?")
        async with sem:
            t0 = time.monotonic()
            first = None
            try:
                async with session.post(f"{base}{path}", json=body) as r:
                    if r.status != 200:
                        failed += 1
                        return
                    async for line in r.content:
                        if not line.startswith(b"data: {"):
                            continue
                        n, shows, called = read_event(api, json.loads(line[6:]))
                        tokens += n
                        calls += called
                        if first is None and shows:
                            first = time.monotonic() - t0
            except aiohttp.ClientError:
                failed += 1
                return
            latencies.append(time.monotonic() - t0)
            if first is not None:
                ttfts.append(first)

    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(session, i) for i in range(total)))
    seconds = time.monotonic() - t0
    return {"requests": total, "failed": failed, "tool_calls": calls, "output_tokens": tokens,
            "output_throughput": tokens / seconds, "requests_per_s": total / seconds,
            "median_ttft_ms": 1000 * statistics.median(ttfts) if ttfts else None,
            "median_e2e_ms": 1000 * statistics.median(latencies) if latencies else None}


FIGURES = ("output_throughput", "requests_per_s", "median_ttft_ms", "median_e2e_ms")


def one_round(server, concurrency: list[int], per_cell: int, apis: list[str]) -> dict:
    server.start()
    try:
        if wait_health(server.base, server.proc, 900) is None:
            raise SystemExit(f"{server.name} did not start")
        out = {}
        for api in apis:
            asyncio.run(load(server.base, 2, 4, api))  # warm-up, not counted
            for c in concurrency:
                out[str(c) if api == "chat" else f"{api} c={c}"] = asyncio.run(
                    load(server.base, c, max(per_cell, 2 * c), api))
        return out
    finally:
        server.stop()


def wait_health(base: str, proc, timeout: float) -> float | None:
    import urllib.request

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() not in (None, 0):
            return None
        try:
            body = json.dumps({"model": "tools", "messages": [{"role": "user", "content": "Hi"}],
                               "max_tokens": 2}).encode()
            req = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.2)  # event-proof: a benchmark waiting for a server it started
    return None


def summarize(rounds: dict[str, list[dict]]) -> dict:
    out: dict = {}
    for name, rs in rounds.items():
        out[name] = {}
        for cell in rs[0]:
            out[name][cell] = spreads(rs, FIGURES, lambda r, f: r[cell][f])
    return out


def markdown(res: dict) -> str:
    s = res["summary"]
    lines = [f"# Tools cell ({res['date']}, {res['rounds']} alternating rounds, {res['machine']['cpu']}, "
             f"{res['machine']['cores']} cores)", "",
             "Streamed `auto` tool calls with reasoning (tools model, hermes + qwen3), median [min–max] of the rounds; "
             "chat completions unless the cell names `responses` (/v1/responses) or `messages` (/v1/messages).",
             "", "| cell | figure | vllm serve | servectl | servectl / vllm serve |", "|---|---|---|---|---|"]
    for cell in s["vllm serve"]:
        for f in FIGURES:
            a, b = s["vllm serve"][cell].get(f), s["servectl"][cell].get(f)
            if not a or not b:
                continue
            lines.append(ratio_row(cell if ' c=' in cell else 'c=' + cell, f, a=a, b=b))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--apis", default="chat", help="chat, responses, messages (comma-separated)")
    ap.add_argument("--requests", type=int, default=24, help="per cell (at least 2 × concurrency)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p = ap.parse_args(argv)
    concurrency = [int(c) for c in p.concurrency.split(",")]
    apis = p.apis.split(",")
    if p.smoke:
        p.rounds, concurrency, p.requests = 1, [2], 2
    with tempfile.TemporaryDirectory(prefix="bench-tools-") as tmp:
        work = Path(tmp)

        def one(i: int, name: str) -> dict:
            server = (VllmServe(work, model=TOOLS_DIR, served="tools", flags=FLAGS, max_model_len=MAX_MODEL_LEN)
                      if name == "vllm serve" else ServectlTools(work, label=f"tools-{i}"))
            result = one_round(server, concurrency, p.requests, apis)
            print(f"round {i + 1} {name}: " + ", ".join(
                f"{c} {r['output_throughput']:.1f} tok/s ({r['failed']} failed)" for c, r in result.items()),
                flush=True)
            return result

        rounds = alternate(p.rounds, ("vllm serve", "servectl"), one)
    date = time.strftime("%Y-%m-%d")
    res = {"date": date, "rounds": p.rounds, "machine": machine(), "concurrency": concurrency, "raw": rounds,
           "summary": summarize(rounds)}
    if p.smoke:
        print(json.dumps(res["summary"], indent=1))
        return 0 if all(r[c]["failed"] == 0 for rs in rounds.values() for r in rs for c in r) else 1
    p.out.mkdir(parents=True, exist_ok=True)
    stem = f"{date}-tools" + ("" if apis == ["chat"] else "-" + "-".join(apis))
    (p.out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    (p.out / f"{stem}.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
