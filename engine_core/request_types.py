"""What building one request makes and how it fails: the types both the builders and the loop use.

``BadRequest`` (a refusal with vLLM's status, message and parameter) and
``refusal`` (any admission error classified as vLLM's server does),
``OutputSpec`` (what a request's output shows) and ``Built`` (a request ready
for ``LLMEngine.add_request``). The builders (requests.py, serving_apis.py,
pooling_apis.py, chat_parsing.py) and the engine loop (core.py) import them
from here, so none of the builders needs another. Importing this module
imports no vLLM; ``refusal`` consults vLLM only when vLLM is loaded.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any


class BadRequest(Exception):
    """A request the engine refuses: an HTTP status (4xx), a message and the field to blame.

    ``unexpected``: the refusal came from an error nothing classified (a bug's symptom as likely
    as bad input): worth a warning in the log.
    """

    def __init__(self, message: str, param: str | None = None, status: int = 400, unexpected: bool = False):
        super().__init__(message)
        self.param = param
        self.status = status
        self.unexpected = unexpected


def is_request_error(exc: BaseException) -> bool:
    """What handling one request may raise without taking the engine down: any ``Exception``,
    and a Rust library's panic (pyo3's ``PanicException``, a ``BaseException``, one class per
    extension): pydantic-core panics on some malformed chat parts (an ``image_url`` part without
    its URL) while vLLM parses them. Callers catch ``BaseException`` and re-raise the rest."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


def refusal(exc: BaseException) -> BadRequest:
    """Any exception raised while admitting a request, classified the way vLLM's server does
    (``create_error_response``: its status, sanitised message and parameter). Admission looks
    only at the request, so what vLLM would call a server error is still the request's fault:
    400, "invalid request: ...".

    vLLM's classifier is imported only where vLLM is loaded already (a module in
    ``sys.modules``): an error raised where it is not (never imported, or blocked with None
    there, as the unit tier blocks it) cannot be vLLM's, and is read here without it, so the
    engine loop's unit tests never import vLLM through this."""
    if isinstance(exc, BadRequest):
        return exc
    if not isinstance(exc, Exception):  # a library's panic over this request's input
        return BadRequest(f"invalid request: it could not be parsed ({type(exc).__name__}: "
                          f"{(str(exc).splitlines() or [''])[0]})")
    if sys.modules.get("vllm") is None:
        if isinstance(exc, (ValueError, TypeError)):
            return BadRequest((str(exc).splitlines() or [""])[0] or type(exc).__name__)
        return BadRequest(f"invalid request: {exc}", unexpected=True)
    from pydantic import ValidationError
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    err = create_error_response(exc).error
    param = err.param
    if isinstance(exc, ValidationError) and param is None and exc.errors():
        loc = exc.errors()[0].get("loc") or ()
        param = str(loc[0]) if loc else None
    message = err.message if isinstance(exc, ValidationError) else (err.message.splitlines() or [""])[0]
    message = message or type(exc).__name__
    if not 400 <= err.code < 500:
        return BadRequest(f"invalid request: {message}", param, unexpected=True)
    return BadRequest(message, param, err.code)


@dataclass
class OutputSpec:
    """What the engine's output formatting needs to know about one request."""

    chat: bool
    logprobs: int | None = None  # alternatives per token (completions: logprobs; chat: top_logprobs); None: none
    all_alternatives: bool = False  # logprob_token_ids: every alternative vLLM returned
    as_token_ids: bool = False  # return_tokens_as_token_ids: tokens as "token_id:N"
    echo: bool = False
    echo_only: bool = False  # a completion's echo with max_tokens 0: the prompt, nothing generated
    return_token_ids: bool = False
    role: str | None = None  # chat: the answer's role
    echo_text: str | None = None  # chat echo: the last message's content (if it is the answer's role)
    return_prompt_text: bool = False
    # chat with a reasoning or tool-call parser (chat_parsing.ChatParsing): what each choice shows
    parsing: Any = None
    constrained: bool = False  # a grammar constrains the output (it does not carry over a restart)
    # a Responses or Messages request (serving_apis.ApiRequest): vLLM's serving code shows its output
    api: Any = None
    # a pooling request (pooling_apis.PoolingCall): one engine request per prompt, one answer
    pooling: Any = None
    started: bool = False  # the request's first output (which carries its prompt) went out
    whole: bool = False  # not streamed: output after the first is held and merged (coalesce.py)


@dataclass
class Built:
    """One request ready for ``LLMEngine.add_request``."""

    engine_input: Any
    params: Any  # SamplingParams
    priority: int
    session_id: str | None
    spec: OutputSpec
    # EngineCoreRequest fields LLMEngine.add_request takes no argument for (reasoning_ended,
    # reasoning_parser_kwargs: chat_parsing.ChatFrontend.reasoning_request_fields), or None.
    core_fields: dict[str, Any] | None = None
    lora_request: Any = None  # the LoRA adapter the request's model names (loras.py), or None
    trace_headers: dict[str, str] | None = None  # tracing on: its span's traceparent, for vLLM's span

    def add_to(self, engine, request_id: str) -> str:
        """``LLMEngine.add_request``; with ``core_fields``, the request is processed here and they are
        set on it first, as ``AsyncLLM.add_request`` does for `vllm serve`. Returns vLLM's id."""
        fields = {k: v for k, v in (self.core_fields or {}).items() if v is not None}
        traced = {"trace_headers": self.trace_headers} if self.trace_headers else {}
        if not fields:
            return engine.add_request(request_id, self.engine_input, self.params, priority=self.priority,
                                      session_id=self.session_id, lora_request=self.lora_request, **traced)
        from vllm.renderers.inputs.preprocess import extract_prompt_components

        core = engine.input_processor.process_inputs(request_id, self.engine_input, self.params,
                                                     supported_tasks=engine.get_supported_tasks(),
                                                     lora_request=self.lora_request,
                                                     priority=self.priority, session_id=self.session_id,
                                                     **traced)
        for name, value in fields.items():
            setattr(core, name, value)
        prompt_text = extract_prompt_components(engine.model_config, self.engine_input).text
        return engine.add_request(request_id, core, core.params, prompt_text=prompt_text)
