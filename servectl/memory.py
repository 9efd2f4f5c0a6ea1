"""Memory sizes, a device's memory budget and the rule for a model's footprint before its first load.

A budget (``[manager] memory_budget``) is set per device label (``device_labels``: a
GPU index, or ``cpu`` for host memory on a machine without an accelerator) in bytes, a size
with a unit ("24GiB", "512MB") or a fraction of the device's memory (0.8). A model's footprint
on each of its devices is what its engine measured at its last load (manager/budget.py); before
that, ``estimate`` says it: ``expected_memory`` if configured, else what vLLM will take — on a
GPU the ``gpu_memory_utilization`` share of the device unless ``kv_cache_memory_bytes`` sizes
the KV cache, on CPU the checkpoint (its size read by model_check.py) plus the KV cache it is given.

Pure but for the devices' memory totals; imports no vLLM.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Protocol

UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
         "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")

# vLLM's defaults where a model does not set them (vllm/config/cache.py, vllm/envs.py).
VLLM_GPU_MEMORY_UTILIZATION = 0.9
VLLM_CPU_KVCACHE_GIB = 4  # VLLM_CPU_KVCACHE_SPACE unset or 0
# Files of a checkpoint that are loaded into memory (weights).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


CPU = "cpu"


class ModelSizing(Protocol):
    """What of a model's configuration (servectl.config's ModelConfig) sizes it: the rules
    here read these fields and know nothing else of the configuration."""

    devices: str | list[str] | None
    tensor_parallel_size: int
    expected_memory: int | str | None
    engine_args: dict[str, Any]
    env: dict[str, str]


def device_labels(model: ModelSizing, accelerator: bool) -> tuple[str, ...]:
    """The devices a model's engine group uses, as labels. Pure."""
    # A replicated model's list: the first replica's (each replica's group has its own string).
    devices = model.devices[0] if isinstance(model.devices, list) else model.devices
    if devices is not None and devices.strip():
        return tuple(d.strip() for d in devices.split(",") if d.strip())
    if not accelerator:
        return (CPU,)
    return tuple(str(i) for i in range(model.tensor_parallel_size))


def has_accelerator() -> bool:
    """A GPU host (NVIDIA or AMD device nodes): workers compute there, not on the cores."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string with an optional unit ("24GiB", "512 MB", "1e9" is not one).
    Decimal units are powers of ten, binary ones (KiB, MiB, GiB, TiB) powers of two. Pure."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{value} is not a positive number of bytes")
        return value
    if isinstance(value, float):
        raise ValueError(f"{value} is a fraction; a size is a whole number of bytes or has a unit (\"24GiB\")")
    m = SIZE.match(value)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in UNITS:
        raise ValueError(f"{value!r} is not a size: a number of bytes, or one with a unit (KiB, MiB, GiB, TiB, "
                         "KB, MB, GB, TB)")
    size = int(float(m.group(1)) * UNITS[unit])
    if size <= 0:
        raise ValueError(f"{value!r} is not a positive size")
    return size


class Amount(NamedTuple):
    """A budget as configured: bytes, or a fraction of the device's memory."""

    bytes: int | None
    fraction: float | None

    def resolve(self, total: int | None) -> int | None:
        """Bytes (None: a fraction of a device whose total is not known)."""
        if self.bytes is not None:
            return self.bytes
        return None if total is None else int(total * (self.fraction or 0.0))

    def __str__(self) -> str:
        return fmt_size(self.bytes) if self.bytes is not None else f"{self.fraction:g} of the device's memory"


def parse_amount(value: int | float | str) -> Amount:
    """A budget's value: a fraction (0 < x <= 1) of the device's memory (0.8, "0.8", "80%"), or a
    size. Pure."""
    if isinstance(value, str):
        text = value.strip()
        if text.endswith("%"):
            try:
                value = float(text[:-1]) / 100
            except ValueError:
                raise ValueError(f"{value!r} is not a percentage of the device's memory") from None
        elif re.fullmatch(r"\d*\.\d+", text):
            value = float(text)
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"{value} is not a fraction of the device's memory (0 < x <= 1); a size is a whole "
                             "number of bytes or has a unit (\"24GiB\")")
        return Amount(None, value)
    return Amount(parse_size(value), None)


LABEL = re.compile(r"^(cpu|\d+)\Z")
MIN_BUDGET = 2**20  # below it a budget is a mistake (`1` meant the whole device)


def check_budget(budget: Mapping[str, int | float | str]) -> dict[str, Amount]:
    """Each label's amount, or ValueError naming the label at fault. Pure."""
    out = {}
    for label, value in budget.items():
        if not LABEL.match(label):
            raise ValueError(f"memory_budget.{label}: a device label is a GPU index (\"0\", \"1\", ...) or \"cpu\" "
                             "(host memory on a machine without an accelerator)")
        try:
            out[label] = parse_amount(value)
        except ValueError as exc:
            raise ValueError(f"memory_budget.{label}: {exc}") from None
        if out[label].bytes is not None and out[label].bytes < MIN_BUDGET:
            raise ValueError(f"memory_budget.{label}: {value!r} is {out[label].bytes} bytes, too small for any "
                             "model: a fraction of the device is written with a point (1.0, 0.8), a size with "
                             "a unit (\"24GiB\")")
    return out


def fmt_size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# ---- a model's footprint before its first load -------------------------------------------------
class Estimate(NamedTuple):
    bytes: int | None  # per device; None: cannot be estimated (a hub id not on disk, a device total unknown)
    source: str  # how it was estimated, said beside the figure


def estimate(model: ModelSizing, accelerator: bool, device_total: int | None,
             checkpoint: int | None) -> Estimate:
    """A model's footprint per device before its engine measured one. Pure."""
    if model.expected_memory is not None:
        return Estimate(parse_size(model.expected_memory), "expected_memory")
    args = model.engine_args
    kv = args.get("kv_cache_memory_bytes")
    tp = max(1, model.tensor_parallel_size)
    if accelerator and not kv:
        share = float(args.get("gpu_memory_utilization") or VLLM_GPU_MEMORY_UTILIZATION)
        if device_total is None:
            return Estimate(None, f"gpu_memory_utilization {share:g} of a device of unknown size")
        return Estimate(int(device_total * share), f"gpu_memory_utilization {share:g} of the device")
    if not kv:
        space = model.env.get("VLLM_CPU_KVCACHE_SPACE") or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        try:
            gib = float(space) if space else 0.0
        except ValueError:
            gib = 0.0
        kv = int((gib or VLLM_CPU_KVCACHE_GIB) * 2**30)
    if checkpoint is None:
        return Estimate(None, "checkpoint not on disk")
    if not accelerator:  # every rank in host memory: the whole checkpoint, a KV cache per rank
        return Estimate(checkpoint + tp * int(kv), "checkpoint + KV cache")
    return Estimate(checkpoint // tp + int(kv), "checkpoint + KV cache")


def host_memory_total(field: str = "MemTotal") -> int | None:
    """A field of /proc/meminfo (MemTotal, MemAvailable), in bytes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpu_memory_totals(field: str = "total") -> dict[str, int]:
    """Each GPU's memory (``total`` or ``free``) by index (NVML, which vLLM's GPU build
    installs); {} without it."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
        try:
            return {str(i): int(getattr(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)), field))
                    for i in range(pynvml.nvmlDeviceGetCount())}
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no device: nothing known
        return {}


def device_free(accelerator: bool) -> dict[str, int]:
    """Each device label's memory free now: GPUs' (NVML) on an accelerator host, else the host's
    MemAvailable as ``cpu``."""
    if accelerator:
        return gpu_memory_totals("free")
    free = host_memory_total("MemAvailable")
    return {} if free is None else {"cpu": free}


def device_totals(accelerator: bool) -> dict[str, int]:
    """Each device label's memory: GPUs on an accelerator host, else ``cpu``."""
    if accelerator:
        return gpu_memory_totals()
    total = host_memory_total()
    return {} if total is None else {"cpu": total}

