"""One gateway request into one vLLM request, the way vLLM's OpenAI server builds it.

The gateway sends the client's fields (``Generate.body``); this module makes
vLLM's own request object from them (``CompletionRequest``,
``ChatCompletionRequest``: vLLM's validation, vLLM's defaults), renders the
prompt with the engine's renderer (chat template, tokenisation, truncation,
length checks), sizes ``max_tokens`` with vLLM's ``get_max_tokens`` (a chat
without it gets the rest of the context) and calls the request's own
``to_sampling_params`` with the model's default sampling parameters
(``generation_config.json`` and the configured overrides). What vLLM's serving
layer adds around that (suffix rendering, the request chat-template check, the
echo and role rules) is mirrored here, function by function, with the vLLM
code it follows named. Every refusal is ``BadRequest`` with vLLM's status,
message and parameter (request_types.py, with what a build makes: ``Built``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from engine_core.request_types import BadRequest, Built, OutputSpec, refusal
from engine_core.speech_apis import KINDS as SPEECH_KINDS

log = logging.getLogger("engine_core")


def default_sampling(model_config) -> tuple[dict[str, Any], int | None]:
    """vLLM's server defaults for a model (``OpenAIServingCompletion.__init__``): the sampling
    parameters of its generation_config.json with ``override_generation_config`` applied, and the
    ``max_new_tokens`` override that caps every request's max_tokens."""
    defaults = model_config.get_diff_sampling_param()
    if model_config.generation_config not in ("auto", "vllm"):
        override_max_tokens = defaults.get("max_tokens")
    else:
        override_max_tokens = (getattr(model_config, "override_generation_config", None) or {}).get("max_new_tokens")
    return defaults, override_max_tokens


class RequestBuilder:
    """Builds vLLM requests for one engine (its model config, renderer and tokenizer)."""

    def __init__(self, model_config, renderer, frontend, trust_request_chat_template: bool = False,
                 serving_apis=None, pooling_apis=None, adapters=None):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
        from vllm.renderers.inputs.preprocess import extract_prompt_len, parse_model_prompt, prompt_to_seq
        from vllm.sampling_params import RequestOutputKind

        self.CompletionRequest = CompletionRequest
        self.ChatCompletionRequest = ChatCompletionRequest
        self._get_max_tokens = get_max_tokens
        self._prompt_len = extract_prompt_len
        self._parse_prompt = parse_model_prompt
        self._prompt_to_seq = prompt_to_seq
        self._DELTA = RequestOutputKind.DELTA
        self.model_config = model_config
        self.renderer = renderer
        self.frontend = frontend  # chat_parsing.ChatFrontend: vLLM's OnlineRenderer for this model
        self.trust_request_chat_template = trust_request_chat_template
        self.serving_apis = serving_apis  # () -> serving_apis.ServingApis, made on first use
        self.pooling_apis = pooling_apis  # () -> pooling_apis.PoolingApis, made on first use
        self.adapters = adapters  # loras.Adapters: the model's LoRA adapters (None: no vLLM engine)
        self._apis = None
        self.defaults, self.override_max_tokens = default_sampling(model_config)
        if self.defaults:
            log.info("default sampling parameters (generation config and overrides): %s", self.defaults)

    @functools.cached_property
    def pooling(self):
        """vLLM's pooling serving classes for this model (pooling_apis.py)."""
        return self.pooling_apis()

    @property
    def apis(self):
        """vLLM's Responses and Messages serving classes for this model (serving_apis.py)."""
        if self._apis is None:
            self._apis = self.serving_apis()
        return self._apis

    def build(self, kind: str, body: dict[str, Any], request_id: str = "", answer_id: str = "") -> Built:
        if kind in ("responses", "messages", *SPEECH_KINDS):  # vLLM's serving code builds it (serving_apis.py)
            return self.apis.start(kind, body, answer_id or request_id)
        if kind in POOLING_ROUTES:  # vLLM's pooling serving classes (pooling_apis.py)
            return self.pooling.start(kind, body, request_id, answer_id or request_id)
        try:
            if kind in ("completion", "chat"):
                lora = self.adapters.request_for(body.get("model")) if self.adapters is not None else None
                built = self._completion(body) if kind == "completion" else self._chat(body)
                built.lora_request = lora
                return built
        except Exception as exc:  # vLLM's validation, rendering and sampling-parameter errors
            raise refusal(exc) from None
        raise BadRequest(f"unknown request kind {kind!r}")

    # ---- /v1/completions ------------------------------------------------------------------
    def _completion(self, body: dict[str, Any]) -> Built:
        req = self.CompletionRequest.model_validate(body)
        prompt = self._suffixed(req) if req.suffix is not None else req.prompt
        prompts = [self._parse_prompt(self.model_config, p) for p in self._prompt_to_seq(prompt)]
        if len(prompts) != 1:
            raise BadRequest("one prompt per engine request", "prompt")
        (engine_input,) = self.renderer.render_cmpl(prompts, req.build_tok_params(self.model_config),
                                                    prompt_extras=self._extras(req))
        params = self._sampling(req, req.max_tokens, engine_input)
        spec = OutputSpec(chat=False, logprobs=req.logprobs, all_alternatives=bool(req.logprob_token_ids),
                          as_token_ids=bool(req.return_tokens_as_token_ids), echo=bool(req.echo),
                          echo_only=bool(req.echo) and req.max_tokens == 0,
                          return_token_ids=bool(req.return_token_ids))
        return Built(engine_input, params, req.priority, req.session_id, spec)

    def _suffixed(self, req):
        """A fill-in-the-middle prompt (``OnlineRenderer.render_completion``'s suffix branch)."""
        if req.echo:
            raise BadRequest("Echo is unsupported with suffix.", "suffix")
        if req.truncate_prompt_tokens is not None:
            raise BadRequest("suffix is not supported with truncate_prompt_tokens", "suffix")
        if not isinstance(req.prompt, str):
            raise BadRequest("suffix requires text prompt input for FIM completion rendering", "suffix")
        rendered = self.renderer.render_completion_suffix(req.prompt, req.suffix)
        if rendered is None:
            raise BadRequest("suffix is only supported for models with FIM completion rendering", "suffix")
        return rendered

    # ---- /v1/chat/completions ------------------------------------------------------------
    def _chat(self, body: dict[str, Any]) -> Built:
        req = self.ChatCompletionRequest.model_validate(body)
        self.check_chat_template(req.chat_template, req.chat_template_kwargs)
        # vLLM's OnlineRenderer: tool-choice checks, tools in the template, the parser's
        # adjust_request (chat_parsing.py).
        conversation, engine_input = self.frontend.render(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self._sampling(req, max_tokens, engine_input)
        # OpenAIServingChat.get_chat_request_role and its echo of the last message.
        role = "assistant" if req.add_generation_prompt else req.messages[-1]["role"]
        echo_text = None
        if req.echo and conversation and "content" in conversation[-1] and conversation[-1].get("role") == role:
            content = conversation[-1]["content"] or ""
            echo_text = "\n".join(m["text"] for m in content) if isinstance(content, list) else content
        spec = OutputSpec(chat=True, logprobs=req.top_logprobs if req.logprobs else None,
                          all_alternatives=bool(req.logprob_token_ids),
                          as_token_ids=bool(req.return_tokens_as_token_ids), echo=bool(req.echo),
                          return_token_ids=bool(req.return_token_ids), role=role, echo_text=echo_text or None,
                          return_prompt_text=bool(req.return_prompt_text))
        built = Built(engine_input, params, req.priority, req.session_id, spec)
        if self.frontend.parser_cls is not None:
            from engine_core.chat_parsing import ChatParsing

            prompt_ids = list(engine_input.get("prompt_token_ids") or ())
            opts = req.stream_options
            spec.parsing = ChatParsing(self.frontend, req, prompt_ids, whole=not req.stream,
                                       count_reasoning_each_step=bool(opts and opts.include_usage
                                                                      and opts.continuous_usage_stats))
            built.core_fields = self.frontend.reasoning_request_fields(req, prompt_ids)
        spec.constrained = params.structured_outputs is not None
        return built

    def check_chat_template(self, chat_template: str | None, kwargs: dict | None) -> None:
        """A template sent with the request runs only where the operator trusts it
        (vLLM's ``--trust-request-chat-template``; servectl's model key
        ``trust_request_chat_template``), with vLLM's message otherwise."""
        if not self.trust_request_chat_template and (
                chat_template is not None or (kwargs and kwargs.get("chat_template") is not None)):
            raise BadRequest("Chat template is passed with request, but --trust-request-chat-template is not set. "
                             "Refused request with untrusted chat template. (servectl: set the model's "
                             "`trust_request_chat_template = true` to allow it)", "chat_template")

    # ---- shared ---------------------------------------------------------------------------
    @staticmethod
    def _extras(req) -> dict[str, Any]:
        return {k: v for k in ("mm_processor_kwargs", "cache_salt") if (v := getattr(req, k, None)) is not None}

    def _sampling(self, req, max_tokens: int | None, engine_input):
        """``get_max_tokens`` then the request's own ``to_sampling_params`` (vLLM's serving classes)."""
        limit = self._get_max_tokens(self.model_config.max_model_len, max_tokens,
                                     self._prompt_len(self.model_config, engine_input), self.defaults,
                                     self.override_max_tokens, truncate_prompt_tokens=req.truncate_prompt_tokens)
        params = req.to_sampling_params(limit, self.defaults)
        # The gateway streams every request (a whole response is assembled there).
        params.output_kind = self._DELTA
        return params


# Pooling routes (api_gateway/passthrough.py) and what the engine answers them with (pooling_apis.py).
POOLING_ROUTES = ("embeddings", "embed", "pooling", "score", "rerank", "classify")


def request_builder(vllm_config, renderer, model, input_processor=None, supported_tasks=(),
                    adapters=None) -> RequestBuilder:
    """The builder for one served model (servectl's ``ModelConfig``: its chat settings), with
    vLLM's OnlineRenderer and parsers made from them (chat_parsing.py) and, on first use, its
    Responses and Messages serving classes (serving_apis.py)."""
    from engine_core.chat_parsing import ChatFrontend

    frontend = ChatFrontend(vllm_config.model_config, renderer, model,
                            vllm_config.structured_outputs_config.reasoning_parser)

    def serving_apis():
        from engine_core.serving_apis import ServingApis

        return ServingApis(vllm_config, renderer, input_processor, frontend, model.name, model.model,
                           adapters.models if adapters is not None else None)

    def pooling_apis():
        from engine_core.pooling_apis import PoolingApis

        return PoolingApis(vllm_config, renderer, input_processor, tuple(supported_tasks), model, model.name,
                           model.model)

    return RequestBuilder(vllm_config.model_config, renderer, frontend,
                          trust_request_chat_template=model.trust_request_chat_template, serving_apis=serving_apis,
                          pooling_apis=pooling_apis, adapters=adapters)

