"""Whether a configured model can be served, before any process starts: its ``model`` path or
hub id (a local directory with a model config, a GGUF file, or a hub id in the local cache
while engines run offline). Configuration itself (schema, rules, lookup) is servectl/config/;
whether vLLM accepts a model's engine arguments is asked of a short-lived engine process
by the CLI (``servectl config check``). Also what a model will hold before its engine has
measured it (its checkpoint on disk, ``model_estimate``) and the budget warnings of
``servectl config check``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from servectl.config import ENGINE_OFFLINE_ENV, Config, LoraModule, ModelConfig, Overrides, memory_budget
from servectl.memory import (WEIGHT_SUFFIXES, Estimate, device_labels, device_totals, estimate, fmt_size,
                             has_accelerator)

# A model's weights may be a single GGUF file instead of a directory.
MODEL_FILE_SUFFIXES = (".gguf",)
# Hugging Face's repo id: "name" or "namespace/name" (huggingface_hub's validate_repo_id).
HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def hf_hub_cache(env: Mapping[str, str]) -> Path:
    """Where huggingface_hub keeps downloaded models, in the environment ``env``."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(env[key]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                              "huggingface")
    return Path(home).expanduser() / "hub"


def model_path_problem(model: str, env: Mapping[str, str]) -> str | None:
    """Why ``model`` (a model's ``model`` value) cannot be served, or None.

    It must be an existing local directory holding a model config (config.json,
    or params.json in Mistral's format), a GGUF file, or a Hugging Face hub id;
    with HF_HUB_OFFLINE (the engines' default) a hub id must be in the local
    cache, since nothing will be downloaded. ``env`` is the engine's environment.
    """
    path = Path(model)
    if path.is_dir():
        if (path / "config.json").is_file() or (path / "params.json").is_file():
            return None
        return f"{model} holds no config.json (not a Hugging Face model directory)"
    if path.exists():
        return None if path.suffix in MODEL_FILE_SUFFIXES else f"{model} is not a model directory"
    if model.startswith(("/", ".", "~")):
        return f"{model} does not exist"
    if not HUB_ID.match(model) or "--" in model or ".." in model:
        return f"{model} does not exist, and is not a Hugging Face hub id either"
    if not _truthy(env.get("HF_HUB_OFFLINE")):
        return None  # a hub id, downloaded by the engine
    cache = hf_hub_cache(env)
    snapshots = cache / f"models--{model.replace('/', '--')}" / "snapshots"
    if any((snap / "config.json").is_file() or (snap / "params.json").is_file()
           for snap in (snapshots.iterdir() if snapshots.is_dir() else ())):
        return None
    return (f"{model} is neither a local directory nor in the local Hugging Face cache ({cache}), and engines "
            "run offline (HF_HUB_OFFLINE=1): download it first, or set HF_HUB_OFFLINE = \"0\" in the model's env")


def check_model_paths(cfg: Config, path: Path | str | None = None, ov: Overrides | None = None) -> list[str]:
    """Every model whose ``model`` cannot be served, naming the key and the file
    (or the option), before any process starts."""
    problems = []
    for i, m in enumerate(cfg.models):
        where = f"config error{' in ' + str(path) if path else ''}"
        for lora in m.lora_modules:
            if isinstance(lora, LoraModule) and (why := adapter_path_problem(lora.path)) is not None:
                problems.append(f"{where}: models[{i}].lora_modules.{lora.name} ({m.name}): {why}")
        why = model_path_problem(m.model, {**os.environ, **ENGINE_OFFLINE_ENV, **m.env})
        if why is None:
            continue
        if i == 0 and ov is not None and ov.model:
            problems.append(f"bad option: --model: {why}")
        else:
            problems.append(f"{where}: models[{i}].model ({m.name}): {why}")
    return problems


def adapter_path_problem(path: str) -> str | None:
    """Why a configured LoRA adapter's ``path`` cannot be loaded, or None: a local directory with
    PEFT's adapter_config.json (what vLLM's loader reads first; its weights are checked at load).
    A hub id is vLLM's to resolve (from the local cache while engines run offline)."""
    p = Path(path)
    if not p.exists():
        if not path.startswith(("/", ".", "~")) and HUB_ID.match(path):
            return None
        return f"{path} does not exist"
    if not (p / "adapter_config.json").is_file():
        return f"{path} holds no adapter_config.json (not a LoRA adapter directory)"
    return None


# ---- a model's footprint before its first load (the memory budget) ---------------------------------

def checkpoint_bytes(model: str, env: Mapping[str, str]) -> int | None:
    """The size of a model's weight files: a local directory, a GGUF file, or a hub id's snapshot
    in the local cache; None where it is not on disk."""
    path = Path(model)
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        snapshots = hf_hub_cache(env) / f"models--{model.replace('/', '--')}" / "snapshots"
        found = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
        if not found:
            return None
        path = found[-1]
    # Only one format is loaded where a checkpoint ships several (safetensors first, as vLLM).
    by_suffix: dict[str, int] = {}
    for f in path.rglob("*"):
        if f.suffix in WEIGHT_SUFFIXES and f.is_file():
            by_suffix[f.suffix] = by_suffix.get(f.suffix, 0) + f.stat().st_size  # follows the cache's links
    for suffix in WEIGHT_SUFFIXES:
        if by_suffix.get(suffix):
            return by_suffix[suffix]
    return None


def model_estimate(model: ModelConfig, labels: tuple[str, ...], accelerator: bool,
                   totals: Mapping[str, int]) -> Estimate:
    """``estimate`` for a configured model, its checkpoint read from disk only when needed."""
    if model.expected_memory is not None:
        return estimate(model, accelerator, None, None)
    total = totals.get(labels[0]) if labels else None
    if accelerator and not model.engine_args.get("kv_cache_memory_bytes"):
        return estimate(model, accelerator, total, None)  # vLLM's share of the device: no checkpoint needed
    try:
        checkpoint = checkpoint_bytes(model.model, {**os.environ, **ENGINE_OFFLINE_ENV, **model.env})
    except OSError:
        checkpoint = None  # unreadable here: not estimated
    return estimate(model, accelerator, total, checkpoint)


def budget_warnings(cfg: Config, accelerator: bool | None = None) -> list[str]:
    """`servectl config check`'s warnings: a model whose footprint (configured or estimated) is
    beyond its device's memory budget on its own is never loaded (its requests are a 503)."""
    budget = memory_budget(cfg.manager)
    if not budget:
        return []
    accelerator = has_accelerator() if accelerator is None else accelerator
    totals = device_totals(accelerator)
    out = [f"memory_budget.{label} is a fraction of device {label}, whose memory is not known here: it is not "
           "applied (give it in bytes)" for label, amount in budget.items() if amount.resolve(totals.get(label)) is None]
    for m in cfg.models:
        labels = device_labels(m, accelerator)
        est = model_estimate(m, labels, accelerator, totals)
        for label in labels:
            limit = budget[label].resolve(totals.get(label)) if label in budget else None
            if limit is not None and est.bytes is not None and est.bytes > limit:
                out.append(f"model {m.name}: needs {fmt_size(est.bytes)} on device {label} ({est.source}), more than "
                           f"its memory_budget of {fmt_size(limit)}: it will not be loaded (requests for it are a 503); "
                           "raise the budget, or set the model's expected_memory if the estimate is wrong")
    return out
