"""Warm a CPU worker's matmul kernels for each batch size a step can have, before it serves.

vLLM on CPU runs a linear layer through a oneDNN primitive built for one row count
(vLLM's csrc/cpu/dnnl_helper.cpp keys its primitive cache by M, the step's tokens).
A step with a row count not seen before JIT-compiles one primitive per weight shape,
about 0.5 ms each: 2-3 ms a step for the bundled model, paid by the first load that
reaches a new batch size (the first c=64 after start ran 12 % below the same load with
this warm-up: bench/results/2026-12-05-warm-rows-ab). Once built, a primitive stays in
oneDNN's process-wide cache, so warming each row count once, with zeros, before the
engine reports ready moves that cost out of serving and into the start: 0.5 s for the
bundled model in float32, 0.04 s in bfloat16 (whose small shapes vLLM runs on kernels
that build nothing). A primitive holds ~350 KB whatever the weight's size, memory a
loaded server builds anyway for the row counts it meets; built here, the budget's
footprint, measured after the start, counts it.

Only layers vLLM dispatched through ``cpu_linear`` (CPU builds) are touched, one per
weight shape (the primitive cache is per shape, shared by the layers of that shape).
The largest row counts go first: oneDNN's cache is least-recently-used (1,024
primitives by default), so if it overflows, it is the rarely used large ones that go.
"""

from __future__ import annotations

import os
import time
from typing import Any

WARM_ROWS_ENV = "SERVECTL_WARM_ROWS"  # row counts warmed: 1 … N ("0": none); default below
# The c=64 load's steps carry 64-150 tokens (every running sequence's decode and a prompt or
# two); 192 rows × the usual 5 weight shapes (qkv, o, gate-up, down, LM head) fits the cache.
DEFAULT_ROWS = 192
CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"  # oneDNN's own knob
DEFAULT_CACHE = 1024  # oneDNN's default capacity
AFTER_METHOD = "compile_or_warm_up_model"  # vLLM's last call to a worker before it serves


def rows_to_warm(max_num_seqs: int, shapes: int, env: dict[str, str] | None = None) -> int:
    """How many row counts to warm: the env's (else the default), at most twice ``max_num_seqs``
    (a step of every running sequence's decode and prompts beside them), and no more than
    oneDNN's cache holds for ``shapes`` weight shapes (warming more would evict what it built)."""
    env = os.environ if env is None else env
    try:
        n = int(env.get(WARM_ROWS_ENV, "").strip() or DEFAULT_ROWS)
    except ValueError:
        n = DEFAULT_ROWS
    try:
        cache = int(env.get(CACHE_ENV, "").strip() or DEFAULT_CACHE)
    except ValueError:
        cache = DEFAULT_CACHE
    return max(0, min(n, 2 * max_num_seqs, cache // max(1, shapes)))


def shapes(modules) -> list[tuple[Any, int, Any]]:
    """One (layer, in_features, bias) per weight shape among the layers with a ``cpu_linear``."""
    seen: set[tuple] = set()
    out = []
    for m in modules:
        fn = getattr(m, "cpu_linear", None)
        if not callable(fn):
            continue
        k = getattr(m, "input_size_per_partition", None)
        n = getattr(m, "output_size_per_partition", None)
        bias = None
        if k is None:  # an embedding used as the LM head: its weight is kept, (vocab, hidden)
            w = getattr(m, "weight", None)
            if w is None or w.dim() != 2 or w.is_meta:
                continue
            n, k = w.shape
        elif not getattr(m, "skip_bias_add", False):
            bias = getattr(m, "bias", None)
        key = (n, k, bias is not None)
        if key in seen:
            continue
        seen.add(key)
        out.append((m, int(k), bias))
    return out


def warm(layers: list[tuple[Any, int, Any]], dtype, rows: int) -> float:
    """Run each shape's ``cpu_linear`` on zeros of every row count ``rows`` … 1; the seconds taken."""
    import torch

    start = time.perf_counter()
    with torch.inference_mode():
        for m in range(rows, 0, -1):
            for layer, k, bias in layers:
                layer.cpu_linear(torch.zeros(m, k, dtype=dtype), getattr(layer, "weight", None), bias)
    return time.perf_counter() - start


def warm_worker(wrapper, log) -> None:
    """After vLLM's warm-up call: warm the row counts if this worker runs on the CPU."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        worker = wrapper.worker
        layers = shapes(worker.model_runner.get_model().modules())
        rows = rows_to_warm(worker.vllm_config.scheduler_config.max_num_seqs, len(layers))
        if rows == 0 or not layers:
            return
        took = warm(layers, worker.model_config.dtype, rows)
        log.info("warmed %d weight shapes × row counts 1-%d in %.2f s", len(layers), rows, took)
    except Exception:  # a warm-up is an optimisation: a layer it cannot call costs speed, not the start
        log.warning("matmul warm-up skipped", exc_info=True)
