"""Idle release on this machine: what a released model costs and what waking it costs (issue 18).

    python -m bench.idle_release              # a few minutes here; writes bench/results/<date>-idle-release.*
    python -m bench.idle_release --rounds 1 --no-save

One daemon, the bundled model with ``autostart = false`` and
``idle_release_s`` (default 3 s; ``unload``: this is CPU), bench/run.py's
engine settings. Figures:

- first use: time from the first request (the model never started) to its
  first token, to the whole answer;
- memory: the tree's RSS by kind while the model serves (standbys warm) and
  once it is released (the standbys stay);
- idle with the model released: CPU ms/s and context switches/s of the tree;
- request to first token for a released model (the wake: the group restarts
  on its warm standbys, then loads the model), each round after the standbys
  are warm again, beside the same request on a loaded model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import date
from pathlib import Path

from bench import run as B
from servectl.config import DEFAULT_MODEL_DIR

MODEL = "default"
PROMPT = {"model": MODEL, "prompt": "def ", "max_tokens": 16, "temperature": 0, "ignore_eos": True}


class IdleDaemon:
    """A servectl daemon from a config text, driven through its CLI and HTTP API."""

    def __init__(self, workdir: Path, config: str):
        self.workdir = workdir
        self.runtime = workdir / "rt"
        self.config = workdir / "servectl.toml"
        self.config.write_text(config)
        self.port = B.free_port()
        self.base = f"http://127.0.0.1:{self.port}"

    def cli(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "servectl.cli", *args, "--runtime-dir", str(self.runtime)],
                              capture_output=True, text=True, cwd=B.ROOT, timeout=timeout)

    def start(self) -> None:
        proc = self.cli("start", "--config", str(self.config), "--port", str(self.port))
        if proc.returncode != 0:
            raise RuntimeError(f"servectl start failed:\n{proc.stdout}\n{proc.stderr}")

    def stop(self) -> None:
        self.cli("stop", timeout=120)

    def status(self) -> dict:
        return json.loads(self.cli("status", "--json").stdout)

    def model(self) -> dict:
        return next(m for m in self.status()["models"] if m["name"] == MODEL)

    def pids(self) -> list[int]:
        st = self.status()
        return [st["manager_pid"]] + [c["pid"] for c in st["children"] if c["pid"]]

    def log(self, component: str) -> str:
        path = self.runtime / "state" / "logs" / f"{component.replace(':', '-')}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, predicate, timeout: float, what: str, interval: float = 0.2):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            value = predicate()
            if value:
                return value
            time.sleep(interval)
        raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")

    def wait_state(self, *states: str, timeout: float = 600) -> dict:
        return self.wait(lambda: (lambda m: m if m["state"] in states else None)(self.model()), timeout,
                         f"model {MODEL} {'/'.join(states)}")

    def wait_standbys_warm(self, timeout: float = 900) -> list[dict]:
        """Until every standby is warm; those standbys (their status)."""
        def warm() -> list[dict]:
            standbys = [c for c in self.status()["children"] if c["kind"] == "standby"]
            return standbys if standbys and all(c["state"] == "ready" for c in standbys) else []

        return self.wait(warm, timeout, "warm standbys", interval=0.5)

    def stream(self, body: dict = PROMPT, timeout: float = 900) -> dict:
        """One streaming completion: seconds to the first token and to the end, and the text."""
        data = json.dumps({**body, "stream": True}).encode()
        req = urllib.request.Request(f"{self.base}/v1/completions", data=data,
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        first = None
        text = []
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for chunk in B.sse_events(r):
                if "error" in chunk:
                    raise RuntimeError(f"stream failed: {chunk['error']}")
                piece = chunk["choices"][0]["text"] if chunk.get("choices") else ""
                if piece and first is None:
                    first = time.monotonic() - t0
                text.append(piece)
        return {"first_token_s": first, "total_s": time.monotonic() - t0, "text": "".join(text)}

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=30) as r:
            return r.read().decode()


class KeepAlive:
    """One tiny request a second: the model stays loaded meanwhile."""

    def __init__(self, d: IdleDaemon):
        self.d = d
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                self.d.stream({**PROMPT, "max_tokens": 1}, timeout=120)
            except OSError:
                pass

    def __enter__(self) -> "KeepAlive":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(130)


def config_text(release_s: float, mode: str = "unload", extra_engine_args: dict | None = None,
                manager: str = "") -> str:
    args = {"enforce_eager": True, "kv_cache_memory_bytes": B.KV_BYTES, "max_model_len": B.MAX_MODEL_LEN,
            "dtype": B.DTYPE, **(extra_engine_args or {})}
    return (f"[manager]\nfreeze_grace_s = 1.0\n{manager}[[models]]\nname = \"{MODEL}\"\nmodel = \"{DEFAULT_MODEL_DIR}\"\n"
            f"autostart = false\nidle_release_s = {release_s}\nidle_release = \"{mode}\"\nhold_timeout_s = 900\n"
            "[models.engine_args]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in args.items()))


def mib(kinds: dict) -> float:
    return round(sum(kinds.values()), 1)


def measure(p: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="servectl-idle-bench-"))
    d = IdleDaemon(work, config_text(p.release_s))
    res: dict = {"machine": B.machine(), "release_s": p.release_s, "mode": "unload", "rounds": p.rounds}
    try:
        t0 = time.monotonic()
        d.start()
        res["start_to_settled_s"] = round(time.monotonic() - t0, 2)  # nothing loads: the model starts on first use
        first = d.stream()
        res["first_use"] = {"first_token_s": round(first["first_token_s"], 2), "total_s": round(first["total_s"], 2)}
        print(f"first use (cold: import vllm, load, build): first token {first['first_token_s']:.2f} s", flush=True)
        with KeepAlive(d):
            d.wait_standbys_warm()
            serving = B.rss_by_kind(d.pids())
            loaded = [d.stream() for _ in range(3)]
        res["rss_mib_serving"] = serving
        res["loaded_first_token_ms"] = round(statistics.median(r["first_token_s"] for r in loaded) * 1000, 1)
        d.wait_state("released", timeout=120)
        d.wait_standbys_warm()
        released = B.rss_by_kind(d.pids())
        res["rss_mib_released"] = released
        res["rss_mib_total"] = {"serving": mib(serving), "released": mib(released)}
        print(f"tree RSS: serving {mib(serving)} MiB, released {mib(released)} MiB", flush=True)
        res["idle_released"] = B.measure_idle(_Pids(d), p.idle_s)
        res["vllm_metrics_while_released"] = sum(1 for line in d.metrics().splitlines() if line.startswith("vllm:"))
        print(f"idle, released: {res['idle_released']}", flush=True)
        wakes = []
        for rnd in range(p.rounds):
            d.wait_state("released", timeout=120)
            d.wait_standbys_warm()
            r = d.stream()
            if r["text"] != first["text"]:
                raise RuntimeError(f"a woken model answered differently: {r['text']!r} != {first['text']!r}")
            wakes.append(r)
            print(f"round {rnd + 1}: released → first token {r['first_token_s']:.2f} s", flush=True)
        res["wake"] = {"first_token_s": [round(r["first_token_s"], 2) for r in wakes],
                       "first_token_s_median": round(statistics.median(r["first_token_s"] for r in wakes), 2)}
        engine_log = d.log(f"engine_core:{MODEL}")
        res["handed_to_standby"] = d.log("manager").count("engine_core:default: handed to its warm standby")
        res["engine_log_tail"] = engine_log.splitlines()[-3:]
    finally:
        d.stop()
    return res


class _Pids:
    """bench.run.measure_idle's view of a server: its pids."""

    def __init__(self, d: IdleDaemon):
        self.d = d

    def pids(self) -> list[int]:
        return self.d.pids()


def markdown(res: dict) -> str:
    s, r = res["rss_mib_serving"], res["rss_mib_released"]
    kinds = sorted(set(s) | set(r))
    lines = [f"# Idle release ({date.today().isoformat()})", "",
             f"Machine: {res['machine']['cores']} cores, {res['machine']['cpu']}; the bundled model, "
             f"`idle_release_s = {res['release_s']:g}`, `{res['mode']}`, `autostart = false`.", "",
             "| figure | value |", "|---|---|",
             f"| `servectl start` to settled (nothing loaded) | {res['start_to_settled_s']} s |",
             f"| first use: request to first token (cold: import, load, build) | {res['first_use']['first_token_s']} s |",
             f"| released model: request to first token (median of {len(res['wake']['first_token_s'])}; "
             f"warm standbys) | {res['wake']['first_token_s_median']} s ({', '.join(map(str, res['wake']['first_token_s']))}) |",
             f"| loaded model: request to first token (median of 3) | {res['loaded_first_token_ms']} ms |",
             f"| tree RSS serving (standbys warm) | {res['rss_mib_total']['serving']} MiB |",
             f"| tree RSS released (standbys kept) | {res['rss_mib_total']['released']} MiB |",
             f"| idle, released: CPU | {res['idle_released']['cpu_ms_per_s']} ms/s |",
             f"| idle, released: context switches | {res['idle_released']['context_switches_per_s']} /s |",
             f"| `vllm:*` lines on /metrics while released | {res['vllm_metrics_while_released']} |", "",
             "| RSS MiB by kind | serving | released |", "|---|---|---|"]
    lines += [f"| {k} | {s.get(k, 0)} | {r.get(k, 0)} |" for k in kinds]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.idle_release", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--release-s", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--no-save", action="store_true")
    p = ap.parse_args(argv)
    res = measure(p)
    text = markdown(res)
    print(text)
    if not p.no_save:
        stem = B.ROOT / "bench" / "results" / f"{date.today().isoformat()}-idle-release"
        stem.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
        stem.with_suffix(".md").write_text(text)
        print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
