"""Tool calls and reasoning in chat: vLLM's own renderer and parsers, run where the request is built.

A model configured with vLLM's chat flags (``enable_auto_tool_choice``,
``tool_call_parser``, ``tool_parser_plugin``, ``tool_strict_level``,
``chat_template``, ``chat_template_content_format``,
``default_chat_template_kwargs``, ``exclude_tools_when_tool_choice_none``, and
the engine argument ``reasoning_parser``) gets, in its engine:

- ``ChatFrontend``: vLLM's ``OnlineRenderer`` built from those flags as `vllm
  serve` builds it (``init_app_state``). Its ``render_chat`` validates
  ``tool_choice`` against the flags, renders ``tools`` with the chat template
  and lets the parser rewrite the request before sampling (``adjust_request``:
  the grammar of a ``required`` or named choice, structural tags, special
  tokens kept). The renderer is vLLM's async one; here every step of it is
  synchronous (``_SyncRenderer``: the engine's own renderer, text only), so its
  coroutine is run to its end without an event loop (``run_to_end``).
- ``ChatParsing``: one request's parsing, a vLLM ``Parser`` per choice. A
  streamed choice is parsed delta by delta (``parse_delta``), as
  ``OpenAIServingChat.chat_completion_stream_generator`` does; a whole one
  once, at its end (``parse``), as ``chat_completion_full_generator`` does,
  whose choice of message fields and ``finish_reason`` is mirrored in
  ``_whole_message`` (pinned: tools/vllm_pins.py).

What a choice shows goes to the gateway as vLLM's own JSON: a stream's
``DeltaMessage`` (its set fields) or a whole answer's message fields
(``Delta.message``), so the gateway stays free of vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("engine_core")


def run_to_end(coro):
    """The result of a coroutine that never waits: vLLM's async code servectl runs synchronously
    (the renderer over ``_SyncRenderer``, pooling's context, LoRA's ``OpenAIServingModels``)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("vLLM's async code waited for something (servectl runs it synchronously)")


class _SyncRenderer:
    """The engine's renderer with its async chat rendering done synchronously (text content only:
    the gateway refuses media, so nothing is fetched)."""

    def __init__(self, renderer):
        self._renderer = renderer

    def __getattr__(self, name):
        return getattr(self._renderer, name)

    async def render_chat_async(self, conversations, chat_params, tok_params=None, *, prompt_extras=None,
                                skip_mm_cache=False):
        return self._renderer.render_chat(conversations, chat_params, tok_params, prompt_extras=prompt_extras,
                                          skip_mm_cache=skip_mm_cache)


class ChatFrontend:
    """A model's chat flags and vLLM's ``OnlineRenderer`` made from them. Raises vLLM's own error
    when a parser is not registered or does not fit the tokenizer (a permanent load failure)."""

    def __init__(self, model_config, renderer, settings, reasoning_parser: str | None):
        from vllm.renderers.chat_utils import load_chat_template
        from vllm.renderers.online_renderer import OnlineRenderer

        if settings.enable_auto_tool_choice and not settings.tool_call_parser:
            raise TypeError("Error: --enable-auto-tool-choice requires --tool-call-parser")
        if settings.tool_parser_plugin:
            from vllm.tool_parsers import ToolParserManager

            ToolParserManager.import_tool_parser(settings.tool_parser_plugin)
        self.enable_auto_tools = settings.enable_auto_tool_choice
        self.reasoning_parser = reasoning_parser or None
        # vLLM's serving classes are built from the same flags (serving_apis.py).
        self.tool_parser = settings.tool_call_parser
        self.tool_strict_level = settings.tool_strict_level
        self.chat_template_content_format = settings.chat_template_content_format
        self.default_chat_template_kwargs = dict(settings.default_chat_template_kwargs) or None
        self.online = OnlineRenderer(
            model_config=model_config, renderer=_SyncRenderer(renderer), request_logger=None,
            chat_template=load_chat_template(settings.chat_template),
            chat_template_content_format=settings.chat_template_content_format,
            trust_request_chat_template=settings.trust_request_chat_template,
            enable_auto_tools=settings.enable_auto_tool_choice,
            exclude_tools_when_tool_choice_none=settings.exclude_tools_when_tool_choice_none,
            tool_parser=settings.tool_call_parser, tool_strict_level=settings.tool_strict_level,
            reasoning_parser=self.reasoning_parser,
            default_chat_template_kwargs=self.default_chat_template_kwargs)
        self.parser_cls = self.online.parser
        self.forced = self._forced_renderer(self.online)
        self.model_config = model_config
        self.tokenizer = renderer.tokenizer

    @staticmethod
    def _forced_renderer(online):
        """The renderer for a ``required`` or named ``tool_choice``: vLLM's own, its parser at strict
        level ``parameter`` (``--tool-strict-level``: every tool's arguments held to its schema in
        the structural tag, as for a ``strict: true`` tool). vLLM's parsers with a structural tag
        (hermes among them) leave a non-strict tool's arguments free under a forced choice: that
        parser never takes the JSON-schema path (``supports_required_and_named`` is False) and
        ``resolve_tool_strictness`` pins only ``strict`` tools below level ``parameter``. A forced
        call is held to its schema here, beyond ``vllm serve`` (docs/tools.md); ``auto`` and
        ``none`` keep the configured level."""
        import copy

        from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

        parser = online.parser
        if parser is None or parser.tool_parser_cls is None or parser.tool_strict_level >= ToolStrictLevel.PARAMETER:
            return online
        forced = copy.copy(online)
        forced.parser = type(f"Forced{parser.__name__}", (parser,), {"tool_strict_level": ToolStrictLevel.PARAMETER})
        return forced

    def renderer_for(self, request):
        """``forced`` for a ``required`` or named ``tool_choice`` with tools, else vLLM's as configured."""
        choice = request.tool_choice
        forced = choice == "required" or (choice is not None and not isinstance(choice, str))
        return self.forced if forced and request.tools else self.online

    def render(self, request):
        """``OnlineRenderer.render_chat``: (conversation, engine input); its error response raised."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        from engine_core.request_types import BadRequest

        result = run_to_end(self.renderer_for(request).render_chat(request))
        if isinstance(result, ErrorResponse):
            err = result.error
            raise BadRequest(err.message, err.param, err.code if 400 <= err.code < 500 else 400)
        conversation, (engine_input,) = result
        return conversation, engine_input

    def make_parser(self, request):
        """``OpenAIServingChat._make_parser``: one per choice (parsers keep state)."""
        return self.parser_cls(self.tokenizer, request.tools,
                               chat_template_kwargs=self.online.effective_chat_template_kwargs(request),
                               model_config=self.model_config)

    def reasoning_request_fields(self, request, prompt_token_ids: list[int]) -> dict[str, Any]:
        """``OpenAIServingChat._engine_reasoning_kwargs``: what the engine core's structured-output
        and thinking-budget logic are told about reasoning (``EngineCoreRequest`` fields)."""
        parser = self.make_parser(request) if self.parser_cls is not None else None
        kwargs = None
        if parser is not None and parser.reasoning_parser is not None:
            kwargs = {"chat_template_kwargs": self.online.effective_chat_template_kwargs(request)}
        return {"reasoning_ended": request.resolve_reasoning_ended(parser, prompt_token_ids),
                "reasoning_parser_kwargs": kwargs}


class ChatParsing:
    """One chat request's output as vLLM's parsers show it, choice by choice.

    ``step`` takes a choice's new text, token ids and finish reason and returns what the client
    is shown: (the delta's or message's fields as vLLM's JSON, or None where a stream shows
    nothing; the finish reason as vLLM reports it; the reasoning tokens so far, where counted)."""

    def __init__(self, frontend: ChatFrontend, request, prompt_token_ids: list[int], whole: bool,
                 count_reasoning_each_step: bool = False):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam

        self.frontend = frontend
        self.request = request
        self.prompt_ids = list(prompt_token_ids)
        self.whole = whole
        self.named = isinstance(request.tool_choice, ChatCompletionNamedToolChoiceParam)
        self.count_each_step = count_reasoning_each_step and frontend.reasoning_parser is not None
        self.parsers: dict[int, Any] = {}
        self.texts: dict[int, list[str]] = {}
        self.ids: dict[int, list[int]] = {}
        self.tools_streamed: set[int] = set()

    @property
    def counts_reasoning(self) -> bool:
        return self.frontend.reasoning_parser is not None

    @property
    def hides_metadata(self) -> bool:
        """vLLM shows no logprobs or token ids of a parsed answer whose reasoning is hidden."""
        return not self.request.include_reasoning

    def _parser(self, index: int):
        parser = self.parsers.get(index)
        if parser is None:
            parser = self.parsers[index] = self.frontend.make_parser(self.request)
        return parser

    def replay(self, index: int, texts: list[str], token_ids: list[int]) -> None:
        """A resumed choice: its parser sees the output the client has, token by token as the
        stream had it, and what it would show is dropped (the client has it)."""
        if self.whole:
            self.texts.setdefault(index, []).extend(texts)
            self.ids.setdefault(index, []).extend(token_ids)
            return
        for text, token in zip(texts, token_ids):
            self._stream(index, text, [token], None)

    def step(self, index: int, text: str, token_ids: list[int], finish_reason: str | None):
        if self.whole:
            self.texts.setdefault(index, []).append(text)
            self.ids.setdefault(index, []).extend(token_ids)
            if finish_reason is None:
                return None, None, None
            return self._whole_message(index, finish_reason)
        return self._stream(index, text, list(token_ids), finish_reason)

    def _stream(self, index: int, text: str, token_ids: list[int], finish_reason: str | None):
        from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls

        parser = self._parser(index)
        delta = parser.parse_delta(delta_text=text, delta_token_ids=token_ids, request=self.request,
                                   prompt_token_ids=self.prompt_ids, finished=finish_reason is not None)
        if delta is not None and delta.tool_calls:
            self.tools_streamed.add(index)
        reasoning_tokens = None
        if self.counts_reasoning:
            ids = self.ids.setdefault(index, [])
            ids.extend(token_ids)
            if self.count_each_step or finish_reason is not None:
                reasoning_tokens = parser.count_reasoning_tokens(tuple(ids))
        if finish_reason == "stop" and index in self.tools_streamed and not self.named:
            finish_reason = "tool_calls"  # OpenAI's: a call under "auto" or "required"
        if delta is None:
            return None, finish_reason, reasoning_tokens
        delta = maybe_filter_parallel_tool_calls(delta, self.request)
        return delta.model_dump(mode="json", exclude_unset=True), finish_reason, reasoning_tokens

    def _whole_message(self, index: int, finish_reason: str):
        """``chat_completion_full_generator``'s message for one choice (the role aside: the gateway
        has it) and its finish reason."""
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.entrypoints.openai.chat_completion.protocol import ChatMessage
        from vllm.renderers.chat_utils import make_tool_call_id

        request = self.request
        parser = self.frontend.make_parser(request)
        parser.set_prompt_token_ids(self.prompt_ids)
        ids = self.ids.pop(index, [])
        enable_auto = self.frontend.enable_auto_tools
        reasoning, content, tool_calls = parser.parse("".join(self.texts.pop(index, [])), request,
                                                      enable_auto_tools=enable_auto, model_output_token_ids=ids)
        if not request.include_reasoning:
            reasoning = None
        reasoning_tokens = parser.count_reasoning_tokens(ids) if self.counts_reasoning else None
        tool_parser_cls = self.frontend.parser_cls.tool_parser_cls
        required = request.tool_choice == "required"
        auto_called = False
        calls: list = []
        if (not enable_auto or not tool_parser_cls) and not self.named and not required:
            pass
        elif self.named or required:
            content = content or ""
            calls = [ToolCall(id=tc.id or make_tool_call_id(), function=tc) for tc in (tool_calls or [])]
        elif not request.tool_choice or request.tool_choice == "none":
            pass
        elif request.tools and request.tool_choice in ("auto", None) and enable_auto and tool_parser_cls:
            auto_called = bool(tool_calls)
            calls = [ToolCall(id=tc.id or make_tool_call_id(), function=tc) for tc in (tool_calls or [])]
        if request.parallel_tool_calls is False:  # maybe_filter_parallel_tool_calls
            calls = calls[:1]
        message = ChatMessage(role="assistant", reasoning=reasoning, content=content, tool_calls=calls)
        if auto_called or (required and finish_reason == "stop"):
            finish_reason = "tool_calls"
        shown = message.model_dump(mode="json")
        del shown["role"]
        return shown, finish_reason, reasoning_tokens
