"""The warm-up builds what serving then finds: a layer dispatched by vLLM's own CPU GEMM
code, warmed, and oneDNN's log (``ONEDNN_VERBOSE=2``) saying whether each later call
built a primitive (``create:cache_miss``) or found one (``create:cache_hit``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.vllm_unit

PROGRAM = textwrap.dedent("""
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from engine_core.workers.warm_rows import shapes, warm

    class Layer(torch.nn.Module):  # the attributes vLLM's LinearBase has
        def __init__(self, n, k):
            super().__init__()
            self.input_size_per_partition, self.output_size_per_partition = k, n
            self.skip_bias_add, self.bias = False, None
            self.weight = torch.nn.Parameter(torch.randn(n, k), requires_grad=False)

    model = torch.nn.Sequential(Layer(384, 128), Layer(128, 384))
    for layer in model:
        dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    layers = shapes(model.modules())
    print("SHAPES", len(layers), [str(s.dtype) for s in layers], flush=True)
    print("BUDGET 0 WARMS", warm(layers, 64, budget_s=0.0)[0], flush=True)  # at least one row count
    done, _ = warm(layers, 64)
    print("WARMED", done, flush=True)
    # 40: in vLLM's per-layer cache (the last 32 warmed); 5: only in oneDNN's; 65: never warmed.
    for rows in (5, 40, 65):
        print("CALL", rows, flush=True)
        for s in layers:
            s.layer.cpu_linear(torch.zeros(rows, s.k), s.layer.weight, s.bias)
    print("END", flush=True)
""")


def test_warmed_row_counts_find_their_primitives_and_an_unwarmed_one_builds_them():
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ONEDNN_VERBOSE": "2"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "SHAPES 2 ['torch.float32', 'torch.float32']" in lines, out.stdout[-2000:]
    assert "BUDGET 0 WARMS 1" in lines and "WARMED 64" in lines, out.stdout[-2000:]
    calls: dict[int, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith("CALL "):
            current = calls.setdefault(int(line.split()[1]), [])
        elif line == "END":
            current = None
        elif current is not None and ",primitive,create:" in line and ",matmul," in line:
            current.append(line.split(",primitive,create:")[1].split(",")[0])
    if not calls[65]:
        pytest.skip("this CPU build's layers do not run on oneDNN matmuls (nothing to warm)")
    assert calls[5] == ["cache_hit", "cache_hit"], calls  # built by the warm-up, found in oneDNN's
    assert calls[40] == [], calls  # vLLM's own cache: not even a lookup in oneDNN's
    assert calls[65] == ["cache_miss", "cache_miss"], calls
