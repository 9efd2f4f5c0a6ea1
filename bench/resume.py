"""What a crash costs clients (issue 14): continued texts against undisturbed ones, and recovery times.

    python -m bench.resume                  # starts its own servectl (default model)
    python -m bench.resume --rounds 3 --out bench/results/<date>-resume.json

Per round and per kind of failure (worker SIGKILL, engine SIGKILL, worker
SIGSTOP): 8 greedy streams (temperature 0, ignore_eos, 120 tokens, different
prompts) run undisturbed once for reference, then again with the failure
injected once every stream has at least 8 tokens. Figures:

- ``equal``: how many continued texts equal the undisturbed ones. A re-prefill
  of prompt + output can change numerics (a batch of a different shape), so a
  greedy continuation may take another branch at a near-tie: a figure, not a
  promise. Every stream must still end without an error and with 120 tokens.
- ``gap_s``: the longest pause a client saw (the restart, as a client feels it).
- ``serving_again_s``: from the signal until the model is ready again
  (status), and until the first client got its next token.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from http.client import HTTPConnection
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import sse_events  # noqa: E402

PROMPTS = ["def ", "import ", "class ", "for ", "x = ", "return ", "if ", "with "]
TOKENS = 120


class Stream(threading.Thread):
    def __init__(self, port: int, prompt: str, model: str = "default", tokens: int = TOKENS):
        super().__init__(daemon=True)
        self.port, self.prompt, self.model, self.tokens = port, prompt, model, tokens
        self.text: list[str] = []
        self.stamps: list[float] = []
        self.errors: list = []
        self.usage = None
        self.progress = threading.Event()

    def run(self) -> None:
        conn = HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", "/v1/completions", json.dumps({
            "model": self.model, "prompt": self.prompt, "max_tokens": self.tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        for event in sse_events(resp):
            if "error" in event:
                self.errors.append(event["error"])
            elif event.get("usage"):
                self.usage = event["usage"]
            else:
                self.text.append(event["choices"][0]["text"])
                self.stamps.append(time.monotonic())
                if len(self.stamps) >= 8:
                    self.progress.set()
        self.progress.set()
        conn.close()


def run_streams(port: int, inject=None) -> tuple[list[Stream], float | None]:
    streams = [Stream(port, p) for p in PROMPTS]
    for s in streams:
        s.start()
    injected = None
    if inject is not None:
        for s in streams:
            s.progress.wait(300)
        injected = time.monotonic()
        inject()
    for s in streams:
        s.join(600)
    return streams, injected


def one_failure(server, kind: str) -> dict:
    status = server.status()
    pid_of = {c["component"]: c["pid"] for c in status["children"]}
    component, sig = {"worker SIGKILL": ("worker:default:0", signal.SIGKILL),
                      "engine SIGKILL": ("engine_core:default", signal.SIGKILL),
                      "worker SIGSTOP": ("worker:default:0", signal.SIGSTOP)}[kind]
    reference, _ = run_streams(server.port)
    ready_at: list[float] = []

    def watch_ready(engine_pid: int) -> None:
        while True:
            st = server.status()
            engine = next(c for c in st["children"] if c["component"] == "engine_core:default")
            model = next(m for m in st["models"] if m["name"] == "default")
            if engine["pid"] != engine_pid and model["state"] == "ready":
                ready_at.append(time.monotonic())
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_ready, args=(pid_of["engine_core:default"],), daemon=True)

    def inject() -> None:
        os.kill(pid_of[component], sig)
        watcher.start()

    streams, injected = run_streams(server.port, inject)
    watcher.join(600)
    after = [min((t for t in s.stamps if t > injected), default=None) for s in streams]
    gaps = [max((b - a for a, b in zip(s.stamps, s.stamps[1:])), default=0.0) for s in streams]
    return {
        "kind": kind,
        "errors": sum(len(s.errors) for s in streams),
        "complete": sum(bool(s.usage and s.usage["completion_tokens"] == TOKENS) for s in streams),
        "equal": sum("".join(s.text) == "".join(r.text) for s, r in zip(streams, reference)),
        "streams": len(streams),
        "gap_s": round(max(gaps), 2),
        "serving_again_s": round(ready_at[0] - injected, 2) if ready_at else None,
        "first_token_after_s": round(min(t for t in after if t is not None) - injected, 2)
        if any(after) else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.resume")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from bench.run import Servectl, wait_completion

    server = Servectl(Path(tempfile.mkdtemp(prefix="bench-resume-")))
    server.start()
    if wait_completion(server.base, None, 900) is None:
        print("servectl did not serve", file=sys.stderr)
        return 1
    results = []
    try:
        for _ in range(args.rounds):
            for kind in ("worker SIGKILL", "engine SIGKILL", "worker SIGSTOP"):
                server.wait_warm()
                results.append(one_failure(server, kind))
                print(json.dumps(results[-1]), flush=True)
    finally:
        server.stop()
    if args.out:
        args.out.write_text(json.dumps({"tokens": TOKENS, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
