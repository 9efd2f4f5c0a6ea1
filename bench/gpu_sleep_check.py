"""Idle release with vLLM's sleep mode on a GPU host: a prepared check for operators (issue 18).

    python -m bench.gpu_sleep_check              # CUDA host with `vllm` installed: a few minutes
    python -m bench.gpu_sleep_check --level 2    # sleep level 2 (weights discarded, reloaded on wake)
    python -m bench.gpu_sleep_check --dry-run    # any host: everything that runs without a GPU

NOT YET RUN ON A GPU: written and dry-run on a CPU-only machine (see
docs/performance.md). The full check starts servectl with the bundled model,
``idle_release = "sleep"``, ``idle_release_s = 3`` and a 1 GiB KV cache, then

1. records a greedy completion and the accelerator memory in use
   (``nvidia-smi``, and what the engine reports in ``servectl status``);
2. waits until the model is ``asleep`` (vLLM's ``LLMEngine.sleep(level)``):
   engine and worker alive, the memory in use lower by at least half the KV
   cache, ``vllm:engine_sleep_state`` on /metrics says asleep at that level;
3. sends the same request: the model wakes (``wake_up()``) and answers the
   same text; the memory is back;
4. waits until it sleeps again, SIGKILLs its worker: the model comes back
   ``released`` (unloaded), not awake, and the next request is answered.

``--dry-run`` runs the same code on CPU, where vLLM has no sleep mode
(``is_sleep_mode_available()`` is false): it asserts the fallback (the
engine's warning, ``unload`` in force, the model ``released`` with its engine
and worker gone, their RSS as the memory figure, no ``vllm:*`` gauges left),
the same greedy output after the wake, and skips step 4 (a released model has
no process to kill). Exit status 0 when every assertion held, 1 otherwise, 2
when the host cannot run the full check.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import run as B
from bench.gpu_check import CheckFailed, cuda_host, run_daemon_check
from bench.idle_release import MODEL, IdleDaemon, config_text
from prometheus_client.parser import text_string_to_metric_families

KV_BYTES_GPU = 1 << 30
GIB = float(1 << 30)


def check(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailed(message)


def device_used_bytes() -> int | None:
    """Memory in use on the first visible GPU (nvidia-smi), None without one."""
    index = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return int(float(out.splitlines()[0])) << 20
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def memory(d: IdleDaemon) -> dict:
    m = d.model()
    return {"device_used": device_used_bytes(), "engine_reported_device": m.get("device_memory_bytes"),
            "members_rss": m["memory_bytes"]}


def sleep_gauges(d: IdleDaemon) -> dict[str, float]:
    for fam in text_string_to_metric_families(d.metrics()):
        if fam.name == "vllm:engine_sleep_state":
            return {s.labels["sleep_state"]: s.value for s in fam.samples if s.labels.get("model_name") == MODEL}
    return {}


def members(d: IdleDaemon) -> dict[str, int | None]:
    return {c["component"]: c["pid"] for c in d.status()["children"] if c["model"] == MODEL and c["kind"] != "standby"}


def run_check(d: IdleDaemon, p: argparse.Namespace, report: dict) -> None:
    d.start()
    first = d.stream()
    report["text"] = first["text"]
    before = report["memory_serving"] = memory(d)
    pids = members(d)
    print(f"serving: {json.dumps(before)}", flush=True)
    state = "released" if p.dry_run else "asleep"
    t0 = time.monotonic()
    d.wait_state(state, timeout=120)
    report["released_after_s"] = round(time.monotonic() - t0, 2)
    asleep = report["memory_released"] = memory(d)
    print(f"{state}: {json.dumps(asleep)}", flush=True)
    m = d.model()
    if p.dry_run:
        check(m["release_mode"] == "unload", f"release mode in force {m['release_mode']!r}, expected the fallback")
        check("vLLM has no sleep mode on this platform" in d.log(f"engine_core:{MODEL}"),
              "the engine did not warn that sleep falls back to unload")
        check(all(pid is None for pid in members(d).values()), f"members still alive: {members(d)}")
        check(asleep["members_rss"] == 0 and before["members_rss"] > 0, "members' RSS not given back")
        check(not sleep_gauges(d) and "vllm:" not in d.metrics(), "vllm:* gauges left for a released model")
    else:
        check(m["release_mode"] == "sleep", f"release mode in force {m['release_mode']!r}")
        check(members(d) == pids, f"engine/worker changed while asleep: {pids} -> {members(d)}")
        drop = (before["device_used"] or 0) - (asleep["device_used"] or 0)
        report["device_freed_gib"] = round(drop / GIB, 3)
        check(drop >= KV_BYTES_GPU // 2, f"only {drop / GIB:.2f} GiB freed by sleep (KV cache {KV_BYTES_GPU / GIB:g} GiB)")
        gauges = report["sleep_gauges_asleep"] = sleep_gauges(d)
        want = {"awake": 0.0, "weights_offloaded": float(p.level == 1), "discard_all": float(p.level == 2)}
        check(gauges == want, f"vllm:engine_sleep_state {gauges}, expected {want}")
    woken = d.stream()
    report["wake_first_token_s"] = round(woken["first_token_s"], 2)
    check(woken["text"] == first["text"], f"after the wake: {woken['text']!r}, before: {first['text']!r}")
    awake = report["memory_awake"] = memory(d)
    print(f"woken: first token {woken['first_token_s']:.2f} s; {json.dumps(awake)}", flush=True)
    if not p.dry_run:
        check(sleep_gauges(d).get("awake") == 1.0, f"vllm:engine_sleep_state after the wake {sleep_gauges(d)}")
        check((awake["device_used"] or 0) >= (before["device_used"] or 0) - KV_BYTES_GPU // 4,
              "the memory in use did not come back after the wake")
        # A sleeping model that crashes comes back released, not awake.
        d.wait_state("asleep", timeout=120)
        worker = members(d)[f"worker:{MODEL}:0"]
        os.kill(worker, signal.SIGKILL)
        d.wait_state("released", timeout=120)
        check(all(pid is None for pid in members(d).values()), f"members alive after the crash: {members(d)}")
        again = d.stream()
        check(again["text"] == first["text"], f"after the crash and wake: {again['text']!r}")
        report["crash_while_asleep"] = "released, then served"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_sleep_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="no GPU: servectl on CPU, where sleep falls back to unload")
    ap.add_argument("--level", type=int, choices=(1, 2), default=1, help="vLLM sleep level (default 1)")
    ap.add_argument("--release-s", type=float, default=3.0)
    ap.add_argument("--json", type=Path, help="also write the results here")
    p = ap.parse_args(argv)
    if not p.dry_run:
        why = cuda_host()
        if why:
            print(f"gpu_sleep_check: cannot run the full check here: {why}. Use --dry-run.", file=sys.stderr)
            return 2
    extra = {} if p.dry_run else {"kv_cache_memory_bytes": KV_BYTES_GPU, "dtype": "bfloat16"}
    config = config_text(p.release_s, mode="sleep", extra_engine_args=extra,
                         manager=f"sleep_level = {p.level}\n").replace("autostart = false\n", "")
    d = IdleDaemon(Path(tempfile.mkdtemp(prefix="servectl-sleep-check-")), config)
    report: dict = {"dry_run": p.dry_run, "level": p.level, "machine": B.machine()}
    return run_daemon_check("gpu_sleep_check", d, lambda d, report: run_check(d, p, report), report, p.json,
                            " (dry run: sleep falls back to unload on CPU; no GPU figures)" if p.dry_run else "",
                            f"engine_core:{MODEL}")


if __name__ == "__main__":
    sys.exit(main())
