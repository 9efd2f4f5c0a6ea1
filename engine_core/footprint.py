"""What a model holds once loaded, as its engine measured it (the manager's memory budget).

On a GPU it is vLLM's own figure per worker — what its profiling measured (weights, the
activation peak, memory outside torch) plus the KV cache it allocated — the most any rank holds
on its device. On CPU it is the engine group's resident memory (the engine's and every
worker's RSS), charged to host memory. The engine measures at ready and sends the figure in
ChildReady (manager/budget.py uses it from then on instead of an estimate).
"""

from __future__ import annotations

import os
from typing import Any, Callable


def rss_bytes() -> int:
    """This process's resident memory."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def vllm_device_figure(worker: Any, reserved: Callable[[], int]) -> int:
    """vLLM's measure of what a GPU worker holds: after a profiling run, what it consumed
    (weights and memory outside torch) plus the activation peak plus the KV cache it sized from
    them; with kv_cache_memory_bytes (no profiling), the weights plus that KV cache, or what
    torch holds if that is more. ``reserved``: torch's reserved memory on the worker's device."""
    kv = int(getattr(worker, "available_kv_cache_memory_bytes", 0) or 0)
    if not kv:
        cache = getattr(getattr(worker, "cache_config", None), "kv_cache_memory_bytes", None)
        kv = int(cache or 0)
    consumed = getattr(worker, "total_consumed", None)
    if consumed:
        return int(consumed) + int(getattr(worker, "peak_activation_memory", 0) or 0) + kv
    weights = int(getattr(getattr(worker, "model_runner", None), "model_memory_usage", 0) or 0)
    return max(weights + kv, reserved())


def footprint_in_worker(wrapper: Any) -> tuple[int | None, int]:
    """Run in a worker (collective_rpc): (vLLM's figure for its accelerator, None without one;
    its resident memory)."""
    import torch

    rss = rss_bytes()
    if not torch.cuda.is_available():
        return None, rss
    return vllm_device_figure(getattr(wrapper, "worker", wrapper), torch.cuda.memory_reserved), rss


def group_footprint(per_worker: list[tuple[int | None, int]], engine_rss: int) -> tuple[int, str]:
    """A model's footprint per device and what it is: the largest rank's accelerator figure on a
    GPU; the group's resident memory (engine and workers) on CPU. Pure."""
    device = [d for d, _ in per_worker if d is not None]
    if device:
        return max(device), "vLLM (accelerator)"
    return engine_rss + sum(rss for _, rss in per_worker), "RSS (engine and workers)"
