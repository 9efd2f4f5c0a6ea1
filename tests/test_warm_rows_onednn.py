"""The warm-up builds what serving then finds: a layer dispatched by vLLM's own CPU GEMM
code, warmed, and oneDNN's log (``ONEDNN_VERBOSE=2``) saying whether each later call
built a primitive (``create:cache_miss``) or found one (``create:cache_hit``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.vllm_unit

PROGRAM = textwrap.dedent("""
    import sys, torch
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
    print("SHAPES", len(layers), flush=True)
    warm(layers, torch.float32, 8)
    for rows in (5, 8, 1, 9):
        print("CALL", rows, flush=True)
        for layer, k, bias in layers:
            layer.cpu_linear(torch.zeros(rows, k), layer.weight, bias)
    print("END", flush=True)
""")


def test_a_warmed_row_count_finds_its_primitives_and_an_unwarmed_one_builds_them():
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "ONEDNN_VERBOSE": "2"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "SHAPES 2" in lines, out.stdout[-2000:]
    calls: dict[int, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith("CALL "):
            current = calls.setdefault(int(line.split()[1]), [])
        elif line == "END":
            current = None
        elif current is not None and ",primitive,create:" in line and ",matmul," in line:
            current.append(line.split(",primitive,create:")[1].split(",")[0])
    if not any(calls.values()):
        pytest.skip("this CPU build's layers do not run on oneDNN matmuls (nothing to warm)")
    for rows in (5, 8, 1):
        assert "cache_miss" not in calls[rows], (rows, calls)
    assert calls[9].count("cache_miss") == 2, calls
