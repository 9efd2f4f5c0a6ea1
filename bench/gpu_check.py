"""Async scheduling on a GPU host: a prepared check for operators (issue 13).

    python -m bench.gpu_check              # CUDA host with `vllm` installed: < 5 minutes
    python -m bench.gpu_check --dry-run    # any host: everything that runs without a GPU, < 1 minute

The full check starts servectl (the bundled model) and `vllm serve` side by
side with identical engine settings, then

1. asserts from servectl's engine log that vLLM turned async scheduling on
   through ``WorkerGroupExecutor`` ("async scheduling on (max_concurrent_batches 2"),
2. asserts that the engine's overlap counter (steps whose execute_model went
   out before the previous step's reply arrived; ``StatsReply.overlapped_steps``
   on the engine socket) grows under load,
3. asserts that steps' replies came as sampled tokens, unsigned
   (``StatsReply.token_replies``; engine_core/workers/tokens_reply.py): the GPU model
   runner's outputs, resolved on the worker's async output thread, qualify,
4. prints servectl against `vllm serve`: streaming output tokens/s and ITL
   p50, median of ``--rounds`` alternating rounds (A B, B A, A B) at each
   concurrency (default 1 and 16), driven by vLLM's own serving benchmark
   (``bench.run.vllm_bench``).

``--dry-run`` runs the same code without a GPU: argument parsing, the engine
settings of both servers (`vllm serve`'s command line is printed, not run),
servectl started on CPU, where servectl keeps vLLM's decision (async
scheduling on, as on a GPU: the same assertions hold), and one short round of
load. Exit status 0 when every
assertion held, 1 otherwise, 2 when the host cannot run the full check.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from bench import run as B
from servectl.config import DEFAULT_MODEL_DIR
from servectl.wire import engine as EP

MODEL = "default"
BUDGET_S = 290  # the whole full check, start to stop, on a GPU host
ASYNC_ON = re.compile(r"async scheduling on \(max_concurrent_batches (\d+)")


@dataclass
class Settings:
    """Engine settings both servers get (the same as bench/run.py's, per device)."""

    dry_run: bool
    dtype: str
    kv_bytes: int = B.KV_BYTES
    max_model_len: int = B.MAX_MODEL_LEN
    # Both servers are up at once on one GPU: each may claim this share at start.
    gpu_memory_utilization: float = 0.3
    engine_args: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.engine_args = {"enforce_eager": True, "kv_cache_memory_bytes": self.kv_bytes,
                            "max_model_len": self.max_model_len, "dtype": self.dtype}
        if not self.dry_run:
            self.engine_args["gpu_memory_utilization"] = self.gpu_memory_utilization

    def toml(self) -> str:
        return "".join(f"{k} = {json.dumps(v)}\n" for k, v in self.engine_args.items())

    def vllm_serve_args(self) -> list[str]:
        args = ["--enforce-eager", "--kv-cache-memory-bytes", str(self.kv_bytes), "--max-model-len",
                str(self.max_model_len), "--dtype", self.dtype]
        if not self.dry_run:
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return args


class ServectlUnderCheck(B.Servectl):
    """bench/run.py's Servectl with this check's engine settings and no standbys."""

    def __init__(self, workdir: Path, settings: Settings):
        super().__init__(workdir, label="servectl", warm_standby=False)
        self.settings = settings

    def config_text(self) -> str:
        return (f"[manager]\nwarm_standby = false\n[[models]]\nname = \"{MODEL}\"\nmodel = \"{DEFAULT_MODEL_DIR}\"\n"
                f"[models.engine_args]\n{self.settings.toml()}")

    def start(self) -> None:
        config = self.workdir / "servectl.toml"
        config.write_text(self.config_text())
        self.launched = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "servectl.cli", "start", "--config", str(config),
                                      "--port", str(self.port), "--runtime-dir", str(self.runtime)], cwd=B.ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def engine_log(self) -> str:
        path = self.runtime / "state" / "logs" / f"engine_core-{MODEL}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def engine_stats(self, timeout_s: float = 20) -> EP.StatsReply:
        """The engine's counters, asked on its own socket (what the gateway asks on /metrics)."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{self.runtime / f'engine-{MODEL}'}")
        try:
            sock.send(EP.encoder.encode(EP.Stats()))
            end = time.monotonic() + timeout_s
            while sock.poll(max(1, int((end - time.monotonic()) * 1000))):
                try:
                    msg = EP.to_gateway_decoder.decode(sock.recv())
                except msgspec.DecodeError:
                    continue
                if isinstance(msg, EP.StatsReply):
                    return msg
            raise TimeoutError("the engine did not answer Stats")
        finally:
            sock.close()


class VllmServeUnderCheck(B.VllmServe):
    def __init__(self, workdir: Path, settings: Settings):
        super().__init__(workdir)
        self.settings = settings

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(DEFAULT_MODEL_DIR),
                "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
                *self.settings.vllm_serve_args()]

    def start(self) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        self.launched = time.monotonic()
        self.proc = subprocess.Popen(self.command(), env=env, stdout=open(self.workdir / "vllm.log", "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True)


class CheckFailed(Exception):
    pass


def cuda_host() -> str | None:
    """Why this host cannot run the full check, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    if not B.machine().get("gpu"):
        return "no NVIDIA GPU found (nvidia-smi)"
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="no GPU: servectl on CPU, short load, no `vllm serve`")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; 1 with --dry-run)")
    ap.add_argument("--concurrency", default=None, help="comma-separated (default 1,16; 1,4 with --dry-run)")
    ap.add_argument("--prompts-per-client", type=int, default=None,
                    help="requests per concurrent client per measurement (default 16; 2 with --dry-run)")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=None, help="(default 64; 16 with --dry-run)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="stop starting new rounds past this")
    ap.add_argument("--json", type=Path, help="also write the results here")
    p = ap.parse_args(argv)
    p.rounds = p.rounds or (1 if p.dry_run else 3)
    p.concurrency = [int(c) for c in (p.concurrency or ("1,4" if p.dry_run else "1,16")).split(",")]
    p.prompts_per_client = p.prompts_per_client or (2 if p.dry_run else 16)
    p.output_len = p.output_len or (16 if p.dry_run else 64)
    if p.rounds < 1 or any(c < 1 for c in p.concurrency):
        ap.error("rounds and concurrency must be at least 1")
    return p


def wait_started(servers: list, deadline: float) -> None:
    for s in servers:
        started = B.wait_completion(s.base, s.proc if isinstance(s, B.VllmServe) else None,
                                    max(1.0, deadline - time.monotonic()))
        if started is None:
            if isinstance(s, ServectlUnderCheck):
                text = s.engine_log()
            else:
                log = s.workdir / "vllm.log"
                text = log.read_text(errors="replace") if log.exists() else ""
            tail = "\n".join(text.splitlines()[-20:])
            raise CheckFailed(f"{s.name} did not serve a completion in time\n{tail}")
        print(f"{s.name}: first completion {time.monotonic() - s.launched:.1f} s after launch", flush=True)


def check_async_setting(servectl: ServectlUnderCheck) -> str:
    log = servectl.engine_log()
    on = ASYNC_ON.search(log)
    if not on:
        line = next((x for x in log.splitlines() if "async scheduling" in x.lower()), "no such line")
        raise CheckFailed(f"async scheduling is not on in servectl's engine: {line}")
    if int(on.group(1)) < 2:
        raise CheckFailed(f"async scheduling on but max_concurrent_batches {on.group(1)}")
    return f"on (max_concurrent_batches {on.group(1)})"


def measure(server, concurrency: int, p: argparse.Namespace, work: Path) -> dict:
    r = B.vllm_bench(server.base, concurrency, concurrency * p.prompts_per_client, p.input_len, p.output_len, work)
    if r.get("completed") != concurrency * p.prompts_per_client:
        raise CheckFailed(f"{server.name} c={concurrency}: {r.get('completed')} of "
                          f"{concurrency * p.prompts_per_client} requests completed")
    return r


def summary(results: dict[str, dict[int, list[dict]]]) -> dict:
    out: dict = {}
    for name, by_c in results.items():
        out[name] = {}
        for c, runs in by_c.items():
            out[name][c] = {"output_tok_s": round(statistics.median(r["output_throughput"] for r in runs), 1),
                            "itl_p50_ms": round(statistics.median(r["median_itl_ms"] for r in runs), 3),
                            "ttft_p50_ms": round(statistics.median(r["median_ttft_ms"] for r in runs), 2),
                            "rounds": len(runs)}
    return out


def table(summ: dict, concurrency: list[int]) -> str:
    names = list(summ)
    lines = ["| concurrency | figure | " + " | ".join(names) + (" | servectl / vllm serve |" if len(names) > 1 else " |"),
             "|---|---|" + "---|" * len(names) + ("---|" if len(names) > 1 else "")]
    for c in concurrency:
        for key, label in (("output_tok_s", "output tok/s (median)"), ("itl_p50_ms", "ITL p50 ms (median)"),
                           ("ttft_p50_ms", "TTFT p50 ms (median)")):
            vals = [summ[n].get(c, {}).get(key) for n in names]
            row = f"| {c} | {label} | " + " | ".join(str(v) for v in vals) + " |"
            if len(names) > 1 and vals[0] and vals[1]:
                row += f" {vals[0] / vals[1]:.2f} |"
            lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = parse_args(argv)
    t0 = time.monotonic()
    deadline = t0 + p.budget_s
    if not p.dry_run:
        why = cuda_host()
        if why:
            print(f"gpu_check: cannot run the full check here: {why}. Use --dry-run.", file=sys.stderr)
            return 2
    settings = Settings(dry_run=p.dry_run, dtype=B.DTYPE if p.dry_run else "bfloat16")
    work = Path(tempfile.mkdtemp(prefix="servectl-gpu-check-"))
    servectl = ServectlUnderCheck(work, settings)
    vllm = VllmServeUnderCheck(work, settings)
    print(f"servectl engine settings: {settings.engine_args}", flush=True)
    print(f"vllm serve: {' '.join(vllm.command())}" + (" (not started: --dry-run)" if p.dry_run else ""), flush=True)
    servers: list = [servectl] if p.dry_run else [servectl, vllm]
    report: dict = {"dry_run": p.dry_run, "machine": B.machine(), "settings": settings.engine_args,
                    "rounds": p.rounds, "concurrency": p.concurrency, "ok": False}
    try:
        for s in servers:  # both start at once; each has its own port
            s.start()
        # vLLM's benchmark module imports vLLM: pay for it while the servers start.
        from vllm.benchmarks import serve as _  # noqa: F401

        wait_started(servers, deadline - (0 if p.dry_run else 90))  # the full check keeps 90 s for its rounds
        report["async_scheduling"] = check_async_setting(servectl)
        print(f"servectl: async scheduling {report['async_scheduling']}", flush=True)
        first = servectl.engine_stats()
        before = first.overlapped_steps
        results: dict[str, dict[int, list[dict]]] = {s.name: {c: [] for c in p.concurrency} for s in servers}
        for rnd in range(p.rounds):
            if rnd and time.monotonic() > deadline - 60:
                print(f"stopping after {rnd} round(s): the {p.budget_s:g} s budget is nearly spent", flush=True)
                break
            for s in (servers if rnd % 2 == 0 else servers[::-1]):
                for c in p.concurrency:
                    r = measure(s, c, p, work)
                    results[s.name][c].append(r)
                    print(f"round {rnd + 1} {s.name} c={c}: {r['output_throughput']:.1f} tok/s, "
                          f"ITL p50 {r['median_itl_ms']:.3f} ms", flush=True)
        last = servectl.engine_stats()
        after = last.overlapped_steps
        report["overlapped_steps"] = {"before": before, "after": after}
        print(f"servectl: overlapped steps {before} -> {after}", flush=True)
        # A step's reply of sampled tokens only comes unsigned (engine_core/workers/tokens_reply.py), from the
        # async output thread too: the GPU runner's outputs must qualify, or every step pays the pickle.
        report["token_replies"] = {"before": first.token_replies, "after": last.token_replies,
                                   "signed_after": last.signed_replies}
        print(f"servectl: replies as sampled tokens {first.token_replies} -> {last.token_replies} "
              f"(signed pickles: {last.signed_replies})", flush=True)
        if last.token_replies <= first.token_replies:
            raise CheckFailed("no step's reply came as sampled tokens: every one was a signed pickle")
        if after <= before:
            raise CheckFailed(f"the overlap counter did not grow under load ({before} -> {after})")
        report["summary"] = summ = summary(results)
        print(table(summ, p.concurrency), flush=True)
        report["ok"] = True
    except CheckFailed as exc:
        report["failure"] = str(exc)
        print(f"gpu_check FAILED: {exc}", file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.stop()
    return finish("gpu_check", report, t0, p.json, " (dry run: no GPU figures)" if p.dry_run else "")


def run_daemon_check(tool: str, d, check, report: dict, json_path: Path | None, note: str,
                     log_component: str) -> int:
    """Run ``check(d, report)`` against a started-by-it daemon ``d``; stop ``d`` whatever happens;
    a failed assertion is the report's failure, with the tail of ``log_component``'s log."""
    report["ok"] = False
    t0 = time.monotonic()
    try:
        check(d, report)
        report["ok"] = True
    except (CheckFailed, TimeoutError, RuntimeError, OSError) as exc:
        report["failure"] = f"{type(exc).__name__}: {exc}"
        print(f"{tool} FAILED: {report['failure']}", file=sys.stderr, flush=True)
        print("\n".join(d.log(log_component).splitlines()[-15:]), file=sys.stderr)
    finally:
        d.stop()
    return finish(tool, report, t0, json_path, note)


def finish(tool: str, report: dict, t0: float, json_path: Path | None, note: str) -> int:
    """A check's last words: its time, the JSON report if asked for, one line, the exit status."""
    report["seconds"] = round(time.monotonic() - t0, 1)
    if json_path:
        json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"{tool} {'passed' if report['ok'] else 'failed'} in {report['seconds']} s{note}", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
