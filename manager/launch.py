"""Launching an engine group's members: their environments, the engine's spec, each one exec'd.

Workers first (the engine gets their pidfds), each member with the group key on a pipe, the
engine's spec (it carries the model's env: tokens) on a memfd, never the argv. A member whose
warm standby was made for exactly its environment is handed its role instead of a cold exec
(manager/standbys.py). What the launch means for the group's state is the group's
(manager/group.py); this file only starts processes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Protocol

from manager.children import Child
from manager.cluster import RemotePart
from manager.standbys import StandbyPool
from manager.worker_cpus import worker_envs as cpu_worker_envs
from servectl import config as C
from servectl.memory import has_accelerator
from servectl.wire.spawn import REPLICA_MARK, EngineSpec, Role, fd_ref, resolve_fd_args, spec_fd

# What every engine and worker gets: no hub lookups for local paths, no usage
# reporting thread, vLLM's engine in-process (we are its multiprocessing).
ENGINE_ENV = {
    **C.ENGINE_OFFLINE_ENV,  # `config check` and `start` check hub ids against the local cache for it
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class LaunchHost(Protocol):
    """What a launch needs from the supervisor (the Manager)."""

    settings: C.ManagerConfig
    gateway_cfg: C.GatewayConfig  # its max_body_bytes sizes the engine's frontend (EngineSpec)
    runtime_dir: Path
    standbys: StandbyPool

    def child_env(self, extra: dict[str, str]) -> dict[str, str]: ...
    def watch(self, child: Child) -> None: ...


class Launched(Protocol):
    """What a launch reads of the group it starts (manager/group.py's EngineGroup)."""

    name: str
    cfg: C.ModelConfig  # this replica's share: its devices and env
    engine: Child
    workers: list[Child]
    incarnation: str
    freezing: bool
    loras: list[C.LoraModule]
    events_slot: int | None


def member_envs(cfg: C.ModelConfig, host: LaunchHost, ranks: int | None = None,
                extra: dict[str, str] | None = None) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The engine's environment and each rank's (their standbys get the same): a worker's
    OpenMP threads and CPUs as vLLM's executor would choose them (worker_cpus.py). ``ranks``:
    those on this host (a model spread over hosts runs the others elsewhere); ``extra``: theirs."""
    base = host.child_env(ENGINE_ENV | (extra or {}) | cfg.env)
    if cfg.devices is not None:
        base["CUDA_VISIBLE_DEVICES"] = cfg.devices
    n = cfg.tensor_parallel_size if ranks is None else ranks
    worker_envs = [base | omp for omp in cpu_worker_envs(n, has_accelerator(), base)]
    engine_env = dict(base)
    engine_env.setdefault("OMP_NUM_THREADS", "1")  # it schedules; the workers compute
    return engine_env, worker_envs


def launch(group: Launched, host: LaunchHost, idle: C.IdlePolicy, key: bytes, remote: RemotePart | None = None) -> None:
    """Every member of a group that enters its start: workers, then the engine. ``remote``: the
    part of a model spread over hosts that concerns the others (manager/cluster.py)."""
    root = str(host.runtime_dir)
    engine_env, worker_envs = member_envs(group.cfg, host, len(group.workers), remote.env if remote else None)
    for rank, worker in enumerate(group.workers):
        launch_member(host, worker, "engine_core.workers.worker",
                      ["--model", group.name, "--rank", str(rank), "--runtime-dir", root, "--key-fd", fd_ref(0)],
                      [], key, worker_envs[rank])
    m = host.settings
    # The spec carries the model's env (tokens): a memfd, never the argv.
    spec = spec_fd(EngineSpec(
        model=group.cfg, runtime_dir=root, incarnation=group.incarnation, freezing=group.freezing,
        freeze_grace_s=m.freeze_grace_s or C.DEFAULT_FREEZE_GRACE_S,
        worker_reply_timeout_s=m.worker_reply_timeout_s, idle_release_s=idle.after_s,
        idle_release=idle.mode, sleep_level=idle.sleep_level, step_deadline_multiple=m.step_deadline_multiple,
        step_deadline_floor_s=m.step_deadline_floor_s,
        max_body_bytes=host.gateway_cfg.max_body_bytes, loras=list(group.loras), group=group.name,
        replica=int(group.name.partition(REPLICA_MARK)[2] or 0), events_slot=group.events_slot,
        **(dict(init_methods=remote.init_methods, remote_ranks=remote.remote_ranks, local_ranks=remote.local_ranks,
                dead_after_s=remote.dead_after_s) if remote else {})),
        "servectl-engine-spec")
    pidfds = [w.pidfd for w in group.workers]
    args = ["--key-fd", fd_ref(0), "--spec-fd", fd_ref(1),
            "--worker-pidfds", ",".join(fd_ref(i + 2) for i in range(len(pidfds)))]
    fds = [spec, *pidfds]
    if remote is not None:
        args += ["--remote-listen-fd", fd_ref(len(fds) + 1)]
        fds.append(remote.listener.fileno())
    try:
        launch_member(host, group.engine, "engine_core", args, fds, key, engine_env)
    finally:
        os.close(spec)
        if remote is not None:
            remote.listener.close()  # the engine holds it now


def launch_member(host: LaunchHost, member: Child, module: str, args: list[str], extra_fds: list[int], key: bytes,
                  env: dict[str, str]) -> None:
    """Hand the role to the member's warm standby if one fits, else exec it cold."""
    fd = key_pipe(key)
    fds = [fd, *extra_fds]
    try:
        standby = host.standbys.take(member.component, env)
        if standby is not None and host.standbys.hand_over(standby, member, Role(module=module, argv=args), fds):
            return
        member.spawn([sys.executable, "-m", module, *resolve_fd_args(args, fds)], env, tuple(fds))
        host.watch(member)
    finally:
        os.close(fd)


def key_pipe(key: bytes) -> int:
    """A pipe holding the group key; returns the read end (to pass to a child)."""
    r, w = os.pipe()
    os.write(w, key)
    os.close(w)
    return r
