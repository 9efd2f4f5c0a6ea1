"""The Responses and Messages APIs: vLLM's own serving classes, run inside the engine.

`vllm serve` answers ``/v1/responses`` with ``OpenAIServingResponses`` and
``/v1/messages`` with ``AnthropicServingMessages`` (which turns the request
into a chat completion and vLLM's chat stream back into Anthropic's events).
Here the same classes are built as ``init_generate_state`` builds them, over
the model's ``OnlineRenderer`` (chat_parsing.py), and given a
``ServingEngineClient`` (driven.py): what those classes see of an engine. Their
``engine_client.generate`` call is only recorded; the engine loop adds that
request to its ``LLMEngine`` like any other (request_types.py ``Built``) and puts
each step's ``RequestOutput`` into the ``OutputFeed`` the serving code reads.

vLLM's serving code is async, but between two outputs it waits for nothing
but the feed: ``Driven`` (driven.py) runs it without an event loop, turn by
turn, until it needs the next output or ends. What it yields is the client's answer already
in the API's form (a stream's SSE events; a whole answer's JSON body), sent
to the gateway as ``Delta.api_output``; the gateway only passes it on.

Ids: vLLM mints item, call and message ids with ``uuid.uuid4``; while a
request's serving code runs, those come from a generator seeded with the
request's id, so the same request fed the same outputs yields the same ids.
That is what lets a stream go on after an engine restart: the new engine
runs the request again, feeds it the outputs the client already has
(``Resume.deltas``, delta by delta as they came), drops what that shows, and
the continuation's events follow with the same ids and sequence numbers.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from engine_core.driven import Driven, GenerateCall, ServingEngineClient, _SeededIds
from engine_core.request_types import BadRequest, Built, OutputSpec, is_request_error, refusal
from engine_core.speech_apis import KINDS as SPEECH_KINDS
from servectl.wire import engine as P

log = logging.getLogger("engine_core")

KINDS = ("responses", "messages", *SPEECH_KINDS)


def _json(body) -> str:
    """A body as Starlette's ``JSONResponse`` renders it for `vllm serve`."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


class ServingApis:
    """One model's Responses and Messages serving classes, as `vllm serve` builds them."""

    def __init__(self, vllm_config, renderer, input_processor, frontend, served_name: str, model_path: str,
                 models=None):
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

        self.client = ServingEngineClient(vllm_config, renderer, input_processor)
        self._speech = None
        # The engine's OpenAIServingModels (loras.py): a request naming an adapter gets it.
        if models is None:
            models = OpenAIServingModels(self.client, [BaseModelPath(name=served_name, model_path=model_path)])
        online = frontend.online
        common = dict(request_logger=None, chat_template=online.chat_template,
                      chat_template_content_format=frontend.chat_template_content_format,
                      return_tokens_as_token_ids=False, enable_auto_tools=frontend.enable_auto_tools,
                      tool_parser=frontend.tool_parser, tool_strict_level=frontend.tool_strict_level,
                      reasoning_parser=frontend.reasoning_parser or "", enable_prompt_tokens_details=False,
                      enable_force_include_usage=False, enable_log_outputs=False,
                      default_chat_template_kwargs=frontend.default_chat_template_kwargs)
        self.models = models
        self.responses = OpenAIServingResponses(self.client, models, online, tool_server=None,
                                                enable_per_request_metrics=False, **common)
        self.messages = AnthropicServingMessages(self.client, models, "assistant", online_renderer=online,
                                                 enable_log_deltas=True, disabled_thinking_effort="auto",
                                                 **common)

    @property
    def speech(self):
        """vLLM's transcription and translation serving classes (speech_apis.py), made on first use."""
        if self._speech is None:
            from engine_core.speech_apis import SpeechApis

            self._speech = SpeechApis(self.client, self.models)
        return self._speech

    def start(self, kind: str, body: dict[str, Any], answer_id: str) -> Built:
        """Run the request's serving code until it asks the engine to generate: that request,
        ready for ``LLMEngine``. vLLM's refusal (its status, message, parameter) is ``BadRequest``.
        ``answer_id``: the answer's id, the same across restarts (``Generate.answer_id``)."""
        return ApiRequest(self, kind, body, answer_id).start()

    def count_tokens(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/messages/count_tokens``: ``AnthropicServingMessages.count_tokens``."""
        from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        try:
            request = AnthropicCountTokensRequest.model_validate(body)
            driven = Driven(_SeededIds("count_tokens"), self.messages.count_tokens(request))
            driven.turn()
            if not driven.done:
                driven.close()
                raise RuntimeError("counting tokens asked the engine to generate")
            result = driven.result
        except Exception as exc:
            raise refusal(exc) from None
        if isinstance(result, ErrorResponse):
            raise _refused(result)
        return result.model_dump(exclude_none=True)


def _refused(error) -> BadRequest:
    err = error.error
    status = err.code if 400 <= err.code < 600 else 400
    return BadRequest(err.message, err.param, status, unexpected=status >= 500)


class ApiRequest:
    """One Responses or Messages request in the engine: its driven serving code, what the
    client has been sent, and the outputs it is fed. ``OutputSpec.api`` holds it."""

    def __init__(self, apis: ServingApis, kind: str, body: dict[str, Any], answer_id: str):
        self.apis = apis
        self.kind = kind
        self.body = body
        self.answer_id = answer_id
        self.stream = bool(body.get("stream"))
        self.driven: Driven | None = None
        self.call: GenerateCall | None = None
        self.prompt_ids: list[int] = []
        self.started = False
        self.replaying = False
        self.queued: list[GenerateCall] = []
        self.next: Built | None = None
        # The first call's priority as the intake set it (the fair share's tag, Generate.priority):
        # every later call of the request keeps it, as vLLM's serving code knows none.
        self.priority: int | None = None

    # ---- admission --------------------------------------------------------------------
    def start(self) -> Built:
        try:
            coro = self._create()
            self.driven = Driven(_SeededIds(self.answer_id), coro)
            calls = self.apis.client.calls
            calls.clear()
            self.pending_items = self.driven.turn()
            self.call = calls[0] if calls else None
            self.queued = calls[1:]  # a request that asks the engine more than once (speech_apis.py)
            calls.clear()
        except BadRequest:
            self.close()
            raise
        except BaseException as exc:
            if not is_request_error(exc):
                raise
            self.close()
            raise refusal(exc) from None
        if self.call is None:  # it ended without generating: vLLM's error response
            result = self.driven.result
            self.close()
            raise self._error_of(result)
        return self._built(self.call)

    def _built(self, call: GenerateCall) -> Built:
        engine_input = call.engine_input
        self.prompt_ids = list(engine_input.get("prompt_token_ids") or ()) if isinstance(engine_input, dict) else []
        params = call.params
        kwargs = call.kwargs
        core = {k: kwargs.get(k) for k in ("reasoning_ended", "reasoning_parser_kwargs")}
        spec = OutputSpec(chat=True, constrained=params.structured_outputs is not None)
        spec.api = self
        priority = kwargs.get("priority", 0) if self.priority is None else self.priority
        return Built(engine_input, params, priority, kwargs.get("session_id"), spec,
                     core_fields=core if any(v is not None for v in core.values()) else None,
                     lora_request=kwargs.get("lora_request"))

    def _create(self):
        if self.kind == "responses":
            from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

            body = dict(self.body)
            if self.answer_id:
                body.setdefault("request_id", f"resp_{self.answer_id}")
            return self.apis.responses.create_responses(ResponsesRequest.model_validate(body))
        if self.kind == "messages":
            from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

            return self.apis.messages.create_messages(AnthropicMessagesRequest.model_validate(self.body))
        if self.kind in SPEECH_KINDS:
            return self.apis.speech.create(self.kind, self.body)
        raise BadRequest(f"unknown request kind {self.kind!r}")

    def _error_of(self, result) -> BadRequest:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if isinstance(result, ErrorResponse):
            return _refused(result)
        return BadRequest(f"vLLM's {self.kind} serving ended without an answer", status=500, unexpected=True)

    # ---- a restarted engine: the client's output so far ---------------------------------------
    def replay(self, deltas: list[P.ReplayedDelta], prompt_ids: list[int]) -> None:
        """Feed the serving code the outputs the client already has, as they came, and drop
        what it shows of them (the client has it)."""
        from vllm.outputs import CompletionOutput, RequestOutput

        self.prompt_ids = list(prompt_ids)
        for d in deltas:
            out = CompletionOutput(index=0, text=d.text, token_ids=list(d.token_ids), cumulative_logprob=None,
                                   logprobs=None, finish_reason=None)
            self.call.feed.outputs.append(RequestOutput(
                request_id=self.call.request_id, prompt=None, prompt_token_ids=list(prompt_ids),
                prompt_logprobs=None, outputs=[out], finished=False, num_cached_tokens=0))
        self.pending_items = []
        self.driven.turn()
        self.started = True

    # ---- output -----------------------------------------------------------------------------
    def deltas(self, ro, first: bool) -> list[P.Delta]:
        """One step's output for this request: fed to the serving code; what it shows, in the
        API's form, with the raw text and tokens (what a restart continues from)."""
        feed = self.call.feed
        comp = ro.outputs[0] if ro.outputs else None
        if self.prompt_ids and ro.prompt_token_ids is not None and len(ro.prompt_token_ids) != len(self.prompt_ids):
            # A continued request: its prompt holds the output so far; the client's prompt is the first part.
            ro.prompt_token_ids = list(self.prompt_ids)
            ro.num_cached_tokens = min(ro.num_cached_tokens or 0, len(self.prompt_ids))
        feed.outputs.append(ro)
        if ro.finished:
            feed.ended = True
        items = list(self.pending_items)
        self.pending_items = []
        calls = self.apis.client.calls
        calls.clear()
        items += self.driven.turn()
        self.queued += calls
        calls.clear()
        if ro.finished and self.queued and not self.driven.done:
            # This call is done and the serving code asks the engine again: the next call goes
            # to vLLM under the same id (``next_built``); the client's request goes on.
            self.call = self.queued.pop(0)
            self.next = self._built(self.call)
            shown = self._shown(items)
            # Nothing to show (a language detected): no delta, so the client's answer has not begun
            # (a crash now sends it again whole, stream or not: api_gateway/resume.py).
            return [P.Delta(request_id=ro.request_id, index=0, api_output=shown)] if shown else []
        delta = P.Delta(request_id=ro.request_id, index=0,
                        text=comp.text if comp is not None else "",
                        token_ids=list(comp.token_ids) if comp is not None else [],
                        finish_reason=comp.finish_reason if comp is not None else None,
                        stop_reason=comp.stop_reason if comp is not None else None,
                        api_output=self._shown(items))
        if ro.finished and delta.finish_reason is None:
            delta.finish_reason = "abort"
        if first and not self.started:
            delta.prompt = P.PromptInfo(tokens=len(self.prompt_ids or ro.prompt_token_ids or ()),
                                        constrained=self.call.params.structured_outputs is not None)
        self.started = True
        if ro.finished:
            if not self.driven.done:
                log.warning("request %s: vLLM's %s serving did not end with its last output", ro.request_id,
                            self.kind)
                self.driven.close()
            elif not self.stream:
                delta.api_output = self._whole(self.driven.result)
        return [delta]

    def take_next(self) -> Built | None:
        """The request's next call to the engine, once its previous one finished (speech), or None."""
        built, self.next = self.next, None
        return built

    def _shown(self, items: list) -> str:
        """A stream's items as `vllm serve` writes them (its api_router's SSE framing)."""
        if self.kind == "messages" or self.kind in SPEECH_KINDS:
            return "".join(items)  # their serving classes yield SSE text themselves
        return "".join(f"event: {getattr(event, 'type', 'unknown')}\ndata: "
                       f"{event.model_dump_json(indent=None, by_alias=True)}\n\n" for event in items)

    def _whole(self, result) -> str:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if isinstance(result, ErrorResponse):
            raise _refused(result)
        if self.kind == "messages":
            return _json(result.model_dump(exclude_none=True))
        if self.kind in SPEECH_KINDS:
            return _json(result.model_dump())  # vLLM's speech router: JSONResponse(model_dump())
        return _json(result.model_dump(mode="json", by_alias=True))

    def close(self) -> None:
        if self.driven is not None:
            self.driven.close()
