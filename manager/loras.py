"""LoRA adapters loaded and unloaded at run time: which model a change goes to, and the change.

`/v1/load_lora_adapter`, `/v1/unload_lora_adapter` and `servectl lora load|unload` send the
manager ``LoadLora`` / ``UnloadLora``; the manager picks the model (``lora_target``, pure),
sends that model's engine ``AddLora`` / ``RemoveLora`` and answers with the engine's word
(``LoraReply``). The engine loads the adapter with vLLM's own ``OpenAIServingModels``
(engine_core/loras.py), so what vLLM refuses is refused with vLLM's reason. The group keeps the
list (``EngineGroup.loras``): every later start of its engine loads them again.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from servectl import config as C
from servectl.wire import control as P
from servectl.wire.vocab import ModelState

if TYPE_CHECKING:
    from manager.group import EngineGroup

log = logging.getLogger("manager")

_call_ids = itertools.count(1)


class Candidate(NamedTuple):
    """What ``lora_target`` needs to know of one served model."""

    name: str
    lora_enabled: bool
    state: ModelState
    loras: tuple[str, ...]


class Refusal(NamedTuple):
    status: int
    message: str


def lora_target(models: list[Candidate], model: str | None, adapter: str, loading: bool,
                reserved: frozenset[str] = frozenset(), pending: frozenset[str] = frozenset()) -> str | Refusal:
    """The model a LoRA change goes to, or why none can take it. Pure.

    ``model`` None: the one LoRA-enabled model (for an unload: the one serving ``adapter``). A
    loaded adapter's name must not be a model's — served, or configured and not served now
    (``reserved``) — or another model's adapter's (requests name adapters as they name models);
    nor one a change is under way for (``pending``)."""
    if adapter in pending:
        return Refusal(409, f"a change of adapter {adapter!r} is under way; try again when it is done")
    by_name = {m.name: m for m in models}
    enabled = [m.name for m in models if m.lora_enabled]
    if model is None:
        if not loading:
            owners = [m.name for m in models if adapter in m.loras]
            if owners:
                return owners[0]
        if len(enabled) == 1:
            model = enabled[0]
        elif not enabled:
            return Refusal(400, "no served model takes LoRA adapters (set `enable_lora = true` in a model's "
                                "engine_args)")
        else:
            return Refusal(400, f"several models take LoRA adapters ({', '.join(sorted(enabled))}): name one "
                                "with `model`")
    target = by_name.get(model)
    if target is None:
        return Refusal(404, f"no model {model!r}; served: {', '.join(sorted(by_name)) or 'none'}")
    if not target.lora_enabled:
        return Refusal(400, f"model {model!r} does not take LoRA adapters (its engine_args have no "
                            "`enable_lora = true`)")
    if loading:
        if adapter in by_name or adapter in reserved:
            return Refusal(400, f"The lora adapter '{adapter}' conflicts with a served base model.")
        other = next((m.name for m in models if m.name != model and adapter in m.loras), None)
        if other is not None:
            return Refusal(400, f"the name {adapter!r} is already an adapter of model {other!r}")
    elif adapter not in target.loras:
        return Refusal(404, f"The lora adapter '{adapter}' cannot be found.")
    if target.state is not ModelState.READY:
        return Refusal(409, f"model {model!r} is {target.state}: adapters are loaded into and unloaded from a "
                            "serving model (a request wakes a released one); try again once it is ready")
    return model


def outside_roots(path: str, roots: list[str]) -> bool:
    """Whether ``path``, its links resolved, is not inside one of ``roots`` (pure but for realpath:
    what it says of a path is the same whether the path exists or not). Only an absolute path can
    be inside: a relative one would be resolved against the manager's working directory, and vLLM
    reads ``~user/...`` as a home directory and an unknown relative path as a hub repository."""
    if not os.path.isabs(path) or "\0" in path:
        return True
    real = os.path.realpath(path)
    return not any(os.path.commonpath([real, os.path.realpath(root)]) == os.path.realpath(root)
                   for root in roots if os.path.isabs(root))


def candidates(groups: dict[str, "EngineGroup"]) -> list[Candidate]:
    """One per served model: a replicated model's adapters are its replicas' (each loads them),
    and it takes a change once every replica is ready."""
    by_model: dict[str, list["EngineGroup"]] = {}
    for g in groups.values():
        by_model.setdefault(g.model, []).append(g)
    return [Candidate(model, C.lora_enabled(gs[0].cfg),
                      next((g.state for g in gs if g.state is not ModelState.READY), ModelState.READY),
                      tuple(lora.name for lora in gs[0].loras))
            for model, gs in by_model.items()]


def adapter_owner(groups: dict[str, "EngineGroup"], name: str) -> str | None:
    """The model serving an adapter of that name, or None (a model's name must not be one)."""
    return next((g.model for g in groups.values() if any(lora.name == name for lora in g.loras)), None)


async def change(groups: dict[str, "EngineGroup"], msg: P.LoadLora | P.UnloadLora, timeout_s: float,
                 reserved: frozenset[str] = frozenset(), pending: set[str] | None = None,
                 roots: list[str] | None = None) -> P.LoraReply:
    """Apply one LoRA change: the target model's engine loads or drops the adapter. ``pending``:
    the adapters a change is under way for (the manager's), this one's added while it runs.
    An HTTP caller's load names a path inside ``roots`` ([manager] lora_roots), and a path its
    engine cannot use is refused in words that do not say what is there (the log has them)."""
    pending = set() if pending is None else pending
    loading = isinstance(msg, P.LoadLora)
    adapter = msg.lora.name if loading else msg.name
    http = loading and msg.http is not None
    if http and outside_roots(msg.lora.path, roots or []):
        return P.LoraReply(ok=False, status=400, message="lora_path is not an absolute path inside a directory the "
                           "configuration allows ([manager] lora_roots)" if roots else "loading LoRA adapters over "
                           "HTTP is off (no [manager] lora_roots configured)")
    if http:  # the engine reads the path that was checked, not one a link swapped since
        msg = msgspec.structs.replace(msg, lora=msgspec.structs.replace(msg.lora, path=os.path.realpath(msg.lora.path)))
    target = lora_target(candidates(groups), msg.model, adapter, loading, reserved, frozenset(pending))
    if isinstance(target, Refusal):
        # the reply carries a model's adapters only when it names one
        known = next((g for g in groups.values() if g.model == (msg.model or "")), None)
        return P.LoraReply(ok=False, status=target.status, message=target.message,
                           model=known.model if known else "", loras=list(known.loras) if known else [])
    replicas = [g for g in groups.values() if g.model == target]
    group = replicas[0]
    pending.add(adapter)
    try:
        done = None
        for replica in replicas:  # every replica serves the same adapters
            call = (P.AddLora(call_id=next(_call_ids), lora=msg.lora, load_inplace=msg.load_inplace) if loading
                    else P.RemoveLora(call_id=next(_call_ids), name=adapter))
            done = await replica.change_lora(call, timeout_s)
            if done is None or not done.ok:
                break
    finally:
        pending.discard(adapter)
    if done is None:
        return P.LoraReply(ok=False, status=503, model=target, loras=list(group.loras),
                           message=f"model {target!r}'s engine did not answer (it restarted or is busy); its "
                                   "adapters are as listed")
    if done.ok:
        log.info("model %s: LoRA adapter %s %s", target, adapter, "loaded" if loading else "unloaded")
    message = done.message
    if http and not done.ok and done.files:
        log.warning("model %s: LoRA adapter %s from %s (an HTTP caller's) not loaded: %s", target, adapter,
                    msg.lora.path, done.message)
        message = f"LoRA adapter {adapter!r} could not be loaded from that path (the daemon's log says why)"
    return P.LoraReply(ok=done.ok, status=done.status, message=message, model=target, loras=list(group.loras))
