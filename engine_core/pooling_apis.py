"""Embeddings, scores, reranking, classification and pooling: vLLM's pooling serving classes in the engine.

A pooling model (``engine_args``: ``runner = "pooling"``, ``convert``,
``pooler_config``) is served as `vllm serve` serves it: ``init_pooling_state``
builds ``ServingPooling``, ``ServingEmbedding``, ``ServingClassification`` and
``ServingScores`` for the model's tasks, and each route takes vLLM's request
class (``ROUTES``). Their ``__call__`` is vLLM's five steps — the context, the
inputs rendered by the route's IO processor, one ``engine_client.encode`` per
prompt, the batch collected, the response built — and here they run in the
engine's loop: steps one, two and five are vLLM's own methods (rendering
synchronously, as ``render_async`` does on its executor), steps three and four
are mirrored (``PoolingBaseServing._prepare_generators`` and
``_collect_batch``, pinned in tools/vllm_pins.py): each prompt is rendered
and added to ``LLMEngine`` as its own request, a slice at a time between steps
(engine_core/slices.py), and when the last one is out
the response vLLM builds (its JSON, vectors and scores from vLLM's pooler)
goes to the gateway whole (``Delta.api_output``). The engine requests' ids are
made from the gateway's id for the request, never from the client's
``request_id`` (vLLM's ``_prepare_generators`` makes them from it), which is
only echoed as the answer's id.

A pooling request is one step: after a restart the gateway sends it again whole
(not after its engine was killed as hung: api_gateway/sequences.py).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from engine_core.request_types import BadRequest, OutputSpec, is_request_error, refusal
from servectl.wire import engine as P

log = logging.getLogger("engine_core")

# route kind -> (the serving class's attribute here, vLLM's request type: module, name)
ROUTES = {
    "embeddings": ("embedding", "vllm.entrypoints.pooling.embed.protocol", "EmbeddingRequest"),
    "embed": ("embedding", "vllm.entrypoints.pooling.embed.protocol", "CohereEmbedRequest"),
    "pooling": ("pooling", "vllm.entrypoints.pooling.pooling.protocol", "PoolingRequest"),
    "score": ("scores", "vllm.entrypoints.pooling.scoring.protocol", "ScoreRequest"),
    "rerank": ("scores", "vllm.entrypoints.pooling.scoring.protocol", "RerankRequest"),
    "classify": ("classification", "vllm.entrypoints.pooling.classify.protocol", "ClassificationRequest"),
}
# What each serving class answers, for a refusal that names the route that fits.
NOT_SUPPORTED = {"embedding": "Embeddings API", "pooling": "Pooling API", "scores": "Score API",
                 "classification": "Classification API"}
PATHS = {"embeddings": "/v1/embeddings", "embed": "/v2/embed", "pooling": "/pooling", "score": "/score",
         "rerank": "/rerank", "classify": "/classify"}


class PoolingApis:
    """One pooling model's serving classes, as `vllm serve` builds them (``init_pooling_state``)."""

    def __init__(self, vllm_config, renderer, input_processor, supported_tasks, settings, served_name: str,
                 model_path: str):
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.entrypoints.pooling.classify.serving import ServingClassification
        from vllm.entrypoints.pooling.embed.serving import ServingEmbedding
        from vllm.entrypoints.pooling.pooling.serving import ServingPooling
        from vllm.entrypoints.pooling.scoring.serving import ServingScores
        from vllm.entrypoints.pooling.utils import enable_scoring_api
        from vllm.renderers.chat_utils import ChatTemplateConfig, load_chat_template
        from vllm.tasks import POOLING_TASKS

        from engine_core.driven import ServingEngineClient

        self.client = ServingEngineClient(vllm_config, renderer, input_processor)
        model_config = vllm_config.model_config
        models = OpenAIServingModels(self.client, [BaseModelPath(name=served_name, model_path=model_path)])
        config = ChatTemplateConfig(chat_template=load_chat_template(settings.chat_template),
                                    chat_template_content_format=settings.chat_template_content_format,
                                    trust_request_chat_template=settings.trust_request_chat_template,
                                    trust_request_mm_kwargs=False)
        common = dict(request_logger=None, chat_template_config=config)
        task = model_config.get_pooling_task(supported_tasks)
        self.pooling = ServingPooling(self.client, models, supported_tasks=supported_tasks, **common) \
            if any(t in supported_tasks for t in POOLING_TASKS) else None
        self.embedding = ServingEmbedding(self.client, models, **common) if task == "embed" else None
        self.classification = ServingClassification(self.client, models, **common) if task == "classify" else None
        self.scores = ServingScores(self.client, models, supported_tasks=supported_tasks, **common,
                                    enable_flash_late_interaction=True) \
            if enable_scoring_api(supported_tasks, model_config) else None
        self.routes = tuple(kind for kind, (attr, *_) in ROUTES.items() if getattr(self, attr) is not None)

    def start(self, kind: str, body: dict[str, Any], request_id: str, answer_id: str) -> "PooledBuilt":
        """The request's engine requests (ids made from ``request_id``, the gateway's; prompts;
        pooling parameters), ready to add; vLLM's refusal as ``BadRequest``. The answer's id is
        vLLM's, from the body's ``request_id`` or else ``answer_id``: echoed, never an engine id."""
        attr, module, name = ROUTES[kind]
        serving = getattr(self, attr)
        if serving is None:
            raise BadRequest(f"The model does not support {NOT_SUPPORTED[attr]} (it answers "
                             f"{', '.join(PATHS[k] for k in self.routes)})", status=400)
        try:
            return PooledBuilt(PoolingCall(serving, _request_type(module, name), body, answer_id, request_id))
        except BadRequest:
            raise
        except BaseException as exc:
            if not is_request_error(exc):
                raise
            raise refusal(exc) from None


def _request_type(module: str, name: str):
    import importlib

    from pydantic import TypeAdapter

    return TypeAdapter(getattr(importlib.import_module(module), name))


class PoolingCall:
    """One pooling request in the engine: vLLM's context for it, its engine requests, their outputs."""

    def __init__(self, serving, request_type, body: dict[str, Any], answer_id: str, request_id: str):
        from vllm.entrypoints.pooling.embed.serving import ServingEmbedding
        from vllm.entrypoints.pooling.scoring.serving import ServingScores

        from engine_core.chat_parsing import run_to_end

        if isinstance(serving, ServingScores) and serving.enable_flash_late_interaction:
            raise BadRequest("late-interaction scoring (flash) is not supported by servectl", status=400)
        body = {**body, "request_id": body.get("request_id") or answer_id}
        request = request_type.validate_python(body)
        io = serving.get_io_processor(request)
        ctx = run_to_end(serving._init_ctx(io, request, None))
        # PoolingBaseServing._preprocessing, rendering as render_async does (on this thread),
        # an input at a time as add_some is called (engine_core/slices.py)
        self.renders = io.get_request_factory_online(ctx)
        if len(self.renders) == 0:
            raise ValueError("You must pass at least one prompt")
        self.rendered: list = []
        self.chunked = isinstance(serving, ServingEmbedding)  # its _preprocessing's own step
        self.serving, self.io, self.ctx = serving, io, ctx
        self.requests: list[tuple] = []  # (id, prompt, params, priority), once every input is rendered
        self.added = 0  # of them, added to LLMEngine
        self.complete = False  # every one added
        self.outputs: dict[str, Any] = {}
        self.request_id = request_id  # the engine request it answers (Generate.request_id)
        self.done = False  # its response went out
        self.trace_headers: dict[str, str] | None = None  # tracing on: each input's vLLM span joins it

    @property
    def ids(self) -> list[str]:
        """The engine requests added so far (each, every one once ``complete``)."""
        return [rid for rid, *_ in self.requests[:self.added]]

    def add_some(self, engine, stop) -> list[str]:
        """Render the next inputs, then add their engine requests, until ``stop()`` (at least
        one step of either); the ids added by this call."""
        new: list[str] = []
        ctx = self.ctx
        while len(self.rendered) < len(self.renders):
            self.rendered.append(self.io.render(self.renders[len(self.rendered)]))
            if stop():
                return new
        if not self.requests:
            ctx.engine_inputs = self.rendered
            if self.chunked:
                self.serving.io_processor.maybe_pre_process_chunked(ctx)
            # _prepare_generators: one engine request per prompt. vLLM makes their ids from the
            # client's request_id (ctx.request_id); here they are made from the gateway's id, unique
            # to this request, so two requests sending one request_id cannot take each other's
            # outputs (security issue 53, item 4). The client's id is only echoed (the answer's id).
            ctx.pooling_params.verify(self.serving.model_config)
            self.requests = [(f"{self.request_id}-{i}", e["prompts"], e["params"], e["priorities"])
                             for i, e in enumerate(ctx.engine_inputs)]
        while self.added < len(self.requests):
            rid, prompt, params, priority = self.requests[self.added]
            self.added += 1  # (counted first: vLLM may hold part of one it refuses, and it is dropped)
            traced = {"trace_headers": self.trace_headers} if self.trace_headers else {}
            engine.add_request(rid, prompt, params, priority=priority or 0, **traced)
            new.append(rid)
            if stop():
                return new
        self.complete = True
        return new

    def deltas(self, ro) -> list[P.Delta]:
        """One engine request's output; once every one is in, vLLM's response (``_collect_batch``,
        then ``_postprocessing``) as the request's one delta."""
        from vllm.exceptions import GenerationError

        if not ro.finished:
            return []
        if ro.error is not None:
            raise GenerationError(ro.error.message)
        self.outputs[ro.request_id] = ro
        if not self.complete or len(self.outputs) < len(self.requests):
            return []
        ctx = self.ctx
        ctx.final_res_batch = [self.outputs[rid] for rid in self.ids]
        response = self.serving._postprocessing(self.io, ctx)
        if response.status_code != 200:  # vLLM's error response, in its JSON
            err = json.loads(response.body).get("error", {})
            raise BadRequest(err.get("message", "pooling failed"), err.get("param"), response.status_code)
        prompt_tokens = sum(len(o.prompt_token_ids or ()) for o in ctx.final_res_batch)
        self.done = True
        return [P.Delta(request_id=self.request_id, finish_reason="stop", api_output=bytes(response.body).decode(),
                        prompt=P.PromptInfo(tokens=prompt_tokens))]


class PooledBuilt:
    """A pooling request ready for ``LLMEngine``: its output spec (request_types.py ``Built``'s
    surface); the engine adds its engine requests by slices (engine_core/slices.py)."""

    def __init__(self, call: PoolingCall):
        self.call = call
        self.spec = OutputSpec(chat=False, pooling=call)

    @property
    def trace_headers(self) -> dict[str, str] | None:
        return self.call.trace_headers

    @trace_headers.setter
    def trace_headers(self, value: dict[str, str] | None) -> None:
        self.call.trace_headers = value
