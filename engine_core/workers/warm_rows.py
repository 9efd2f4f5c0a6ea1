"""Warm a CPU worker's matmul kernels for each batch size a step can have, before it serves.

vLLM on CPU runs a linear layer through a oneDNN primitive built for one row count
(vLLM's csrc/cpu/dnnl_helper.cpp keys its primitive cache by M, the step's tokens).
A step with a row count not seen before JIT-compiles one primitive per weight shape,
about 0.5 ms each: 2-3 ms a step for the bundled model, paid by the first load that
reaches a new batch size (the first c=64 after start ran 13 % below the same load with
this warm-up: bench/results/2026-12-05-warm-rows-ab). A primitive built once stays in
oneDNN's process-wide cache (vLLM's own per-layer cache keeps only 32 row counts; past
those it finds them there), so running each row count once, on zeros, before the engine
reports ready moves that cost out of serving and into the start.

What it costs: each call is a real matmul, so the time grows with the model's weights:
0.5 s for the bundled model in float32, tens of seconds a 1B model would take for all
192 row counts. So row counts go smallest first (the commonest: decode steps) within
``BUDGET_S``; a large model warms its smallest few. And a primitive holds ~350 KB
whatever its weight's size: memory a loaded server builds anyway for the row counts it
meets; built here, the budget's footprint, measured after the start, counts it. Where
vLLM runs a shape on kernels that build nothing (bfloat16's small shapes on a CPU with
AMX), warming it costs only the matmuls.

Only layers vLLM dispatched through ``cpu_linear`` (CPU builds) are touched, each with
its own weight's dtype (a float32 head in a bfloat16 model is called in float32, as vLLM
does), one per weight shape (vLLM's cache is per shape, shared by the layers of one).
An embedding is warmed only as the model's LM head, and only up to the rows a step
samples (``max_num_seqs``, with drafts).
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

WARM_ROWS_ENV = "SERVECTL_WARM_ROWS"  # row counts warmed: 1 … N ("0": none); default below
# The c=64 load's steps carry 64-150 tokens (every running sequence's decode and a prompt or
# two); 192 rows × the usual 5 weight shapes (qkv, o, gate-up, down, LM head) fits the cache.
DEFAULT_ROWS = 192
BUDGET_S = 2.0  # the most a start spends on it: a large model warms its smallest row counts
CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"  # oneDNN's own knob
DEFAULT_CACHE = 1024  # oneDNN's default capacity
AFTER_METHOD = "compile_or_warm_up_model"  # vLLM's last call to a worker before it serves


class Shape(NamedTuple):
    layer: Any
    k: int  # in features
    bias: Any  # what vLLM passes as the bias (None: none)
    dtype: Any  # the layer's weight's: what vLLM calls it with
    rows: int  # the most rows a step gives it (an LM head: the sequences sampled)


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


def shapes(modules, head: Any = None, head_rows: int = 1 << 30) -> list[Shape]:
    """One ``Shape`` per (out, in, bias, dtype) among the layers with a ``cpu_linear``; of the
    embeddings only ``head``, the model's LM head (an input embedding is a lookup, never a matmul)."""
    seen: set[tuple] = set()
    out = []
    for m in modules:
        if not callable(getattr(m, "cpu_linear", None)):
            continue
        w = getattr(m, "weight", None)
        k = getattr(m, "input_size_per_partition", None) or getattr(m, "input_size", None)
        n = getattr(m, "output_size_per_partition", None) or getattr(m, "output_size", None)
        if w is None or getattr(w, "is_meta", False) or not k or not n:
            continue
        rows, bias = 1 << 30, None
        if hasattr(m, "num_embeddings_per_partition"):  # vLLM's VocabParallelEmbedding, ParallelLMHead
            if m is not head:
                continue
            rows = head_rows
        elif not getattr(m, "skip_bias_add", False):
            bias = getattr(m, "bias", None)
            # RowParallelLinear adds its bias on rank 0 only (vLLM's forward passes None elsewhere).
            if getattr(m, "input_is_parallel", None) is not None and getattr(m, "tp_rank", 0) > 0:
                bias = None
        key = (n, k, bias is not None, w.dtype)
        if key in seen:
            continue
        seen.add(key)
        out.append(Shape(m, int(k), bias, w.dtype, rows))
    return out


def warm(layers: list[Shape], rows: int, budget_s: float = BUDGET_S, log=None) -> tuple[int, float]:
    """Run each shape's ``cpu_linear`` on zeros of row counts 1 … ``rows`` (each up to its own
    limit) until ``budget_s`` is spent. A shape whose call fails is dropped (and said), the
    others go on. Returns (the last row count warmed, seconds)."""
    import torch

    start = time.perf_counter()
    live = list(layers)
    done = 0
    with torch.inference_mode():
        for m in range(1, rows + 1):
            for shape in [s for s in live if m <= s.rows]:
                try:
                    shape.layer.cpu_linear(torch.zeros(m, shape.k, dtype=shape.dtype), shape.layer.weight, shape.bias)
                except Exception as exc:  # noqa: BLE001 - that shape is left to build while serving
                    live.remove(shape)
                    if log is not None:
                        log.warning("matmul warm-up: %s (%d×%d) left out: %s", type(shape.layer).__name__,
                                    m, shape.k, exc)
            done = m
            if time.perf_counter() - start > budget_s:
                break
    return done, time.perf_counter() - start


def warm_worker(wrapper, log) -> None:
    """After vLLM's warm-up call: warm the row counts if this worker runs on the CPU."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        worker = wrapper.worker
        model = worker.model_runner.get_model()
        config = worker.vllm_config
        seqs = config.scheduler_config.max_num_seqs
        drafts = getattr(config.speculative_config, "num_speculative_tokens", None) or 0
        layers = shapes(model.modules(), getattr(model, "lm_head", None), seqs * (1 + drafts))
        rows = rows_to_warm(seqs, len(layers))
        if rows == 0 or not layers:
            return
        done, took = warm(layers, rows, log=log)
        log.info("warmed %d weight shapes × row counts 1-%d in %.2f s", len(layers), done, took)
    except Exception:  # a warm-up is an optimisation: what it cannot do costs speed, not the start
        log.warning("matmul warm-up skipped", exc_info=True)
