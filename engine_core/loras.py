"""A model's LoRA adapters in its engine: vLLM's own ``OpenAIServingModels``.

`vllm serve` keeps its adapters in ``OpenAIServingModels`` (``--lora-modules`` loaded by
``init_static_loras``, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``), which checks a
load, gives the adapter its id, has the engine load it (``add_lora``: the workers read and check
its files) and maps a request's ``model`` to its ``LoRARequest``. The engine here builds the same
object over the ``LLMEngine`` it holds, and every serving class it runs (chat and completions
in requests.py, Responses and Messages, pooling) finds a request's adapter there, as in
`vllm serve`.

A difference, on purpose (docs/decisions.md): an adapter that fails to load is a 400 with the
worker's reason (vLLM answers 500, or 404 for a missing path, with its message sanitised).

vLLM's methods are async but await nothing here (the engine's ``add_lora`` is a call to the
workers the engine waits for): ``run_to_end`` runs each to its end in one turn, no event loop.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from engine_core.chat_parsing import run_to_end
from engine_core.workers import WorkerHung
from servectl.config import LoraModule

log = logging.getLogger("engine_core")


class LoraRefused(Exception):
    """An adapter vLLM would not load or unload: the HTTP status to answer with, and why."""

    def __init__(self, message: str, status: int = 400, files: bool = False):
        super().__init__(message)
        self.status = status
        self.files = files  # the workers could not read or use what is at its path (not vLLM's request checks)


def reason(exc_text: str) -> str:
    """The exception lines of a worker's failure (``rank N: Type: message`` then its traceback),
    without the traceback: what an operator needs to fix the adapter, in one or two lines."""
    lines: list[str] = []
    for line in exc_text.splitlines():
        text = line.strip()
        if not text or text.startswith(("Traceback", "File ", "^", "~", "The above exception", "During handling")) \
                or line.startswith(" "):
            continue
        text = re.sub(r"^(?:\w+: )?worker call \S+ failed:\s*", "", text)
        text = re.sub(r"^rank \d+: ", "", text)
        if text and text not in lines:
            lines.append(text)
    return " ".join(lines[:3])[:2000] or "the adapter could not be loaded"


class _EngineClient:
    """What ``OpenAIServingModels`` uses of an ``EngineClient``."""

    def __init__(self, engine):
        self.engine = engine
        self.model_config = engine.model_config
        self.renderer = getattr(engine, "renderer", None)
        self.input_processor = getattr(engine, "input_processor", None)
        # What the last add_lora raised, unsanitised: vLLM's error response hides paths, which
        # the operator who sent the path needs to see.
        self.error: BaseException | None = None

    async def add_lora(self, lora_request) -> bool:
        self.error = None
        try:
            return self.engine.add_lora(lora_request)
        except Exception as exc:
            self.error = exc
            raise


class Adapters:
    """The model's adapters: vLLM's ``OpenAIServingModels`` over this engine."""

    def __init__(self, engine, served_name: str, model_path: str, enabled: bool):
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels

        self.engine = engine
        self.enabled = enabled
        self.served_name = served_name
        self.models = OpenAIServingModels(_EngineClient(engine), [BaseModelPath(name=served_name,
                                                                                model_path=model_path)])

    # ---- loading and unloading ------------------------------------------------------------
    def load(self, lora: LoraModule, load_inplace: bool = False) -> str:
        """``load_lora_adapter``: the adapter is served under its name from now on, or
        ``LoraRefused`` says why not."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        if not self.enabled:
            raise LoraRefused(f"model {self.served_name!r} does not take LoRA adapters (engine_args.enable_lora)")
        client = self.models.engine_client
        client.error = None  # this load's failure only, not an earlier one's
        request = LoadLoRAAdapterRequest(lora_name=lora.name, lora_path=lora.path, load_inplace=load_inplace)
        try:
            result = run_to_end(self.models.load_lora_adapter(request, base_model_name=lora.base_model_name))
        except Exception as exc:  # noqa: BLE001 - vLLM's own checks raised instead of answering
            raise LoraRefused(reason(f"{type(exc).__name__}: {exc}")) from None
        if isinstance(client.error, WorkerHung):  # the group, not the adapter: the engine exits for a restart
            raise client.error
        if isinstance(result, ErrorResponse):
            err = result.error
            # vLLM: 404 for a path with no adapter, 500 for anything else the workers refused. Both
            # are the request's fault (its path or its adapter): 400 with the reason.
            status = err.code if 400 <= err.code < 500 and err.code != 404 else 400
            raw = client.error
            raise LoraRefused(reason(f"{type(raw).__name__}: {raw}" if raw is not None else err.message), status,
                              files=raw is not None or err.code == 404)
        lora_request = self.models.lora_requests[lora.name]
        log.info("LoRA adapter %r loaded from %s (id %d)", lora.name, lora.path, lora_request.lora_int_id)
        return result

    def unload(self, name: str) -> str:
        """``unload_lora_adapter``: no request names it from now on. As in `vllm serve`, the
        workers keep it cached (evicted past ``max_cpu_loras``): a request still running through
        it goes on, even if its files are gone meanwhile."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        result = run_to_end(self.models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name)))
        if isinstance(result, ErrorResponse):
            raise LoraRefused(result.error.message, result.error.code)
        log.info("LoRA adapter %r unloaded", name)
        return result

    def load_at_start(self, loras: list[LoraModule], configured: list[LoraModule]) -> None:
        """The adapters of ``EngineSpec.loras``: a configured one that fails raises (the model
        fails, as `vllm serve --lora-modules` does); one loaded at run time (a configured name
        loaded again from another path included) is dropped, logged. A worker that dies or hangs
        meanwhile is ``WorkerHung``: a restart, not the adapter's fault."""
        for lora in loras:
            try:
                self.load(lora)
            except LoraRefused as exc:
                if lora in configured:
                    raise ValueError(f"LoRA adapter {lora.name!r} ({lora.path}): {exc}") from None
                log.warning("LoRA adapter %r (loaded at run time) cannot be loaded again, dropped: %s", lora.name,
                            exc)

    # ---- what is served ---------------------------------------------------------------------
    def listing(self) -> list[LoraModule]:
        return [LoraModule(name=r.lora_name, path=r.lora_path, base_model_name=r.base_model_name)
                for r in self.models.lora_requests.values()]

    def request_for(self, model: Any):
        """The ``LoRARequest`` a request's ``model`` names (None: the base model), as vLLM's
        ``_maybe_get_adapters``; an adapter no longer served is vLLM's 404."""
        if not model or model == self.served_name or not isinstance(model, str):
            return None
        lora_request = self.models.lora_requests.get(model)
        if lora_request is not None:
            return lora_request
        if self.models.is_base_model(model):
            return None
        from engine_core.request_types import BadRequest

        raise BadRequest(f"The model `{model}` does not exist.", "model", 404)
