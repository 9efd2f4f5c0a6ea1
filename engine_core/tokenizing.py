"""The tokenizer endpoints, answered by the engine that owns the tokenizer.

``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` the way vLLM's
``ServingTokenization`` answers them: vLLM's request classes validate the body,
the engine's renderer tokenises (with the chat template for ``messages``), and
vLLM's response classes shape the answer.

One difference, on purpose: vLLM's tokenize requests set no length limit
(``max_total_tokens=None``), so a 4 MB prompt is tokenised in full, seconds of
the engine's only thread. Here ``/tokenize`` is bounded as a prompt is
(``bounded``): vLLM's own ``TokenizeParams`` with the model's context length,
so its character cap refuses an over-long text before tokenising
(``_text_len_check``: ``max_model_len × max_chars_per_token`` characters), the
tokenizer stops at ``max_model_len + 1`` tokens, and a prompt past the context
is refused with vLLM's message (``_token_len_check``), as a completion's is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine_core.request_types import BadRequest, is_request_error, refusal
from engine_core.requests import RequestBuilder


class TokenizerEndpoints:
    def __init__(self, builder: RequestBuilder):
        self.builder = builder
        self.model_config = builder.model_config
        self.renderer = builder.renderer

    def answer(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        handler = {"tokenize": self.tokenize, "detokenize": self.detokenize,
                   "tokenizer_info": self.tokenizer_info, "count_tokens": self.count_tokens}.get(kind)
        if handler is None:
            raise BadRequest(f"unknown tokenizer request {kind!r}")
        try:
            return handler(body)
        except BaseException as exc:
            if not is_request_error(exc):
                raise
            raise refusal(exc) from None

    def count_tokens(self, body: dict[str, Any]) -> dict[str, Any]:
        """Anthropic's ``/v1/messages/count_tokens``, by vLLM's ``AnthropicServingMessages``."""
        return self.builder.apis.count_tokens(body)

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        from vllm.entrypoints.serve.tokenize.protocol import (TokenizeChatRequest, TokenizeCompletionRequest,
                                                              TokenizeResponse)
        from vllm.renderers import merge_kwargs
        from vllm.renderers.inputs.preprocess import extract_prompt_components, parse_model_prompt, prompt_to_seq
        from vllm.utils.mistral import is_mistral_tokenizer

        mc = self.model_config
        if "messages" in body:
            req = TokenizeChatRequest.model_validate(body)
            self.builder.check_chat_template(req.chat_template, req.chat_template_kwargs)
            # ServingTokenization.create_tokenize: the model's template and defaults, the tools rendered.
            online = self.builder.frontend.online
            tokenize = is_mistral_tokenizer(self.renderer.tokenizer) or mc.enable_prompt_embeds
            tools = None if req.tools is None else [tool.model_dump() for tool in req.tools]
            chat_params = req.build_chat_params(online.chat_template, online.chat_template_content_format).with_defaults(
                merge_kwargs(online.default_chat_template_kwargs, dict(tools=tools, tokenize=tokenize)))
            _, engine_inputs = self.renderer.render_chat([req.messages], chat_params, bounded(req, mc))
        else:
            req = TokenizeCompletionRequest.model_validate(body)
            prompts = [parse_model_prompt(mc, p) for p in prompt_to_seq(req.prompt)]
            engine_inputs = self.renderer.render_cmpl(prompts, bounded(req, mc))
        ids: list[int] = []
        for engine_input in engine_inputs:
            ids.extend(extract_prompt_components(mc, engine_input).token_ids or ())
        token_strs = self.renderer.get_tokenizer().convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(tokens=ids, token_strs=token_strs, count=len(ids),
                                max_model_len=mc.max_model_len).model_dump()

    def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, DetokenizeResponse
        from vllm.inputs import TokensPrompt

        req = DetokenizeRequest.model_validate(body)
        prompt = self.renderer.tokenize_prompt(TokensPrompt(prompt_token_ids=req.tokens),
                                               req.build_tok_params(self.model_config))
        return DetokenizeResponse(prompt=prompt["prompt"]).model_dump()

    def tokenizer_info(self, body: dict[str, Any]) -> dict[str, Any]:
        from vllm.entrypoints.serve.tokenize.protocol import TokenizerInfoResponse
        from vllm.entrypoints.serve.tokenize.serving import TokenizerInfo

        # vLLM adds the server's --chat-template (the model's `chat_template`) to the tokenizer's config.
        info = TokenizerInfo(self.renderer.get_tokenizer(), self.builder.frontend.online.chat_template).to_dict()
        return TokenizerInfoResponse(**info).model_dump()


def bounded(req, model_config):
    """The request's own ``TokenizeParams`` with the limits vLLM puts on a prompt: the model's
    context length (``CompletionRequest.build_tok_params``' ``max_total_tokens``, named
    ``max_model_len`` in its messages), nothing reserved for output."""
    return dataclasses.replace(req.build_tok_params(model_config), max_total_tokens=model_config.max_model_len,
                               max_output_tokens=0, max_total_tokens_param="max_model_len")
