"""The configuration's rules: what holds between fields (unique names, LoRA adapters, replica
devices, KV-cache events, budgets, API keys), the defaults that depend on other fields, and
the start options applied over a file. Errors name the key and the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import msgspec

from servectl import kv_events
from servectl.config import cluster
from servectl.config.schema import (DEFAULT_ENGINE_ARGS, FRONTEND_KEYS, Config, ConfigError, LoraModule,
                                    ManagerConfig, ModelConfig, Overrides, default_model)
from servectl.memory import Amount, check_budget, parse_size


def explain(err: msgspec.ValidationError, path: Path | None) -> str:
    where = f" in {path}" if path else ""
    msg = str(err)
    # msgspec says "... - at `$.gateway.port`"; turn that into a key path.
    m = re.search(r"at `\$\.?(.*)`", msg)
    key = m.group(1) if m else ""
    key = re.sub(r"\[(\d+)\]", r"[\1]", key)
    text = msg.split(" - at ")[0]
    return f"config error{where}: {key + ': ' if key else ''}{text}"


def finalize(cfg: Config, path: Path | None = None) -> Config:
    """Fill defaults that depend on other fields and check cross-field rules."""
    if not cfg.models:
        cfg.models = [default_model()]
    names = [m.name for m in cfg.models]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ConfigError(f"config error{' in ' + str(path) if path else ''}: models: duplicate name(s) {sorted(dupes)}")
    where = f" in {path}" if path else ""
    for m in cfg.models:
        frontend = sorted(set(m.engine_args) & FRONTEND_KEYS)
        if frontend:
            key = frontend[0]
            raise ConfigError(f"config error{where}: models.{m.name}.engine_args.{key}: `{key}` is a chat setting of "
                              f"vLLM's OpenAI server, not an engine argument: set it on the model "
                              f"(`{key} = ...` under [[models]])")
        if m.enable_auto_tool_choice and not m.tool_call_parser:
            raise ConfigError(f"config error{where}: models.{m.name}: enable_auto_tool_choice needs tool_call_parser "
                              "(vLLM: --enable-auto-tool-choice requires --tool-call-parser)")
        m.engine_args = {**DEFAULT_ENGINE_ARGS, **m.engine_args}
        try:
            kv_events.resolve(m.engine_args)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"config error{where}: models.{m.name}.engine_args.{kv_events.KEY}: {exc}") from None
        exposed = kv_events.exposure_problem(kv_events.events_config(m.engine_args), m.kv_events_token_ids,
                                             m.kv_events_network)
        if exposed:
            raise ConfigError(f"config error{where}: models.{m.name}.engine_args.{exposed}")
        m.lora_modules = lora_modules(m, where)
        replica_devices(m, where)
        if m.replica_env and len(m.replica_env) != m.replicas:
            raise ConfigError(f"config error{where}: models.{m.name}.replica_env: {len(m.replica_env)} table(s) for "
                              f"{m.replicas} replica(s): give one per replica")
        if m.expected_memory is not None:
            try:
                parse_size(m.expected_memory)
            except ValueError as exc:
                raise ConfigError(f"config error{where}: models.{m.name}.expected_memory: {exc}") from None
    check_lora_names(cfg.models, where)
    cluster.check(cfg, where)
    clash = kv_events.port_clash(cfg.models, cfg.gateway.port)
    if clash:
        raise ConfigError(f"config error{where}: {clash}")
    try:
        check_budget(cfg.manager.memory_budget)
    except ValueError as exc:
        raise ConfigError(f"config error{where}: manager.{exc}") from None
    relative = [r for r in cfg.manager.lora_roots if not os.path.isabs(r)]
    if relative:
        raise ConfigError(f"config error{where}: manager.lora_roots: {relative[0]!r} is not an absolute path")
    gw = cfg.gateway
    gw.api_keys = _keys(gw.api_keys, gw.api_key_file, "api", path)
    gw.admin_keys = _keys(gw.admin_keys, gw.admin_key_file, "admin", path)
    _named_keys(cfg, path)
    return cfg


def _named_keys(cfg: Config, path: Path | None) -> None:
    """[[gateway.keys]]: each with one key (``key`` or ``key_file``'s first word), checked as any
    API key; names and keys unique (no key also unnamed or an admin key: one name per key); the
    models named served here (or adapters of them)."""
    where = f" in {path}" if path else ""
    gw = cfg.gateway
    names: set[str] = set()
    served = {m.name for m in cfg.models} | {lora.name for m in cfg.models for lora in m.lora_modules
                                             if hasattr(lora, "name")}
    taken = set(gw.api_keys) | set(gw.admin_keys)
    for i, named in enumerate(gw.keys):
        at = f"gateway.keys[{i}] ({named.name})"
        if named.name in names:
            raise ConfigError(f"config error{where}: {at}: the name is used twice (usage is counted by name)")
        names.add(named.name)
        if (named.key is None) == (named.key_file is None):
            raise ConfigError(f"config error{where}: {at}: give `key` or `key_file` (one of them)")
        if named.key_file is not None:
            try:
                words = Path(named.key_file).read_text().split()
            except OSError as exc:
                raise ConfigError(f"config error{where}: {at}.key_file: cannot read {named.key_file}: "
                                  f"{exc.strerror}") from None
            if not words:
                raise ConfigError(f"config error{where}: {at}.key_file: {named.key_file} holds no key")
            named.key, named.key_file = words[0], None
        why = api_key_problem(named.key)
        if why:
            raise ConfigError(f"config error{where}: {at}.key: {why}")
        if named.key in taken:
            raise ConfigError(f"config error{where}: {at}.key: the same key is already configured (in api_keys, "
                              "admin_keys or another named key): one key, one name")
        taken.add(named.key)
        unknown = [m for m in named.models or () if m not in served]
        if unknown:
            raise ConfigError(f"config error{where}: {at}.models: {unknown[0]!r} is not a model served here "
                              f"({', '.join(sorted(served))})")


def replica_devices(m: ModelConfig, where: str = "", accelerator: bool = False) -> list[str | None]:
    """Each replica's devices (CUDA_VISIBLE_DEVICES): a list has one string per replica; one
    string is split evenly among them, in order. Where the model names none: None (vLLM's
    first GPUs, the host's CPUs), but several replicas on a GPU host take consecutive GPUs,
    replica i those from i × tensor_parallel_size (as vLLM's data-parallel ranks)."""
    if m.devices is None:
        if accelerator and m.replicas > 1:
            tp = m.tensor_parallel_size
            return [",".join(str(i * tp + k) for k in range(tp)) for i in range(m.replicas)]
        return [None] * m.replicas
    if isinstance(m.devices, list):
        if len(m.devices) != m.replicas:
            raise ConfigError(f"config error{where}: models.{m.name}.devices: {len(m.devices)} device list(s) for "
                              f"{m.replicas} replica(s): give one per replica, or one string to split")
        return list(m.devices)
    if m.replicas == 1:
        return [m.devices]
    ids = [d.strip() for d in m.devices.split(",") if d.strip()]
    if not ids or len(ids) % m.replicas:
        raise ConfigError(f"config error{where}: models.{m.name}.devices: {len(ids)} device(s) cannot be split "
                          f"evenly among {m.replicas} replicas")
    share = len(ids) // m.replicas
    return [",".join(ids[i * share:(i + 1) * share]) for i in range(m.replicas)]


def lora_modules(m: ModelConfig, where: str = "") -> list[LoraModule]:
    """A model's ``lora_modules`` in their one form (a list of ``LoraModule``), each checked: what
    vLLM's --lora-modules takes (``name=path`` or its JSON form), and enable_lora set."""
    raw = m.lora_modules
    items: list[Any] = [LoraModule(name=k, path=v) for k, v in raw.items()] if isinstance(raw, dict) else list(raw)
    out: list[LoraModule] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            name, sep, path = item.partition("=")
            if not sep or not path:
                raise ConfigError(f"config error{where}: models.{m.name}.lora_modules[{i}]: {item!r} is not "
                                  "`name=path` (or a table with name and path)")
            item = LoraModule(name=name, path=path)
        try:
            item = msgspec.convert(msgspec.to_builtins(item), LoraModule)  # the name's pattern
        except msgspec.ValidationError as exc:
            raise ConfigError(f"config error{where}: models.{m.name}.lora_modules[{i}]: "
                              f"{explain(exc, None).removeprefix('config error: ')}") from None
        if not item.path:
            raise ConfigError(f"config error{where}: models.{m.name}.lora_modules.{item.name}: an empty path")
        out.append(item)
    if out and m.engine_args.get("runner") == "pooling":
        raise ConfigError(f"config error{where}: models.{m.name}.lora_modules: servectl serves LoRA adapters on "
                          "generating models only (this one has runner = \"pooling\")")
    if out and not lora_enabled(m):
        raise ConfigError(f"config error{where}: models.{m.name}.lora_modules needs `enable_lora = true` in the "
                          "model's engine_args (vLLM: --lora-modules needs --enable-lora)")
    return out


def memory_budget(manager: ManagerConfig) -> dict[str, Amount]:
    """[manager] memory_budget as amounts per device label (checked by finalize)."""
    return check_budget(manager.memory_budget)


def lora_enabled(m: ModelConfig) -> bool:
    """The model's engine takes LoRA adapters (vLLM's engine argument ``enable_lora``; a pooling
    model's are not served)."""
    return m.engine_args.get("enable_lora") is True and m.engine_args.get("runner") != "pooling"


def check_lora_names(models: list[ModelConfig], where: str = "") -> None:
    """An adapter's name is a model name in requests: unique across models and adapters."""
    seen = {m.name: f"model {m.name!r}" for m in models}
    for m in models:
        for lora in m.lora_modules:
            if isinstance(lora, LoraModule):
                if lora.name in seen:
                    raise ConfigError(f"config error{where}: models.{m.name}.lora_modules.{lora.name}: the name is "
                                      f"already {seen[lora.name]}'s (requests name adapters like models)")
                seen[lora.name] = f"an adapter of model {m.name!r}"


def _keys(keys: list[str], key_file: str | None, kind: str, path: Path | None) -> list[str]:
    """A [gateway] key list with its file's keys (one per whitespace-separated word) added, each checked."""
    where = f" in {path}" if path else ""
    if key_file:
        try:
            keys = list(dict.fromkeys([*keys, *Path(key_file).read_text().split()]))
        except OSError as exc:
            raise ConfigError(f"config error{where}: gateway.{kind}_key_file: cannot read {key_file}: "
                              f"{exc.strerror}") from None
    for i, key in enumerate(keys):
        why = api_key_problem(key)
        if why:
            raise ConfigError(f"config error{where}: gateway.{kind}_keys[{i}]: {why}")
    return keys


def api_key_problem(key: str) -> str | None:
    """Why a configured API key cannot be one, or None. An empty key would turn authentication off
    for anyone who sends an empty bearer token; a key with spaces or control characters cannot be sent."""
    if not key.strip():
        return "an empty API key is not allowed (remove it; no keys at all means no authentication)"
    if any(c.isspace() or not c.isprintable() for c in key) or not key.isascii():
        return "an API key must be printable ASCII without spaces (it travels in an HTTP header)"
    return None


def apply_overrides(cfg: Config, ov: Overrides) -> Config:
    if ov.runtime_dir:
        cfg.manager.runtime_dir = ov.runtime_dir
    if ov.state_dir:
        cfg.manager.state_dir = ov.state_dir
    if ov.host:
        cfg.gateway.host = ov.host
    if ov.port is not None:
        cfg.gateway.port = ov.port
    if ov.gateways is not None:
        cfg.gateway.processes = ov.gateways
    if ov.freeze_grace_s is not None:
        cfg.manager.freeze_grace_s = ov.freeze_grace_s
    if ov.api_key_file:
        cfg.gateway.api_key_file = ov.api_key_file
    if ov.model or ov.name or ov.tensor_parallel_size is not None or ov.engine_args:
        target = cfg.models[0]
        if ov.model:
            target.model = ov.model
        if ov.name:
            target.name = ov.name
        if ov.tensor_parallel_size is not None:
            target.tensor_parallel_size = ov.tensor_parallel_size
        target.engine_args = {**target.engine_args, **ov.engine_args}
    try:
        cfg = msgspec.convert(msgspec.to_builtins(cfg), Config)  # re-validate what the options changed
    except msgspec.ValidationError as exc:
        raise ConfigError(f"bad option: {explain(exc, None).removeprefix('config error: ')}") from None
    return finalize(cfg)
