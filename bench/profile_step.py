"""Where a decode step goes, at concurrency 1 (or ``--concurrency N``): py-spy over every process of both servers.

    python -m bench.profile_step                  # 2 alternating runs per server (A B A B)
    python -m bench.profile_step --concurrency 16 --tag profile-c16   # a batch's step
    python -m bench.profile_step --runs 3 --duration 20
    python -m bench.profile_step --only servectl --env SERVECTL_WORKER_SPIN_US=300   # an experiment
    python -m bench.profile_step --reanalyze bench/results/<date>-profile.json       # re-attribute saved stacks

For each server in turn (``vllm serve``, and servectl without warm standbys;
the engine settings of ``python -m bench``): start it, warm it up, drive a
steady streaming load at concurrency 1 (32-token prompts, 64 output tokens,
ignore_eos, the payload vLLM's serving benchmark sends), measure a window of
it untouched (per-thread CPU, run-queue wait and context switches from
``/proc``), then sample every process of the tree with ``py-spy record --idle
--threads --nonblocking`` (wall-clock stacks, waiting included). Each sample
goes to one phase by its frames (``RULES``: the first rule whose patterns all
occur in the stack), and a phase's share of a thread's samples times the
client's wall time per token in the window (at c=1 one engine step per token)
is its µs per step; a thread's phases add up to the step.

py-spy's default rate here is 100 Hz: on this 2-core machine 500 Hz doubled
the step time. Absolute µs move with the load other people put on the
machine; the shares within one run and the /proc counters hold better.
Results: ``bench/results/<date>-profile.{json,md}`` and the collapsed stacks
in ``<date>-profile-stacks.json.gz`` (what ``--reanalyze`` reads).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

from bench.rounds import step_totals
from bench.run import DEFAULT_MODEL_DIR, ROOT, Servectl, VllmServe, machine, wait_completion

INPUT_LEN = 32
OUTPUT_LEN = 64


# ---- the load -----------------------------------------------------------------------------------
def prompt_text(n_tokens: int = INPUT_LEN) -> str:
    """A text prompt of exactly ``n_tokens`` tokens of the bundled model (without BOS)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(DEFAULT_MODEL_DIR) / "tokenizer.json"))
    base = ("def handler(request):\n    body = json.loads(request.body)\n    for key, value in body.items():\n"
            "        if key.startswith('x-'):\n            headers[key] = str(value).strip()\n" * 4)
    ids = tok.encode(base, add_special_tokens=False).ids
    for k in range(n_tokens, n_tokens + 8):
        text = tok.decode(ids[:k])
        if len(tok.encode(text, add_special_tokens=False).ids) == n_tokens:
            return text
    return tok.decode(ids[:n_tokens])


class Load:
    """A closed loop of streaming completions at ``concurrency`` (1: one stream), in a thread; every
    token's arrival time."""

    def __init__(self, base: str, prompt: str, output_len: int = OUTPUT_LEN, concurrency: int = 1):
        self.base = base
        self.concurrency = concurrency
        self.payload = {"model": "default", "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": output_len,
                        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        self.stamps: list[tuple[float, int]] = []  # (arrival, request number) per chunk carrying tokens
        self.requests: list[dict] = []  # per request: chunks, completion_tokens, prompt_tokens
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            await asyncio.gather(*(self._client(session) for _ in range(self.concurrency)))

    async def _client(self, session) -> None:
        """One closed loop: a streamed completion after another until stopped."""
        while not self._stop.is_set():
            n = len(self.requests)
            self.requests.append({"chunks": 0, "completion_tokens": None, "prompt_tokens": None})
            try:
                async with session.post(f"{self.base}/v1/completions", json=self.payload) as r:
                    if r.status != 200:
                        self.errors.append(f"HTTP {r.status}")
                        await asyncio.sleep(0.1)
                        continue
                    async for line in r.content:
                        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                            continue
                        obj = json.loads(line[6:])
                        if obj.get("choices"):
                            self.requests[n]["chunks"] += 1
                            self.stamps.append((time.monotonic(), n))
                        if obj.get("usage"):
                            self.requests[n]["completion_tokens"] = obj["usage"].get("completion_tokens")
                            self.requests[n]["prompt_tokens"] = obj["usage"].get("prompt_tokens")
            except Exception as exc:  # noqa: BLE001 - counted, the loop goes on
                self.errors.append(repr(exc))
                await asyncio.sleep(0.1)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(150)

    def window(self, t0: float, t1: float, steps: float | None = None) -> dict:
        """Tokens received in [t0, t1): a chunk counts 1, or completion_tokens / chunks of its request when
        the server merged tokens into fewer chunks (``vllm serve`` does when its API server falls behind).
        A step is a token at c=1; above, ``steps`` (the engines' own count, from /metrics) says."""
        tokens = 0.0
        stamps = []
        for t, n in self.stamps:
            if t0 <= t < t1:
                r = self.requests[n]
                tokens += r["completion_tokens"] / r["chunks"] if r["completion_tokens"] and r["chunks"] else 1
                stamps.append(t)
        gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
        return {"seconds": round(t1 - t0, 3), "tokens": round(tokens, 1), "chunks": len(stamps),
                "requests_started": len({n for t, n in self.stamps if t0 <= t < t1}),
                "us_per_step": (round((t1 - t0) * 1e6 / steps, 1) if steps else None) if steps is not None else
                (round((t1 - t0) * 1e6 / tokens, 1) if tokens else None),
                "steps": steps if steps is not None else round(tokens, 1),
                "itl_p50_ms": round(gaps[len(gaps) // 2] * 1e3, 3) if gaps else None}

    def finished(self) -> list[dict]:
        return [r for r in self.requests if r["completion_tokens"]]


# ---- the processes ------------------------------------------------------------------------------
def vllm_processes(server: VllmServe) -> dict[str, int]:
    import psutil

    out = {}
    for pid in server.pids():
        try:
            p = psutil.Process(pid)
            title = " ".join(p.cmdline()) + " " + p.name()
        except psutil.Error:
            continue
        kind = ("worker" if "Worker" in title else "engine_core" if "EngineCore" in title
                else "api_server" if pid == server.proc.pid else None)
        if kind:
            out[kind] = pid
    return out


def servectl_processes(server: Servectl) -> dict[str, int]:
    st = server.status()
    out = {"manager": st["manager_pid"]}
    for c in st["children"]:
        if c["pid"] and c["kind"] != "standby":
            out[c["kind"] if c["kind"] not in out else f"{c['kind']}-{c['pid']}"] = c["pid"]
    return out


def thread_counters(procs: dict[str, int]) -> dict[str, dict[str, list]]:
    """Per process kind, per thread id: [name, CPU ns, run-queue wait ns, voluntary, involuntary switches]
    (/proc/<pid>/task/<tid>/schedstat and status: exact, and not perturbed by a profiler)."""
    out: dict[str, dict[str, list]] = {}
    for kind, pid in procs.items():
        threads = {}
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                cpu, wait, _ = (int(x) for x in (task / "schedstat").read_text().split())
                comm = (task / "comm").read_text().strip()
                vol = invol = 0
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("voluntary_ctxt_switches"):
                        vol = int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        invol = int(line.split()[1])
            except (OSError, ValueError):
                continue
            threads[task.name] = [comm, cpu, wait, vol, invol]
        out[kind] = threads
    return out


def counters_per_step(before: dict, after: dict, tokens: float) -> dict[str, dict]:
    """Per process: per thread and in total, CPU µs, run-queue wait µs and context switches per step."""
    out = {}
    for kind, threads in after.items():
        per_thread = {}
        total = [0.0, 0.0, 0.0, 0.0]
        for tid, (comm, cpu, wait, vol, invol) in threads.items():
            b = before.get(kind, {}).get(tid)
            if b is None:
                continue
            d = [(cpu - b[1]) / 1e3 / tokens, (wait - b[2]) / 1e3 / tokens, (vol - b[3]) / tokens,
                 (invol - b[4]) / tokens]
            total = [x + y for x, y in zip(total, d)]
            if d[0] >= 1 or d[2] >= 0.05:
                per_thread[tid] = {"name": comm, "cpu_us": round(d[0], 1), "runq_wait_us": round(d[1], 1),
                                   "voluntary": round(d[2], 2), "involuntary": round(d[3], 2)}
        out[kind] = {"cpu_us": round(total[0], 1), "runq_wait_us": round(total[1], 1),
                     "voluntary": round(total[2], 2), "involuntary": round(total[3], 2), "threads": per_thread}
    return out


def pin(pid: int, cpu: int) -> None:
    """Every thread of ``pid`` onto one CPU: what ``vllm serve`` does to its CPU worker
    (VLLM_CPU_OMP_THREADS_BIND=auto: GOMP_CPU_AFFINITY with libgomp preloaded), for an A/B."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), {cpu})
        except OSError:
            pass


def py_spy(pid: int, rate: int, duration: float, out: Path) -> subprocess.Popen:
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", str(rate), "--duration",
                             str(int(duration)), "--format", "raw", "--idle", "--nonblocking", "--threads",
                             "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


FRAME = re.compile(r".* \(.*:\d+\)$")  # "function (path.py:line)"; a thread name is not one


def read_raw(path: Path) -> dict[str, dict[str, int]]:
    """Collapsed stacks per thread id: {tid: {"root;...;leaf": samples}} (py-spy --threads --format raw)."""
    threads: dict[str, dict[str, int]] = defaultdict(dict)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack.startswith("thread (") or not count.isdigit():
            continue
        head, _, rest = stack.partition(": ")
        tid = head[len("thread ("):].rstrip(")")
        frames = rest.split(";") if rest else []
        if frames and not FRAME.match(frames[0]):
            frames = frames[1:]  # the thread's name, when py-spy could read it
        key = ";".join(frames)
        threads[tid][key] = threads[tid].get(key, 0) + int(count)
    return threads


# ---- attribution --------------------------------------------------------------------------------
# (key, label), in the order of a step's path. "idle" and "wait_worker" are waiting, not work.
PHASES = [
    ("gateway", "gateway / API server: HTTP request in, validation, tokenising there, submit (per request)"),
    ("intake", "engine: request intake (tokenise, add_request; per request)"),
    ("schedule", "engine scheduling: schedule()"),
    ("serialize", "serialization of the step's call and reply (pickle, HMAC), both ends"),
    ("hop_worker", "hop to the worker and back: socket / shm-ring calls, both ends"),
    ("wait_worker", "engine waits for the worker's reply"),
    ("model", "model execution: execute_model + sample_tokens (worker)"),
    ("update", "engine scheduling: update_from_output()"),
    ("output", "output processing: detokenise, stop checks (OutputProcessor.process_outputs)"),
    ("hop_gateway", "hop to the gateway: build deltas/outputs, encode, send, receive, decode"),
    ("sse", "SSE write: per-token response path, chunk JSON, HTTP write"),
    ("stats", "stats, metrics, logging"),
    ("loop", "step loop / event loop bookkeeping, other"),
    ("idle", "idle: waiting for the next call, request or event (a spin counts here)"),
    ("unknown", "no stack: py-spy read an empty one (--nonblocking, a stack changing under it)"),
]
LABELS = dict(PHASES)
WAITING = ("idle", "wait_worker", "unknown")

# First match wins; every pattern of a rule must occur in the stack ("root;...;leaf" of
# "function (package/path.py:line)" frames). Ordered from the most specific.
RULES: list[tuple[str, tuple[str, ...]]] = [
    # -- stats and logging, anywhere
    ("stats", ("StatLoggerManager.record",)), ("stats", ("make_stats",)), ("stats", ("prometheus_client/",)),
    ("stats", ("api_gateway/metrics.py",)), ("stats", ("Generator.observe",)), ("stats", ("logging/__init__.py",)),
    # -- worker (servectl): engine_core/workers/worker.py
    ("idle", ("serve (engine_core/workers/worker.py", "Poller.poll")),
    ("serialize", ("engine_core/workers/worker.py", "Signer.")),
    ("serialize", ("Replies._frames",)),
    ("hop_worker", ("Replies.send",)), ("hop_worker", ("Replies.forward",)),
    ("model", ("_handle (engine_core/workers/worker.py",)),
    ("hop_worker", ("serve (engine_core/workers/worker.py",)),
    # -- worker (vllm serve): multiproc_executor WorkerProc
    ("idle", ("worker_busy_loop", "acquire_read")),
    ("hop_worker", ("worker_busy_loop", "MessageQueue.dequeue", "flush_releases")),
    ("serialize", ("worker_busy_loop", "MessageQueue.dequeue")),
    ("hop_worker", ("enqueue_output", "acquire_write")), ("hop_worker", ("enqueue_output", "SpinCondition.notify")),
    ("serialize", ("enqueue_output",)),
    ("model", ("worker_busy_loop", "_execute_worker_rpc")),
    ("hop_worker", ("worker_busy_loop",)),
    # -- engine -> worker hop (servectl: WorkerGroup; vllm serve: MultiprocExecutor)
    ("wait_worker", ("WorkerGroup.wait_once", "Poller.poll")),
    ("serialize", ("WorkerGroup.", "Signer.")),
    ("hop_worker", ("WorkerGroup.",)),
    ("wait_worker", ("get_response", "acquire_read")),
    ("serialize", ("get_response", "MessageQueue.dequeue")),
    ("hop_worker", ("get_response",)), ("hop_worker", ("FutureWrapper.",)),
    ("hop_worker", ("collective_rpc", "acquire_write")), ("hop_worker", ("collective_rpc", "SpinCondition.notify")),
    ("serialize", ("collective_rpc", "MessageQueue.enqueue")),
    ("hop_worker", ("collective_rpc",)),
    ("hop_worker", ("MessageQueue.acquire_write",)), ("hop_worker", ("SpinCondition.notify",)),
    # -- engine scheduling
    ("schedule", ("Scheduler.schedule",)), ("schedule", ("get_grammar_bitmask",)),
    ("update", ("Scheduler.update_from_output",)),
    # -- output processing (servectl: in the engine's step; vllm serve: the API server's output handler)
    ("output", ("OutputProcessor.process_outputs",)),
    # -- request intake
    ("intake", ("EngineServer._drain_frontend",)), ("intake", ("_process_input_queue", "add_request")),
    ("intake", ("_process_input_queue", "preprocess_add_request")),
    ("idle", ("_process_input_queue",)),
    ("idle", ("process_input_sockets", "poll")), ("intake", ("process_input_sockets",)),
    # -- the hop to the gateway, engine side
    ("idle", ("process_output_sockets", "Queue.get")), ("idle", ("process_output_sockets", "Condition.wait")),
    ("hop_gateway", ("process_output_sockets",)),
    ("hop_gateway", ("_process_engine_step", "put_nowait")),
    ("idle", ("EngineServer.run", "Poller.poll")),
    ("hop_gateway", ("EngineServer._step", "EngineServer._send")),
    ("loop", ("EngineServer._step", "LLMEngine.step")),
    ("hop_gateway", ("EngineServer._step",)),
    ("loop", ("EngineServer.run",)), ("loop", ("run_busy_loop",)), ("loop", ("EngineCoreProc.",)),
    # -- gateway / API server: request in
    ("gateway", ("EngineLink.submit",)),
    ("gateway", ("AsyncLLM.add_request",)), ("gateway", ("InputProcessor",)), ("gateway", ("renderer",)),
    ("gateway", ("_preprocess",)), ("gateway", ("tokeniz",)),
    # -- the hop to the gateway, receiving side
    ("hop_gateway", ("process_outputs_socket",)), ("hop_gateway", ("get_output_async",)),
    ("hop_gateway", ("output_handler",)),
    ("hop_gateway", ("EngineLink.",)), ("hop_gateway", ("zmq/_future.py",)), ("hop_gateway", ("zmq/asyncio.py",)),
    # -- SSE write and the per-token response path
    ("sse", ("completion_stream_generator",)), ("sse", ("StreamingResponse",)), ("sse", ("Generator.stream",)),
    ("sse", ("Generator._events_once",)), ("sse", ("Generator.events",)), ("sse", ("ResponseAccumulator",)),
    ("sse", ("aiohttp/http_writer.py",)), ("sse", ("uvicorn/protocols/http",)),
    # -- gateway / API server: the rest of a request's handling
    ("gateway", ("Gateway.",)), ("gateway", ("aiohttp/web_",)), ("gateway", ("starlette/",)),
    ("gateway", ("fastapi/",)), ("gateway", ("create_completion",)), ("gateway", ("vllm/entrypoints/openai/",)),
    # -- stacks py-spy read torn (--nonblocking) without their root: model code is the worker's
    ("model", ("vllm/model_executor/",)), ("model", ("vllm/v1/worker/",)), ("model", ("vllm/_custom_ops.py",)),
    ("model", ("torch/nn/",)), ("model", ("vllm/v1/sample/",)), ("model", ("vllm/v1/attention/",)),
    # -- helper threads waiting (monitors, pools): by the leaf, see classify()
]
IDLE_LEAVES = ("Condition.wait (threading.py", "Event.wait (threading.py", "_PollLikeSelector.select (selectors.py",
               "Poller.poll (zmq/", "_worker (concurrent/futures/thread.py", "Connection._recv (multiprocessing/",
               "sched_yield (", "select (", "Queue.get (queue.py")


def is_loop_leaf(frames: list[str]) -> bool:
    """uvloop/asyncio's own frame at the leaf: the loop waits in epoll (or runs C-level callbacks)."""
    leaf = frames[-1] if frames else ""
    return leaf.startswith(("Runner.run (asyncio/runners.py", "run (uvloop/", "BaseEventLoop.run_forever",
                            "BaseEventLoop._run_once", "run_until_complete"))


def classify(stack: str) -> str:
    frames = stack.split(";") if stack else []
    if not frames:
        return "unknown"
    if is_loop_leaf(frames):
        return "idle"
    for phase, patterns in RULES:
        if all(p in stack for p in patterns):
            return phase
    if frames and frames[-1].startswith(IDLE_LEAVES):
        return "idle"
    return "loop"


def attribute(threads: dict[str, dict[str, int]]) -> dict[str, dict]:
    """Per thread: total samples and samples per phase (plus the top unclassified 'loop' stacks)."""
    out = {}
    for tid, stacks in threads.items():
        phases: Counter = Counter()
        other: Counter = Counter()
        for stack, n in stacks.items():
            phase = classify(stack)
            phases[phase] += n
            if phase == "loop":
                other[";".join(stack.split(";")[-3:])] += n
        out[tid] = {"samples": sum(phases.values()), "phases": dict(phases),
                    "top_other": other.most_common(5), "root": thread_root(stacks)}
    return out


def thread_root(stacks: dict[str, int]) -> str:
    """What the thread runs: the deepest frame that its most common stacks share (a name for the table)."""
    best = max(stacks.items(), key=lambda kv: kv[1])[0].split(";") if stacks else []
    for f in best:
        name = f.split(" (")[0]
        if name not in ("<module>", "_run_code", "_run_module_as_main", "main", "Thread._bootstrap",
                        "Thread._bootstrap_inner", "Thread.run", "BaseProcess._bootstrap", "BaseProcess.run",
                        "_main", "spawn_main", "run", "Runner.run", "asyncio.run", "uvloop.run",
                        "run_engine_core", "WorkerProc.worker_main", "worker_main", "run_server", "run_server_worker",
                        "Server.serve", "Server._serve", "Server.main_loop", "Server.on_tick", "Server.run",
                        "Command.__call__", "cmd", "_run_module", "wrapper", "uvloop_run"):
            return name
    return best[-1].split(" (")[0] if best else "?"


def per_step(attr: dict[str, dict], us_per_step: float) -> dict[str, dict]:
    """µs per step per phase, per thread: share of the thread's samples × the wall time of a step."""
    out = {}
    for tid, a in attr.items():
        n = a["samples"]
        if not n:
            continue
        out[tid] = {"root": a["root"], "samples": n,
                    "us": {ph: round(c / n * us_per_step, 1) for ph, c in a["phases"].items()}}
    return out


# ---- one profile of one server ------------------------------------------------------------------
def strip_lines(stacks: dict[str, int]) -> dict[str, int]:
    """The same stacks without line numbers (what the rules read; a fraction of the size)."""
    out: dict[str, int] = {}
    for stack, n in stacks.items():
        key = ";".join(re.sub(r":\d+\)$", ")", f) for f in stack.split(";"))
        out[key] = out.get(key, 0) + n
    return out


def profile_server(name: str, p: argparse.Namespace, work: Path, prompt: str) -> dict:
    server = (VllmServe(work) if name == "vllm serve"
              else Servectl(work, env=dict(e.split("=", 1) for e in p.env), label=name.replace(" ", "-"),
                            warm_standby=False))
    out: dict = {"server": name}
    server.start()
    load = None
    try:
        started = wait_completion(server.base, server.proc if isinstance(server, VllmServe) else None, 900)
        if started is None:
            return {**out, "error": "did not start"}
        out["start_s"] = round(started, 1)
        procs = vllm_processes(server) if isinstance(server, VllmServe) else servectl_processes(server)
        out["pids"] = procs
        if p.pin_worker is not None and isinstance(server, Servectl) and "worker" in procs:
            pin(procs["worker"], p.pin_worker)
            out["pinned_worker_to_cpu"] = p.pin_worker
        load = Load(server.base, prompt, concurrency=p.concurrency)
        load.start()
        time.sleep(p.warmup)  # warm-up, not counted

        def steps_since(before):  # the engines' step count (vLLM's histogram) above c=1; at c=1 a token
            after = step_totals(server.base) if p.concurrency > 1 else None
            return after[1] - before[1] if after and before else None

        s0 = step_totals(server.base) if p.concurrency > 1 else None
        c0 = thread_counters(procs)
        b0 = time.monotonic()
        time.sleep(p.baseline)
        b1 = time.monotonic()
        c1 = thread_counters(procs)
        out["baseline"] = load.window(b0, b1, steps_since(s0))  # the same load, no profiler attached
        out["baseline"]["counters"] = counters_per_step(c0, c1, out["baseline"]["steps"] or 1)
        s0 = step_totals(server.base) if p.concurrency > 1 else None
        raw_dir = work / f"raw-{name.replace(' ', '-')}-{time.monotonic_ns()}"
        raw_dir.mkdir()
        c0 = thread_counters(procs)
        t0 = time.monotonic()
        spies = {kind: py_spy(pid, p.rate, p.duration, raw_dir / f"{kind}.raw") for kind, pid in procs.items()}
        time.sleep(p.duration)
        c1 = thread_counters(procs)
        logs = {kind: sp.communicate(timeout=120)[0] for kind, sp in spies.items()}
        out["window"] = load.window(t0, t0 + p.duration, steps_since(s0))
        out["window"]["counters"] = counters_per_step(c0, c1, out["window"]["steps"] or 1)
        load.stop()
        done = load.finished()
        out["requests"] = {"finished": len(done), "errors": len(load.errors), "first_errors": load.errors[:3],
                           "chunks_per_request": statistics.median([r["chunks"] for r in done] or [0]),
                           "completion_tokens": statistics.median([r["completion_tokens"] for r in done] or [0]),
                           "prompt_tokens": done[-1]["prompt_tokens"] if done else None}
        out["processes"] = {}
        for kind, pid in procs.items():
            path = raw_dir / f"{kind}.raw"
            summary = next((ln.strip() for ln in logs[kind].splitlines() if "Samples:" in ln), "")
            behind = [ln.strip() for ln in logs[kind].splitlines() if "behind in sampling" in ln]
            if not path.exists():
                out["processes"][kind] = {"pid": pid, "error": logs[kind][-500:]}
                continue
            threads = {tid: strip_lines(st) for tid, st in read_raw(path).items()}
            out["processes"][kind] = {"pid": pid, "py_spy": summary, "py_spy_behind": behind[-1:] ,
                                      "stacks": threads}
        shutil.rmtree(raw_dir, ignore_errors=True)
    finally:
        if load is not None:
            load.stop()
        server.stop()
    return out


# ---- tables ---------------------------------------------------------------------------------------
def analyse(run: dict) -> dict:
    """µs per step per phase for every thread of every process of one profiled server."""
    us = run["window"]["us_per_step"]
    procs = {}
    for kind, proc in run.get("processes", {}).items():
        if "stacks" not in proc:
            continue
        attr = attribute(proc["stacks"])
        threads = per_step(attr, us)
        for tid in threads:
            threads[tid]["top_other"] = attr[tid]["top_other"]
        procs[kind] = threads
    return {"us_per_step": us, "processes": procs}


def busy(thread: dict) -> float:
    return sum(v for k, v in thread["us"].items() if k not in WAITING)


def main_thread(threads: dict[str, dict]) -> dict | None:
    return max(threads.values(), key=busy, default=None)


PROCESS_ORDER = ("api_server", "gateway", "engine_core", "worker", "manager")
WORKER = "worker"


def step_summary(server: str, an: dict) -> dict:
    """Per phase: µs/step summed over every thread (waiting excluded), and the derived hop latency."""
    phases: Counter = Counter()
    where: dict[str, Counter] = defaultdict(Counter)
    for kind, threads in an["processes"].items():
        for t in threads.values():
            for ph, v in t["us"].items():
                if ph in WAITING:
                    continue
                phases[ph] += v
                where[ph][kind] += v
    engine = main_thread(an["processes"].get("engine_core", {})) or {"us": {}}
    worker = main_thread(an["processes"].get(WORKER, {})) or {"us": {}}
    # The worker's own socket / ring calls are left out of its compute: a send that wakes the
    # engine is where the worker loses the CPU, so that time overlaps the engine's, after its wait.
    worker_compute = sum(worker["us"].get(ph, 0.0) for ph in ("model", "serialize", "loop", "stats"))
    wait = engine["us"].get("wait_worker", 0.0)
    return {"us_per_step": an["us_per_step"], "phases": {k: round(v, 1) for k, v in phases.items()},
            "where": {ph: {k: round(v, 1) for k, v in c.items() if v >= 0.5} for ph, c in where.items()},
            "engine_main": {k: round(v, 1) for k, v in engine["us"].items()},
            "worker_main": {k: round(v, 1) for k, v in worker["us"].items()},
            "worker_compute": round(worker_compute, 1), "engine_waits_for_worker": round(wait, 1),
            "hop_latency": round(wait - worker_compute, 1)}


def fmt(vals: list[float | None]) -> str:
    """Three runs or more: median [min – max]; fewer: every run's value."""
    vals = [v for v in vals if v is not None]
    if not vals:
        return "–"
    if len(vals) >= 3:
        return f"{statistics.median(vals):,.0f} [{min(vals):,.0f} – {max(vals):,.0f}]"
    return " / ".join(f"{v:,.0f}" for v in vals)


def fmt1(vals: list[float | None]) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "–"
    if len(vals) >= 3:
        return f"{statistics.median(vals):.1f} [{min(vals):.1f} – {max(vals):.1f}]"
    return " / ".join(f"{v:.1f}" for v in vals)


def markdown(res: dict) -> str:
    servers = [s for s in ("vllm serve", "servectl") if s in res["summary"]]
    runs = {s: res["summary"][s] for s in servers}
    c = res["params"].get("concurrency", 1)
    per = ("the client's wall time per token in the window" if c == 1 else
           "the window's wall time per engine step (the engines' own step count, vLLM's "
           "`vllm:iteration_tokens_total` histogram)")
    lines = [f"# Where a decode step goes, c={c} — {res['date']}", "",
             f"Machine: {res['machine']['cores']} cores, {res['machine']['cpu']}; load average at the start "
             f"{res['loadavg_start']}. Streaming completions at concurrency {c}, {INPUT_LEN}-token prompts, "
             f"{OUTPUT_LEN} output tokens (ignore_eos); py-spy --rate {res['params']['rate']} --idle --threads "
             f"--nonblocking on every process for {res['params']['duration']} s. µs per step = a phase's share of "
             f"a thread's samples × {per} (wall clock: a phase includes "
             f"the time its thread was preempted in it). Servers alternate, each freshly started; a cell is the "
             f"median [min – max] of the runs (every run's value when fewer than 3).", ""]
    hdr = "| | " + " | ".join(servers) + " |"
    sep = "|---|" + "---|" * len(servers)
    lines += ["## Wall time per step", "", hdr, sep]

    def row(label, get):
        lines.append(f"| {label} | " + " | ".join(fmt([get(s, r) for r in runs[s]]) for s in servers) + " |")

    row("µs per step, profiled (window / steps)", lambda s, r: r["us_per_step"])
    row("µs per step, same load without the profiler", lambda s, r: r.get("baseline_us_per_step"))
    lines += ["", "## CPU per step without the profiler (/proc schedstat, the baseline window)", "",
              "CPU µs and run-queue wait µs (runnable, no core free) per step, and context switches per step "
              "(voluntary / involuntary), per process; every thread counted, native ones (ZeroMQ I/O, OpenMP, "
              "gloo) too: in both servers' workers, gloo's 13 TCP-loop threads wake ~0.7 times per step each. "
              "Per-thread figures are in the JSON (`baseline.counters`).", "", hdr, sep]
    for kind in PROCESS_ORDER:
        row(f"{kind}: CPU µs", lambda s, r, k=kind: r["baseline_counters"].get(k, {}).get("cpu_us"))
        row(f"{kind}: run-queue wait µs", lambda s, r, k=kind: r["baseline_counters"].get(k, {}).get("runq_wait_us"))
        for f, what in (("voluntary", "voluntary switches"), ("involuntary", "involuntary switches")):
            lines.append(f"| {kind}: {what} | " + " | ".join(fmt1([r["baseline_counters"].get(kind, {}).get(f)
                                                                    for r in runs[s]]) for s in servers) + " |")
    row("whole tree: CPU µs", lambda s, r: sum(c["cpu_us"] for c in r["baseline_counters"].values()))
    row("whole tree: run-queue wait µs", lambda s, r: sum(c["runq_wait_us"] for c in r["baseline_counters"].values()))
    lines += ["", "## Per phase, µs per step (work summed over every process; waiting excluded)", "", hdr, sep]
    for ph, label in PHASES:
        if ph in WAITING:
            continue
        row(label, lambda s, r, ph=ph: r["phases"].get(ph, 0.0))
    row("**sum of work**", lambda s, r: sum(r["phases"].values()))
    row("engine waits for the worker (engine main thread)", lambda s, r: r["engine_waits_for_worker"])
    row("worker computes (unpickle + model + pickle, its main thread)", lambda s, r: r["worker_compute"])
    row("the engine's wait that is not the worker computing (transit, wake-ups, the worker's socket calls)",
        lambda s, r: r["hop_latency"])
    lines += ["", "## The critical path: the engine's main thread (its phases sum to the step)", "", hdr, sep]
    for ph, label in PHASES:
        row(label, lambda s, r, ph=ph: r["engine_main"].get(ph, 0.0))
    row("**sum (= the step, by construction)**", lambda s, r: sum(r["engine_main"].values()))
    lines += ["", "## The worker's main thread", "", hdr, sep]
    for ph in ("serialize", "hop_worker", "model", "loop", "idle", "unknown"):
        row(LABELS[ph], lambda s, r, ph=ph: r["worker_main"].get(ph, 0.0))
    lines += ["", "## Per process (first run), µs per step", ""]
    for s in servers:
        an = res["analysis"][s][0]
        kinds = list(an["processes"])
        lines += [f"### {s}", "", "| phase | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
        for ph, label in PHASES:
            cells = []
            for k in kinds:
                v = sum(t["us"].get(ph, 0.0) for t in an["processes"][k].values()
                        if ph not in WAITING or t is main_thread(an["processes"][k]))
                cells.append(f"{v:,.0f}" if v >= 0.5 else "")
            lines.append(f"| {ph} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.append("Threads (samples; the busiest per process is its main thread): " + "; ".join(
            f"{k}/{t['root']} {t['samples']}" for k in kinds for t in an["processes"][k].values()
            if t["samples"] > 20))
        lines.append("")
    return "\n".join(lines) + "\n"


def summarise(res: dict) -> None:
    res["analysis"] = {s: [analyse(r) for r in res["raw"][s] if "window" in r] for s in res["raw"]}
    res["summary"] = {}
    for s, analyses in res["analysis"].items():
        rows = []
        good = [r for r in res["raw"][s] if "window" in r]
        for r, an in zip(good, analyses):
            summ = step_summary(s, an)
            summ["baseline_us_per_step"] = r["baseline"]["us_per_step"]
            summ["baseline_counters"] = r["baseline"].get("counters", {})
            summ["window_counters"] = r["window"].get("counters", {})
            rows.append(summ)
        res["summary"][s] = rows


def stacks_path(result: Path) -> Path:
    return result.with_name(result.stem + "-stacks.json.gz")


def detach_stacks(res: dict, result: Path) -> None:
    """The collapsed stacks go to ``<stem>-stacks.json.gz`` (for --reanalyze), not into the result."""
    stacks = {s: [{k: proc.pop("stacks") for k, proc in r.get("processes", {}).items() if "stacks" in proc}
                  for r in runs] for s, runs in res["raw"].items()}
    with gzip.open(stacks_path(result), "wt") as f:
        json.dump(stacks, f)


def attach_stacks(res: dict, result: Path) -> None:
    if not stacks_path(result).exists():
        return  # kept inline
    with gzip.open(stacks_path(result), "rt") as f:
        stacks = json.load(f)
    for s, runs in res["raw"].items():
        for r, st in zip(runs, stacks[s]):
            for k, threads in st.items():
                r["processes"][k]["stacks"] = threads


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2, help="alternating runs per server (A B A B ...)")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="streams at once; above 1 a step is the engines' own count (their /metrics)")
    ap.add_argument("--duration", type=int, default=20, help="seconds of py-spy sampling per run")
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second (500 nearly doubled the step time here)")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of load before anything is counted")
    ap.add_argument("--baseline", type=float, default=10.0, help="seconds of load measured without the profiler")
    ap.add_argument("--only", choices=["vllm serve", "servectl"], help="profile one server")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="servectl model env (experiments)")
    ap.add_argument("--pin-worker", type=int, metavar="CPU",
                    help="servectl experiment: pin every thread of its worker to this CPU, as vllm serve's is")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--tag", default="profile")
    ap.add_argument("--reanalyze", type=Path, help="re-attribute the stacks of a saved result; starts nothing")
    p = ap.parse_args(argv)

    if p.reanalyze:
        res = json.loads(p.reanalyze.read_text())
        attach_stacks(res, p.reanalyze)
        summarise(res)
        detach_stacks(res, p.reanalyze)
        p.reanalyze.write_text(json.dumps(res, indent=1) + "\n")
        md = markdown(res)
        p.reanalyze.with_suffix(".md").write_text(md)
        print(md)
        return 0
    # A stop (SIGTERM) unwinds like an exception, so the server being profiled is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if shutil.which("py-spy") is None:
        print("py-spy is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    servers = [p.only] if p.only else ["vllm serve", "servectl"]
    work = Path(tempfile.mkdtemp(prefix="servectl-profile-"))
    prompt = prompt_text()
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
                 "loadavg_start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
                 "params": {"runs": p.runs, "duration": p.duration, "rate": p.rate, "warmup": p.warmup,
                            "baseline": p.baseline, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
                            "env": p.env, "pin_worker": p.pin_worker, "warm_standby": False,
                            "concurrency": p.concurrency},
                 "raw": {s: [] for s in servers}}
    for i in range(p.runs):
        for s in servers:
            print(f"== run {i + 1}/{p.runs}: {s} (load average {os.getloadavg()[0]:.1f})", flush=True)
            r = profile_server(s, p, work, prompt)
            r["loadavg"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
            res["raw"][s].append(r)
            print(json.dumps({k: r.get(k) for k in ("start_s", "baseline", "window", "requests", "error")}),
                  flush=True)
    summarise(res)
    p.out.mkdir(parents=True, exist_ok=True)
    stem = p.out / f"{time.strftime('%Y-%m-%d')}-{p.tag}"
    detach_stacks(res, stem.with_suffix(".json"))
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    stem.with_suffix(".md").write_text(md)
    print(md)
    return 0 if all(len(res["summary"][s]) == p.runs for s in servers) else 1


if __name__ == "__main__":
    sys.exit(main())
