"""servectl side by side with `vllm serve`, in one run.

    python -m bench            # the full run (see docs/performance.md)
    python -m bench --smoke    # tiny counts: the harness itself, for the test suite

Each server is started in turn with identical engine settings (eager, the same
KV cache size, the same model directory), driven by vLLM's own serving
benchmark (``vllm.benchmarks.serve``: random prompts, fixed output length with
ignore_eos) and by a small in-repo client for non-streaming requests, then
stopped. Results: ``bench/results/<date>.json``, ``<date>.md`` and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from servectl.config import DEFAULT_ENGINE_ARGS, DEFAULT_MODEL_DIR  # noqa: E402

KV_BYTES = DEFAULT_ENGINE_ARGS["kv_cache_memory_bytes"]
MAX_MODEL_LEN = 512
# float32 for both servers: in bfloat16 vLLM picks its AMX attention kernel on
# AMX CPUs, and `vllm serve`'s worker dies of SIGILL there (nothing asks Linux
# for AMX tile permission first; servectl's worker does). Same setting for both.
DTYPE = "float32"


def sse_events(lines) -> Iterator[dict]:
    """The JSON events of a streamed response read line by line (http.client and urllib split
    at LF, as SSE does; never ``str.splitlines``: a JSON string may hold U+2028 unescaped)."""
    for raw in lines:
        line = raw.rstrip(b"\r\n")
        if line.startswith(b"data: {"):
            yield json.loads(line[6:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))) // 1024
    gpu = None
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"cores": os.cpu_count(), "memory_mib": mem, "cpu": cpu, "gpu": gpu, "python": platform.python_version()}


def complete(base: str, max_tokens: int = 8, timeout: float = 60) -> bool:
    body = json.dumps({"model": "default", "prompt": "def ", "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_completion(base: str, proc: subprocess.Popen | None, timeout: float) -> float | None:
    """Seconds until a completion succeeds (a benchmark may poll), or None."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            return None
        if complete(base, 4, timeout=10):
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def tree_pids(root: int) -> list[int]:
    import psutil

    try:
        p = psutil.Process(root)
        return [root] + [c.pid for c in p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_counters(pids: list[int]) -> tuple[float, int]:
    """(CPU seconds, context switches) summed over every thread of every pid."""
    hz = os.sysconf("SC_CLK_TCK")
    cpu = 0.0
    switches = 0
    for pid in pids:
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                cpu += (int(fields[11]) + int(fields[12])) / hz
                for line in (task / "status").read_text().splitlines():
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        switches += int(line.split()[1])
        except OSError:
            continue
    return cpu, switches


def rss_by_kind(pids: list[int]) -> dict[str, float]:
    import psutil

    out: dict[str, float] = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            cmd = " ".join(p.cmdline())
            name = p.name()
            rss = p.memory_info().rss / 2**20
        except psutil.Error:
            continue
        kind = ("manager" if "-m manager" in cmd else "gateway" if "api_gateway" in cmd
                else "standby" if "engine_core.standby" in cmd
                else "worker" if "engine_core.workers.worker" in cmd or "Worker" in name
                else "engine_core" if "-m engine_core" in cmd or "EngineCore" in name
                else "api_server" if "api_server" in cmd else name)
        out[kind] = round(out.get(kind, 0) + rss, 1)
    return out


class Server:
    name = ""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.launched = 0.0

    def pids(self) -> list[int]:
        raise NotImplementedError

    def kill_worker(self) -> int:
        raise NotImplementedError


class VllmServe(Server):
    name = "vllm serve"

    def __init__(self, workdir: Path, model: Path = DEFAULT_MODEL_DIR, served: str = "default",
                 flags: tuple[str, ...] = (), max_model_len: int = MAX_MODEL_LEN):
        super().__init__(workdir)
        self.model, self.served, self.flags, self.max_model_len = model, served, tuple(flags), max_model_len

    def start(self) -> None:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", self.served, "--host", "127.0.0.1", "--port", str(self.port),
               "--enforce-eager", "--kv-cache-memory-bytes", str(KV_BYTES), "--max-model-len",
               str(self.max_model_len), "--dtype", DTYPE, *self.flags]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        self.launched = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(self.workdir / "vllm.log", "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def pids(self) -> list[int]:
        return tree_pids(self.proc.pid) if self.proc else []

    def kill_worker(self) -> int:
        import psutil

        for pid in self.pids()[1:]:
            try:
                p = psutil.Process(pid)
                if "Worker" in p.name() or "Worker" in " ".join(p.cmdline()):
                    p.kill()
                    return pid
            except psutil.Error:
                continue
        # One process below the API server and one below that: the last one is the worker.
        pid = self.pids()[-1]
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Servectl(Server):
    name = "servectl"

    def __init__(self, workdir: Path, env: dict | None = None, label: str = "servectl", warm_standby: bool = True,
                 engine_args: dict | None = None, code: Path | None = None, start_env: dict | None = None,
                 sections: str = ""):
        super().__init__(workdir)
        self.sections = sections  # more of the config file ([gateway] and its keys: bench.fair_share)
        self.runtime = workdir / f"rt-{label}"
        self.extra_env = env or {}
        self.extra_engine_args = engine_args or {}  # TOML values as written (true, 8, "x")
        self.name = label
        self.warm_standby = warm_standby
        # Whose servectl serves: this tree, or a checkout of another commit (bench.rounds
        # --base-commit). Its CLI runs from there and its children import from there
        # (servectl.proc.with_package_path puts the importing tree first on their PYTHONPATH).
        self.code = code or ROOT
        # The environment of `servectl start` itself, which every process of the tree inherits
        # (the OpenTelemetry SDK's variables: bench.tracing); extra_env reaches the engine only.
        self.start_env = start_env or {}

    def cli_env(self) -> dict | None:
        if self.code == ROOT:
            return None
        env = dict(os.environ)
        env["PYTHONPATH"] = str(self.code) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def cli(self, *args) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "servectl.cli", *args, "--runtime-dir", str(self.runtime)],
                              capture_output=True, text=True, cwd=self.code, env=self.cli_env())

    def start(self) -> None:
        config = self.workdir / f"{self.name}.toml"
        env_lines = "".join(f'{k} = "{v}"\n' for k, v in self.extra_env.items())
        arg_lines = "".join(f"{k} = {v}\n" for k, v in self.extra_engine_args.items())
        config.write_text(f'{self.sections}[manager]\nwarm_standby = {str(self.warm_standby).lower()}\n'
                          f'[[models]]\nname = "default"\nmodel = "{DEFAULT_MODEL_DIR}"\n'
                          f'[models.engine_args]\nenforce_eager = true\nkv_cache_memory_bytes = {KV_BYTES}\n'
                          f'max_model_len = {MAX_MODEL_LEN}\ndtype = "{DTYPE}"\n{arg_lines}'
                          + (f"[models.env]\n{env_lines}" if env_lines else ""))
        env = self.cli_env()
        if self.start_env:
            env = {**(env or os.environ), **self.start_env}
        self.launched = time.monotonic()
        # `servectl start` returns when ready; the clock runs from launch to first completion either way.
        self.proc = subprocess.Popen([sys.executable, "-m", "servectl.cli", "start", "--config", str(config),
                                      "--port", str(self.port), "--runtime-dir", str(self.runtime)], cwd=self.code,
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def status(self) -> dict:
        return json.loads(self.cli("status", "--json").stdout)

    def pids(self) -> list[int]:
        try:
            st = self.status()
        except json.JSONDecodeError:
            return []
        return [st["manager_pid"]] + [c["pid"] for c in st["children"] if c["pid"]]

    def wait_warm(self, timeout: float = 300) -> float | None:
        """Seconds until every warm standby has imported vLLM (they are exec'd once the model serves)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            standbys = [c for c in self.status()["children"] if c["kind"] == "standby"]
            if standbys and all(c["state"] == "ready" for c in standbys):
                return time.monotonic() - t0
            time.sleep(0.2)
        return None

    def kill_worker(self) -> int:
        pid = next(c["pid"] for c in self.status()["children"] if c["kind"] == "worker")
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self) -> None:
        self.cli("stop")
        if self.proc:
            self.proc.wait(30)


def vllm_bench(base_url: str, concurrency: int, num_prompts: int, input_len: int, output_len: int,
               result_dir: Path, dataset: Path | None = None) -> dict:
    """vLLM's own serving benchmark: the primary numbers (a generator nobody here wrote). Random
    prompts of ``input_len`` tokens, or ``dataset``'s (a JSONL of ``{"prompt": ...}`` as vLLM's custom
    dataset has it, taken in order)."""
    from vllm.benchmarks import serve as vb
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    vb.add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", "default",
        "--tokenizer", str(DEFAULT_MODEL_DIR), "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--num-prompts", str(num_prompts), "--max-concurrency",
        str(concurrency), "--ignore-eos", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--seed", "0", "--ready-check-timeout-sec", "0",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", f"vb-{concurrency}.json",
    ])
    if dataset is None:
        vb.main(args)
    else:  # vLLM's custom dataset reads JSONL with pandas, which nothing else here needs: the same samples
        from vllm.benchmarks.datasets import SampleRequest

        rows = [json.loads(line)["prompt"] for line in dataset.read_text().splitlines()]

        def samples(a, tokenizer):
            return [SampleRequest(prompt=text, prompt_len=len(tokenizer(text).input_ids), expected_output_len=output_len,
                                  request_id=f"{a.request_id_prefix}{i}")
                    for i, text in enumerate((rows * (num_prompts // len(rows) + 1))[:num_prompts])]

        saved, vb.get_samples = vb.get_samples, samples
        try:
            vb.main(args)
        finally:
            vb.get_samples = saved
    data = json.loads((result_dir / f"vb-{concurrency}.json").read_text())
    return {k: data.get(k) for k in ("completed", "output_throughput", "request_throughput", "median_ttft_ms",
                                      "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "duration")}


async def non_stream_load(base: str, concurrency: int, total: int, output_len: int) -> dict:
    """The in-repo cross-check: non-streaming requests at a fixed concurrency."""
    import aiohttp

    body = {"model": "default", "prompt": "def handler(request):\n", "max_tokens": output_len,
            "ignore_eos": True}
    sem = asyncio.Semaphore(concurrency)
    ok = failed = 0

    async def one(session):
        nonlocal ok, failed
        async with sem:
            for attempt in (1, 2):
                try:
                    async with session.post(f"{base}/v1/completions", json=body) as r:
                        await r.read()
                        ok += r.status == 200
                        failed += r.status != 200
                        return
                except aiohttp.ServerDisconnectedError:
                    # A pooled keep-alive connection the server closed as we reused it:
                    # the request never reached it, so it is sent once more.
                    if attempt == 2:
                        failed += 1
                except aiohttp.ClientError:
                    failed += 1
                    return

    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(session) for _ in range(total)))
    elapsed = time.monotonic() - t0
    return {"requests": total, "ok": ok, "failed": failed, "seconds": round(elapsed, 3),
            "requests_per_s": round(ok / elapsed, 2)}


def measure_idle(server: Server, seconds: float) -> dict:
    pids = server.pids()
    cpu0, sw0 = tree_counters(pids)
    time.sleep(seconds)
    cpu1, sw1 = tree_counters(pids)
    return {"seconds": seconds, "cpu_ms_per_s": round((cpu1 - cpu0) * 1000 / seconds, 2),
            "context_switches_per_s": round((sw1 - sw0) / seconds, 1), "processes": len(pids)}


def run_server(server: Server, p: argparse.Namespace, results_dir: Path) -> dict:
    out: dict = {"server": server.name}
    server.start()
    cold = wait_completion(server.base, server.proc if isinstance(server, VllmServe) else None, 900)
    out["cold_start_s"] = round(cold, 2) if cold else None
    if cold is None:
        out["error"] = "did not start"
        server.stop()
        return out
    try:
        if isinstance(server, Servectl) and server.warm_standby:
            # Not measured against the load below: the standbys import once, right after the start.
            warm = server.wait_warm()
            out["standbys_warm_after_s"] = round(warm, 2) if warm is not None else None
        out["stream"] = {}
        for c in p.concurrency:
            out["stream"][str(c)] = vllm_bench(server.base + "", c, max(p.prompts, c * 2), p.input_len,
                                               p.output_len, results_dir)
        out["non_stream_c32"] = asyncio.run(non_stream_load(server.base, 32, p.non_stream_requests, p.output_len))
        # Idle: after the warm-up burst above, let the tree settle, then count.
        time.sleep(p.settle)
        out["idle"] = measure_idle(server, p.idle_seconds)
        out["rss_mib"] = rss_by_kind(server.pids())
        if p.kill:
            t0 = time.monotonic()
            victim = server.kill_worker()
            recovered = wait_completion(server.base, server.proc if isinstance(server, VllmServe) else None,
                                        p.recovery_timeout)
            rec = {"killed_pid": victim, "recovered_s": round(recovered, 2) if recovered else None}
            if isinstance(server, VllmServe) and server.proc.poll() is not None:
                rec["what_happened"] = (f"the whole server exited (code {server.proc.returncode}) "
                                        f"{time.monotonic() - t0:.1f}s after the worker was killed")
            elif recovered is None:
                rec["what_happened"] = f"no successful completion within {p.recovery_timeout:g}s"
            out["worker_kill"] = rec
    finally:
        server.stop()
    return out


def ratios(vllm: dict, ours: dict) -> dict:
    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    r = {}
    for c, s in ours.get("stream", {}).items():
        v = vllm.get("stream", {}).get(c, {})
        r[f"stream_tok_s_c{c}"] = ratio(s["output_throughput"], v.get("output_throughput"))
        r[f"ttft_p50_c{c}"] = ratio(s["median_ttft_ms"], v.get("median_ttft_ms"))
    r["cold_start"] = ratio(ours.get("cold_start_s"), vllm.get("cold_start_s"))
    r["recovery_vs_own_cold_start"] = ratio(ours.get("worker_kill", {}).get("recovered_s"), ours.get("cold_start_s"))
    r["non_stream_req_s_c32"] = ratio(ours.get("non_stream_c32", {}).get("requests_per_s"),
                                      vllm.get("non_stream_c32", {}).get("requests_per_s"))
    return r


def markdown(res: dict) -> str:
    v, s = res["vllm serve"], res["servectl"]
    lines = [f"# servectl vs `vllm serve` — {res['date']}", "",
             f"Machine: {res['machine']['cores']} cores, {res['machine']['memory_mib']} MiB, {res['machine']['cpu']}"
             f", GPU: {res['machine']['gpu'] or 'none'}. Model: the bundled default, eager, {DTYPE}, KV cache "
             f"{KV_BYTES // 2**20} MiB, max_model_len {MAX_MODEL_LEN}; random prompts of {res['params']['input_len']}"
             f" tokens, {res['params']['output_len']} output tokens (ignore_eos).", "",
             "| figure | vllm serve | servectl | ratio |", "|---|---|---|---|"]

    def row(name, a, b, ratio=None):
        lines.append(f"| {name} | {a} | {b} | {ratio if ratio is not None else ''} |")

    row("cold start to first completion (s)", v.get("cold_start_s"), s.get("cold_start_s"),
        res["ratios"].get("cold_start"))
    for c in res["params"]["concurrency"]:
        a, b = v.get("stream", {}).get(str(c), {}), s.get("stream", {}).get(str(c), {})
        row(f"stream output tok/s, c={c}", a.get("output_throughput") and round(a["output_throughput"], 1),
            b.get("output_throughput") and round(b["output_throughput"], 1), res["ratios"].get(f"stream_tok_s_c{c}"))
        row(f"TTFT p50 / p99 ms, c={c}", f"{a.get('median_ttft_ms', 0):.1f} / {a.get('p99_ttft_ms', 0):.1f}",
            f"{b.get('median_ttft_ms', 0):.1f} / {b.get('p99_ttft_ms', 0):.1f}", res["ratios"].get(f"ttft_p50_c{c}"))
        row(f"ITL p50 / p99 ms, c={c}", f"{a.get('median_itl_ms', 0):.2f} / {a.get('p99_itl_ms', 0):.2f}",
            f"{b.get('median_itl_ms', 0):.2f} / {b.get('p99_itl_ms', 0):.2f}")
    row("non-stream requests/s, c=32", v.get("non_stream_c32", {}).get("requests_per_s"),
        s.get("non_stream_c32", {}).get("requests_per_s"), res["ratios"].get("non_stream_req_s_c32"))
    for key, label in (("cpu_ms_per_s", "idle CPU ms/s (whole tree)"),
                       ("context_switches_per_s", "idle context switches/s (whole tree)")):
        row(label, v.get("idle", {}).get(key), s.get("idle", {}).get(key))
    row("RSS MiB by process kind", v.get("rss_mib"), s.get("rss_mib"))
    row("after SIGKILL of the worker", v.get("worker_kill", {}).get("what_happened")
        or v.get("worker_kill", {}).get("recovered_s"), f"requests succeed again after "
        f"{s.get('worker_kill', {}).get('recovered_s')} s")
    if "ceiling" in res:
        c = res["ceiling"]
        figures = ", ".join(f"c={k}: {(x.get('output_throughput') or 0):.0f} tok/s"
                            for k, x in c.get("stream", {}).items())
        lines += ["", f"Control-plane ceiling (zero-cost token source through gateway → ZeroMQ → engine loop): "
                      f"{figures}."]
        for kind, frames in c.get("profile_top_leaf_frames_percent", {}).items():
            if isinstance(frames, list):
                lines.append(f"- py-spy, {kind} at the ceiling (c=32), top leaf frames: "
                             + "; ".join(f"{name} {pct}%" for name, pct in frames[:5]))
    missed = [f"{k} {v}" for k, v in res["ratios"].items() if v is not None and (
        (k.startswith("stream_tok_s") and v < 1.0) or (k.startswith("ttft") and v > 1.0)
        or (k in ("cold_start", "recovery_vs_own_cold_start") and v > 0.5))]
    if missed:
        lines += ["", "Targets missed: " + ", ".join(missed) + ". Why, and what would close them: "
                  "docs/performance.md, \"Known gaps\" (recovery: what a warm standby still has to do, "
                  "load the model and build the engine)."]
    return "\n".join(lines) + "\n"


def plots(res: dict, stem: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    conc = res["params"]["concurrency"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("vllm serve", "servectl"):
        st = res[name].get("stream", {})
        axes[0].plot(conc, [st.get(str(c), {}).get("output_throughput") or 0 for c in conc], marker="o", label=name)
        axes[1].plot(conc, [st.get(str(c), {}).get("median_ttft_ms") or 0 for c in conc], marker="o", label=name)
    axes[0].set(title="streaming output tokens/s", xlabel="concurrency", xscale="log")
    axes[1].set(title="TTFT p50 (ms)", xlabel="concurrency", xscale="log")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    path = stem.with_name(stem.name + "-throughput.png")
    fig.savefig(path, dpi=90)
    made.append(path.name)
    fig, ax = plt.subplots(figsize=(6, 4))
    names = ["vllm serve", "servectl"]
    ax.bar(names, [res[n].get("idle", {}).get("context_switches_per_s") or 0 for n in names])
    ax.set(title="idle context switches per second (whole tree)")
    fig.tight_layout()
    path = stem.with_name(stem.name + "-idle.png")
    fig.savefig(path, dpi=90)
    made.append(path.name)
    return made


def top_frames(collapsed: Path, n: int = 8) -> list[list]:
    """py-spy's collapsed stacks → the n leaf frames with the most samples, in percent."""
    leaves: dict[str, int] = {}
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        leaf = stack.split(";")[-1]
        leaves[leaf] = leaves.get(leaf, 0) + int(count)
        total += int(count)
    ranked = sorted(leaves.items(), key=lambda kv: -kv[1])[:n]
    return [[name, round(100 * c / max(1, total), 1)] for name, c in ranked]


def profile_ceiling(server: "Servectl", work: Path, seconds: int = 8) -> dict:
    """Where the serving layer's time goes at its ceiling: py-spy on gateway and engine under load."""
    import shutil
    import threading

    if not shutil.which("py-spy"):
        return {"skipped": "py-spy is not installed (pip install py-spy)"}
    st = server.status()
    pids = {c["kind"]: c["pid"] for c in st["children"] if c["kind"] in ("gateway", "engine_core")}
    load = threading.Thread(target=vllm_bench, args=(server.base, 32, 2000, 32, 256, work), daemon=True)
    load.start()
    time.sleep(2)
    procs = {}
    for kind, pid in pids.items():
        out = work / f"profile-{kind}.txt"
        procs[kind] = (out, subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(seconds),
                                              "--rate", "200", "--format", "raw", "--nonblocking",
                                              "--output", str(out)], stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL))
    result = {}
    for kind, (out, proc) in procs.items():
        proc.wait(seconds + 60)
        result[kind] = top_frames(out) if out.exists() else "no samples"
    load.join(600)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny counts: checks the harness, not performance")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--no-ceiling", action="store_true")
    p = ap.parse_args(argv)
    if p.smoke:
        p.concurrency, p.prompts, p.input_len, p.output_len = [2], 4, 16, 8
        p.non_stream_requests, p.settle, p.idle_seconds, p.kill, p.recovery_timeout = 4, 3, 2, False, 120
    else:
        p.concurrency, p.prompts, p.input_len, p.output_len = [1, 8, 32], 64, 32, 64
        p.non_stream_requests, p.settle, p.idle_seconds, p.kill, p.recovery_timeout = 128, 8, 30, True, 300
    p.out.mkdir(parents=True, exist_ok=True)
    date = time.strftime("%Y-%m-%d")
    work = Path(tempfile.mkdtemp(prefix="servectl-bench-"))
    res: dict = {"date": date, "machine": machine(), "smoke": p.smoke,
                 "params": {k: getattr(p, k) for k in ("concurrency", "prompts", "input_len", "output_len",
                                                       "non_stream_requests", "idle_seconds")}}
    for server in (VllmServe(work), Servectl(work)):
        print(f"== {server.name}", flush=True)
        res[server.name] = run_server(server, p, work)
        print(json.dumps(res[server.name], indent=1), flush=True)
    if not p.no_ceiling and not p.smoke:
        ceiling = Servectl(work, env={"SERVECTL_ENGINE_FACTORY": "bench.zero_cost:make_engine",
                                      "PYTHONPATH": str(ROOT)}, label="servectl-zero-cost", warm_standby=False)
        ceiling.start()
        wait_completion(ceiling.base, None, 600)
        try:
            res["ceiling"] = {"stream": {str(c): vllm_bench(ceiling.base, c, 256, p.input_len, 256, work)
                                         for c in (8, 32)}}
            res["ceiling"]["profile_top_leaf_frames_percent"] = profile_ceiling(ceiling, work)
        finally:
            ceiling.stop()
    res["ratios"] = ratios(res["vllm serve"], res["servectl"])
    stem = p.out / (f"{date}-smoke" if p.smoke else date)
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(res))
    res["plots"] = plots(res, stem)
    print(markdown(res))
    return 0 if all(res[n].get("cold_start_s") for n in ("vllm serve", "servectl")) else 1


if __name__ == "__main__":
    sys.exit(main())
