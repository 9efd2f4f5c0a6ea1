"""Each worker's OpenMP threads, and the CPUs they are bound to when the operator asks.

The thread count is vLLM's: on a CPU host one core per rank is left to the
scheduling process and each worker gets an equal share of the rest (on 2
cores: one thread). On a GPU host vLLM sizes the pool for loading (cores /
ranks) and marks it as its own, so the worker drops to one thread once it
serves; nothing is bound there.

Binding follows a model's ``VLLM_CPU_OMP_THREADS_BIND`` as vLLM's executor
(``vllm.utils.ompmultiprocessing.OMPProcessManager``) follows it: "auto"
gives rank N the CPUs of the N-th NUMA node, one logical CPU per physical
core on x86, takes one CPU per rank back for the scheduling process (the
last ranks' last CPUs first) and binds each worker's threads to the rest
(``OMP_PLACES`` and ``OMP_PROC_BIND``, or libgomp's / Intel OpenMP's own
variables when one is preloaded); "0-3|4-7" is each rank's list. Where vLLM
refuses (more ranks than NUMA nodes) the CPUs are split into equal runs, one
per rank. Each rank's standby gets its rank's environment: OpenMP reads it
when torch loads, long before the standby knows its rank.

Unlike `vllm serve` (whose default is "auto"), servectl's default is
"nobind": in alternating rounds on a 2-core machine, binding the worker to
core 0 as `vllm serve` does gained nothing (c=1 0.94–1.03×, c=16 0.82–1.12×
of unbound; bench/results/2026-11-30-bind-ab.md), and a bound worker cannot move off a core
another process keeps busy. A model's own ``OMP_NUM_THREADS`` wins over all
of it.
"""

from __future__ import annotations

import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("manager")

SYS_CPU = Path("/sys/devices/system/cpu")
SYS_NODE = Path("/sys/devices/system/node")


@dataclass(frozen=True)
class Cpu:
    id: int
    node: int
    core: tuple[int, int]  # (package, core id): logical CPUs of one physical core share it


def parse_id_list(text: str) -> list[int]:
    """"0-3,8" → [0, 1, 2, 3, 8] (the kernel's and vLLM's list syntax)."""
    out: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def host_cpus(allowed: set[int] | None = None) -> list[Cpu]:
    """The CPUs this process may run on, with their NUMA node and physical core (from /sys;
    one node and one core per CPU where /sys does not say)."""
    allowed = allowed if allowed is not None else os.sched_getaffinity(0)
    node_of: dict[int, int] = {}
    for node_dir in sorted(SYS_NODE.glob("node[0-9]*")):
        try:
            for cpu in parse_id_list((node_dir / "cpulist").read_text().strip()):
                node_of[cpu] = int(node_dir.name[4:])
        except (OSError, ValueError):
            continue
    cpus = []
    for cpu in sorted(allowed):
        topo = SYS_CPU / f"cpu{cpu}" / "topology"
        try:
            core = (int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text()))
        except (OSError, ValueError):
            core = (0, cpu)
        cpus.append(Cpu(cpu, node_of.get(cpu, 0), core))
    return cpus


def auto_cpu_lists(cpus: list[Cpu], ranks: int, one_per_core: bool = True) -> list[list[int]]:
    """vLLM's ``auto`` binding: each rank's CPU ids (see the module's docstring)."""
    nodes = sorted({c.node for c in cpus})
    if len(nodes) >= ranks:
        per_rank = [[c for c in cpus if c.node == nodes[r]] for r in range(ranks)]
    else:  # vLLM refuses; split the CPUs into equal runs instead
        share = max(1, len(cpus) // ranks)
        per_rank = [cpus[r * share:(r + 1) * share] or cpus[-1:] for r in range(ranks)]
    lists = []
    for rank_cpus in per_rank:
        if one_per_core:  # x86: the highest-numbered logical CPU of each physical core
            last: dict[tuple[int, int], Cpu] = {}
            for c in sorted(rank_cpus, key=lambda c: c.id):
                last[c.core] = c
            rank_cpus = list(last.values())
        lists.append(sorted(c.id for c in rank_cpus))
    reserve = ranks  # one CPU per rank for the engine (vLLM: local_world_size on x86 and Arm)
    if sum(len(x) for x in lists) <= reserve:
        return lists
    per = [reserve // ranks] * ranks
    for r in range(ranks - 1, ranks - 1 - reserve % ranks, -1):
        per[r] += 1
    return [x[:-n] if n and len(x) > n else x for x, n in zip(lists, per)]


def binding_env(cpu_list: list[int], ld_preload: str) -> dict[str, str]:
    """What binds one worker's OpenMP threads to ``cpu_list``, for the runtime that will load."""
    ids = [str(i) for i in cpu_list]
    env = {"OMP_NUM_THREADS": str(len(ids))}
    if "libiomp" in ld_preload or "libomp" in ld_preload:
        env.update(KMP_AFFINITY=f"granularity=fine,explicit,proclist=[{','.join(ids)}]", KMP_BLOCKTIME="5",
                   KMP_TPAUSE="0")
    elif "libgomp" in ld_preload:
        env["GOMP_CPU_AFFINITY"] = " ".join(ids)
    else:
        env.update(OMP_PLACES="{" + ",".join(ids) + "}", OMP_PROC_BIND="true")
    return env


def worker_envs(ranks: int, accelerator: bool, env: dict[str, str], cpus: list[Cpu] | None = None,
                machine: str | None = None) -> list[dict[str, str]]:
    """Each rank's OpenMP settings, to add to its environment (``env``: the model's, which wins)."""
    if "OMP_NUM_THREADS" in env:
        return [{} for _ in range(ranks)]  # the operator's word
    cpus = cpus if cpus is not None else host_cpus()
    if accelerator:
        threads = str(max(1, len(cpus) // ranks))
        return [{"OMP_NUM_THREADS": threads, "VLLM_OMP_NUM_THREADS_SET_BY_VLLM": "1"} for _ in range(ranks)]
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if bind == "nobind":
        return [{"OMP_NUM_THREADS": str(max(1, (len(cpus) - ranks) // ranks))} for _ in range(ranks)]
    if bind == "auto":
        arch = (machine or platform.machine()).lower()
        lists = auto_cpu_lists(cpus, ranks, one_per_core=arch in ("x86_64", "amd64", "i686", "s390x"))
    else:
        try:
            lists = [parse_id_list(part) for part in bind.split("|")]
        except ValueError:
            lists = []
        if len(lists) != ranks or not all(lists):
            log.warning("VLLM_CPU_OMP_THREADS_BIND=%r is not %d CPU list(s) separated by '|' (as '0-3|4-7'): "
                        "binding as vLLM's 'auto' would", bind, ranks)
            return worker_envs(ranks, accelerator, {**env, "VLLM_CPU_OMP_THREADS_BIND": "auto"}, cpus, machine)
    ld_preload = env.get("LD_PRELOAD", "")
    return [binding_env(cpu_list, ld_preload) for cpu_list in lists]
