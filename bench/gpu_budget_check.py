"""The memory budget on a GPU host: a prepared check for operators (issue 35).

    python -m bench.gpu_budget_check              # CUDA host with `vllm` installed: a few minutes
    python -m bench.gpu_budget_check --dry-run    # any host: everything that runs without a GPU

NOT YET RUN ON A GPU: written and dry-run on a CPU-only machine (see docs/performance.md).
The full check serves two copies of the bundled model on GPU 0 (``a`` loaded at start, ``b``
on first use; ``idle_release = "sleep"``, a 1 GiB KV cache each), then

1. reads ``a``'s footprint from ``servectl status``: measured by its engine (vLLM's figure,
   "vLLM (accelerator)"), at least its KV cache, and no more than the memory in use on the
   device (``nvidia-smi``);
2. reloads with ``memory_budget = {"0" = 1.5 footprints}`` and ``b`` expecting one footprint:
   the two do not fit together;
3. asks ``b``: ``a`` is evicted by sleeping (its engine and worker stay, the device memory in
   use drops by at least half a KV cache), ``b`` loads and answers what ``a`` answered;
4. asks ``a``: ``b`` is evicted the same way and ``a`` wakes (the same processes), with the
   same answer; an asleep model holds no accelerator memory and is not counted as loaded.

``--dry-run`` runs the same code on CPU: the footprint is the group's RSS ("RSS"), the budget
is on ``cpu``, and eviction falls back to unloading (vLLM has no sleep mode there): the
evicted model is ``released`` with its processes gone. Exit status 0 when every assertion held,
1 otherwise, 2 when the host cannot run the full check.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench import run as B
from bench.gpu_check import cuda_host, run_daemon_check
from bench.gpu_sleep_check import GIB, KV_BYTES_GPU, check, device_used_bytes
from bench.idle_release import PROMPT, IdleDaemon
from servectl.config import DEFAULT_MODEL_DIR


def config_text(dry_run: bool, budget: str, b_expects: int | None = None) -> str:
    args = {"enforce_eager": True, "max_model_len": B.MAX_MODEL_LEN,
            **({"kv_cache_memory_bytes": B.KV_BYTES, "dtype": B.DTYPE} if dry_run else
               {"kv_cache_memory_bytes": KV_BYTES_GPU, "dtype": "bfloat16"})}
    label = "cpu" if dry_run else "0"
    engine = "[models.engine_args]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in args.items())
    devices = "" if dry_run else 'devices = "0"\n'
    return ("[gateway]\nhold_timeout_s = 600\n"
            f"[manager]\nfreeze_grace_s = 1.0\nwarm_standby = false\nmemory_budget = {{ {label} = {budget} }}\n"
            f'[[models]]\nname = "a"\nmodel = "{DEFAULT_MODEL_DIR}"\nidle_release = "sleep"\n{devices}{engine}'
            f'[[models]]\nname = "b"\nmodel = "{DEFAULT_MODEL_DIR}"\nidle_release = "sleep"\nautostart = false\n'
            f'{devices}' + (f"expected_memory = {b_expects}\n" if b_expects else "") + engine)


class BudgetDaemon(IdleDaemon):
    def models(self) -> dict[str, dict]:
        return {m["name"]: m for m in self.status()["models"]}

    def ask(self, model: str) -> dict:
        return self.stream({**PROMPT, "model": model})

    def members(self, model: str) -> dict[str, int | None]:
        return {c["component"]: c["pid"] for c in self.status()["children"]
                if c["model"] == model and c["kind"] != "standby"}


def run_check(d: BudgetDaemon, p: argparse.Namespace, report: dict) -> None:
    d.start()
    a = d.models()["a"]
    first = d.ask("a")
    report["text"] = first["text"]
    footprint = a["footprint_bytes"]
    report["footprint_a"] = {"bytes": footprint, "measured": a["footprint_measured"], "source": a["footprint_source"]}
    print(f"a loaded: footprint {json.dumps(report['footprint_a'])}", flush=True)
    check(a["footprint_measured"] and footprint, "a's footprint was not measured at its load")
    if p.dry_run:
        check(a["footprint_source"].startswith("RSS"), f"footprint source {a['footprint_source']!r} on CPU")
    else:
        check(a["footprint_source"] == "vLLM (accelerator)", f"footprint source {a['footprint_source']!r} on a GPU")
        check(footprint >= KV_BYTES_GPU, f"footprint {footprint / GIB:.2f} GiB below its KV cache")
        used = device_used_bytes() or 0
        report["device_used_a"] = used
        check(footprint <= used, f"footprint {footprint / GIB:.2f} GiB above the {used / GIB:.2f} GiB in use")
    # Two footprints do not fit in 1.5.
    d.config.write_text(config_text(p.dry_run, str(int(1.5 * footprint)), footprint))
    reload = d.cli("reload")
    check(reload.returncode == 0, f"reload failed: {reload.stderr}")
    pids_a = d.members("a")
    before = device_used_bytes()
    t0 = time.monotonic()
    answer = d.ask("b")
    report["evicted_to_first_token_s"] = round(answer["first_token_s"] or (time.monotonic() - t0), 2)
    check(answer["text"] == first["text"], f"b answered {answer['text']!r}, a {first['text']!r}")
    m = d.models()
    evicted_state = "released" if p.dry_run else "asleep"
    check(m["a"]["state"] == evicted_state and m["b"]["state"] == "ready",
          f"after b's request: a {m['a']['state']}, b {m['b']['state']}")
    check("model a: evicted: model b needs room (memory_budget" in d.log("manager"), "no eviction in the manager log")
    budget = d.status()["budget"]
    report["budget_after_first_eviction"] = budget
    check(budget["loaded"] == 1, f"{budget['loaded']} models counted as loaded (an asleep one holds no accelerator "
                                 "memory)")
    if p.dry_run:
        check(all(pid is None for pid in d.members("a").values()), f"a's members alive: {d.members('a')}")
    else:
        after = device_used_bytes() or 0
        report["device_used_before_after_eviction"] = [before, after]
        # b loaded meanwhile (a KV cache and more): without a's sleep the device would hold both.
        check(after <= (before or 0) + KV_BYTES_GPU // 2,
              f"{after / GIB:.2f} GiB in use after the eviction, {(before or 0) / GIB:.2f} before: a's memory "
              "was not given back")
        check(d.members("a") == pids_a, f"a's processes changed while asleep: {pids_a} -> {d.members('a')}")
    woken = d.ask("a")
    report["evicted_again_to_first_token_s"] = round(woken["first_token_s"] or 0, 2)
    check(woken["text"] == first["text"], f"a after its wake answered {woken['text']!r}")
    m = d.models()
    check(m["a"]["state"] == "ready" and m["b"]["state"] == evicted_state,
          f"after a's request: a {m['a']['state']}, b {m['b']['state']}")
    if not p.dry_run:
        check(d.members("a") == pids_a, "a was restarted, not woken")
        freed = (report["device_used_before_after_eviction"][0] or 0) - (device_used_bytes() or 0)
        report["device_freed_by_b_sleeping_gib"] = round(freed / GIB, 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_budget_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="no GPU: servectl on CPU, eviction by unloading")
    ap.add_argument("--json", type=Path, help="also write the results here")
    p = ap.parse_args(argv)
    if not p.dry_run:
        why = cuda_host()
        if why:
            print(f"gpu_budget_check: cannot run the full check here: {why}. Use --dry-run.", file=sys.stderr)
            return 2
    d = BudgetDaemon(Path(tempfile.mkdtemp(prefix="servectl-budget-check-")), config_text(p.dry_run, '"1TiB"'))
    report: dict = {"dry_run": p.dry_run, "machine": B.machine()}
    return run_daemon_check("gpu_budget_check", d, lambda d, report: run_check(d, p, report), report, p.json,
                            " (dry run: eviction unloads on CPU; no GPU figures)" if p.dry_run else "", "manager")


if __name__ == "__main__":
    sys.exit(main())
